"""The radar's metrics on sampled trajectories: conciseness, successful execution, reasoning length.

- **Conciseness**: is any tool call redundant (repeats earlier content, goes unused, does not
  help the answer) or ineffective? An LLM judge answers yes/no ``rounds`` times per trajectory
  (the paper: 10, temperature 0.6) and the majority decides; ties and unreadable replies count as
  not redundant, as in the paper. On the toy world an oracle knows the calls each question needs
  (:func:`toy_redundant`). Conciseness = the share of trajectories judged not redundant.
- **Successful execution**, by two rules, both reported:
  the paper's rule (:func:`paper_result_ok`) counts a result as failed when it is empty or
  contains "Execution Timeout", "Tool execute failed" or the word "error" in any case, so a
  document that merely mentions an error fails; the corrected rule (:func:`corrected_call_ok`)
  uses the rollout's own record of each call (it ran and returned normally; over-budget calls
  count as failed). Per trajectory, correctness divided by max(failed calls, 1), averaged (the
  paper's errors_with_correctness_ratio); also the plain share of successful calls.
- **Reasoning length**: tokens of the text outside tool results, with the policy's tokenizer;
  reported as correctness per 1000 reasoning tokens (mean of c_i / len_i, x1000).
"""

from __future__ import annotations

import re
import string

from etagent import protocol
from etagent.records import ToolCallRecord

# Calls an efficient solver makes for each toy question kind (etagent.toy.world).

REDUNDANCY_PROMPT = """You are an expert analyst of tool-integrated reasoning. Below is a question, its golden answer, and a model's reasoning trajectory, in which <search> and <python> are tool calls and <result> holds what each tool returned.

A tool call is redundant if it repeats information already obtained, if its result is never used later, or if it does not contribute to the final answer. A tool call is ineffective if it returns irrelevant or unhelpful results.

Question: {question}
Golden answer: {answer}
Trajectory:
{trajectory}

Does the trajectory contain any redundant or ineffective tool call? Reply with only <answer>yes</answer> or <answer>no</answer>."""


def parse_redundancy(reply: str | None) -> bool | None:
    """True (redundant), False, or None (no reply or neither word)."""
    if reply is None:
        return None
    match = re.search(r"<answer>\s*(.*?)\s*</answer>", reply, re.IGNORECASE | re.DOTALL)
    text = (match.group(1) if match else reply).strip().lower().strip(string.punctuation + " ")
    if text.startswith("yes"):
        return True
    if text.startswith("no"):
        return False
    return None


def majority_redundant(votes: list[bool | None]) -> bool:
    """Redundant when more rounds say yes than no; ties and unreadable votes do not count."""
    return sum(v is True for v in votes) > sum(v is False for v in votes)


def toy_redundant(needed_calls: dict[str, int], calls: list[ToolCallRecord]) -> bool:
    """The toy worlds' oracle: more calls than the question needs (its ``needed_calls``, which
    every toy question carries: per kind on the toy, per chain on the hard world)."""
    return len(calls) > sum(needed_calls.values())


def paper_result_ok(result: str) -> bool:
    """The paper's rule for one <result> text."""
    return bool(result) and "Execution Timeout" not in result and "Tool execute failed" not in result and "error" not in result.lower()


def corrected_call_ok(call: ToolCallRecord) -> bool:
    """A call succeeded when it ran and returned normally (the rollout's own record)."""
    return call.ok and not call.budget_exhausted


def execution(text: str, calls: list[ToolCallRecord]) -> dict:
    """Successful and failed tool results of one trajectory, by both rules."""
    results = protocol.tool_results(text)
    paper_ok = [paper_result_ok(r) for r in results]
    corrected_ok = [corrected_call_ok(c) for c in calls]
    return {
        "paper_total": len(paper_ok),
        "paper_failed": paper_ok.count(False),
        "corrected_total": len(corrected_ok),
        "corrected_failed": corrected_ok.count(False),
    }


def reasoning_tokens(text: str, tokenizer) -> int:
    """Tokens the policy wrote: the text without tool results and stray result tags."""
    thinking = protocol.strip_results(text).replace("<result>", "").replace("</result>", "")
    return len(tokenizer.encode(thinking, add_special_tokens=False))

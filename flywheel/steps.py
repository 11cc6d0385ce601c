"""Trajectory text surgery for the flywheel's operations: steps, editor replies, cuts and hints.

Pure functions over trajectory text (the protocol of :mod:`etagent.protocol`), each one operation's
edit, so that every cut point can be tested by hand:

- a **step** is the policy text up to and including one tool result; the text after the last
  result (the final reasoning and the answer) is the last step. Steps concatenate to the text.
- editor replies are parsed strictly (:class:`EditorReplyError` says why one is refused). Unlike
  the reference, ``Step: now`` is not ``Step: no``, a reply without ``Analysis:`` is read without
  slicing at -1, and a step number out of range is refused rather than appending a result after
  the final answer (docs/paper-code.md §A8 (item 18)).
- a step written by a model is cleaned before anything runs (:func:`clean_step`): cut after its
  first tool call or answer, nothing it wrote as a ``<result>`` kept, ``<think>`` opened and
  closed. The reference trusted this text as it came (§8.19).

What this module does not do: call models, run tools or judge (``etagent.flywheel.evolve``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from etagent import protocol


class EditorReplyError(ValueError):
    """An editor or reflector reply the operation cannot use (the reason is the message)."""


# ---------------------------------------------------------------------------------------------
# Steps


def split_steps(text: str) -> list[str]:
    """The steps of a trajectory: policy text plus the result that follows it, then the tail."""
    steps, current = [], ""
    for piece, is_result in protocol.split_result_segments(text):
        current += piece
        if is_result:
            steps.append(current)
            current = ""
    if current.strip():
        steps.append(current)
    elif current and steps:
        steps[-1] += current  # trailing whitespace stays with the last step
    return steps


def tool_steps(text: str) -> list[str]:
    """Only the steps that end in a tool result (the steps the step-level hint may cut after)."""
    return [step for step in split_steps(text) if step.rstrip().endswith("</result>")]


def format_steps(steps: list[str]) -> str:
    """Steps as the prompts show them: ``#### Step i: <text>``, 1-indexed."""
    return "\n\n".join(f"#### Step {i}: {step.strip()}" for i, step in enumerate(steps, 1))


# ---------------------------------------------------------------------------------------------
# Editor replies

_STEP_NO = re.compile(r"^\W*step\s*:\s*(no|none)\b", re.IGNORECASE | re.MULTILINE)
_STEP_N = re.compile(r"step\s*:?\s*(\d+)", re.IGNORECASE)


def _step_number(text: str, n_steps: int) -> int:
    match = _STEP_N.search(text)
    if match is None:
        raise EditorReplyError(f"no 'Step: N' in the reply {text[:120]!r}")
    step = int(match.group(1))
    if not 1 <= step <= n_steps:
        raise EditorReplyError(f"step {step} is out of range (the trajectory has {n_steps} steps)")
    return step


@dataclass(frozen=True)
class RedundancyFix:
    """The editor's answer to the redundancy prompt: which step, why, and its corrected form."""

    step: int
    analysis: str
    corrected_step: str


def parse_redundancy_reply(reply: str, n_steps: int) -> RedundancyFix | None:
    """``Step: no`` -> None; ``Step: N / Analysis: ... / Corrected Step: ...`` -> the fix."""
    if _STEP_NO.search(reply):
        return None
    lower = reply.lower()
    corrected_at = lower.find("corrected step:")
    if corrected_at < 0:
        raise EditorReplyError("no 'Corrected Step:' in the reply")
    analysis_at = lower.find("analysis:")
    head = reply[: analysis_at if 0 <= analysis_at < corrected_at else corrected_at]
    step = _step_number(head, n_steps)
    analysis = reply[analysis_at + len("analysis:") : corrected_at].strip() if 0 <= analysis_at < corrected_at else ""
    corrected = clean_step(reply[corrected_at + len("corrected step:") :])
    return RedundancyFix(step, analysis, corrected)


def parse_flaw_reply(reply: str, n_steps: int) -> int:
    """The flawed step N from ``Step: N`` (generation stops before ``Analysis:``)."""
    return _step_number(reply.split("Analysis:", 1)[0], n_steps)


# ---------------------------------------------------------------------------------------------
# Cleaning a written step

_FIRST_ACTION = re.compile(r"<(search|python|answer)>")


def clean_step(text: str) -> str:
    """A model-written step made safe to continue from.

    Cut at the first ``<result>`` (the model cannot write tool output) and after the first
    closing tool or answer tag (one action per step); ``<think>`` added at the start when
    missing, ``</think>`` before the first action (or at the end) when the reasoning never
    closes. Raises :class:`EditorReplyError` when no reasoning or action is left."""
    text = text.split("<result>", 1)[0]
    text = protocol.cut_at_stop(text).strip()
    if not text:
        raise EditorReplyError("the written step is empty")
    if not text.startswith("<think>"):
        text = "<think>" + text
    action = _FIRST_ACTION.search(text)
    reasoning = text if action is None else text[: action.start()]
    if "</think>" not in reasoning:
        if action is None:
            text = text.rstrip() + "</think>"
        else:
            text = text[: action.start()].rstrip() + "</think>" + text[action.start() :]
    action = _FIRST_ACTION.search(text)
    if action is not None:
        tag = action.group(1)
        if f"</{tag}>" not in text[action.end() :]:
            raise EditorReplyError(f"the written step opens <{tag}> and never closes it")
    if text == "<think></think>":
        raise EditorReplyError("the written step has no reasoning and no action")
    return text


def replace_step(steps: list[str], step: int, new_step: str) -> str:
    """Steps 1..step-1 kept as they are, step ``step`` replaced by ``new_step``, the rest dropped."""
    return "".join(steps[: step - 1]) + new_step


# ---------------------------------------------------------------------------------------------
# The rewrite (A3): new reasoning, the same actions

_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def think_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every complete ``<think>...</think>``, in order."""
    return [m.span(1) for m in _THINK_BLOCK.finditer(text)]


def without_reasoning(text: str) -> str:
    """The text with every think block emptied: what a rewrite must leave byte-identical."""
    return _THINK_BLOCK.sub("<think></think>", text)


def rewrite_problems(original: str, rewritten: str) -> list[str]:
    """Why a rewrite is refused (empty list: it only changed reasoning).

    Everything outside the think blocks must be byte-identical, and no rewritten block may
    contain a protocol tag (a tag inside reasoning changes what the protocol counts)."""
    problems = []
    if without_reasoning(original) != without_reasoning(rewritten):
        problems.append("a tool call, result or the answer changed")
    for start, end in think_blocks(rewritten):
        inner = rewritten[start:end]
        tags = [t for t in protocol.TAG_STRINGS if t in inner]
        if tags:
            problems.append(f"a reasoning block contains {' '.join(tags)}")
        elif not inner.strip():
            problems.append("a reasoning block is empty")
    if len(think_blocks(original)) != len(think_blocks(rewritten)):
        problems.append("the number of reasoning blocks changed")
    return problems


# ---------------------------------------------------------------------------------------------
# Hints (B2, B3)


def step_hint_prefix(text: str, step: int, hint: str) -> str:
    """B2: the tool steps 1..step kept (the flawed one included), then ``<think>`` and the hint."""
    steps = tool_steps(text)
    if not 1 <= step <= len(steps):
        raise EditorReplyError(f"step {step} does not end in a tool result (the trajectory has {len(steps)} such steps)")
    return "".join(steps[:step]) + "<think>" + hint


def reopen_final_think(text: str, hint: str) -> str:
    """B3: the final reasoning reopened and the hint appended.

    After the last tool result: the answer's tags are removed (their content stays, as the
    reference keeps "The final answer is ..." inside the reopened reasoning), the first
    ``</think>`` is removed, or ``<think>`` opened when there is none, and the hint follows. A
    trajectory that never answered is reopened the same way from its last result (the reference
    started from nothing there, §2.6 B3)."""
    cut = text.rfind("</result>")
    head, tail = (text[: cut + len("</result>")], text[cut + len("</result>") :]) if cut >= 0 else ("", text)
    tail = tail.replace("<answer>", "").replace("</answer>", "")
    if "</think>" in tail:
        tail = tail.replace("</think>", " ", 1)
    elif "<think>" not in tail:
        tail = "<think>" + tail.lstrip()
    return head + tail.rstrip() + " " + hint

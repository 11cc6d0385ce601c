"""Seed trajectories for the toy questions, with good and bad tool habits in a controlled mix.

Each trajectory follows one behaviour:

- ``efficient``: exactly the calls the question needs (0, 1 or 2), then the answer;
- ``redundant``: the same, plus one unnecessary call (a repeated search for a fact already
  found, a second Python run of a sum already done, or a search for a question that needs none);
  still correct. The habit is announced in the first thought ("To be sure, I will search for it
  twice."), as a model that over-calls decides it up front; a tiny model learns a choice made at
  the start of its answer far more faithfully than one made after a long result;
- ``insufficient``: skips the needed calls and answers from memory, rightly: the writer of the
  data knew the fact or did the sum in its head, as a stronger model sometimes does. SFT keeps
  these (they are correct), so the policy learns the habit without the knowledge, and its own
  guesses are mostly wrong: the under-calling the paper's RL is meant to correct. (A ``none``
  question cannot be under-served, so it gets ``efficient`` instead.)

Tool results come from running the tools' logic: searches go through the same BM25 index and
result formatting as the retriever's BM25 method, and the Python code (written here, so trusted)
is executed and its printed output captured. The text is assembled from segments: what the
policy would write and the inserted ``<result>`` spans (protocol.format_result), exactly as the
agent loop builds trajectories.

What this module does not do: choose SFT data (the builder keeps the correct ones) or tokenize.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections.abc import Sequence

from etagent import protocol
from etagent.records import Provenance, ToolCallRecord, Trajectory
from etagent.scoring import rule_judgement
from etagent.tools.search import BM25Index, format_documents
from etagent.toy.world import ToyQuestion

BEHAVIOURS = ("efficient", "redundant", "insufficient")


class ToySearch:
    """Search over the toy corpus with the retriever's BM25 method and result format."""

    def __init__(self, corpus: Sequence[dict], top_k: int, max_doc_chars: int):
        self.contents = [doc["contents"] for doc in corpus]
        self.index = BM25Index(self.contents)
        self.top_k, self.max_doc_chars = top_k, max_doc_chars

    def __call__(self, query: str) -> str:
        ids, _ = self.index.search([query], self.top_k)
        return format_documents([self.contents[i] for i in ids[0]], self.max_doc_chars)


def run_trusted_python(code: str) -> str:
    """Run code written by the toy builder itself and return its printed output, stripped."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<toy>", "exec"), {})
    return out.getvalue().strip()


def _answer(value: str) -> str:
    return f"<answer>The final answer is \\[ \\boxed{{{value}}} \\]</answer>"


class TrajectoryBuilder:
    """Accumulates a trajectory's text and tool-call records."""

    def __init__(self, search: ToySearch):
        self.search = search
        self.text = ""
        self.calls: list[ToolCallRecord] = []

    def think(self, text: str) -> None:
        # Consecutive thoughts share one think block: think, tool, result, think, ... answer.
        if self.text.endswith("</think>"):
            self.text = self.text[: -len("</think>")] + f" {text}</think>"
        else:
            self.text += f"<think>{text}</think>"

    def call(self, tool: str, payload: str) -> str:
        self.text += f"<{tool}>{payload}</{tool}>"
        start = time.perf_counter()
        output = self.search(payload) if tool == protocol.SEARCH else run_trusted_python(payload)
        self.calls.append(ToolCallRecord(tool=tool, input=payload, output=output, ok=True, seconds=time.perf_counter() - start))
        self.text += protocol.format_result(output)
        return output

    def answer(self, value: str) -> None:
        self.text += _answer(value)


def _plan(q: ToyQuestion, behaviour: str, rng: random.Random) -> list[tuple[str, str, bool]]:
    """The calls a trajectory makes: (tool, input, is_repeat) in order."""
    plan = [(protocol.SEARCH, query, False) for query in q.searches]
    if q.code is not None:
        plan.append((protocol.PYTHON, q.code, False))
    if behaviour == "insufficient":
        return []
    if behaviour == "redundant":
        if not plan:  # nothing is needed: the redundant habit is to search anyway
            return [(protocol.SEARCH, q.entity, False)]
        at = rng.randrange(len(plan))
        tool, payload, _ = plan[at]
        plan.insert(at + 1, (tool, payload, True))
    return plan


def write_trajectory(q: ToyQuestion, behaviour: str, search: ToySearch, rng: random.Random) -> Trajectory:
    """One seed trajectory of the given behaviour for a toy question."""
    if q.toy_kind == "none" and behaviour == "insufficient":
        behaviour = "efficient"
    b = TrajectoryBuilder(search)
    pick = rng.choice
    answer = q.question.answer[0]
    plan = _plan(q, behaviour, rng)
    if behaviour == "insufficient":
        b.think(pick(["I think I know this without any tool.", "I can answer this directly."]) + f" The answer should be {answer}.")
    elif not plan:
        b.think(pick(["The answer is already in the question.", "The question itself contains the answer."]))
    repeated = next((tool for tool, _, repeat in plan if repeat), None)
    announce = {
        protocol.SEARCH: " To be sure, I will search for it twice.",
        protocol.PYTHON: " To be safe, I will run the calculation twice.",
        None: "",
    }[repeated]
    for tool, payload, repeat in plan:
        if tool == protocol.SEARCH and q.toy_kind == "none":
            b.think(pick([f"Let me look up {payload} first.", f"I will search for {payload}."]))
            b.call(tool, payload)
            b.think("The search does not change anything: the answer is in the question.")
        elif tool == protocol.SEARCH:
            if repeat:
                b.think(pick([f"Let me search for {q.entity} again to be sure.", "I will search once more to double-check."]))
            else:
                b.think(
                    pick([f"I do not know this fact about {q.entity}, so I will search for it.", f"I need to look up {q.entity}."])
                    + announce
                )
                announce = ""
            b.call(tool, payload)
            b.think(f"The result {'again ' if repeat else ''}says that {q.fact}.")
        else:
            if repeat:
                b.think(pick(["Let me check this calculation once more.", "I will run the calculation again to be safe."]))
            else:
                b.think(pick(["This needs exact arithmetic, so I will use Python.", "I will compute this with Python."]) + announce)
                announce = ""
            output = b.call(tool, payload)
            b.think(f"Python {'again ' if repeat else ''}gives {output}.")
    b.answer(answer)

    prediction = protocol.extract_answer(b.text)
    return Trajectory(
        id="",
        text=b.text,
        tool_calls=b.calls,
        prediction=prediction,
        # a seed writes the gold answer itself, so nothing short of an exact F1 of 1 is right
        judgement=rule_judgement(prediction, q.question.answer, q.question.kind, qa_pass_mark=1.0),
        finish_reason="answer",
        provenance=Provenance(stage="toy", operation="seed", behaviour=behaviour),
    )

"""How the paper's released RL reward reads an answer, behaviour for behaviour: the ``paper`` mode
of :mod:`etagent.rl.reward`, and the paper's validation score.

The released code (ET-Agent's ``verl/utils/reward_score/``: ``efficiency.compute_score`` for
training, ``default_compute_score`` for validation; docs/paper-code.md §C4.3-C4.4) reads answers in ways
that differ from the rest of this toolkit. The paper's numbers depend on them, so they are
reproduced here exactly, quirks included:

- The answer block is the *first* ``<answer>...</answer>`` (a lazy regular expression).
- The box is ``last_boxed_only_string``: when ``"\\boxed "`` (with a space) occurs anywhere, it
  is the text after its last occurrence up to the next ``$``, whatever boxes follow; otherwise
  the last ``\\boxed`` (or, when there is none, the last ``\\fbox``), brace-matched.
- The content is that string without its first 7 characters and its last one when it starts with
  ``\\boxed`` and ends with ``}``, and the whole string otherwise: ``\\fbox{4}`` is compared as
  ``\\fbox{4}`` and ``\\boxed 4`` as ``\\boxed 4``, so both are wrong.
- Math compares the content with the first gold answer only, by the MATH string rules of the
  released reward's own copy (:func:`math_strip`), which keeps a bare ``%`` and, on a malformed
  answer (two ``\\text{ `` units, a ``\\sqrt`` or ``\\frac`` with nothing after it), falls
  back to plain string equality. The evaluator's copy (:func:`etagent.scoring.strip_string`)
  differs on these, which is why this one is not shared.
- QA scores :func:`qa_f1`, the maximum over the gold answers.

The format check (:func:`etagent.protocol.validate_format`) and the tool-call count
(:func:`etagent.protocol.count_tool_calls`) are the released ones too; they live in ``etagent``,
where the flywheel uses them as well.

What this module does not do: the group terms (f_tool, f_length, f_format: :mod:`etagent.rl.reward`), or
choose the text it reads. The released code scores the response decoded without special tokens,
tool results included, and so does RL in its paper mode. Where the released code stops with an
exception (a group with no gold answer), this module returns 0 instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from etagent import protocol, scoring

_FIRST_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def first_answer_block(response: str) -> str | None:
    """The text of the first ``<answer>...</answer>``: from the first ``<answer>`` to the first
    ``</answer>`` after it (None without one)."""
    match = _FIRST_ANSWER.search(response)
    return None if match is None else match.group(1)


def last_boxed_only_string(text: str) -> str | None:
    """The released ``last_boxed_only_string``: the last box, its command included."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def box_content(boxed: str) -> str:
    """The training reward's slicing of a box: ``boxed[7:-1]`` when it starts with ``\\boxed``
    and ends with ``}``, else the whole string (``\\fbox{..}`` and ``\\boxed x`` stay as they are)."""
    return boxed[7:-1] if boxed.startswith("\\boxed") and boxed.endswith("}") else boxed


def strict_box_content(boxed: str | None) -> str | None:
    """The validation score's ``remove_boxed``: the content of ``\\boxed{...}`` or of ``\\boxed x``;
    None (the released code raises, and the score is -1) for anything else, ``\\fbox`` included."""
    if boxed is None:
        return None
    if "\\boxed " in boxed:
        return boxed[len("\\boxed ") :] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


class _Malformed(Exception):
    """Raised where the released MATH rules raise; :func:`math_equal` then compares the raw strings."""


def _fix_sqrt(text: str) -> str:
    if "\\sqrt" not in text:
        return text
    parts = text.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if not part:
            raise _Malformed("\\sqrt with nothing after it")
        out += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def _fix_fracs(text: str) -> str:
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part:
            raise _Malformed("\\frac with nothing after it")
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return text
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def math_strip(text: str) -> str:
    """The released reward's copy of the Hendrycks MATH string rules, in their order. Raises
    :class:`_Malformed` where that copy raises."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in text:  # units
        units = text.split("\\text{ ")
        if len(units) != 2:
            raise _Malformed("more than one \\text{ unit")
        text = units[0]
    text = text.replace("\\%", "")  # a bare % stays
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _fix_sqrt(text).replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return scoring.fix_slash_fraction(text)


def math_equal(prediction: str, gold: str) -> bool:
    """The released ``is_equiv``: equal after :func:`math_strip`, or, when it raises, equal as written."""
    try:
        return math_strip(prediction) == math_strip(gold)
    except _Malformed:
        return prediction == gold


def qa_f1(prediction: str, gold: str) -> float:
    """The released ``get_f1_score`` for one gold answer: SQuAD normalisation, then the deepsearch
    strip, which deletes every space, so each side is one token and the "F1" is exact match
    without spaces ("Kess River" scores 1 against "the Kess river", "river Kess" 0).
    yes/no/noanswer must match exactly. On SQuAD-normalised text (no ASCII punctuation, single
    spaces) the deepsearch strip does only two things: tfrac/dfrac become frac, and the spaces go;
    :func:`etagent.scoring.strip_string` does the same there."""
    pred = scoring.strip_string(scoring.squad_normalize(prediction), deepsearch=True)
    ref = scoring.strip_string(scoring.squad_normalize(gold), deepsearch=True)
    if (pred in scoring.YES_NO or ref in scoring.YES_NO) and pred != ref:
        return 0.0
    return scoring.token_f1(pred.split(), ref.split())


def raw_score(kind: str, response: str, golds: Sequence[str]) -> float:
    """The training reward's correctness (``compute_score_math`` / ``compute_score_deep_research``):
    0 without an answer block. Math: the last box of the *whole* response against the first gold
    answer, 1 or 0. QA: the last box of the first answer block, :func:`qa_f1` over the golds (0
    without a box)."""
    block = first_answer_block(response)
    if block is None or not golds:
        return 0.0
    if kind == "math":
        boxed = last_boxed_only_string(response)
        return float(boxed is not None and math_equal(box_content(boxed), golds[0]))
    boxed = last_boxed_only_string(block)
    if boxed is None:
        return 0.0
    return scoring.best_over_golds(qa_f1, box_content(boxed), golds)


def validation_score(kind: str, response: str, golds: Sequence[str]) -> float:
    """The paper's validation score (``default_compute_score``), which differs from the training
    reward. -1 for a bad format. Math: -1 without a box anywhere, else 1 or 0 as in
    :func:`raw_score`. QA: -1 when the first answer block's last box is not ``\\boxed{...}`` or
    ``\\boxed x`` (:func:`strict_box_content`); else the F1, plus 0.1 when it is above 0 and the
    response closed both a search and a python call."""
    if not protocol.validate_format(response):
        return -1.0
    block = first_answer_block(response)  # validate_format guarantees one
    if kind == "math":
        boxed = last_boxed_only_string(response)
        return -1.0 if boxed is None else float(math_equal(box_content(boxed), golds[0]))
    content = strict_box_content(last_boxed_only_string(block))
    if content is None:
        return -1.0
    f1 = scoring.best_over_golds(qa_f1, content, golds)
    both_tools = "</search>" in response and "</python>" in response
    return f1 + 0.1 if f1 > 0 and both_tools else f1

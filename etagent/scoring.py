"""Answer scoring: normalisation, EM, F1, substring accuracy, math equivalence, efficiency, and
an LLM-as-judge client.

The paper's code scores answers in three slightly different ways, and its numbers depend on which
one is used. Each is here under its own name, so a stage picks the one it means:

- ``f1`` / ``em`` / ``acc``: SQuAD/HotpotQA normalisation (lower case, punctuation and articles
  removed), with the yes/no/noanswer rule: if either side normalises to one of those words, F1
  is 1 only for an exact match. The RL reward's QA score (after ``strip_string(deepsearch)``).
- ``f1_paper`` / ``em_paper`` / ``acc_paper``: the evaluation scripts' normalisation behind the
  paper's main table: lower case and articles removed, **punctuation kept**.
- ``f1_raw_whitespace``: the flywheel's judge: lower case, whitespace split, nothing else.

Every metric over several gold answers is the maximum over them (:func:`best_over_golds`).
Math equivalence has two checks: :func:`is_equiv`, the Hendrycks MATH string rules as the
reference has them (no sympy, so ``0.50`` and ``1/2`` differ), and :func:`math_verify_equal`,
the symbolic check from the ``math-verify`` package. ``math_equal`` in :func:`score_prediction`
is true when either holds.

Also here, shared by every stage that judges answers: per-sample metrics of a trajectory
(:func:`sample_metrics`: every score above, the tool calls as the paper counts them with
:func:`etagent.protocol.count_valid_tags`, executed and successful calls, format) and its
correctness c_i (:func:`correctness`); rule verdicts as records (:func:`rule_judgement`); and the
LLM judge (:class:`LLMJudge`). ``is_equiv_paper`` is the paper evaluator's variant that applies
the MATH string rules after its QA normalisation (articles removed: "The Scotland" equals
"Scotland").

What this module does not do: extract the answer from a trajectory (``etagent.protocol``),
aggregate per dataset or compute pass@k over datasets (``evaluation/``), or compute the RL
reward (``rl/``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from etagent import protocol
from etagent.llm.text import TextModel
from etagent.net import ExternalCallError
from etagent.records import Judgement, Question, Trajectory

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Normalisation and token metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str, *, remove_articles: bool, remove_punctuation: bool) -> str:
    """Lower case, optionally drop the words a/an/the and ASCII punctuation, collapse spaces."""
    text = str(text).lower().strip()
    if remove_punctuation:
        text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    if remove_articles:
        text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def squad_normalize(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    return normalize_answer(text, remove_articles=True, remove_punctuation=True)


def paper_normalize(text: str) -> str:
    """The paper's evaluation normalisation: lower case, no articles, punctuation kept."""
    return normalize_answer(text, remove_articles=True, remove_punctuation=False)


def token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


YES_NO = {"yes", "no", "noanswer"}


def f1(prediction: str, gold: str) -> float:
    """Token F1 after SQuAD normalisation, with the yes/no/noanswer exact-match rule."""
    pred, ref = squad_normalize(prediction), squad_normalize(gold)
    if (pred in YES_NO or ref in YES_NO) and pred != ref:
        return 0.0
    return token_f1(pred.split(), ref.split())


def em(prediction: str, gold: str) -> float:
    """Exact match after SQuAD normalisation."""
    return float(squad_normalize(prediction) == squad_normalize(gold))


def acc(prediction: str, gold: str) -> float:
    """Substring accuracy after SQuAD normalisation: the gold answer appears in the prediction."""
    return float(squad_normalize(gold) in squad_normalize(prediction))


def f1_paper(prediction: str, gold: str) -> float:
    """Token F1 as the paper's evaluation computes it (articles removed, punctuation kept)."""
    return token_f1(paper_normalize(prediction).split(), paper_normalize(gold).split())


def em_paper(prediction: str, gold: str) -> float:
    """Exact match with the paper's evaluation normalisation."""
    return float(paper_normalize(prediction) == paper_normalize(gold))


def acc_paper(prediction: str, gold: str) -> float:
    """Substring accuracy with the paper's evaluation normalisation."""
    return float(paper_normalize(gold) in paper_normalize(prediction))


def f1_raw_whitespace(prediction: str, gold: str) -> float:
    """The flywheel judge's F1: lower case and whitespace split only (the reference's variant)."""
    return token_f1(str(prediction).lower().split(), str(gold).lower().split())


def best_over_golds(metric: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """The best score of a prediction over its acceptable gold answers (0 when there are none)."""
    return max((metric(prediction, gold) for gold in golds), default=0.0)


# ---------------------------------------------------------------------------------------------
# Math equivalence: the MATH string rules


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}`` and ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return text
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def fix_slash_fraction(text: str) -> str:
    """``a/b`` with integer a and b -> ``\\frac{a}{b}`` (the MATH rules' last step, the same in every
    copy of them)."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{a}/{b}":
        return text
    return f"\\frac{{{a}}}{{{b}}}"


def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    parts = text.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] != "{":
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def _unwrap_text_commands(text: str) -> str:
    """Replace every ``\\text{X}`` with X (brace-matched)."""
    while (pos := text.find("\\text{")) >= 0:
        depth, end = 0, -1
        for i in range(pos + 5, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                end = i
                break
        if end < 0:
            break
        text = text[:pos] + text[pos + 6 : end] + text[end + 1 :]
    return text


def strip_string(text: str, *, deepsearch: bool = False) -> str:
    """Normalise a math answer with the Hendrycks MATH rules, in the reference's order.

    Removes line breaks, ``\\!``, ``\\left``/``\\right``, degree marks, dollars, percent signs
    and spaces; tfrac/dfrac become frac; units after ``\\text{ `` are dropped (with
    ``deepsearch=True`` every ``\\text{X}`` is replaced by X instead, as the RL QA reward does); a
    short ``x =`` prefix is removed; ``\\sqrt3``, ``\\frac12``, ``a/b`` and ``0.5`` get their
    canonical forms.
    """
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if deepsearch:
        text = _unwrap_text_commands(text)
    elif "\\text{ " in text:
        text = text.split("\\text{ ")[0]
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return fix_slash_fraction(text)


def is_equiv(a: str | None, b: str | None, *, deepsearch: bool = False) -> bool:
    """The reference's math equivalence: equal after :func:`strip_string` (no sympy)."""
    if a is None and b is None:
        return True
    if a is None or b is None:
        return False
    try:
        return strip_string(str(a), deepsearch=deepsearch) == strip_string(str(b), deepsearch=deepsearch)
    except Exception:  # the MATH rules fall back to plain equality on malformed input
        return str(a) == str(b)


def _as_latex(text: str) -> str:
    return text if "$" in text else f"${text}$"


# Remembered per process: sympy's simplification is most of an evaluation's scoring (about 30 ms a
# pair), and the same pair comes back for every sample that gives the same answer and again for
# math_equal. The answer is a function of the two strings; a pair whose parsing timed out is
# remembered as not equal, as it was found.
@functools.lru_cache(maxsize=1 << 16)
def math_verify_equal(prediction: str, gold: str) -> bool:
    """Symbolic equivalence with ``math-verify`` (``0.5`` = ``\\frac{1}{2}`` = ``1/2``).

    math-verify times its parsing out with ``signal.alarm``, which only works in the main
    thread; elsewhere it runs without its own timeout (the caller's timeout applies).
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        parsed_gold = parse(_as_latex(str(gold)), parsing_timeout=timeout)
        parsed_pred = parse(_as_latex(str(prediction)), parsing_timeout=timeout)
        if not parsed_gold or not parsed_pred:
            return False
        return bool(verify(parsed_gold, parsed_pred, timeout_seconds=timeout))
    except Exception:  # math-verify raises on some malformed LaTeX; that is simply "not equal"
        return False


# ---------------------------------------------------------------------------------------------
# Everything at once (the `etagent score` command)


def score_prediction(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """Every rule-based metric of a prediction against its gold answers (max over golds)."""
    golds = [str(g) for g in golds]
    prediction = str(prediction)
    lowered = prediction.lower()  # the paper's evaluator compares lower-cased math answers
    return {
        "em": best_over_golds(em, prediction, golds),
        "f1": best_over_golds(f1, prediction, golds),
        "acc": best_over_golds(acc, prediction, golds),
        "em_paper": best_over_golds(em_paper, prediction, golds),
        "f1_paper": best_over_golds(f1_paper, prediction, golds),
        "acc_paper": best_over_golds(acc_paper, prediction, golds),
        "f1_raw_whitespace": best_over_golds(f1_raw_whitespace, prediction, golds),
        "is_equiv": float(any(is_equiv(lowered, g.lower()) for g in golds)),
        "is_equiv_paper": float(any(is_equiv(paper_normalize(prediction), paper_normalize(g)) for g in golds)),
        "math_verify": float(any(math_verify_equal(prediction, g) for g in golds)),
        "math_equal": float(math_equal(prediction, golds)),
    }


def math_equal(prediction: str, golds: Sequence[str]) -> bool:
    """True when the prediction equals a gold answer by the MATH string rules (on lower-cased
    strings, as the paper's evaluator compares them) or by math-verify."""
    prediction = str(prediction)
    return any(is_equiv(prediction.lower(), str(g).lower()) or math_verify_equal(prediction, str(g)) for g in golds)


def rule_correctness(prediction: str, golds: Sequence[str], kind: str) -> float:
    """Rule-based correctness in [0, 1]: :func:`math_equal` for math, paper F1 for QA."""
    if kind == "math":
        return float(math_equal(prediction, golds))
    return best_over_golds(f1_paper, prediction, golds)


def rule_judgement(prediction: str, golds: Sequence[str], kind: str, qa_pass_mark: float) -> Judgement:
    """:func:`rule_correctness` as a :class:`Judgement`: math is right or wrong
    (``math_equal``); QA's score is the paper's F1, counted correct at ``qa_pass_mark`` or above
    (each stage's own setting of that name)."""
    score = rule_correctness(prediction, golds, kind)
    if kind == "math":
        return Judgement(metric="math_equal", score=score, verdict=score == 1.0)
    return Judgement(metric="f1_paper", score=score, verdict=score >= qa_pass_mark, threshold=qa_pass_mark)


# ---------------------------------------------------------------------------------------------
# Per-sample metrics (evaluation, radar and the rollout stages share them)


def sample_metrics(trajectory: Trajectory, question: Question) -> dict:
    text = trajectory.text
    metrics = (
        score_prediction(trajectory.prediction, question.answer)
        if trajectory.prediction
        else dict.fromkeys(score_prediction("x", ["y"]), 0.0)
    )
    executed = [c for c in trajectory.tool_calls if not c.budget_exhausted]
    python_calls = protocol.count_valid_tags(text, protocol.PYTHON)
    search_calls = protocol.count_valid_tags(text, protocol.SEARCH)
    metrics.update(
        python_calls=python_calls,
        search_calls=search_calls,
        tool_calls=python_calls + search_calls,
        executed_calls=len(executed),
        successful_calls=sum(c.ok for c in executed),
        length_chars=len(protocol.strip_results(text)),
        n_tokens=trajectory.n_tokens,
        valid_format=protocol.validate_format(text),
        has_prediction=bool(trajectory.prediction),
        finish_reason=trajectory.finish_reason,
    )
    if question.needed_calls is not None:
        calls = {protocol.PYTHON: python_calls, protocol.SEARCH: search_calls}
        metrics["redundant_calls"], metrics["insufficient_calls"] = call_behaviour(calls, question.needed_calls)
    return metrics


def correctness(metrics: dict, kind: str) -> float:
    """c_i: the judge for math where it answered, else math equivalence; paper F1 for QA."""
    if kind == "math":
        judged = metrics.get("llm_judge")
        return float(judged) if judged is not None else metrics["math_equal"]
    return metrics["f1_paper"]


# ---------------------------------------------------------------------------------------------
# Aggregates of the paper's main table


def efficiency(correctness: Sequence[float], tool_calls: Sequence[int]) -> float:
    """The paper's efficiency: mean over samples of c_i / n_i (c_i when n_i = 0).

    c_i is the sample's correctness (LLM judge for math, F1 for QA in the table) and n_i its
    tool-call count (:func:`etagent.protocol.count_tool_calls`). A correct answer scores 1 with
    0 or 1 calls and 0.5 with 2. Returned in [0, 1]; the paper shows it x100.
    """
    if len(correctness) != len(tool_calls):
        raise ValueError(f"{len(correctness)} correctness values but {len(tool_calls)} tool counts")
    if not correctness:
        return 0.0
    return sum(c / n if n > 0 else c for c, n in zip(correctness, tool_calls)) / len(correctness)


def call_behaviour(calls: Mapping[str, int], needed: Mapping[str, int]) -> tuple[bool, bool]:
    """(redundant, insufficient) for one trajectory whose question needs ``needed`` calls per
    tool (the toy world knows them): redundant when some tool was called more often than needed,
    insufficient when some tool was called less often. A trajectory can be both (a search where
    Python was needed). ``calls`` counts per tool as :func:`etagent.protocol.count_valid_tags`
    does; a tool missing from either mapping counts 0."""
    tools = set(calls) | set(needed)
    redundant = any(calls.get(tool, 0) > needed.get(tool, 0) for tool in tools)
    insufficient = any(calls.get(tool, 0) < needed.get(tool, 0) for tool in tools)
    return redundant, insufficient


def tool_productivity(mean_correctness: float, mean_tool_calls: float, sigma: float = 0.1) -> float:
    """The reference's tool productivity: A * T / (T + sigma) * 100."""
    return mean_correctness * mean_tool_calls / (mean_tool_calls + sigma) * 100


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ---------------------------------------------------------------------------------------------
# LLM as judge

JUDGE_PROMPT = """You are grading an answer to a question.

Question: {question}
Golden answer: {golden}
Predicted answer: {prediction}

The golden answer may list several acceptable answers separated by " | "; matching any one of them is enough. Decide whether the predicted answer fully matches the meaning and the key information of the golden answer. Reply with exactly one word: Correct or Incorrect."""


def parse_judgement(reply: str) -> bool | None:
    """The reference's reading of a judge reply: True, False, or None when it says neither.

    The text inside ``<judgment>...</judgment>`` if present, else the whole reply, lower-cased:
    correct when it contains "correct" and none of "incorrect", "wrong", "not correct"; a reply
    containing none of these words is unparseable (None), which the judge retries.
    """
    match = re.search(r"<judgment>(.*?)</judgment>", reply, re.DOTALL | re.IGNORECASE)
    text = (match.group(1) if match else reply).lower()
    negative = any(word in text for word in ("incorrect", "wrong", "not correct"))
    if negative:
        return False
    if "correct" in text:
        return True
    return None


class LLMJudge:
    """LLM-as-judge over any text model (:class:`etagent.llm.text.TextModel`: a pool of served
    models with their timeouts, retries and fail-over, or a model in this process).

    A prediction is correct when it equals a gold answer by :func:`is_equiv` (no call is made;
    ``metric="is_equiv"``) or when the judge says so (:func:`parse_judgement`). Unlike the
    reference, the judge samples as its config says (the presets: temperature 0, 16 tokens); an
    unparseable reply is asked again up to ``attempts`` times, and a judge that gives no usable
    answer is reported as such (``verdict=None``, ``error`` says why) instead of being scored.
    """

    def __init__(self, model: TextModel, *, attempts: int = 3):
        self.model, self.attempts = model, attempts

    def prompt(self, question: str, golds: Sequence[str], prediction: str) -> str:
        return JUDGE_PROMPT.format(question=question, golden=" | ".join(map(str, golds)), prediction=prediction)

    async def ajudge(self, question: str, golds: Sequence[str], prediction: str) -> Judgement:
        if any(is_equiv(prediction, str(g)) for g in golds):
            return Judgement(metric="is_equiv", score=1.0, verdict=True, attempts=0)
        messages = [{"role": "user", "content": self.prompt(question, golds, prediction)}]
        reply, error = "", ""
        for attempt in range(1, self.attempts + 1):
            try:
                reply = await self.model.chat(messages)
            except ExternalCallError as exc:  # the engine has retried and failed over already
                return Judgement(metric="llm_judge", score=None, verdict=None, reply=reply, attempts=attempt, error=str(exc))
            except (KeyError, IndexError, TypeError) as exc:  # an answer without a message: ask again
                error = f"malformed answer ({type(exc).__name__}: {exc})"
                continue
            verdict = parse_judgement(reply)
            if verdict is not None:
                return Judgement(metric="llm_judge", score=float(verdict), verdict=verdict, reply=reply, attempts=attempt)
            error = f"unparseable reply {reply[:80]!r}"
        return Judgement(metric="llm_judge", score=None, verdict=None, reply=reply, attempts=self.attempts, error=error)

    async def ajudge_many(self, items: Sequence[tuple[str, Sequence[str], str]]) -> list[Judgement]:
        """Judge (question, golds, prediction) items concurrently (the engine bounds how many are
        in flight), in order."""
        return list(await asyncio.gather(*(self.ajudge(*item) for item in items)))

    def judge_many(self, items: Sequence[tuple[str, Sequence[str], str]]) -> list[Judgement]:
        """Synchronous :meth:`ajudge_many` for scripts that have no event loop."""
        return asyncio.run(self.ajudge_many(items))

    def judge_into(self, rows: Sequence[tuple[dict, str, Sequence[str], str]]) -> None:
        """Judge (metrics, question, golds, prediction) rows and record each verdict in its metrics
        dict as ``llm_judge`` (True, False or None), ``llm_judge_reason`` (``rule``, ``judge`` or
        ``failed: ...``) and ``llm_judge_response``: what ``etagent score`` and evaluation write."""
        judgements = self.judge_many([item for _, *item in rows])
        for (metrics, *_), j in zip(rows, judgements):
            reason = "rule" if j.metric == "is_equiv" else ("judge" if j.verdict is not None else f"failed: {j.error}")
            metrics.update(llm_judge=j.verdict, llm_judge_reason=reason, llm_judge_response=j.reply or "")

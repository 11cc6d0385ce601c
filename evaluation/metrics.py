"""Per-dataset aggregates, as the paper's table computes them, plus pass@k and bootstrap
intervals, over the per-sample metrics of :func:`etagent.scoring.sample_metrics` (which radar and
the other stages share).

Per sample: every rule-based score of :func:`etagent.scoring.score_prediction`; the tool calls
the paper counts (paired ``<python>``/``<search>`` tags in the text: calls over budget and tags
quoted in results included, as its efficiency uses them) and the calls actually executed and
succeeding (from the rollout's records); the length outside tool results; format validity.

Correctness c_i, as the paper's table uses it: the LLM judge's verdict for math (falling back to
math equivalence where there is no judge or the judge failed; failures are counted), token F1
with the paper's normalisation for QA. A sample is *solved* (for pass@k) when c_i reaches the
evaluation's ``qa_pass_mark`` (0.8 in the presets, the flywheel's F1 rule; math's c_i is 0 or 1).

Where a question says how many calls of each tool it needs (``needed_calls``; the toy world's
do), each sample is also marked redundant (some tool called more often than needed) and/or
insufficient (some tool called less often), and :func:`behaviour` reports per kind of question
the correctness, mean tool calls and the two rates: the behaviour the paper calibrates.

Per dataset: correctness and efficiency (mean of c_i / n_i, c_i when n_i = 0; n_i = tool calls),
both x100 with bootstrap 95% intervals over questions; tool productivity (A * T / (T + 0.1) * 100);
mean EM/F1/accuracy; tool use; pass@k with the unbiased estimator for every k up to the samples
per question.

Deliberate difference from the paper's evaluator: an empty prediction scores 0 (the paper scored
the last five lines of the output instead, giving partial credit to trajectories with no answer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from etagent.scoring import correctness, efficiency, pass_at_k, tool_productivity


def _bootstrap(values_per_question: list[list[float]], statistic, rng: np.random.Generator, rounds: int) -> tuple[float, float]:
    """95% interval of statistic(flattened values) when resampling questions with replacement."""
    n = len(values_per_question)
    if n == 0:
        return (0.0, 0.0)
    estimates = []
    for _ in range(rounds):
        picks = rng.integers(0, n, size=n)
        estimates.append(statistic([values_per_question[i] for i in picks]))
    low, high = np.percentile(estimates, [2.5, 97.5])
    return float(low), float(high)


def aggregate(questions: Sequence[tuple[str, list[dict]]], qa_pass_mark: float, bootstrap_rounds: int = 1000, seed: int = 0) -> dict:
    """The dataset's aggregates from (kind, per-sample metrics) per question. Each question is
    scored by its own kind, so a dataset may mix math and QA (the toy world does)."""
    samples = [(kind, m) for kind, per_question in questions for m in per_question]
    if not samples:
        return {"questions": 0, "samples": 0}
    c = [correctness(m, kind) for kind, m in samples]
    tools = [m["tool_calls"] for _, m in samples]
    mean_c, mean_t = float(np.mean(c)), float(np.mean(tools))
    rng = np.random.default_rng(seed)

    def correctness_of(groups):
        return 100 * float(np.mean([correctness(m, kind) for kind, g in groups for m in g]))

    def efficiency_of(groups):
        flat = [(kind, m) for kind, g in groups for m in g]
        return 100 * efficiency([correctness(m, kind) for kind, m in flat], [m["tool_calls"] for _, m in flat])

    metrics = [m for _, m in samples]
    executed = sum(m["executed_calls"] for m in metrics)
    out = {
        "questions": len(questions),
        "samples": len(samples),
        "correctness": round(100 * mean_c, 2),
        "correctness_ci95": [round(x, 2) for x in _bootstrap(list(questions), correctness_of, rng, bootstrap_rounds)],
        "efficiency": round(100 * efficiency(c, tools), 2),
        "efficiency_ci95": [round(x, 2) for x in _bootstrap(list(questions), efficiency_of, rng, bootstrap_rounds)],
        "tool_productivity": round(tool_productivity(mean_c, mean_t), 2),
        "tool_calls": round(mean_t, 3),
        "python_calls": round(float(np.mean([m["python_calls"] for m in metrics])), 3),
        "search_calls": round(float(np.mean([m["search_calls"] for m in metrics])), 3),
        "used_tools": round(float(np.mean([t > 0 for t in tools])), 4),
        "successful_execution": round(sum(m["successful_calls"] for m in metrics) / executed, 4) if executed else None,
        "valid_format": round(float(np.mean([m["valid_format"] for m in metrics])), 4),
        "answered": f"{sum(m['has_prediction'] for m in metrics)} of {len(metrics)}",
        "mean_tokens": round(float(np.mean([m["n_tokens"] for m in metrics])), 1),
        "mean_length_chars": round(float(np.mean([m["length_chars"] for m in metrics])), 1),
    }
    for key in ("em", "f1", "acc", "em_paper", "f1_paper", "acc_paper", "math_equal"):
        out[key] = round(100 * float(np.mean([m[key] for m in metrics])), 2)
    judged = [m for m in metrics if "llm_judge" in m]
    if judged:
        answered = [m["llm_judge"] for m in judged if m["llm_judge"] is not None]
        out["llm_judge"] = round(100 * float(np.mean(answered)), 2) if answered else None
        out["judge_failures"] = sum(m["llm_judge"] is None for m in judged)
    n = min(len(g) for _, g in questions)
    if n >= 1:
        solved = [sum(correctness(m, kind) >= qa_pass_mark for m in g[:n]) for kind, g in questions]
        for k in sorted({k for k in (1, 2, 4, 8, 16, n) if k <= n}):
            per_question = [("", [pass_at_k(n, s, k)]) for s in solved]
            out[f"pass@{k}"] = round(100 * float(np.mean([v for _, [v] in per_question])), 2)
            out[f"pass@{k}_ci95"] = [
                round(x, 2) for x in _bootstrap(per_question, lambda gs: 100 * float(np.mean([v for _, [v] in gs])), rng, bootstrap_rounds)
            ]
    return out


def behaviour(rows: Sequence[dict], qa_pass_mark: float) -> dict:
    """Per source (kind of question) and over all: questions, samples, correctness, mean tool
    calls, redundant-call rate and insufficient-call rate (shares of all samples), and the
    redundant-call rate among the solved samples (c_i >= qa_pass_mark: over-calling that correctness
    alone does not punish, the case the efficiency reward is for), from scored rows (``source``,
    ``kind`` and per-sample metrics). Only questions with known needed calls count; {} when there
    are none."""
    per_source: dict[str, list[tuple[str, dict]]] = {}
    for row in rows:
        samples = [m for m in row["samples"] if "redundant_calls" in m]
        if samples:
            per_source.setdefault(row["source"], []).append((row["kind"], samples))

    def summary(questions: list[tuple[str, list[dict]]]) -> dict:
        samples = [(kind, m) for kind, ms in questions for m in ms]
        solved = [m for kind, m in samples if correctness(m, kind) >= qa_pass_mark]
        return {
            "questions": len(questions),
            "samples": len(samples),
            "correctness": round(100 * float(np.mean([correctness(m, kind) for kind, m in samples])), 2),
            "tool_calls": round(float(np.mean([m["tool_calls"] for _, m in samples])), 3),
            "redundant_rate": round(100 * float(np.mean([m["redundant_calls"] for _, m in samples])), 2),
            "insufficient_rate": round(100 * float(np.mean([m["insufficient_calls"] for _, m in samples])), 2),
            "redundant_when_solved": round(100 * float(np.mean([m["redundant_calls"] for m in solved])), 2) if solved else 0.0,
        }

    if not per_source:
        return {}
    out = {source: summary(questions) for source, questions in sorted(per_source.items())}
    out["all"] = summary([q for questions in per_source.values() for q in questions])
    return out

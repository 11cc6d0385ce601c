"""Pareto selection speed: ours against the reference's pairwise NSGA-II, in the same run.

    python bench/bench_pareto.py [--questions 100000] [--chains 8] [--count 8000] [--reference-questions 5000]

Synthetic direct-rollout results, drawn from a seed: half math questions (each chain right with
the question's own probability), half QA (F1 from {0, 1/3, 1/2, 2/3, 1}), tool calls 0-6 per
chain around the question's own mean, lengths around 600 tokens.

1. Ours at scale: objectives from the per-chain arrays, the mixed-outcome filter, then selecting
   ``count`` questions (pareto/selection.py), timed phase by phase; then the same with a third,
   continuous objective (the general front sort instead of the two-objective sweep).
2. Side by side on the first ``reference-questions`` questions' objectives: the reference's
   algorithm as docs/paper-code.md §A5.3 describes it (a pure-Python double loop recording, per
   question, whom it dominates and how many dominate it; fronts peeled by decrementing counters;
   crowding distance on the cut front), and ours on the same points. The fronts must agree; the
   ratio of the two times is printed.

Printed, never asserted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from etagent.pareto.selection import Chains, mixed_outcome, objectives, pareto_ranks, select


def synthetic_chains(questions: int, chains: int, seed: int) -> tuple[Chains, np.ndarray]:
    rng = np.random.default_rng(seed)
    question = np.repeat(np.arange(questions), chains)
    math = np.arange(questions) < questions // 2
    p_right = rng.beta(0.8, 0.8, questions)
    right = rng.random(questions * chains) < p_right[question]
    f1_levels = np.array([0.0, 1 / 3, 0.5, 2 / 3, 1.0])
    qa_f1 = np.where(right, 1.0, f1_levels[rng.integers(0, 4, questions * chains)])
    correctness = np.where(math[question], right.astype(float), qa_f1)
    tool_mean = rng.uniform(0.3, 3.0, questions)
    tool_calls = np.minimum(rng.poisson(tool_mean[question]), 6).astype(float)
    tokens = rng.normal(600, 150, questions * chains).clip(50).round()
    threshold = np.where(math, 1.0, 0.75)
    return Chains(question, correctness, tool_calls, tool_calls, tokens, questions), threshold


def reference_select(points: list[tuple[float, float]], count: int) -> tuple[list[int], list[int]]:
    """The reference's selection, O(N^2) in pure Python: returns (ranks, selected indices)."""
    n = len(points)
    dominated: list[list[int]] = [[] for _ in range(n)]
    counter = [0] * n
    for p in range(n):
        for q in range(n):
            if p == q:
                continue
            a, b = points[p], points[q]
            if a[0] >= b[0] and a[1] >= b[1] and (a[0] > b[0] or a[1] > b[1]):
                dominated[p].append(q)
            elif b[0] >= a[0] and b[1] >= a[1] and (b[0] > a[0] or b[1] > a[1]):
                counter[p] += 1
    ranks = [0] * n
    fronts = [[p for p in range(n) if counter[p] == 0]]
    while fronts[-1]:
        following = []
        for p in fronts[-1]:
            for q in dominated[p]:
                counter[q] -= 1
                if counter[q] == 0:
                    ranks[q] = len(fronts)
                    following.append(q)
        fronts.append(following)
    selected: list[int] = []
    for front in fronts:
        if len(selected) + len(front) <= count:
            selected += front
            continue
        distance = dict.fromkeys(front, 0.0)
        for m in range(2):
            ordered = sorted(front, key=lambda i: points[i][m])
            span = points[ordered[-1]][m] - points[ordered[0]][m]
            if span == 0:
                continue
            distance[ordered[0]] = distance[ordered[-1]] = float("inf")
            for k in range(1, len(ordered) - 1):
                distance[ordered[k]] += (points[ordered[k + 1]][m] - points[ordered[k - 1]][m]) / span
        selected += sorted(front, key=lambda i: -distance[i])[: count - len(selected)]
        break
    return ranks, selected


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=100_000)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--count", type=int, default=8000)
    parser.add_argument("--reference-questions", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = ["correctness_variance", "tool_calls_variance"]

    chains, threshold = synthetic_chains(args.questions, args.chains, args.seed)
    points, t_objectives = timed(objectives, chains, names)
    mixed, t_filter = timed(mixed_outcome, chains, threshold)
    eligible = np.flatnonzero(mixed)
    selection, t_select = timed(select, points[eligible], args.count, args.seed)
    total = t_objectives + t_filter + t_select
    print(
        f"ours: {args.questions:,} questions x {args.chains} chains -> {len(eligible):,} eligible -> {len(selection.selected):,} selected"
    )
    print(
        f"  objectives {t_objectives:.3f} s, mixed-outcome filter {t_filter:.3f} s, fronts + selection {t_select:.3f} s; total {total:.3f} s"
    )
    print(
        f"  {len(selection.front_sizes())} fronts over {len(np.unique(points[eligible], axis=0)):,} distinct points; cut front {selection.cut_front}"
    )
    three = objectives(chains, [*names, "length_variance"])[eligible]
    selection3, t_three = timed(select, three, args.count, args.seed)
    print(
        f"  with length_variance as a third objective (continuous: {len(np.unique(three, axis=0)):,} distinct points, "
        f"{len(selection3.front_sizes())} fronts): fronts + selection {t_three:.2f} s"
    )

    n = args.reference_questions
    sample = points[:n]
    (reference_ranks, reference_selected), t_reference = timed(reference_select, [tuple(p) for p in sample.tolist()], args.count // 20)
    (ours_ranks, t_ranks) = timed(pareto_ranks, sample)
    ours, t_ours = timed(select, sample, args.count // 20, args.seed)
    agree = list(ours_ranks) == reference_ranks
    same_fronts_taken = sorted(ours.ranks[ours.selected].tolist()) == sorted(reference_ranks[i] for i in reference_selected)
    print(f"side by side on {n:,} questions (selecting {args.count // 20}), no filter, as the reference runs it:")
    print(f"  reference pairwise (pure Python, O(N^2)) {t_reference:.3f} s")
    print(f"  ours (sort-based fronts + selection)      {t_ours:.4f} s (fronts alone {t_ranks:.4f} s)")
    print(f"  ratio {t_reference / t_ours:.0f}x; fronts identical: {agree}; same fronts selected from: {same_fronts_taken}")


if __name__ == "__main__":
    main()

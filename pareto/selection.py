"""Group-wise Pareto selection of RL questions: objectives per question, the mixed-outcome filter,
NSGA-II fronts and crowding distance. Pure functions over numpy arrays, no files.

One point per question, computed from its chains (the rollouts of ``direct_rollout/``), every
objective maximised. The paper's two (docs/paper-code.md §A5.2) are the population variance of
the chains' correctness and of their executed tool calls; :data:`OBJECTIVES` has a few more.

Selection (:func:`select`) is NSGA-II's: whole fronts in order while they fit, then the first
front that does not fit is cut by crowding distance, largest first. What differs from the
reference, on purpose:

- fronts come from a sort, not the O(N^2) pairwise pass: an O(N log N) sweep for two objectives,
  and for more the "efficient non-dominated sort" with a binary search over fronts; both on the
  distinct points only, since questions with equal objectives always share a front;
- objectives are rounded to 12 decimals, so that chains with the same values in another order
  give exactly equal points (a last-bit difference would make one dominate the other);
- crowding distance is computed over the distinct points of the cut front: in the reference,
  copies of one point get different distances depending on where the sort put them. Questions
  left equal after that are taken in a random order drawn from ``seed``;
- the mixed-outcome filter (:func:`mixed_outcome`) is the caller's to apply before selecting,
  so that exactly ``count`` questions come out whenever that many qualify.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

# Per-question objectives, all maximised: name -> what it measures.
OBJECTIVES = {
    "correctness_variance": "population variance of the chains' correctness (the paper's score_corr)",
    "tool_calls_variance": "population variance of the chains' executed tool calls (the paper's score_tool)",
    "written_tool_calls_variance": "population variance of the tool calls as the protocol counts them in the text",
    "length_variance": "population variance of the chains' generated tokens",
    "mean_tool_calls": "mean executed tool calls (questions where the policy calls many tools)",
}


@dataclass(frozen=True)
class Chains:
    """Every chain of every question as flat arrays; ``question`` is the question's row (0..n-1)."""

    question: np.ndarray
    correctness: np.ndarray
    tool_calls: np.ndarray
    written_tool_calls: np.ndarray
    generated_tokens: np.ndarray
    n_questions: int

    def per_question_count(self) -> np.ndarray:
        return np.bincount(self.question, minlength=self.n_questions)

    def mean(self, values: np.ndarray) -> np.ndarray:
        """Per-question mean (0 for a question with no chains)."""
        count = self.per_question_count()
        total = np.bincount(self.question, weights=values, minlength=self.n_questions)
        return np.divide(total, count, out=np.zeros(self.n_questions), where=count > 0)

    def variance(self, values: np.ndarray) -> np.ndarray:
        """Per-question population variance (ddof 0; 0 for a question with no chains)."""
        values = np.asarray(values, float)
        deviation = values - self.mean(values)[self.question]
        return self.mean(deviation * deviation)


def objectives(chains: Chains, names: list[str]) -> np.ndarray:
    """The (n_questions, len(names)) points, rounded to 12 decimals so equal groups tie exactly."""
    unknown = [name for name in names if name not in OBJECTIVES]
    if unknown or not names:
        raise ValueError(f"objectives: unknown {unknown or 'none given'}; choose from {', '.join(OBJECTIVES)}")
    columns = {
        "correctness_variance": lambda: chains.variance(chains.correctness),
        "tool_calls_variance": lambda: chains.variance(chains.tool_calls),
        "written_tool_calls_variance": lambda: chains.variance(chains.written_tool_calls),
        "length_variance": lambda: chains.variance(chains.generated_tokens),
        "mean_tool_calls": lambda: chains.mean(np.asarray(chains.tool_calls, float)),
    }
    return np.round(np.stack([columns[name]() for name in names], axis=1), 12)


def mixed_outcome(chains: Chains, threshold: np.ndarray) -> np.ndarray:
    """Per question: at least one chain at or above its threshold and one below (the paper's
    filter: math, threshold 1, needs both a 0 and a 1; QA, threshold 0.75)."""
    above = chains.correctness >= threshold[chains.question]
    some_above = np.bincount(chains.question, weights=above, minlength=chains.n_questions) > 0
    some_below = np.bincount(chains.question, weights=~above, minlength=chains.n_questions) > 0
    return some_above & some_below


# ---------------------------------------------------------------------------------------------
# Fronts


def pareto_ranks(points: np.ndarray) -> np.ndarray:
    """The front of every point (0: dominated by none), every objective maximised.

    p dominates q when p >= q in every objective and p > q in one; front k holds the points
    whose dominators all lie in fronts below k. Equal points share a front."""
    points = np.asarray(points, float)
    if points.ndim != 2:
        raise ValueError(f"points must be (n, objectives), got shape {points.shape}")
    if len(points) == 0:
        return np.zeros(0, dtype=np.int64)
    distinct, inverse = np.unique(points, axis=0, return_inverse=True)
    # np.unique sorts ascending; visit in descending lexicographic order, so that every
    # dominator of a point comes before it
    order = np.arange(len(distinct))[::-1]
    ranks = _ranks_two(distinct, order) if points.shape[1] == 2 else _ranks_any(distinct, order)
    return ranks[inverse.reshape(-1)]


def _ranks_two(points: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Two objectives, distinct points, in descending (x, y) order: a visited point dominates the
    current one exactly when its y is at least as large. Each front keeps the y of its last member
    (its largest so far); these decrease from front to front, so the first front the point fits
    in (last y below its y) is found by binary search: O(N log N) in all."""
    ranks = np.empty(len(points), dtype=np.int64)
    negated_last = []  # -last y of each front, non-decreasing
    for i in order:
        y = points[i, 1]
        k = bisect.bisect_right(negated_last, -y)
        if k == len(negated_last):
            negated_last.append(-y)
        else:
            negated_last[k] = -y
        ranks[i] = k
    return ranks


def _ranks_any(points: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Any number of objectives: the efficient non-dominated sort with binary search over fronts
    (Zhang et al., 2015). If a member of front k dominates p, so does one of every earlier front,
    so 'dominated by front k' is monotone in k."""
    ranks = np.empty(len(points), dtype=np.int64)
    fronts: list[list[int]] = []
    for i in order:
        p = points[i]
        low, high = 0, len(fronts)
        while low < high:
            mid = (low + high) // 2
            members = points[fronts[mid]]
            if np.any(np.all(members >= p, axis=1) & np.any(members > p, axis=1)):
                low = mid + 1
            else:
                high = mid
        if low == len(fronts):
            fronts.append([])
        fronts[low].append(i)
        ranks[i] = low
    return ranks


def crowding_distance(points: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance of the points of one front: per objective with a non-zero range,
    the two extremes get infinity and each other point adds (next - previous) / range."""
    points = np.asarray(points, float)
    distance = np.zeros(len(points))
    for column in points.T:
        order = np.argsort(column, kind="stable")
        values = column[order]
        span = values[-1] - values[0] if len(values) else 0.0
        if span == 0:
            continue
        distance[order[0]] = distance[order[-1]] = np.inf
        distance[order[1:-1]] += (values[2:] - values[:-2]) / span
    return distance


@dataclass(frozen=True)
class Selection:
    """``selected``: the chosen rows, by front, then crowding distance (largest first), then the
    seeded tie-break. ``ranks``: every row's front. ``distance``: crowding distance of the rows of
    the cut front, NaN elsewhere. ``whole_fronts``: how many fronts were taken whole;
    ``cut_front``: the front that did not fit whole (None when whole fronts filled the quota or
    everything was taken); ``taken_from_cut``: rows taken from it."""

    selected: np.ndarray
    ranks: np.ndarray
    distance: np.ndarray
    whole_fronts: int
    cut_front: int | None
    taken_from_cut: int

    def front_sizes(self) -> list[int]:
        return np.bincount(self.ranks).tolist() if len(self.ranks) else []


def select(points: np.ndarray, count: int, seed: int) -> Selection:
    """Choose ``count`` rows of ``points`` (all, when there are no more) by NSGA-II."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    points = np.asarray(points, float)
    n = len(points)
    ranks = pareto_ranks(points)
    tiebreak = np.random.default_rng(seed).permutation(n)
    distance = np.full(n, np.nan)
    sizes = np.bincount(ranks) if n else np.zeros(0, dtype=np.int64)
    whole = int(np.searchsorted(np.cumsum(sizes), count, side="right"))  # fronts that fit whole
    taken = ranks < whole
    room = count - int(taken.sum())
    cut_front, taken_from_cut = None, 0
    if room > 0 and whole < len(sizes):
        cut_front = whole
        rows = np.flatnonzero(ranks == cut_front)
        distinct, inverse = np.unique(points[rows], axis=0, return_inverse=True)
        distance[rows] = crowding_distance(distinct)[inverse.reshape(-1)]
        best = rows[np.lexsort((tiebreak[rows], -distance[rows]))[:room]]
        taken[best] = True
        taken_from_cut = len(best)
    chosen = np.flatnonzero(taken)
    sort_distance = np.where(np.isnan(distance[chosen]), 0.0, -distance[chosen])
    selected = chosen[np.lexsort((tiebreak[chosen], sort_distance, ranks[chosen]))]
    return Selection(
        selected=selected, ranks=ranks, distance=distance, whole_fronts=whole, cut_front=cut_front, taken_from_cut=taken_from_cut
    )

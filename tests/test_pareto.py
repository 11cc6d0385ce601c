"""Pareto selection against a brute-force front computation, on hand-made and random groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etagent.pareto.selection import Chains, crowding_distance, mixed_outcome, objectives, pareto_ranks, select
from tests.support.trajectories import rollout_line


def brute_force_ranks(points: np.ndarray) -> np.ndarray:
    """The definition, peeled front by front: a point is in the current front when no remaining
    point dominates it (>= everywhere, > somewhere)."""
    points = np.asarray(points, float)
    ranks = np.full(len(points), -1)
    remaining = set(range(len(points)))
    front = 0
    while remaining:
        current = {
            i for i in remaining if not any(np.all(points[j] >= points[i]) and np.any(points[j] > points[i]) for j in remaining if j != i)
        }
        for i in current:
            ranks[i] = front
        remaining -= current
        front += 1
    return ranks


points_2d = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=0, max_size=60)
points_3d = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=50)


@settings(max_examples=200, deadline=None)
@given(points_2d)
def test_two_objective_fronts_equal_brute_force(raw):
    points = np.array(raw, float).reshape(-1, 2)
    assert pareto_ranks(points).tolist() == brute_force_ranks(points).tolist()


@settings(max_examples=150, deadline=None)
@given(points_3d)
def test_three_objective_fronts_equal_brute_force(raw):
    points = np.array(raw, float)
    assert pareto_ranks(points).tolist() == brute_force_ranks(points).tolist()


def test_continuous_points_match_brute_force():
    rng = np.random.default_rng(3)
    for m in (1, 2, 3, 4):
        points = rng.random((150, m))
        assert pareto_ranks(points).tolist() == brute_force_ranks(points).tolist()


def test_fronts_of_a_hand_made_set():
    #            0       1       2       3       4          5       6       7
    points = [[2, 2], [2, 2], [3, 0], [0, 3], [1, 1], [0.5, 0.5], [1, 1], [0, 0]]
    assert pareto_ranks(np.array(points)).tolist() == [0, 0, 0, 0, 1, 2, 1, 3]


def check_selection(points: np.ndarray, count: int, seed: int):
    s = select(points, count, seed)
    n = len(points)
    chosen = set(s.selected.tolist())
    assert len(s.selected) == len(chosen) == min(count, n)
    rejected = [i for i in range(n) if i not in chosen]
    if chosen and rejected:
        # every selected question lies in an earlier or equal front than every rejected one
        assert max(s.ranks[list(chosen)]) <= min(s.ranks[rejected])
    assert s.whole_fronts == (s.cut_front if s.cut_front is not None else len(set(s.ranks[s.selected].tolist())))
    if s.cut_front is None:
        # whole fronts only
        for front in set(s.ranks.tolist()):
            members = set(np.flatnonzero(s.ranks == front).tolist())
            assert members <= chosen or not members & chosen
    else:
        # fronts before the cut are taken whole, later ones not at all
        assert all(i in chosen for i in np.flatnonzero(s.ranks < s.cut_front))
        assert not any(i in chosen for i in np.flatnonzero(s.ranks > s.cut_front))
        cut = np.flatnonzero(s.ranks == s.cut_front)
        taken = [i for i in cut if i in chosen]
        left = [i for i in cut if i not in chosen]
        assert taken and left and len(taken) == s.taken_from_cut
        # the cut front is cut by crowding distance: no rejected member is less crowded
        assert min(s.distance[taken]) >= max(s.distance[left])
        # and that distance is the NSGA-II one over the front's distinct points
        distinct, inverse = np.unique(points[cut], axis=0, return_inverse=True)
        assert np.array_equal(s.distance[cut], crowding_distance(distinct)[inverse.reshape(-1)])
    return s


@settings(max_examples=200, deadline=None)
@given(points_2d, st.integers(0, 70), st.integers(0, 3))
def test_selection_takes_whole_fronts_then_the_least_crowded(raw, count, seed):
    check_selection(np.array(raw, float).reshape(-1, 2), count, seed)


def test_selection_on_hand_made_groups():
    points = np.array([[2, 2], [3, 0], [0, 3], [1, 1], [2, 0.5], [0.5, 2], [1.5, 1.5]], float)
    # fronts: {(2,2), (3,0), (0,3)}, {(2,0.5), (0.5,2), (1.5,1.5)}, {(1,1)}
    assert pareto_ranks(points).tolist() == brute_force_ranks(points).tolist() == [0, 0, 0, 2, 1, 1, 1]
    s = check_selection(points, 4, seed=0)
    # front 0 whole, then front 1 cut: its extremes have infinite distance, (1.5,1.5) has 1 + 1
    assert s.cut_front == 1 and s.distance[6] == 2.0 and s.distance[4] == s.distance[5] == np.inf
    assert sorted(s.selected[:3].tolist()) == [0, 1, 2] and s.selected[3] in (4, 5)
    assert check_selection(points, 5, seed=0).selected[3:].tolist() in ([4, 5], [5, 4])
    assert check_selection(points, 6, seed=0).cut_front is None  # fronts 0 and 1 fit exactly


def test_all_equal_objectives_are_one_front_drawn_by_the_seed():
    points = np.zeros((20, 2))
    first = select(points, 5, seed=1)
    assert first.front_sizes() == [20] and first.cut_front == 0 and np.all(first.distance == 0)
    assert select(points, 5, seed=1).selected.tolist() == first.selected.tolist()  # deterministic
    draws = {tuple(sorted(select(points, 5, seed=s).selected.tolist())) for s in range(10)}
    assert len(draws) > 1  # the seed decides among equals, not the input order


def test_fewer_rows_than_requested_gives_all_of_them():
    points = np.array([[0.25, 1.0], [0.1, 0.0], [0.0, 2.0]])
    s = select(points, 10, seed=0)
    assert sorted(s.selected.tolist()) == [0, 1, 2] and s.cut_front is None
    assert select(np.zeros((0, 2)), 5, seed=0).selected.tolist() == []


def test_crowding_distance_by_hand():
    front = np.array([[0.0, 4.0], [1.0, 3.0], [3.0, 1.0], [4.0, 0.0]])
    # objective 0: range 4; point 1 adds (3-0)/4, point 2 adds (4-1)/4; objective 1 the same
    assert crowding_distance(front).tolist() == [np.inf, 1.5, 1.5, np.inf]
    assert crowding_distance(np.array([[1.0, 2.0], [1.0, 2.0]])).tolist() == [0.0, 0.0]  # range 0: skipped


def chains_of(groups: list[list[tuple[float, int]]]) -> Chains:
    """Chains from per-question lists of (correctness, executed tool calls)."""
    question = np.array([q for q, group in enumerate(groups) for _ in group], dtype=np.int64)
    correctness = np.array([c for group in groups for c, _ in group], float)
    tools = np.array([t for group in groups for _, t in group], float)
    return Chains(question, correctness, tools, tools, np.full(len(tools), 10.0), len(groups))


def test_objectives_of_hand_made_groups():
    groups = [
        [(1, 0), (0, 2), (1, 0), (0, 2)],  # half right: variance 0.25; tools 0,2,0,2: variance 1
        [(1, 1), (1, 1), (1, 1), (1, 1)],  # all right, same calls: 0, 0
        [(0.5, 3)],  # one chain: 0, 0
        [(0.0, 0), (1 / 3, 1), (2 / 3, 2)],  # F1s: variance 2/27; tools variance 2/3
    ]
    points = objectives(chains_of(groups), ["correctness_variance", "tool_calls_variance"])
    assert np.allclose(points, [[0.25, 1.0], [0.0, 0.0], [0.0, 0.0], [2 / 27, 2 / 3]], atol=1e-12)
    assert objectives(chains_of(groups), ["mean_tool_calls"])[:, 0].tolist() == pytest.approx([1.0, 1.0, 3.0, 1.0])
    with pytest.raises(ValueError, match="unknown"):
        objectives(chains_of(groups), ["accuracy"])


def test_equal_groups_in_another_order_tie_exactly():
    f1s = [0.1, 0.7, 0.3, 0.9, 0.2, 0.6, 0.45, 0.8]
    groups = [[(c, 1) for c in f1s], [(c, 1) for c in reversed(f1s)], [(c, 1) for c in sorted(f1s)]]
    points = objectives(chains_of(groups), ["correctness_variance", "tool_calls_variance"])
    assert points[0].tolist() == points[1].tolist() == points[2].tolist()
    assert pareto_ranks(points).tolist() == [0, 0, 0]


def test_mixed_outcome_filter():
    groups = [
        [(1, 0), (0, 0)],  # math: a 0 and a 1
        [(1, 0), (1, 0)],  # math: all right
        [(0, 0), (0, 0)],  # math: all wrong
        [(0.8, 0), (0.5, 0)],  # QA: one at or above 0.75, one below
        [(0.75, 0), (0.74, 0)],  # QA: the bar itself counts as above
        [(0.7, 0), (0.5, 0)],  # QA: none above
        [(1, 0)],  # one chain can never be mixed
    ]
    threshold = np.array([1.0, 1.0, 1.0, 0.75, 0.75, 0.75, 1.0])
    assert mixed_outcome(chains_of(groups), threshold).tolist() == [True, False, False, True, True, False, False]


def test_pareto_stage_on_a_hand_made_rollout_file(tmp_path):
    """The stage end to end on a file written by hand: reasons for dropping, failed chains left
    out, exactly `count` selected, and the same files again on a rerun."""
    import json

    from etagent.config import load_settings
    from etagent.pareto.run import run

    lines = [
        rollout_line("a", "math", [(1, 0), (0, 2), (1, 1), (0, 3)]),
        rollout_line("b", "math", [(1, 1), (1, 1), (1, 1), (1, 1)]),  # all right
        rollout_line("c", "math", [(0, 0), (0, 5), (0, 1), (0, 0)]),  # all wrong
        rollout_line("d", "qa", [(0.8, 1), (0.5, 1), (0.2, 1), (0.0, 1)]),
        rollout_line("e", "qa", [(0.7, 1), (0.5, 2)]),  # none at 0.75: all wrong
        rollout_line("f", "math", [(1, 1)]),  # one chain
        rollout_line("g", "math", [(1, 0), (0, 0), (0, 4), (1, 4)]),
    ]
    lines[6]["trajectories"][3]["finish_reason"] = "error"  # left out: g keeps three chains
    rollouts = tmp_path / "trajectories.jsonl"
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in reversed(lines)))
    cfg = load_settings("pareto", "tiny", [f"rollouts={rollouts}", f"out_dir={tmp_path / 'out'}", "count=2"])
    report = run(cfg)
    assert report["counts"]["eligible"] == 3 and report["counts"]["selected"] == 2
    assert report["counts"]["chains_left_out"] == {"engine_error": 1}
    assert report["dropped"] == {"all_correct": 1, "all_wrong": 2, "one_chain": 1, "not_selected": 1}
    scores = {s["id"]: s for s in map(json.loads, (tmp_path / "out" / "scores.jsonl").read_text().splitlines())}
    assert scores["g"]["chains"] == 3 and scores["e"]["ineligible_because"] == "all_wrong"
    # front 0: a (correctness variance 0.25, tool-call variance 1.25) and g (2/9, 32/9); d (0.092, 0) is behind a
    assert {i for i, s in scores.items() if s["selected"]} == {"a", "g"}
    first = (tmp_path / "out" / "rl.parquet").read_bytes()
    run(cfg)
    assert (tmp_path / "out" / "rl.parquet").read_bytes() == first

    # the ablation without Pareto: as many questions, drawn from all of them under the seed
    drawn = []
    for seed in range(12):
        cfg = load_settings(
            "pareto", "tiny", [f"rollouts={rollouts}", f"out_dir={tmp_path / 'random'}", "count=2", "method=random", f"seed={seed}"]
        )
        report = run(cfg)
        assert report["counts"]["selected"] == 2 and report["fronts"] == {}
        scores = [json.loads(line) for line in (tmp_path / "random" / "scores.jsonl").read_text().splitlines()]
        drawn.append(frozenset(s["id"] for s in scores if s["selected"]))
    assert len(set(drawn)) > 3 and any(not chosen <= {"a", "d", "g"} for chosen in drawn)  # ineligible ones too


def test_pareto_names_the_file_line_and_field_of_bad_input(tmp_path):
    import json

    from etagent.pareto.run import read_rollouts
    from etagent.records import RecordError

    line = rollout_line("a", "math", [(1, 0), (0, 1)])
    del line["trajectories"][1]["tool_calls_executed"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(rollout_line("z", "qa", [(1, 0)])) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:2: field 'trajectories.1.tool_calls_executed': missing"):
        read_rollouts(path)
    path.write_text(json.dumps({**rollout_line("a", "math", [(1, 0)]), "kind": "poetry"}) + "\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:1: field 'kind'"):
        read_rollouts(path)

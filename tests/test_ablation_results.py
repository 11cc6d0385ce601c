"""The ablation's kept results (evaluation/ablation_results.py) on hand-made run directories laid
out as scripts/ablations.sh lays them out: only finished runs are kept, the table computed from
what is kept is the table computed from the run, a restore gives a run directory the kept runs
back, and results from other starting policies are refused both ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from etagent.errors import UserError
from etagent.evaluation.ablation_results import ABLATION_STARTS, restore, save
from etagent.evaluation.ablations import ablation_table


def write_summary(directory, correctness):
    (directory / "eval").mkdir(parents=True)
    behaviour = {"tool_calls": 1.2, "redundant_rate": 3.0, "redundant_when_solved": 4.0, "insufficient_rate": 20.0}
    shapes = {"all": behaviour, "toy_hops3": {"correctness": correctness / 2, "samples": 8}}
    summary = {"datasets": {"toy": {"correctness": correctness, "efficiency": correctness - 5, "behaviour": shapes}}}
    (directory / "eval" / "summary.json").write_text(json.dumps(summary))


def write_starts(run_dir, weights=b"policy"):
    for name in ABLATION_STARTS:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(weights + name.encode())


def write_variant(run_dir, seed, variant, correctness, curve_points_missing=0):
    """Two stages of 8 RL steps, a checkpoint exported every 4 (steps 4 of each; the stage's last
    saved as model/), each step's rollouts with the text the table does not read, and the curve's
    points (steps 0, 4, 8, 12, 16) but the last ``curve_points_missing``."""
    run = run_dir / "ablations" / f"seed{seed}" / variant
    write_summary(run, correctness)
    for k in (1, 2):
        rl = run / f"stage{k}" / "rl"
        (rl / "models" / "step_4").mkdir(parents=True)
        (rl / "model").mkdir()
        (rl / "model" / "model.safetensors").write_bytes(b"weights")
        (rl / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "rollout/tool_calls_executed": 3 * s}) + "\n" for s in range(1, 9))
        )
        (rl / "rollouts").mkdir()
        for step in range(1, 9):
            rows = [{"index": i // 4, "reward": float(i % (step % 3 + 1) == 0), "text": "x" * 500} for i in range(8)]
            (rl / "rollouts" / f"step_{step}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (run / f"stage{k}" / "data").mkdir()
        rows = [
            {"id": f"q{i}", "source": f"toy_hops{i % 4}", "kind": "hops", "chains": 8, "mean_correctness": i / 8, "objectives": {"x": 1.0},
             "selected": i % 3 != k}
            for i in range(6)
        ]  # fmt: skip
        (run / f"stage{k}" / "data" / "scores.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    points = [0, 4, 8, 12, 16]
    for step in points[: len(points) - curve_points_missing]:
        write_summary(run / "curve" / f"step{step}", correctness - 10 + step / 2)


def build_run(run_dir):
    write_starts(run_dir)
    for seed in (0, 1):
        write_variant(run_dir, seed, "full", 50.0 + seed)
        write_summary(run_dir / "ablations" / f"seed{seed}" / "seed-sft", 40.0 + seed)
    write_variant(run_dir, 0, "no-pareto", 45.0, curve_points_missing=1)  # killed while its curve was measured
    write_variant(run_dir, 1, "no-pareto", 44.0, curve_points_missing=5)  # evaluated, its curve not begun


def test_finished_runs_are_kept_and_give_the_same_table(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    build_run(run_dir)
    saved = save(run_dir, kept)
    assert saved == ["seed0/full", "seed0/seed-sft", "seed1/full", "seed1/seed-sft"]
    assert not any(kept.rglob("*.safetensors")) and not (kept / "seed0" / "full" / "stage1" / "rl" / "models").exists()
    rollout = (kept / "seed0" / "full" / "stage2" / "rl" / "rollouts" / "step_3.jsonl").read_text().splitlines()
    assert [set(json.loads(line)) for line in rollout] == [{"index", "reward"}] * 8
    # the table's figures, curve and flat groups included, from the kept files as from the run
    from_run = ablation_table(run_dir / "ablations", 2, ["full"], ["seed-sft"])[1]
    from_kept = ablation_table(kept, 2, ["full"], ["seed-sft"])[1]
    assert from_kept == from_run
    assert {"curve_area", "rl_flat_groups", "deep_correctness", "selected_hops_rise"} <= set(from_kept["full"]["seed0"])
    starts = json.loads((kept / "starts.json").read_text())
    assert set(starts["sha256"]) == set(ABLATION_STARTS) and set(starts["runs"]) == set(saved)

    # the killed run finishes later; a second save adds it and keeps what was kept
    write_summary(run_dir / "ablations" / "seed0" / "no-pareto" / "curve" / "step16", 44.0)
    assert save(run_dir, kept) == ["seed0/no-pareto"]
    assert len(json.loads((kept / "starts.json").read_text())["runs"]) == 5


def test_restore_gives_a_new_run_directory_the_kept_runs_and_refuses_other_starts(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    build_run(run_dir)
    save(run_dir, kept)
    fresh = tmp_path / "fresh"
    write_starts(fresh)
    assert restore(kept, fresh) == ["seed0/full", "seed0/seed-sft", "seed1/full", "seed1/seed-sft"]
    assert (
        ablation_table(fresh / "ablations", 2, ["full"], ["seed-sft"])[1]
        == ablation_table(run_dir / "ablations", 2, ["full"], ["seed-sft"])[1]
    )
    assert restore(kept, fresh) == []  # what the run directory has is left as it is

    other = tmp_path / "other"
    write_starts(other, weights=b"another policy")
    for argv in (["save", str(other), str(kept)], ["restore", str(kept), str(other)]):
        done = subprocess.run([sys.executable, "-m", "etagent.evaluation.ablation_results", *argv], capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        assert (
            len(done.stderr.strip().splitlines()) == 1 and "sft/model/model.safetensors" in done.stderr and "not comparable" in done.stderr
        )
    assert not (other / "ablations" / "seed0").exists()
    # a run directory without its start files: refused before anything is written
    empty, nowhere = tmp_path / "empty", tmp_path / "nowhere"
    (empty / "ablations").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.ablation_results", "save", str(empty), str(nowhere)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "sft/model/model.safetensors: no such file" in done.stderr and not nowhere.exists()


def test_the_real_models_seeds_are_kept_from_their_own_start(tmp_path):
    """scripts/real_model.sh's layout: RUN_DIR/seed{s}/{smollm2,sft,rl}, its RL under rl/rl. Each
    evaluated policy is a finished run (the script saves only once a seed's RL is evaluated, so
    that a seed is kept whole)."""
    run_dir, kept = tmp_path / "real", tmp_path / "kept"
    starts = ("smollm2/model.safetensors", "held_out.jsonl")
    for name in starts:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    for seed in (0, 1):
        for policy, correctness in (("smollm2", 10.0), ("sft", 20.0 + seed), ("rl", 22.0)):
            if (seed, policy) != (1, "rl"):
                write_summary(run_dir / f"seed{seed}" / policy, correctness)
        rl = run_dir / f"seed{seed}" / "rl" / "rl"
        (rl / "model").mkdir(parents=True)
        (rl / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/tool_calls_executed": 7}) + "\n")
    saved = save(run_dir, kept, runs=".", starts=starts)
    assert saved == ["seed0/rl", "seed0/sft", "seed0/smollm2", "seed1/sft", "seed1/smollm2"]
    assert (kept / "seed0" / "rl" / "rl" / "metrics.jsonl").exists()
    tables = [ablation_table(root, 1, ["smollm2", "sft", "rl"], baseline="sft")[1] for root in (run_dir, kept)]
    assert tables[0] == tables[1]

    fresh = tmp_path / "fresh"
    for name in starts:
        (fresh / name).parent.mkdir(parents=True, exist_ok=True)
        (fresh / name).write_text(name)
    assert restore(kept, fresh) == saved and (fresh / "seed1" / "sft" / "eval" / "summary.json").exists()
    # the ablation's results are not these: another set of start files is refused
    for name in ABLATION_STARTS:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    with pytest.raises(UserError, match="kept runs of RUN_DIR/. from held_out.jsonl"):
        save(run_dir, kept)


def write_toy_variant(run_dir, seed, variant, correctness, stage_evaluated=True):
    """The toy world's layout: no curve, two stages, the first stage's policy evaluated after the
    run's own (scripts/ablations.sh with CURVE_POINTS=0)."""
    run = run_dir / "ablations" / f"seed{seed}" / variant
    write_summary(run, correctness)
    for k in (1, 2):
        rl = run / f"stage{k}" / "rl"
        (rl / "model").mkdir(parents=True)
        (rl / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/tool_calls_executed": 5}) + "\n")
    if stage_evaluated:
        write_summary(run / "stage1", correctness - 3)


def test_the_toys_runs_keep_their_first_stages_evaluation_and_come_back_done(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    write_starts(run_dir)
    write_toy_variant(run_dir, 0, "full", 90.0)
    write_toy_variant(run_dir, 0, "no-arpo", 91.0, stage_evaluated=False)  # its stage 1 not yet evaluated
    assert save(run_dir, kept) == ["seed0/full"]
    fresh = tmp_path / "fresh"
    write_starts(fresh)
    assert restore(kept, fresh) == ["seed0/full"]
    # the table's first-stage rows come back too: the script finds the run done, nothing to redo
    tables = [ablation_table(root / "ablations", 1, ["full"])[1] for root in (run_dir, fresh)]
    assert tables[0] == tables[1] and tables[0]["full/stage1"]["seed0"]["correctness"] == 87.0


def test_a_killed_save_or_export_leaves_nothing_half_kept(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    build_run(run_dir)
    # a save killed while copying seed0/full: its partial folder is not a kept run, and is redone
    (kept / "seed0" / ".full.partial" / "eval").mkdir(parents=True)
    (kept / "seed0" / ".full.partial" / "eval" / "summary.json").write_text("{")
    # an export a kill left half-written is no checkpoint: seed1/full needs no curve point for it
    (run_dir / "ablations" / "seed1" / "full" / "stage1" / "rl" / "models" / "step_8.tmp").mkdir()
    assert save(run_dir, kept) == ["seed0/full", "seed0/seed-sft", "seed1/full", "seed1/seed-sft"]
    assert not (kept / "seed0" / ".full.partial").exists()
    assert json.loads((kept / "seed0" / "full" / "eval" / "summary.json").read_text())["datasets"]["toy"]["correctness"] == 50.0


def test_runs_of_another_budget_are_refused(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    build_run(run_dir)
    budget = {"stages": "2", "steps": "48", "eval_n": "4"}
    save(run_dir, kept, settings=budget)
    assert json.loads((kept / "starts.json").read_text())["settings"] == budget
    with pytest.raises(UserError, match="kept runs made with settings eval_n=4 stages=2 steps=48, not eval_n=4 stages=2 steps=12"):
        save(run_dir, kept, settings={**budget, "steps": "12"})
    fresh = tmp_path / "fresh"
    write_starts(fresh)
    with pytest.raises(UserError, match="runs of another budget are not comparable"):
        restore(kept, fresh, settings={**budget, "eval_n": "2"})
    assert not (fresh / "ablations" / "seed0").exists()
    assert len(restore(kept, fresh, settings=budget)) == 4

"""scripts/rl_curriculum.sh end to end on the toy world, cut small: two stages, each with its own
data from the previous model, a fresh RL run from it, and an evaluation; a rerun resumes every
step and changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_curriculum_chains_stages_and_resumes(sft_model_full, toy, index_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "toy").symlink_to(toy)
    (run / "index").symlink_to(index_dir)
    env = dict(
        os.environ,
        ROLLOUT_ARGS="limit=32",
        PARETO_ARGS="count=8",
        RL_ARGS="train.max_steps=2 data.prompts_per_step=4 rollout.n=4 rollout.initial_rollouts=2",
        EVAL_ARGS="limit=8",
    )
    command = ["bash", "scripts/rl_curriculum.sh", str(sft_model_full / "model"), "2", str(run)]
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    stage1, stage2 = run / "rl" / "stage1", run / "rl" / "stage2"
    # stage k's data and RL start from model k-1, with no conversion between stages
    assert json.loads((stage1 / "manifest.json").read_text())["config"]["model"] == str(sft_model_full / "model")
    assert json.loads((stage2 / "manifest.json").read_text())["config"]["model"] == str(stage1 / "model")
    assert json.loads((run / "rollouts" / "stage2" / "manifest.json").read_text())["config"]["engine"]["model"] == str(stage1 / "model")
    # each stage is a fresh run: its own step counter and a sigma schedule that starts at full strength
    for stage in (stage1, stage2):
        metrics = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert metrics[0]["reward/sigma_factor"] == 1.0
        assert (
            metrics[0]["rollout/roots"] == 4 * 2
            and metrics[0]["rollout/roots"] + metrics[0]["rollout/branches"] + metrics[0]["rollout/fill_ins"] == 4 * 4
        )
    first_weights, second_weights = (load_file(stage / "model" / "model.safetensors") for stage in (stage1, stage2))
    assert any(not first_weights[k].equal(second_weights[k]) for k in first_weights)
    for k in (1, 2):
        summary = json.loads((run / f"eval-rl-stage{k}" / "summary.json").read_text())
        assert summary["run"] == f"rl-stage{k}" and summary["datasets"]["toy"]["questions"] == 8

    before = {p: p.read_bytes() for p in run.rglob("metrics.jsonl")}
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert {p: p.read_bytes() for p in run.rglob("metrics.jsonl")} == before

    # scripts/partial_effect.sh on this run's first stage (its start is the SFT policy here), one
    # seed: the stage run to the end and with partial rollouts, each evaluated, then tabulated
    (run / "sft-flywheel").symlink_to(sft_model_full)
    effect = subprocess.run(
        ["bash", "scripts/partial_effect.sh", str(run), "1"],
        cwd=ROOT,
        env={**env, "PARTIAL_ARGS": "rollout.partial_extra=2 rollout.on_stale=drop rollout.max_staleness=1 rollout.stale_tokens=tis"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert effect.returncode == 0, effect.stdout[-3000:] + effect.stderr[-3000:]
    for arm in ("to-the-end", "partial"):
        rl = json.loads((run / "partial_effect" / "seed0" / arm / "stage1" / "rl" / "manifest.json").read_text())
        assert rl["status"] == "complete" and rl["config"]["rollout"]["partial"] == (arm == "partial")
        assert (
            json.loads((run / "partial_effect" / "seed0" / arm / "eval" / "summary.json").read_text())["datasets"]["toy"]["questions"] == 8
        )
    assert "partial" in (run / "partial_effect" / "ablations.md").read_text()
    assert "partial/carried_share" in effect.stdout

"""Direct rollout and Pareto selection with the SFT'd toy policy, the real tools and the real
retriever: resume without duplicates (also after kill -9, to the identical parquet), Ray fan-out,
and the parquet read back by pandas and pyarrow in verl's schema."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etagent.config import load_settings
from etagent.direct_rollout.run import chain_judgement
from etagent.direct_rollout.run import run as run_direct_rollout
from etagent.pareto.run import run as run_pareto
from etagent.question_formats import read_questions
from etagent.records import TrajectoryGroup, read_jsonl
from tests.support.commands import TOKEN


def rollout_overrides(sft_model: Path, toy: Path, server: str, out: Path, *extra: str) -> list[str]:
    return [
        f"model={sft_model / 'model'}",
        f"questions={toy / 'questions' / 'test.jsonl'}",
        f"out_dir={out}",
        "n=4",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "tools.python.limits.timeout_s=10",
        "batch_questions=4",
        *extra,
    ]


def pareto_cfg(rollouts: Path, out: Path, *extra: str):
    return load_settings("pareto", "tiny", [f"rollouts={rollouts}", f"out_dir={out}", "count=10", *extra])


def test_chain_judgement_is_what_pareto_reads():
    assert chain_judgement("42", ["42.0", "x"], "math", 0.75).score == 1.0
    assert chain_judgement("41", ["42"], "math", 0.75).score == 0.0
    partial = chain_judgement("the river Kess", ["Kess river bank"], "qa", 0.75)
    assert partial.metric == "f1" and partial.score == pytest.approx(0.8) and partial.threshold == 0.75 and partial.verdict
    assert not chain_judgement("the river Kess", ["Kess river bank"], "qa", 0.85).verdict  # below the mark
    assert chain_judgement("Kess River", ["Pell", "the Kess river"], "qa", 0.75).score == 1.0  # best over golds
    # the stage's setting is Pareto's bar
    assert load_settings("direct_rollout", "tiny", []).qa_pass_mark == load_settings("pareto", "tiny", []).mixed_outcome.qa_pass_mark


def test_direct_rollout_resumes_without_duplicates(sft_model, toy, server, tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    out = tmp_path / "rollouts"
    first = run_direct_rollout(load_settings("direct_rollout", "tiny", rollout_overrides(sft_model, toy, server, out, "limit=6")))
    assert first["questions"] == 6 and first["trajectories"] == 24
    before = (out / "trajectories.jsonl").read_text()
    second = run_direct_rollout(load_settings("direct_rollout", "tiny", rollout_overrides(sft_model, toy, server, out, "limit=10")))
    assert second["questions"] == 10 and second["trajectories"] == 40
    assert (out / "trajectories.jsonl").read_text().startswith(before)  # the first six kept as written
    groups = read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)
    assert len({g.id for g in groups}) == 10
    for g in groups:
        for t in g.trajectories:
            # what Pareto reads, per chain; no per-token arrays
            assert t.judgement.metric == ("math_equal" if g.kind == "math" else "f1")
            assert t.tool_calls_executed is not None and t.tool_calls_written is not None and t.n_generated > 0
            assert t.response_ids is None and t.logprobs is None
            assert t.sampling["top_k"] == 20 and t.sampling["top_p"] == 0.95 and t.sampling["temperature"] == 1.0
            assert t.provenance.stage == "direct_rollout/stage1"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["trajectories"] == 40 and manifest["stage"] == "direct_rollout/stage1"
    assert set(manifest["metrics"]["per_kind"]) == {g.kind for g in groups}


@pytest.mark.slow
def test_direct_rollout_on_a_local_ray_cluster_with_two_cpus(sft_model_full, toy, server, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    out = tmp_path / "ray"
    overrides = rollout_overrides(sft_model_full, toy, server, out, "limit=8", "n=2", "ray.workers=2", "ray.num_cpus_per_worker=1")
    try:
        metrics = run_direct_rollout(load_settings("direct_rollout", "tiny", overrides))
    finally:
        ray.shutdown()
    groups = read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)
    assert metrics["questions"] == 8
    assert sorted(g.id for g in groups) == sorted(q.id for q in read_questions(toy / "questions" / "test.jsonl")[:8])
    assert all(len(g.trajectories) == 2 and all(t.judgement.metric in ("f1", "math_equal") for t in g.trajectories) for g in groups)
    assert sum(t.tool_calls_executed for g in groups for t in g.trajectories) > 0


# two rollouts of the stage in subprocesses (17 s): kept out of the default run's 10 minutes, on the slow
# run's policy; the default run tests the stage's resume without a kill
# (test_direct_rollout_resumes_without_duplicates)
@pytest.mark.slow
def test_kill_9_mid_rollout_then_resume_gives_the_identical_parquet(sft_model_full, toy, server, tmp_path, monkeypatch):
    """The acceptance check: one run straight through; another killed with SIGKILL while it
    writes, then rerun. Both give the same trajectories and byte-identical Pareto outputs."""
    import pandas as pd
    import pyarrow.parquet as pq

    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    questions = 24
    straight = tmp_path / "straight"
    run_direct_rollout(load_settings("direct_rollout", "tiny", rollout_overrides(sft_model_full, toy, server, straight, f"limit={questions}")))

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "etagent.direct_rollout.run", *rollout_overrides(sft_model_full, toy, server, killed, f"limit={questions}")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    lines = killed / "trajectories.jsonl"
    deadline = time.monotonic() + 300
    while not (lines.exists() and len(lines.read_bytes().splitlines()) >= 8):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no rollouts written"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = len(lines.read_bytes().splitlines())
    assert 8 <= written < questions, f"killed too late to test a resume ({written} lines)"
    run_direct_rollout(load_settings("direct_rollout", "tiny", rollout_overrides(sft_model_full, toy, server, killed, f"limit={questions}")))

    def chains(path: Path) -> dict:
        return {
            g.id: [(t.text, t.judgement.score, t.tool_calls_executed, t.n_generated) for t in g.trajectories]
            for g in read_jsonl(path / "trajectories.jsonl", TrajectoryGroup)
        }

    assert chains(killed) == chains(straight)
    a = run_pareto(pareto_cfg(straight, tmp_path / "pareto-straight"))
    b = run_pareto(pareto_cfg(killed, tmp_path / "pareto-killed"))
    for name in ("rl.parquet", "scores.jsonl"):
        assert (tmp_path / "pareto-straight" / name).read_bytes() == (tmp_path / "pareto-killed" / name).read_bytes()
    assert a["counts"] == b["counts"] and a["counts"]["questions"] == questions

    # the parquet in verl's schema, read back by pandas and pyarrow
    path = tmp_path / "pareto-killed" / "rl.parquet"
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "metadata"]
    frame = pd.read_parquet(path)
    assert len(frame) == a["counts"]["selected"] == min(10, a["counts"]["eligible"]) > 0
    scores = [json.loads(line) for line in (tmp_path / "pareto-killed" / "scores.jsonl").read_text().splitlines()]
    selected = {s["id"] for s in scores if s["selected"]}
    assert set(frame["extra_info"].map(lambda e: e["question_id"])) == selected
    assert sorted(frame["extra_info"].map(lambda e: e["index"])) == list(range(len(frame)))
    by_id = {q.id: q for q in read_questions(toy / "questions" / "test.jsonl")}
    for row in frame.itertuples():
        q = by_id[row.extra_info["question_id"]]
        assert row.data_source == ("math_effi_rl" if q.kind == "math" else "qa_effi_rl") and row.ability == q.kind
        assert [m["role"] for m in row.prompt] == ["system", "user"] and row.prompt[1]["content"] == q.question
        assert list(row.reward_model["ground_truth"]) == q.answer and row.reward_model["style"] == "rule"
        assert row.extra_info["split"] == "train" and row.extra_info["question"] == q.question and pd.isna(row.metadata)
    # every selected question had a right and a wrong chain
    for s in scores:
        if s["selected"]:
            assert s["eligible"] and s["ineligible_because"] is None
    report = json.loads((tmp_path / "pareto-killed" / "report.json").read_text())
    assert sum(report["fronts"]["sizes"]) == report["counts"]["eligible"]
    assert report["counts"]["questions"] == report["counts"]["eligible"] + sum(
        v for k, v in report["dropped"].items() if k != "not_selected"
    )
    assert (tmp_path / "pareto-killed" / "scatter.png").stat().st_size > 1000

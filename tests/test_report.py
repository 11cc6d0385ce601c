"""`etagent report`: the report page of a small real run (the tiny SFT, an evaluation and two RL
steps on the toy world) opened in headless Chromium, and the reports of runs cut short."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etagent.question_formats import read_questions
from etagent.records import RLRow, input_identity, write_manifest, write_rl_parquet
from tests.support.commands import TOKEN, eval_command, report, rl_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_run(sft_model, toy, server, tmp_path_factory) -> Path:
    """A run directory laid out as the demo's: the toy world, the SFT, an evaluation of it and an
    RL stage of two steps."""
    run = tmp_path_factory.mktemp("run")
    # copies, as the demo's run holds them: the report reads nothing through a link out of the run
    shutil.copytree(toy, run / "toy", ignore=shutil.ignore_patterns("rl_world"))
    shutil.copytree(sft_model, run / "sft", ignore=shutil.ignore_patterns("checkpoints"))
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN)
    subprocess.run(
        eval_command(sft_model, toy, server, run / "eval", "limit=12", "run_name=toy-sft"),
        check=True,
        env=env,
        capture_output=True,
        timeout=900,
    )
    questions = [q for q in read_questions(toy / "questions" / "test.jsonl") if q.source in ("toy_python", "toy_both", "toy_search")]
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions[::10][:8])], run / "rl.parquet")
    overrides = rl_overrides(sft_model, parquet, server, run / "rl" / "stage1", "train.max_steps=2")
    result = subprocess.run([sys.executable, "-m", "etagent.rl.run", *overrides], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_the_report_of_a_small_run_in_chromium(small_run, browser, tmp_path):
    result = report(small_run)
    assert result.returncode == 0, result.stderr[-3000:]
    page = small_run / "report.html"
    assert "wrote" in result.stdout and page.exists()
    text = page.read_text()
    assert "http://" not in text.replace("http://127.0.0.1", "") and "https://" not in text  # nothing fetched from outside

    browser.open(page)
    assert browser.errors() == []
    # the first screen (1400 x 1000) shows the evaluation table: its first row is in view
    summary = json.loads((small_run / "eval" / "summary.json").read_text())["datasets"]["toy"]
    top, bottom = browser.evaluate(
        "(() => { const r = document.querySelector('#evaluation table.numbers tbody tr').getBoundingClientRect(); return [r.top, r.bottom]; })()"
    )
    assert 0 < top and bottom < browser.evaluate("window.innerHeight")
    row = browser.evaluate("[...document.querySelector('#evaluation table.numbers tbody tr').cells].map(c => c.textContent)")
    assert row[0] == "toy-sft" and float(row[2]) == pytest.approx(summary["correctness"], abs=0.01)
    # the pipeline, folded at the end: the SFT, the evaluation and the RL stage, complete, each
    # with the commit it ran
    assert browser.evaluate("document.querySelector('#pipeline details').open") is False
    stages = browser.evaluate(
        "[...document.querySelectorAll('table.pipeline tbody tr')].map(r => r.cells[0].textContent + ' ' + r.cells[2].textContent)"
    )
    assert {"sft complete", "evaluation complete", "rl/stage1 complete"} <= set(stages)
    git = json.loads((small_run / "sft" / "manifest.json").read_text())["git"]
    sft_git = browser.evaluate(
        "[...document.querySelectorAll('table.pipeline tbody tr')].find(r => r.cells[0].textContent === 'sft').cells[7].textContent.replace(/(dirty)$/, ' $1')"
    )
    assert sft_git == ("–" if git["commit"] is None else git["commit"][:7] + (" dirty" if git["dirty"] else ""))
    # curves: every RL metric of metrics.jsonl and the SFT loss, a panel each, or in the line of
    # constant ones; the SFT loss and the step timings change, so are drawn
    panels = browser.evaluate(
        "[...document.querySelectorAll('svg.curve')].map(s => [s.getAttribute('aria-label'), s.querySelectorAll('polyline.smoothed').length])"
    )
    drawn = {name for name, lines in panels if lines >= 1}
    assert {"sft/loss", "rl/timing_s/generate", "rl/timing_s/step"} <= drawn
    constant = browser.evaluate("document.getElementById('constant-curves')?.textContent ?? ''")
    metrics = {
        key
        for line in (small_run / "rl" / "stage1" / "metrics.jsonl").read_text().splitlines()
        for key, value in json.loads(line).items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }
    for metric in metrics:
        assert (f"rl/{metric}" in drawn) != (f"rl/{metric} = " in constant), metric
    kinds = browser.evaluate("[...document.querySelectorAll('#evaluation table.behaviour tbody tr')].map(r => r.cells[1].textContent)")
    assert set(kinds) == set(summary["behaviour"])

    # the browser lists every evaluation sample and RL rollout
    rollouts = sum(len((small_run / "rl" / "stage1" / "rollouts" / f"step_{k}.jsonl").read_text().splitlines()) for k in (1, 2))
    total = 12 * 2 + rollouts
    assert browser.evaluate("document.getElementById('count').textContent") == f"{total} of {total} trajectories match"
    assert browser.evaluate("document.querySelectorAll('#list li').length") == min(total, 50)
    # a filter narrows them: the wrong answers of the evaluation only
    stage = browser.evaluate("[...document.getElementById('f-stage').options].map(o => o.value).find(v => v.startsWith('eval'))")
    browser.evaluate(
        f"""(() => {{ for (const [id, v] of [['f-stage', {json.dumps(stage)}], ['f-correct', '0']]) {{
            const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('input')); }} }})()"""
    )
    wrong = sum(
        1
        for row in map(json.loads, (small_run / "eval" / "toy" / "scored.jsonl").read_text().splitlines())
        for m in row["samples"]
        if not is_right(m, row["kind"])
    )
    assert browser.evaluate("document.getElementById('count').textContent") == f"{wrong} of {total} trajectories match"
    # an RL rollout in full: its reward terms, and its tokens by origin (sampled, and tool results)
    browser.evaluate(
        """(() => { for (const [id, v] of [['f-stage', ''], ['f-correct', '']]) {
            const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('input')); }
          const e = document.getElementById('f-reward-min'); e.value = '-100'; e.dispatchEvent(new Event('input')); })()"""
    )
    assert browser.evaluate("document.getElementById('count').textContent") == f"{rollouts} of {total} trajectories match"
    browser.evaluate(
        "[...document.querySelectorAll('#list li')].find(li => li.textContent.includes('tool calls') && !li.textContent.includes(' 0 tool calls')).click()"
    )
    assert browser.evaluate("document.querySelector('#detail table.terms').textContent").startswith("reward")
    origins = browser.evaluate(
        "[...new Set([...document.querySelectorAll('#detail pre.response span')].map(s => s.className.split(' ').pop()))]"
    )
    assert {"origin-sampled", "origin-tool"} <= set(origins)
    assert browser.evaluate("document.querySelectorAll('#detail pre.response .part-result').length") >= 1
    shot = browser.screenshot(tmp_path / "report.png")
    assert shot.stat().st_size > 20_000
    assert browser.errors() == []


def is_right(metrics: dict, kind: str) -> bool:
    from etagent.scoring import correctness

    return correctness(metrics, kind) >= 0.8


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in ``folder``, read back from the TFRecord
    framing (length, its CRC, the Event proto, its CRC) with tensorboardX's Event message."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files, f"no event file in {folder}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_event_files_hold_the_sft_and_rl_curves(small_run):
    """The logger that needs no account, on by default: the SFT's loss as the Trainer logged it,
    and every RL step's metrics, as in metrics.jsonl."""
    sft = scalars(small_run / "sft" / "tensorboard")
    logged = [e for e in json.loads((small_run / "sft" / "loss_history.json").read_text()) if "loss" in e]
    assert [step for step, _ in sft["train/loss"]] == [e["step"] for e in logged]
    assert [v for _, v in sft["train/loss"]] == pytest.approx([e["loss"] for e in logged], rel=1e-6)
    rl = scalars(small_run / "rl" / "stage1" / "tensorboard")
    for line in map(json.loads, (small_run / "rl" / "stage1" / "metrics.jsonl").read_text().splitlines()):
        for key in ("reward/mean", "rollout/tool_calls", "actor/grad_norm", "timing_s/generate"):
            assert (line["step"], pytest.approx(line[key], rel=1e-6)) in rl[key]


def test_a_run_cut_short_gives_a_report_that_says_what_is_missing(tmp_path, browser):
    """A stage still running, a stage killed before its manifest, a missing input, a metrics line
    cut in the middle and an evaluation without its summary: the page lists each, and opens."""
    run = tmp_path / "run"
    started = time.time()
    rl = run / "rl" / "stage1"
    rl.mkdir(parents=True)
    write_manifest(rl, stage="rl/stage1", config={"data": {"train": str(run / "gone.parquet")}}, started_at=started, status="running")
    (rl / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n" + '{"step": 2, "rew')
    (rl / "rollouts").mkdir()
    rollout = {"id": "r0", "index": 3, "reward": 0.5, "raw": 1.0, "tool_calls": 0, "text": "<answer>4</answer>"}
    (rl / "rollouts" / "step_1.jsonl").write_text(json.dumps(rollout) + "\n")
    sft = run / "sft"
    sft.mkdir()
    write_manifest(sft, stage="sft", config={}, inputs=[], started_at=started)
    evaluation = run / "eval"
    (evaluation / "toy").mkdir(parents=True)
    (evaluation / "toy" / "trajectories.jsonl").write_text("")
    write_manifest(evaluation, stage="evaluation", config={}, started_at=started)
    orphan = run / "old"
    orphan.mkdir()
    (orphan / "summary.json").write_text("{}")
    flywheel = run / "flywheel"
    flywheel.mkdir()
    (flywheel / "trajectories.jsonl").write_text("")
    data = run / "data.jsonl"
    data.write_text("{}\n")
    write_manifest(flywheel, stage="flywheel", config={}, inputs=[input_identity("questions", data)], started_at=started)
    data.unlink()

    degraded = run / "rollouts"
    degraded.mkdir()
    (degraded / "trajectories.jsonl").write_text("")
    write_manifest(degraded, stage="direct_rollout", config={}, started_at=started, status="degraded")
    broken = run / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text('{"stage": "pareto", ')

    result = report(run)
    assert result.returncode == 0, result.stderr[-3000:]
    browser.open(run / "report.html")
    assert browser.errors() == []
    problems = browser.evaluate("[...document.querySelectorAll('#problems li')].map(li => li.textContent)")
    expected = [
        f"{rl}: rl/stage1 is running",
        f"{rl / 'metrics.jsonl'}:2: not a JSON line (the last line: its writer was stopped while writing it)",
        f"{run / 'gone.parquet'} is missing",
        f"{sft / 'loss_history.json'}: missing",
        f"{evaluation / 'summary.json'}: missing",
        f"{orphan}: stage outputs but no manifest.json",
        f"{flywheel}: its input {data} is missing",
        f"{degraded}: direct_rollout is degraded",
        f"{broken / 'manifest.json'}: not valid JSON",
    ]
    for line in expected:
        assert any(line in p for p in problems), (line, problems)
    assert len(problems) == len(expected)  # each once: the unreadable manifest is not also "no manifest"
    # what is there is still shown: the one complete RL step and its rollout
    assert browser.evaluate("document.getElementById('count').textContent") == "1 of 1 trajectories match"
    # one step: its metrics are constant, one line
    assert "rl/reward/mean = 0.5" in browser.evaluate("document.getElementById('constant-curves').textContent")


def test_a_run_folder_that_is_not_there_is_one_line(tmp_path):
    result = report(tmp_path / "nowhere")
    assert result.returncode == 2 and result.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such directory"


def test_a_report_reads_only_the_run_and_lists_malformed_files(tmp_path, browser):
    """A page made to be shared carries nothing from outside the run: a chart or a stage folder
    that is a link out of it is listed, not read. NaN and infinity are shown as text; a line that
    is not an object, a reward that is not a number, a question that is a number and a manifest
    that is a list are listed as problems, and the rest of the page works."""
    outside = tmp_path / "private"
    outside.mkdir()
    secret = b"\x89PNG\r\n\x1a\nSECRET-BYTES-OUTSIDE-THE-RUN"
    (outside / "radar.png").write_bytes(secret)
    write_manifest(outside, stage="sft", config={}, started_at=time.time())
    run = tmp_path / "run"
    started = time.time()
    radar = run / "radar"
    radar.mkdir(parents=True)
    write_manifest(radar, stage="radar", config={}, started_at=started)
    (radar / "radar.png").symlink_to(outside / "radar.png")
    (run / "linked").symlink_to(outside, target_is_directory=True)
    rl = run / "rl" / "stage1"
    (rl / "rollouts").mkdir(parents=True)
    write_manifest(rl, stage="rl/stage1", config={}, started_at=started)
    (rl / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": float("nan"), "reward/raw": 0.5}) + "\n")
    rows = [
        {"id": "nan", "index": 0, "reward": float("nan"), "raw": float("inf"), "f_tool": float("-inf"), "text": "<answer>1</answer>"},
        {"id": "string", "index": 1, "reward": "high", "raw": "yes", "tool_calls": "two", "text": "<answer>2</answer>"},
        [1, 2, 3],
        {"id": "segments", "index": 2, "reward": 0.5, "segments": "not a list", "text": "<answer>3</answer>"},
    ]
    (rl / "rollouts" / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluation = run / "eval"
    (evaluation / "toy").mkdir(parents=True)
    write_manifest(evaluation, stage="evaluation", config={"qa_pass_mark": "high"}, started_at=started)
    (evaluation / "summary.json").write_text(json.dumps({"run": 7, "datasets": {"toy": {"correctness": float("nan")}}}))
    group = {
        "id": 5,
        "question": 42,
        "answer": [1],
        "kind": "qa",
        "trajectories": [{"id": "t", "text": 3, "judgement": {"score": float("inf")}}],
    }
    (evaluation / "toy" / "trajectories.jsonl").write_text(json.dumps(group) + "\n")
    listed = run / "listed"
    listed.mkdir()
    (listed / "manifest.json").write_text("[]")

    result = report(run)
    assert result.returncode == 0, result.stderr[-3000:]
    page = (run / "report.html").read_text()
    assert base64.b64encode(secret).decode() not in page and "SECRET" not in page
    browser.open(run / "report.html")
    assert browser.errors() == []
    problems = browser.evaluate("[...document.querySelectorAll('#problems li')].map(li => li.textContent)")
    for expected in (
        f"{radar / 'radar.png'}: outside the run folder",
        f"{run / 'linked'}: a link out of the run folder",
        f"{rl / 'rollouts' / 'step_1.jsonl'}:3: a JSON list, not an object; skipped",
        f"{listed / 'manifest.json'}: holds a JSON list, not the dict expected",
    ):
        assert any(expected in p for p in problems), (expected, problems)
    # every trajectory but the list line is listed and opens; NaN and infinity are text
    assert browser.evaluate("document.getElementById('count').textContent") == "4 of 4 trajectories match"
    for i in range(4):
        browser.evaluate(f"document.querySelectorAll('#list li')[{i}].click()")
        assert browser.errors() == []
    browser.evaluate("[...document.querySelectorAll('#list li')].find(li => li.textContent.includes('rl/stage1')).click()")
    cells = browser.evaluate("[...document.querySelectorAll('#detail td')].map(td => td.textContent)")
    assert "inf" in cells and "-inf" in cells, cells
    summary = (evaluation / "summary.json").read_bytes()
    for bad_out, why in (
        (run, "is a folder"),
        (tmp_path / "no" / "such" / "report.html", "does not exist"),
        (evaluation / "summary.json", "is a file the report did not write"),
    ):
        refused = report(run, "--out", str(bad_out))
        assert refused.returncode == 2 and why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert (evaluation / "summary.json").read_bytes() == summary
    assert report(run, "--out", str(run / "report.html")).returncode == 0  # its own page, written again

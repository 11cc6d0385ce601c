"""`etagent report` at the paper's scale, on a synthetic run written in a few seconds: 26 stage
folders, two RL stages of 50 steps with 1,000 rollouts each (100,000 trajectories), 40 metrics a
step, an SFT loss history and three evaluations. The page puts the evaluation on its first screen
and folds the pipeline; the curves are smoothed, log-scaled, hovered and ticked in Chromium; the
constant metrics are one line; the browser holds an even sample with every step in it."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import pytest

from etagent.errors import SettingError
from etagent.records import Question, RLRow, git_revision, write_manifest, write_rl_parquet
from etagent.report.collect import collect, even_shares, sample_positions
from etagent.report.run import ReportSettings
from etagent.settings import out_of_range_values, settings_of, validate
from tests.support.commands import report

STEPS, ROLLOUTS_PER_STEP, QUESTIONS = 50, 1000, 16
EVALUATIONS = {"eval": ("sft", 80.5), "eval-rl-stage1": ("rl-stage1", 88.0), "eval-rl-stage2": ("rl-stage2", 90.25)}
EVALUATION_SAMPLES = 20 * 2  # per evaluation: 20 questions, 2 samples each
# RL metrics that change from step to step: a random walk above 0 each, but the loss, which
# crosses 0, and the logprob mismatch, which spans two decades (for the log scale)
VARYING = [f"{group}/{name}" for group in ("actor", "rollout", "timing_s") for name in "abcdefghijk"] + [
    "reward/mean",
    "reward/raw",
    "rollout/logprob_mismatch",
    "actor/loss",
]
CONSTANT = {"tools/failed": 0, "actor/optimizer_steps": 2}  # the same in both stages
ROOTS = {"rl/stage1": 32, "rl/stage2": 16}  # constant within each stage, different between them


def manifest(folder: Path, stage: str, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(folder, stage=stage, config=fields.pop("config", {}), started_at=time.time(), **fields)


def write_rl_stage(run: Path, name: str, data: Path, rng: random.Random) -> None:
    folder = run / name
    manifest(folder, name, config={"data": {"train": str(data)}}, counts={"steps": STEPS})
    walk = {metric: rng.uniform(0.5, 2) for metric in VARYING}
    lines = []
    for step in range(1, STEPS + 1):
        for metric in walk:
            walk[metric] *= math.exp(rng.gauss(0, 0.1))
        row = {"step": step, **walk, **CONSTANT, "rollout/roots": ROOTS[name]}
        row["rollout/logprob_mismatch"] = 1e-7 * 100 ** ((step - 1) / (STEPS - 1))
        row["actor/loss"] = rng.gauss(0, 0.1)
        lines.append(json.dumps(row))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "rollouts").mkdir()
    for step in range(1, STEPS + 1):
        rows = (
            f'{{"id": "step{step}/{k // 8}/{k % 8}", "index": {k % QUESTIONS}, "reward": {(k % 7) / 7}, "raw": {float(k % 2)}, '
            f'"tool_calls": {k % 3}, "f_tool": 1.0, "f_length": 1.0, "f_format": 0.0, "length": 40, "finish_reason": "answer", '
            f'"text": "<think>step {step} rollout {k}</think><answer>{k}</answer>"}}\n'
            for k in range(ROLLOUTS_PER_STEP)
        )
        (folder / "rollouts" / f"step_{step}.jsonl").write_text("".join(rows))


def write_evaluation(run: Path, folder_name: str, run_name: str, correctness: float) -> None:
    folder = run / folder_name
    manifest(folder, "evaluation", counts={"toy": EVALUATION_SAMPLES})
    manifest(folder / "toy", "evaluation/toy", counts={"questions": 20, "trajectories": EVALUATION_SAMPLES})
    behaviour = {"all": {"questions": 20, "correctness": correctness, "tool_calls": 1.1, "redundant_rate": 20.0}}
    metrics = {"correctness": correctness, "efficiency": correctness - 15, "f1": correctness, "em": correctness, "behaviour": behaviour}
    (folder / "summary.json").write_text(json.dumps({"run": run_name, "datasets": {"toy": metrics}}))
    groups = [
        {
            "id": f"q{q}",
            "question": f"question {q}",
            "answer": ["1"],
            "source": "toy_python",
            "kind": "qa",
            "trajectories": [{"id": f"q{q}/{k}", "text": "<answer>1</answer>"} for k in range(2)],
        }
        for q in range(20)
    ]
    (folder / "toy" / "trajectories.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))


@pytest.fixture(scope="module")
def large_run(tmp_path_factory) -> Path:
    """A run laid out as a curriculum at the paper's scale: every stage's folder and manifest
    (with the inputs and counts a real run writes), the RL stages' metrics and rollouts, the
    SFT's loss history, three evaluations."""
    run = tmp_path_factory.mktemp("large")
    rng = random.Random(0)
    (run / "toy" / "training_worlds").mkdir(parents=True)
    inputs = []
    for k in range(6):  # six inputs a stage names, as a wide pipeline row has
        path = run / "toy" / "training_worlds" / f"world_{k}_questions_with_needed_calls.jsonl"
        path.write_text("{}\n")
        inputs.append({"key": "questions", "path": str(path), "bytes": 3, "sha256": "0"})
    manifest(run / "toy", "toy", counts={"corpus": 360, "train_questions": 6000, "test_questions": 200, "seed_trajectories": 6000})
    manifest(run / "index", "etagent.retriever.build", counts={"passages": 360})
    sft = run / "sft"
    manifest(sft, "sft", counts={"examples": 6000, "steps": 7200})
    history = [
        {"step": s, "loss": 8 * math.exp(-s / 800) + 0.05, "grad_norm": 10 * math.exp(-s / 500) + 0.5, "learning_rate": 1e-3}
        for s in range(10, 7201, 10)
    ]
    (sft / "loss_history.json").write_text(json.dumps(history))
    for version in range(1, 5):
        manifest(run / "flywheel" / f"v{version}", "flywheel", inputs=inputs, counts={"kept": 900, "dropped": 100, "rounds": 3})
        manifest(run / "flywheel_index" / f"v{version}", "etagent.retriever.build", counts={"passages": 360})
    manifest(run / "sft-flywheel", "sft", counts={"examples": 3600})
    (run / "sft-flywheel" / "loss_history.json").write_text(json.dumps(history[:30]))
    questions = [
        Question(id=f"q{i}", question=f"What is {i} + 1?", answer=[str(i + 1)], source="toy_python", kind="math") for i in range(QUESTIONS)
    ]
    for stage in ("stage1", "stage2"):
        manifest(run / "rollouts" / stage, "direct_rollout", inputs=inputs, counts={"questions": 350, "chains": 2800})
        data = write_rl_parquet(
            [RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], run / "rl_data" / stage / "rl.parquet"
        )
        manifest(data.parent, "pareto", inputs=inputs, counts={"selected": QUESTIONS})
        write_rl_stage(run, f"rl/{stage}", data, rng)
    for folder_name, (run_name, correctness) in EVALUATIONS.items():
        write_evaluation(run, folder_name, run_name, correctness)
    manifest(run / "radar", "radar", inputs=inputs)
    return run


def test_even_shares_give_every_bucket_the_same_share_and_small_ones_all_they_have():
    assert even_shares([1000] * 100, 20000) == [200] * 100
    # a bucket smaller than its share keeps all it has; the rest is spread over the others
    assert even_shares([5, 1000, 1000, 3], 101) == [5, 47, 46, 3]
    # what does not divide evenly goes one each to the first buckets; the total is exact
    shares = even_shares([300] * 7, 1000)
    assert shares == [143] * 6 + [142] and sum(shares) == 1000
    # a run with fewer than the cap keeps everything; an empty bucket keeps nothing
    assert even_shares([10, 0, 20], 20000) == [10, 0, 20]
    # fewer to keep than buckets: one each to the first
    assert even_shares([50] * 5, 3) == [1, 1, 1, 0, 0]
    # 100,000 trajectories over 500 steps of uneven sizes, a cap of 20,000: every step keeps some
    rng = random.Random(1)
    sizes = [rng.randint(1, 399) for _ in range(500)]
    pairs = list(zip(even_shares(sizes, 20000), sizes, strict=True))
    assert sum(share for share, _ in pairs) == 20000 and all(0 < share <= size for share, size in pairs)
    cut = [share for share, size in pairs if share < size]
    assert max(cut) - min(cut) <= 1  # the steps cut all keep the same share, give or take one
    assert all(size <= max(cut) for share, size in pairs if share == size)  # and the steps kept whole are no larger


def test_sample_positions_are_the_same_each_time_and_spread_over_the_bucket():
    chosen = sample_positions("rl/stage1 step 3", 1000, 200)
    assert chosen == sample_positions("rl/stage1 step 3", 1000, 200) and chosen == sorted(set(chosen)) and len(chosen) == 200
    assert chosen != sample_positions("rl/stage1 step 4", 1000, 200)  # each bucket its own draw
    assert min(chosen) < 100 and max(chosen) >= 900  # from the whole step, not its first rollouts
    assert sample_positions("eval (sft) toy", 40, 200) == list(range(40))


def test_a_100k_trajectory_run_keeps_an_even_sample_with_every_step(large_run):
    started = time.time()
    run = collect(large_run, max_trajectories=20000)
    rl_total = 2 * STEPS * ROLLOUTS_PER_STEP
    assert run.trajectories_found == rl_total + len(EVALUATIONS) * EVALUATION_SAMPLES == 100_120
    assert len(run.trajectories) == 20000
    kept = {}
    for t in run.trajectories:
        kept[t["stage"]] = kept.get(t["stage"], 0) + 1
    steps = {f"rl/{stage} step {step}" for stage in ("stage1", "stage2") for step in range(1, STEPS + 1)}
    assert steps <= set(kept)
    # the evaluations' 40 samples each are all kept; the RL steps share the rest evenly
    evaluations = {label: n for label, n in kept.items() if label not in steps}
    assert sorted(evaluations.values()) == [EVALUATION_SAMPLES] * len(EVALUATIONS)
    assert {kept[s] for s in steps} <= {198, 199} and sum(kept[s] for s in steps) == 20000 - 120
    # a step's sample is spread over its rollouts, with its questions read from the RL data
    step_3 = [t for t in run.trajectories if t["stage"] == "rl/stage1 step 3"]
    rollout_numbers = [int(t["segments"][0][1].split("rollout ")[1].split("<")[0]) for t in step_3]
    assert min(rollout_numbers) < 100 and max(rollout_numbers) >= 900
    assert all(t["question"].startswith("What is ") for t in step_3)
    # the same run gives the same sample
    assert [t["id"] for t in collect(large_run, max_trajectories=20000).trajectories] == [t["id"] for t in run.trajectories]
    assert run.problems == []
    assert time.time() - started < 20


def test_the_report_of_a_large_run_reads_from_the_results_down(large_run, browser, tmp_path):
    result = report(large_run, "--out", str(tmp_path / "report.html"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "20000 trajectories (a sample of the run's 100120)" in result.stdout
    browser.open(tmp_path / "report.html")
    assert browser.errors() == []

    # the first screen (1400 x 1000) shows the evaluation table, whole, and nothing is wider than it
    first_row = browser.evaluate(
        "(() => { const r = document.querySelector('#evaluation table.numbers tbody tr').getBoundingClientRect(); return [r.top, r.bottom]; })()"
    )
    assert 0 < first_row[0] and first_row[1] < browser.evaluate("window.innerHeight")
    assert browser.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    assert browser.evaluate(
        "[...document.querySelectorAll('#evaluation table.numbers:not(.behaviour) tbody tr')].map(r => r.cells[0].textContent)"
    ) == [
        "sft",
        "rl-stage1",
        "rl-stage2",
    ]
    # the pipeline is folded, last, and says what it holds; its git column is the commit, shortened
    assert browser.evaluate("document.querySelector('#pipeline details').open") is False
    assert browser.evaluate("document.querySelector('#pipeline summary').textContent") == "25 stage folders: 25 complete (the table)"
    assert browser.evaluate("[...document.querySelectorAll('section')].map(s => s.id)")[-1] == "pipeline"
    browser.evaluate("document.querySelector('#pipeline details').open = true")
    assert browser.evaluate(
        "(() => { const box = document.querySelector('#pipeline .wide'); return box.scrollWidth <= box.clientWidth; })()"
    )
    revision = git_revision()
    git_cells = set(
        browser.evaluate(
            "[...document.querySelectorAll('table.pipeline tbody tr')].map(r => r.cells[7].textContent.replace(/(dirty)$/, ' $1'))"
        )
    )
    assert git_cells == {"–" if revision["commit"] is None else revision["commit"][:7] + (" dirty" if revision["dirty"] else "")}

    # constant metrics are one line, not panels; the others are panels, grouped by prefix
    constant = browser.evaluate("document.getElementById('constant-curves').textContent")
    assert "rl/tools/failed = 0" in constant and "rl/actor/optimizer_steps = 2" in constant
    assert "rl/rollout/roots = 32 (rl/stage1), 16 (rl/stage2)" in constant
    assert "sft/learning_rate = 0.001" in constant and "rl/reward terms/f_tool = 1" in constant  # every rollout's f_tool is 1
    panels = browser.evaluate("[...document.querySelectorAll('svg.curve')].map(s => s.getAttribute('aria-label'))")
    assert sorted(panels) == sorted([f"rl/{m}" for m in VARYING] + ["sft/loss", "sft/grad_norm"])
    assert browser.evaluate("[...document.querySelectorAll('details.curve-group > summary')].map(s => s.textContent)")[0] == "sft (2)"
    # several round ticks on each axis
    ticks = browser.evaluate(
        "[...document.querySelectorAll('svg.curve')].map(s => [s.querySelectorAll('text.tick.y').length, s.querySelectorAll('text.tick.x').length])"
    )
    assert all(y >= 3 and x >= 3 for y, x in ticks), ticks
    loss = "document.querySelector('svg.curve[aria-label=\"sft/loss\"]')"
    assert browser.evaluate(f"[...{loss}.querySelectorAll('text.tick.x')].map(t => t.textContent)") == ["2000", "4000", "6000"]

    # smoothing: off, the line is the values; on, a smoothed line over the raw one
    def smoothing(value: float) -> None:
        browser.evaluate(
            f"(() => {{ const s = document.getElementById('smoothing'); s.value = '{value}'; s.dispatchEvent(new Event('input')); }})()"
        )

    smoothing(0)
    assert browser.evaluate(f"{loss}.querySelectorAll('polyline.raw').length") == 0
    raw_line = browser.evaluate(f"{loss}.querySelector('polyline.smoothed').getAttribute('points')")
    smoothing(0.9)
    assert browser.evaluate(f"{loss}.querySelector('polyline.raw').getAttribute('points')") == raw_line
    assert browser.evaluate(f"{loss}.querySelector('polyline.smoothed').getAttribute('points')") != raw_line

    # a log scale where every value is above 0: ticks at 1, 2 and 5 times the powers of ten
    mismatch = "document.querySelector('figure.chart[data-curve=\"rl/rollout/logprob_mismatch\"]')"
    linear = browser.evaluate(f"[...{mismatch}.querySelectorAll('text.tick.y')].map(t => t.textContent)")
    browser.evaluate(f"{mismatch}.querySelector('.log input').click()")
    logarithmic = browser.evaluate(f"[...{mismatch}.querySelectorAll('text.tick.y')].map(t => t.textContent)")
    assert logarithmic == ["1e-7", "2e-7", "5e-7", "1e-6", "2e-6", "5e-6", "1e-5"] != linear
    # and none where a value is 0 or below
    assert browser.evaluate("document.querySelector('figure.chart[data-curve=\"rl/actor/loss\"] .log input').disabled") is True

    # hover: the step under the pointer and each stage's value there
    smoothing(0)
    tooltip = browser.evaluate(
        """(() => { const f = document.querySelector('figure.chart[data-curve="rl/reward/mean"]');
          const o = f.querySelector('rect.overlay'), b = o.getBoundingClientRect();
          o.dispatchEvent(new MouseEvent('mousemove', {clientX: b.left + b.width * 0.5, clientY: b.top + 10, bubbles: true}));
          return [...f.querySelectorAll('.tooltip div')].map(d => d.textContent); })()"""
    )
    step = int(tooltip[0].removeprefix("step "))
    assert 20 <= step <= 30
    for line, stage in zip(tooltip[1:], ("rl/stage1", "rl/stage2"), strict=True):
        row = json.loads((large_run / stage / "metrics.jsonl").read_text().splitlines()[step - 1])
        assert line.startswith(f"\u25a0 {stage}: ") and float(line.split(": ")[1]) == pytest.approx(row["reward/mean"], rel=1e-4)

    # the browser: a sample with every step in it, and the page says how many of how many
    assert browser.evaluate("document.getElementById('sample').textContent").startswith(
        "The browser holds 20,000 of the run's 100,120 trajectories: the same share of each of its 103 RL steps and evaluation datasets"
    )
    assert browser.evaluate("document.getElementById('count').textContent") == "20000 of 20000 trajectories match"
    stages = set(browser.evaluate("[...document.getElementById('f-stage').options].map(o => o.value)"))
    assert {f"rl/{s} step {k}" for s in ("stage1", "stage2") for k in range(1, STEPS + 1)} <= stages
    browser.evaluate(
        "(() => { const e = document.getElementById('f-stage'); e.value = 'rl/stage2 step 50'; e.dispatchEvent(new Event('input')); })()"
    )
    assert browser.evaluate("document.getElementById('count').textContent") in (
        "198 of 20000 trajectories match",
        "199 of 20000 trajectories match",
    )
    browser.evaluate("document.querySelector('#list li').click()")
    assert "step 50 rollout" in browser.evaluate("document.querySelector('#detail pre.response').textContent")
    assert browser.errors() == []


def test_max_trajectories_refuses_what_its_declaration_refuses(tmp_path):
    (setting,) = settings_of(ReportSettings)
    for value in out_of_range_values(setting):
        with pytest.raises(SettingError, match="setting max_trajectories: must be"):
            validate(ReportSettings, {"max_trajectories": value})
    validate(ReportSettings, dataclasses.asdict(ReportSettings()))
    tmp_path.joinpath("run").mkdir()
    refused = report(tmp_path / "run", "--max-trajectories", "0")
    assert refused.returncode == 2 and refused.stderr.strip() == "error: setting max_trajectories: must be an integer >= 1, got 0"

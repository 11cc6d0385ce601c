"""The ablation table (evaluation/ablations.py) on hand-made run directories laid out as
scripts/ablations.sh lays them out: means and their 95% intervals over seeds, RL tool calls summed
over stages and steps, the per-seed comparisons with the whole pipeline (or another baseline), and
missing runs named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from etagent.evaluation.ablations import ablation_table, main


def write_eval(directory, correctness, redundant):
    (directory / "eval").mkdir(parents=True)
    behaviour = {"tool_calls": 1.0, "redundant_rate": redundant, "redundant_when_solved": 2 * redundant, "insufficient_rate": 1.0}
    summary = {"datasets": {"toy": {"correctness": correctness, "efficiency": correctness - 10, "behaviour": {"all": behaviour}}}}
    (directory / "eval" / "summary.json").write_text(json.dumps(summary))


def write_run(root, seed, variant, correctness, redundant, rl_calls_per_stage):
    run = root / f"seed{seed}" / variant
    write_eval(run, correctness, redundant)
    for k, calls in enumerate(rl_calls_per_stage, start=1):
        (run / f"stage{k}" / "rl").mkdir(parents=True)
        lines = [{"step": s, "rollout/tool_calls_executed": c} for s, c in enumerate(calls, start=1)]
        (run / f"stage{k}" / "rl" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_means_spreads_and_per_seed_comparisons(tmp_path):
    write_run(tmp_path, 0, "full", 80.0, 10.0, [[10, 20], [30]])
    write_run(tmp_path, 1, "full", 82.0, 20.0, [[20, 20], [20]])
    write_run(tmp_path, 0, "no-efficiency", 79.0, 30.0, [[60]])
    write_run(tmp_path, 1, "no-efficiency", 83.0, 40.0, [[60]])
    write_run(tmp_path, 0, "no-arpo", 81.0, 10.0, [[100]])
    for seed in (0, 1):
        write_run(tmp_path, seed, "start", 70.0 + seed, 30.0, [])
    markdown, figures = ablation_table(tmp_path, 2, ["full", "no-efficiency", "no-arpo"], references=["start"])
    assert figures["full"]["seed0"]["rl_tool_calls"] == 60 and figures["no-arpo"]["seed1"] is None
    summary = markdown.split("Each variant minus full")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in summary.splitlines() if line.startswith("| ")}
    # correctness 80, 82: mean 81, sample std sqrt(2), half-width t(0.975, 1) x sqrt(2) / sqrt(2) = 12.7;
    # redundant 10, 20: half-width 12.706 x 7.07 / 1.41 = 63.5; RL tool calls 60 and 60
    assert rows["full"].startswith(
        "| full | 2 | 81.0 [68.3, 93.7] | 71.0 [58.3, 83.7] | 1.00 [1.00, 1.00] | 15.0 [-48.5, 78.5] | 30.0 [-97.1, 157.1] "
        "| 1.0 [1.0, 1.0] | 60 [60, 60] |"
    )
    assert rows["no-arpo"].startswith("| no-arpo | 1 | 81.0 |")
    assert "missing or unfinished: seed1/no-arpo" in markdown
    # per seed, full's figures then the variant's: correctness and the difference, the redundant
    # rates, the RL tool calls and full's as a multiple of the variant's
    assert "| no-efficiency | 0 | 80.0; 79.0; -1.0 | 10.0; 30.0 | 20.0; 60.0 | 60; 60; 1.00x |" in markdown
    assert "| no-efficiency | 1 | 82.0; 83.0; +1.0 | 20.0; 40.0 | 40.0; 80.0 | 60; 60; 1.00x |" in markdown
    assert "| no-arpo | 0 | 80.0; 81.0; +1.0 | 10.0; 10.0 | 20.0; 20.0 | 60; 100; 0.60x |" in markdown
    # a variant that made no RL tool calls (a starting policy compared as a variant): no multiple
    markdown_from_start, _ = ablation_table(tmp_path, 2, ["start", "full"], baseline="full")
    assert "| start | 0 | 80.0; 70.0; -10.0 | 10.0; 30.0 | 20.0; 60.0 | 60; 0; n/a |" in markdown_from_start
    # each variant minus full, paired per seed: diffs -1 and +1, mean 0, half-width t(0.975, 1) x 1 = 12.7
    assert "| no-efficiency | 2 | +0.0 [-12.7, +12.7] |" in markdown and "| no-arpo | 1 | +1.0 |" in markdown
    # a reference (a starting policy) is in the table, not compared
    assert rows["start"].startswith("| start | 2 | 70.5 [64.1, 76.9] |") and "| start | 0 |" not in markdown


def test_the_learning_curves_area_and_the_paired_intervals_over_five_seeds(tmp_path):
    """The curve's checkpoints (RL steps counted over the stages) give its mean height by the
    trapezoid rule; five seeds give each difference from full a t interval with 4 degrees of
    freedom (2.776 x sd / sqrt 5)."""
    for seed, gap in enumerate([1.0, 2.0, 3.0, 2.0, 2.0]):
        write_run(tmp_path, seed, "full", 80.0, 10.0, [[10]])
        write_run(tmp_path, seed, "no-pareto", 80.0 - gap, 10.0, [[10]])
        for variant, heights in (("full", [60.0, 70.0, 80.0]), ("no-pareto", [60.0, 64.0, 80.0 - gap])):
            for step, height in zip((0, 4, 12), heights):
                write_eval(tmp_path / f"seed{seed}" / variant / "curve" / f"step{step}", height, 0.0)
    markdown, figures = ablation_table(tmp_path, 5, ["full", "no-pareto"])
    # full: (4 x 65 + 8 x 75) / 12 = 71.67; no-pareto in seed 0: (4 x 62 + 8 x 71.5) / 12 = 68.33
    assert figures["full"]["seed0"]["curve_area"] == pytest.approx(860 / 12)
    assert figures["no-pareto"]["seed0"]["curve_area"] == pytest.approx((4 * 62 + 8 * 71.5) / 12)
    # correctness differences -1, -2, -3, -2, -2: mean -2, sd 0.7071, half 2.776 x 0.7071 / 2.236 = 0.878
    assert "| no-pareto | 5 | -2.0 [-2.9, -1.1] |" in markdown
    assert "area under the curve" in markdown.split("Each variant minus full")[1].splitlines()[2]


def test_the_first_stage_table_reads_each_stage_evaluation_and_its_own_rl(tmp_path):
    write_run(tmp_path, 0, "full", 80.0, 0.0, [[10, 20], [30]])
    write_run(tmp_path, 0, "no-efficiency", 81.0, 0.5, [[40], [50]])
    write_run(tmp_path, 0, "no-curriculum", 79.0, 0.0, [[90]])  # one stage: its evaluation is the final one
    write_eval(tmp_path / "seed0" / "full" / "stage1", 78.0, 1.0)
    write_eval(tmp_path / "seed0" / "no-efficiency" / "stage1", 78.5, 6.0)
    markdown, figures = ablation_table(tmp_path, 1, ["full", "no-efficiency", "no-curriculum"])
    final, first = markdown.split("After the first stage")
    assert "| no-efficiency | 0 | 80.0; 81.0; +1.0 | 0.0; 0.5 | 0.0; 1.0 | 60; 90; 0.67x |" in final
    # after stage 1: stage 1's evaluation and stage 1's RL tool calls only; no-curriculum has no stage of its own
    assert "| full | 1 | 78.0 | 68.0 | 1.00 | 1.0 | 2.0 | 1.0 | 30 |" in first
    assert "| no-efficiency | 0 | 78.0; 78.5; +0.5 | 1.0; 6.0 | 2.0; 12.0 | 30; 40; 0.75x |" in first
    assert "no-curriculum" not in first and "missing" not in first
    assert figures["no-efficiency/stage1"]["seed0"]["rl_tool_calls"] == 40


def test_the_command_writes_both_files_and_refuses_a_missing_directory(tmp_path):
    write_run(tmp_path, 0, "full", 80.0, 10.0, [[10]])
    out = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.ablations", str(tmp_path), "--seeds", "1", "--variants", "full"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert (tmp_path / "ablations.md").read_text() in out.stdout
    assert json.loads((tmp_path / "ablations.json").read_text())["full"]["seed0"]["correctness"] == pytest.approx(80.0)
    missing = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.ablations", str(tmp_path / "nope"), "--seeds", "1", "--variants", "full"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_another_baseline_the_real_model_runs_layout(tmp_path, capsys):
    """scripts/real_model.sh's policies (seed{s}/{smollm2,sft,rl}) compared with the SFT policy,
    paired per seed; a baseline that is not one of the variants is refused before anything is
    written. In process: the command's own subprocess is tested above."""
    for seed, (base, sft, rl) in enumerate([(0.0, 20.0, 23.0), (0.0, 22.0, 24.0), (1.0, 21.0, 25.0)]):
        write_run(tmp_path, seed, "smollm2", base, 0.0, [])
        write_run(tmp_path, seed, "sft", sft, 0.0, [])
        write_run(tmp_path, seed, "rl", rl, 0.0, [[8, 8]])
    main([str(tmp_path), "--seeds", "3", "--variants", "smollm2", "sft", "rl", "--baseline", "sft"])
    markdown = (tmp_path / "ablations.md").read_text()
    # rl - sft: 3, 2, 4: mean 3, sd 1, half-width t(0.975, 2) x 1 / sqrt 3 = 2.48
    assert "Each variant minus sft, paired per seed" in markdown
    assert "| rl | 3 | +3.0 [+0.5, +5.5] |" in markdown
    assert "| smollm2 | 3 | -20.7 [" in markdown and "| sft | 3 | +" not in markdown
    assert "| rl | 1 | 22.0; 24.0; +2.0 |" in markdown
    (tmp_path / "ablations.md").unlink()
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path), "--seeds", "3", "--variants", "sft", "rl", "--baseline", "full"])
    assert refused.value.code == 2 and "--baseline full is not one of --variants sft rl" in capsys.readouterr().err
    assert not (tmp_path / "ablations.md").exists()


def test_groups_without_spread_and_the_deep_questions_correctness(tmp_path):
    """A group (one prompt's paths in one RL step) whose rewards are all equal has no advantage
    anywhere: its share over every step of every stage; and correctness on the hard world's 3- and
    4-hop questions, weighted by their samples."""
    write_run(tmp_path, 0, "full", 50.0, 0.0, [])
    rollouts = {
        "stage1/rl/rollouts/step_1.jsonl": [(0, 1.0), (0, 1.0), (1, 0.0), (1, 0.7)],  # group 0 flat
        "stage1/rl/rollouts/step_2.jsonl": [(0, 0.0), (0, 0.0), (3, 0.5), (3, 0.5)],  # both flat
        "stage2/rl/rollouts/step_1.jsonl": [(4, 0.2), (4, 0.9)],
    }
    for name, rows in rollouts.items():
        path = tmp_path / "seed0" / "full" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"id": f"x/{i}", "index": i, "reward": r}) + "\n" for i, r in rows))
    summary = tmp_path / "seed0" / "full" / "eval" / "summary.json"
    figures = json.loads(summary.read_text())
    figures["datasets"]["toy"]["behaviour"].update(
        toy_hops2={"correctness": 90.0, "samples": 100},
        toy_hops3={"correctness": 20.0, "samples": 100},
        toy_hops3_python={"correctness": 10.0, "samples": 50},
        toy_hops4_python={"correctness": 0.0, "samples": 50},
    )
    summary.write_text(json.dumps(figures))
    write_run(tmp_path, 0, "start", 40.0, 0.0, [])
    markdown, table = ablation_table(tmp_path, 1, ["full"], references=["start"])
    assert table["full"]["seed0"]["rl_flat_groups"] == pytest.approx(100 * 3 / 5)
    # a run that has neither (a starting policy, evaluated only) shows n/a, not missing
    assert "| start | 1 | 40.0 | 30.0 | 1.00 | 0.0 | 0.0 | 1.0 | 0 | n/a | n/a |" in markdown and "missing" not in markdown
    assert table["full"]["seed0"]["deep_correctness"] == pytest.approx((2000 + 500) / 200)
    assert "correctness, 3-4 hops | RL groups without spread % |" in markdown and "| 12.5 | 60.0 |" in markdown
    # a run without rollouts or hop shapes (the toy world's) has neither figure
    write_run(tmp_path / "toy", 0, "full", 50.0, 0.0, [[3]])
    assert "rl_flat_groups" not in ablation_table(tmp_path / "toy", 1, ["full"])[1]["full"]["seed0"]


def test_the_selected_questions_hop_counts_per_stage(tmp_path):
    """The curriculum's lever: the mean hop count of what each stage selected (hard-world sources
    toy_hops{N}, with or without Python), stage 1's and the rise to the last stage; none for a
    run without selections."""
    write_run(tmp_path, 0, "full", 50.0, 5.0, [[1], [1]])
    write_run(tmp_path, 0, "start", 40.0, 5.0, [])
    for k, chosen in (
        (1, {"toy_hops0": 2, "toy_hops1": 1, "toy_hops3_python": 0}),
        (2, {"toy_hops1": 1, "toy_hops2_python": 1, "toy_hops4": 1}),
    ):
        rows = [{"id": f"{source}-{i}", "source": source, "selected": i < n} for source, n in chosen.items() for i in range(3)]
        data = tmp_path / "seed0" / "full" / f"stage{k}" / "data"
        data.mkdir(parents=True)
        (data / "scores.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    markdown, figures = ablation_table(tmp_path, 1, ["full"], references=["start"])
    # stage 1: hops 0, 0, 1 -> 1/3; stage 2: 1, 2, 4 -> 7/3
    assert figures["full"]["seed0"]["selected_hops_stage1"] == pytest.approx(1 / 3)
    assert figures["full"]["seed0"]["selected_hops_rise"] == pytest.approx(2.0)
    assert "selected_hops_stage1" not in figures["start"]["seed0"]
    assert "selected hops, last stage - first" in markdown

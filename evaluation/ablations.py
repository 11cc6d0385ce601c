"""The ablation table: variants of the pipeline side by side over seeds, each figure's mean with its
95% interval.

    python -m etagent.evaluation.ablations RUN_DIR/ablations --seeds 3 --variants full no-efficiency ...
    python -m etagent.evaluation.ablations RUN_DIR --seeds 3 --variants smollm2 sft rl --baseline sft

Reads, per seed s and variant v (and reference: a starting policy, evaluated only),
``seed{s}/{v}/eval/summary.json`` (the held-out evaluation),
``seed{s}/{v}/stage*/rl/metrics.jsonl`` (the RL steps) and, where the run has them,
``seed{s}/{v}/curve/step{N}/eval/summary.json`` (checkpoints evaluated along RL: the learning
curve, its area by the trapezoid rule) and ``seed{s}/{v}/stage*/rl/rollouts/step_*.jsonl`` (the
share of RL groups whose rewards are all equal: no advantage, nothing learnt) and
``seed{s}/{v}/stage*/data/scores.jsonl`` (the mean hop count of the questions each stage selected,
on the hard world: the curriculum's rise), as
scripts/ablations.sh lays them out (scripts/real_model.sh lays out its policies the same way,
``seed{s}/{policy}``), and writes ``ablations.md`` and ``ablations.json`` beside them. Per variant: correctness,
efficiency, tool calls per answer, the redundant and insufficient rates, the redundant rate among
solved answers, the tool calls the RL rollouts executed (a tree's copied calls counted once) and,
where there are such, correctness on the hard world's 3- and 4-hop questions;
then each variant's difference from the baseline (``--baseline``, the whole pipeline ``full`` by
default), paired per seed, with its 95% interval (Student's t); then, per seed, each variant beside
the baseline, the comparisons the paper's ablations make; then both again for the policies after
the first stage (``seed{s}/{v}/stage1/eval``), where there is one. A run that is missing or
unfinished is named, not averaged.

What this module does not do: run anything (scripts/ablations.sh does).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

from etagent.errors import MissingInput, exit_on_user_error

# (column, heading, digits)
FIELDS = (
    ("correctness", "correctness", 1),
    ("efficiency", "efficiency", 1),
    ("tool_calls", "tool calls per answer", 2),
    ("redundant_rate", "redundant %", 1),
    ("redundant_when_solved", "redundant when solved %", 1),
    ("insufficient_rate", "insufficient %", 1),
    ("rl_tool_calls", "RL tool calls", 0),
)


def run_figures(run: Path) -> dict | None:
    """The figures of the policy a run ends with, or None when its evaluation is not there: ``run``
    is a variant's directory in one seed (its RL tool calls summed over its stages) or one of its
    stages' (``stage{k}``, its own RL's)."""
    summary = run / "eval" / "summary.json"
    if not summary.exists():
        return None
    toy = json.loads(summary.read_text())["datasets"]["toy"]
    every = toy["behaviour"]["all"]
    rl_calls = 0.0
    for metrics in sorted(run.glob("**/rl/metrics.jsonl")):
        rl_calls += sum(json.loads(line)["rollout/tool_calls_executed"] for line in metrics.read_text().splitlines() if line.strip())
    figures = {
        "correctness": toy["correctness"],
        "efficiency": toy["efficiency"],
        **{key: every[key] for key in ("tool_calls", "redundant_rate", "redundant_when_solved", "insufficient_rate")},
        "rl_tool_calls": rl_calls,
    }
    curve = learning_curve(run)
    if curve:
        figures["curve"] = curve
        figures["curve_area"] = curve_area(curve)
    deep = [shape for kind, shape in toy["behaviour"].items() if re.fullmatch(r"toy_hops[34](_python)?", kind)]
    if deep:
        figures["deep_correctness"] = sum(s["correctness"] * s["samples"] for s in deep) / sum(s["samples"] for s in deep)
    flat = flat_group_share(run)
    if flat is not None:
        figures["rl_flat_groups"] = flat
    hops = selected_hops(run)
    if hops:
        figures["selected_hops_stage1"] = hops[0]
    if len(hops) > 1:
        figures["selected_hops_rise"] = hops[-1] - hops[0]
    return figures


def selected_hops(run: Path) -> list[float]:
    """Per stage, in order, the mean hop count of the questions its selection chose
    (``stage{k}/data/scores.jsonl``, the hop count read from a hard-world source ``toy_hops{N}``):
    what the curriculum moves up. Empty where no stage has a selection, or none of hard-world
    questions."""
    means = []
    stages = sorted(
        (int(m.group(1)), p) for p in run.glob("stage*/data/scores.jsonl") if (m := re.fullmatch(r"stage(\d+)", p.parent.parent.name))
    )
    for _, scores in stages:
        hops = []
        for row in (json.loads(line) for line in scores.read_text().splitlines() if line.strip()):
            match = re.fullmatch(r"toy_hops(\d+)(_python)?", row["source"] or "")
            if row["selected"] and match:
                hops.append(int(match.group(1)))
        if hops:
            means.append(sum(hops) / len(hops))
    return means


def flat_group_share(run: Path) -> float | None:
    """The share (%) of the groups of the run's RL steps, over its stages, whose paths all have the
    same reward: every advantage in them is zero, so they teach nothing (the always- and
    never-solved questions that Pareto sampling exists to leave out). None where no step kept its
    rollouts."""
    groups = flat = 0
    for step in run.glob("**/rl/rollouts/step_*.jsonl"):
        rewards = defaultdict(list)
        for line in step.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rewards[row["index"]].append(row["reward"])
        groups += len(rewards)
        flat += sum(max(r) - min(r) < 1e-9 for r in rewards.values())
    return 100 * flat / groups if groups else None


def learning_curve(run: Path) -> list[tuple[int, float]]:
    """(RL step, held-out correctness) of the checkpoints evaluated along the run
    (``curve/step{N}/eval/summary.json``, N counted over every stage), in step order."""
    points = []
    for summary in run.glob("curve/step*/eval/summary.json"):
        step = int(re.fullmatch(r"step(\d+)", summary.parent.parent.name).group(1))
        points.append((step, json.loads(summary.read_text())["datasets"]["toy"]["correctness"]))
    return sorted(points)


def curve_area(curve: list[tuple[int, float]]) -> float:
    """The area under the learning curve by the trapezoid rule, over the steps it spans: its mean
    height, in correctness points (one point: its correctness)."""
    if len(curve) == 1:
        return curve[0][1]
    area = sum((s1 - s0) * (c0 + c1) / 2 for (s0, c0), (s1, c1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def half_width(values: list[float]) -> float:
    """The half-width of the 95% interval of the mean of ``values`` (Student's t, n - 1 degrees
    of freedom): the spread over seeds, as the issue's ablations are to be read."""
    from scipy.stats import t

    return float(t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def cell(values: list[float], digits: int) -> str:
    """The mean and its 95% interval, ``mean [low, high]`` (one value: itself)."""
    if not values:
        return "missing"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    mean, half = statistics.mean(values), half_width(values)
    return f"{mean:.{digits}f} [{mean - half:.{digits}f}, {mean + half:.{digits}f}]"


def interval(values: list[float], digits: int) -> str:
    """The mean and its 95% interval, ``mean [low, high]``."""
    if len(values) < 2:
        return f"{values[0]:+.{digits}f}" if values else "missing"
    mean, half = statistics.mean(values), half_width(values)
    return f"{mean:+.{digits}f} [{mean - half:+.{digits}f}, {mean + half:+.{digits}f}]"


# The figures each variant's difference from the baseline is given for, with 95% intervals.
DIFFERENCES = (
    *FIELDS,
    ("curve_area", "area under the curve", 1),
    ("deep_correctness", "correctness, 3-4 hops", 1),
    ("rl_flat_groups", "RL groups without spread %", 1),
    ("selected_hops_stage1", "selected hops, stage 1", 2),
    ("selected_hops_rise", "selected hops, last stage - first", 2),
)


def difference_lines(figures: dict[str, dict[int, dict | None]], baseline: str = "full") -> list[str]:
    """Each variant minus ``baseline``, paired per seed (the same questions, seeds and starting
    policy): the mean difference and its 95% interval over the seeds both finished. A difference
    whose interval holds 0 is not resolved by these seeds."""
    keys = [
        (key, heading, digits)
        for key, heading, digits in DIFFERENCES
        if any(key in f for per in figures.values() for f in per.values() if f)
    ]
    lines = [
        f"Each variant minus {baseline}, paired per seed: mean difference [95% interval, Student's t over the seeds]; an "
        "interval that holds 0 does not resolve the difference.",
        "",
        "| variant | seeds | " + " | ".join(h for _, h, _ in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for name, per_seed in figures.items():
        if name == baseline:
            continue
        pairs = [(figures[baseline][s], f) for s, f in per_seed.items() if f is not None and figures[baseline].get(s) is not None]
        cells = [
            interval([other[key] - base[key] for base, other in pairs if key in base and key in other], digits) for key, _, digits in keys
        ]
        lines.append(f"| {name} | {len(pairs)} | " + " | ".join(cells) + " |")
    return lines


def ratio(a: float, b: float) -> str:
    """``a`` as a multiple of ``b`` (``1.28x``), or n/a where ``b`` is 0."""
    return f"{a / b:.2f}x" if b else "n/a"


def summary_lines(figures: dict[str, dict[int, dict | None]]) -> list[str]:
    """Mean and 95% interval per run name (and the area under the learning curve, where runs have
    one), then the runs that are not there."""
    fields = [f for f in DIFFERENCES if f in FIELDS or any(f[0] in r for per in figures.values() for r in per.values() if r)]
    lines = ["| variant | seeds | " + " | ".join(h for _, h, _ in fields) + " |", "|---|---|" + "---|" * len(fields)]
    for name, per_seed in figures.items():
        done = [f for f in per_seed.values() if f is not None]
        # a figure only some runs have (a curve, rollouts, hop shapes): n/a for a run that has none
        cells = [cell([f[key] for f in done if key in f], digits) if (key, h, digits) in FIELDS or any(key in f for f in done) else "n/a"
                 for key, h, digits in fields]  # fmt: skip
        lines.append(f"| {name} | {len(done)} | " + " | ".join(cells) + " |")
    missing = [f"seed{s}/{name}" for name, per_seed in figures.items() for s, f in per_seed.items() if f is None]
    if missing:
        lines += ["", f"missing or unfinished: {', '.join(missing)}"]
    return lines


def comparison_lines(figures: dict[str, dict[int, dict | None]], baseline: str = "full") -> list[str]:
    """Per seed, each variant beside ``baseline``."""
    lines = [
        f"Per seed, each variant beside {baseline} ({baseline}; variant): the rates themselves, since the baseline's "
        f"are often 0; correctness with the difference variant - {baseline}; RL tool calls with {baseline}'s as a "
        "multiple of the variant's.",
        "",
        "| variant | seed | correctness | redundant % | redundant when solved % | RL tool calls |",
        "|---|---|---|---|---|---|",
    ]
    for name, per_seed in figures.items():
        if name == baseline:
            continue
        for s, other in per_seed.items():
            full = figures[baseline][s]
            if full is None or other is None:
                continue
            lines.append(
                f"| {name} | {s} | {full['correctness']:.1f}; {other['correctness']:.1f}; "
                f"{other['correctness'] - full['correctness']:+.1f} | "
                f"{full['redundant_rate']:.1f}; {other['redundant_rate']:.1f} | "
                f"{full['redundant_when_solved']:.1f}; {other['redundant_when_solved']:.1f} | "
                f"{full['rl_tool_calls']:.0f}; {other['rl_tool_calls']:.0f}; "
                f"{ratio(full['rl_tool_calls'], other['rl_tool_calls'])} |"
            )
    return lines


def ablation_table(root: Path, seeds: int, variants: list[str], references: list[str] = (), baseline: str = "full") -> tuple[str, dict]:
    """The table of ``references`` (evaluated only: the starting policies) and ``variants`` and the
    per-seed comparison of each variant with ``baseline`` (when it is one of them); then the same
    after the first stage, for the variants whose first stage was evaluated on its own (those with
    more than one stage)."""
    figures = {v: {s: run_figures(root / f"seed{s}" / v) for s in range(seeds)} for v in (*references, *variants)}
    lines = [
        f"Mean [95% interval of the mean, Student's t] over {seeds} seeds (held-out questions at the demo's evaluation "
        "sampling; RL tool calls: executed by the RL rollouts over all stages).",
        "",
        *summary_lines(figures),
    ]
    if baseline in variants:
        lines += ["", *difference_lines({v: figures[v] for v in variants}, baseline)]
        lines += ["", *comparison_lines({v: figures[v] for v in variants}, baseline)]
    first = {v: {s: run_figures(root / f"seed{s}" / v / "stage1") for s in range(seeds)} for v in variants}
    first = {v: per_seed for v, per_seed in first.items() if any(f is not None for f in per_seed.values())}
    if first:
        lines += ["", "After the first stage (RL tool calls: that stage's).", "", *summary_lines(first)]
        if baseline in first:
            lines += ["", *comparison_lines(first, baseline)]
    table = {v: {f"seed{s}": f for s, f in per_seed.items()} for v, per_seed in figures.items()}
    table.update({f"{v}/stage1": {f"seed{s}": f for s, f in per_seed.items()} for v, per_seed in first.items()})
    return "\n".join(lines) + "\n", table


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m etagent.evaluation.ablations", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the ablations directory (RUN_DIR/ablations)")
    parser.add_argument("--seeds", type=int, required=True)
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--references", nargs="*", default=[], help="runs evaluated only (the starting policies), not compared")
    parser.add_argument("--baseline", help="the variant the others are compared with, paired per seed (default: full, where it is one)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        raise MissingInput(f"{root}: no such directory (run scripts/ablations.sh first)")
    if args.baseline is not None and args.baseline not in args.variants:
        raise MissingInput(f"--baseline {args.baseline} is not one of --variants {' '.join(args.variants)}")
    markdown, figures = ablation_table(root, args.seeds, args.variants, args.references, args.baseline or "full")
    (root / "ablations.md").write_text(markdown)
    (root / "ablations.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(markdown, end="")
    print(f"wrote {root / 'ablations.md'} and {root / 'ablations.json'}")


if __name__ == "__main__":
    main()

"""The ablation table: variants of the pipeline side by side, mean and std over seeds.

    python -m etagent.evaluation.ablations RUN_DIR/ablations --seeds 3 --variants full no-efficiency ...

Reads, per seed s and variant v (and reference: a starting policy, evaluated only),
``seed{s}/{v}/eval/summary.json`` (the held-out evaluation) and
``seed{s}/{v}/stage*/rl/metrics.jsonl`` (the RL steps), as scripts/ablations.sh lays them out,
and writes ``ablations.md`` and ``ablations.json`` beside them. Per variant: correctness,
efficiency, tool calls per answer, the redundant and insufficient rates, the redundant rate among
solved answers, and the tool calls the RL rollouts executed (a tree's copied calls counted once);
then, per seed, each variant beside the whole pipeline, the comparisons the paper's ablations
make; then both again for the policies after the first stage (``seed{s}/{v}/stage1/eval``), where
there is one. A run that is missing or unfinished is named, not averaged.

What this module does not do: run anything (scripts/ablations.sh does).
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    return {
        "correctness": toy["correctness"],
        "efficiency": toy["efficiency"],
        **{key: every[key] for key in ("tool_calls", "redundant_rate", "redundant_when_solved", "insufficient_rate")},
        "rl_tool_calls": rl_calls,
    }


def cell(values: list[float], digits: int) -> str:
    if not values:
        return "missing"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def summary_lines(figures: dict[str, dict[int, dict | None]]) -> list[str]:
    """Mean ± std per run name, then the runs that are not there."""
    lines = ["| variant | seeds | " + " | ".join(h for _, h, _ in FIELDS) + " |", "|---|---|" + "---|" * len(FIELDS)]
    for name, per_seed in figures.items():
        done = [f for f in per_seed.values() if f is not None]
        cells = [cell([f[key] for f in done], digits) for key, _, digits in FIELDS]
        lines.append(f"| {name} | {len(done)} | " + " | ".join(cells) + " |")
    missing = [f"seed{s}/{name}" for name, per_seed in figures.items() for s, f in per_seed.items() if f is None]
    if missing:
        lines += ["", f"missing or unfinished: {', '.join(missing)}"]
    return lines


def comparison_lines(figures: dict[str, dict[int, dict | None]]) -> list[str]:
    """Per seed, each variant beside ``full``."""
    lines = [
        "Per seed, each variant beside the whole pipeline (full; variant): the rates themselves, since full's are "
        "often 0; correctness with the difference variant - full; RL tool calls with full's as a multiple of the "
        "variant's.",
        "",
        "| variant | seed | correctness | redundant % | redundant when solved % | RL tool calls |",
        "|---|---|---|---|---|---|",
    ]
    for name, per_seed in figures.items():
        if name == "full":
            continue
        for s, other in per_seed.items():
            full = figures["full"][s]
            if full is None or other is None:
                continue
            lines.append(
                f"| {name} | {s} | {full['correctness']:.1f}; {other['correctness']:.1f}; "
                f"{other['correctness'] - full['correctness']:+.1f} | "
                f"{full['redundant_rate']:.1f}; {other['redundant_rate']:.1f} | "
                f"{full['redundant_when_solved']:.1f}; {other['redundant_when_solved']:.1f} | "
                f"{full['rl_tool_calls']:.0f}; {other['rl_tool_calls']:.0f}; "
                f"{ratio(full['rl_tool_calls'], other['rl_tool_calls'])}x |"
            )
    return lines


def ablation_table(root: Path, seeds: int, variants: list[str], references: list[str] = ()) -> tuple[str, dict]:
    """The table of ``references`` (evaluated only: the starting policies) and ``variants`` and the
    per-seed comparison of each variant with ``full``; then the same after the first stage, for the
    variants whose first stage was evaluated on its own (those with more than one stage)."""
    figures = {v: {s: run_figures(root / f"seed{s}" / v) for s in range(seeds)} for v in (*references, *variants)}
    lines = [
        f"Mean ± std over {seeds} seeds (held-out questions, T=0.6, 2 samples each; RL tool calls: executed by the RL "
        "rollouts over all stages).",
        "",
        *summary_lines(figures),
    ]
    if "full" in variants:
        lines += ["", *comparison_lines({v: figures[v] for v in variants})]
    first = {v: {s: run_figures(root / f"seed{s}" / v / "stage1") for s in range(seeds)} for v in variants}
    first = {v: per_seed for v, per_seed in first.items() if any(f is not None for f in per_seed.values())}
    if first:
        lines += ["", "After the first stage (RL tool calls: that stage's).", "", *summary_lines(first)]
        if "full" in first:
            lines += ["", *comparison_lines(first)]
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
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        raise MissingInput(f"{root}: no such directory (run scripts/ablations.sh first)")
    markdown, figures = ablation_table(root, args.seeds, args.variants, args.references)
    (root / "ablations.md").write_text(markdown)
    (root / "ablations.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(markdown, end="")
    print(f"wrote {root / 'ablations.md'} and {root / 'ablations.json'}")


if __name__ == "__main__":
    main()

"""The paper's main table from evaluation runs, several runs side by side.

    python -m etagent.evaluation.table runs/eval-sft runs/eval-rl [--out runs/table]

Rows are runs, columns datasets (the paper's six first, in its order), each cell
``correctness / efficiency`` (x100: LLM judge or math equivalence for math, F1 for QA), then the
plain averages "Avg P" and "Avg Effi" over the datasets the runs share, as the paper computes them.
Writes ``{out}.md`` and ``{out}.csv`` (one column per number).

Where the runs know which tool calls each question needs (the toy world's ``behaviour`` in their
summaries), a second table compares how they use tools, per kind of question: correctness,
tool calls per answer, and the rates of redundant calls (more than the question needs) and
insufficient ones (fewer); it goes to ``{out}_behaviour.md`` and ``{out}_behaviour.csv``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from etagent.errors import MissingInput, exit_on_user_error
from etagent.evaluation.benchmarks import PAPER_TABLE
from etagent.records import read_json_file


def summary_rows(run_dirs: list[Path]) -> list[dict]:
    rows = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            raise MissingInput(f"{path}: no such file (is {run_dir} an evaluation output directory?)")
        summary = read_json_file(path)
        rows.append(
            {
                "run": summary["run"],
                # a dataset with no samples (an empty file run with partial_input_ok) has no cell
                "datasets": {name: (d["correctness"], d["efficiency"]) for name, d in summary["datasets"].items() if d.get("samples")},
                "behaviour": {name: d["behaviour"] for name, d in summary["datasets"].items() if d.get("behaviour")},
            }
        )
    return rows


def write_behaviour_table(rows: list[dict], out: Path) -> Path | None:
    """The tool-use table, one row per dataset, kind and run (runs side by side under each kind);
    None when no run has behaviour figures."""
    if not any(row["behaviour"] for row in rows):
        return None
    md = ["| dataset | kind | run | correctness | tool calls | redundant % | insufficient % | redundant when solved % |", "|---" * 8 + "|"]
    table = []
    datasets = sorted({name for row in rows for name in row["behaviour"]})
    for dataset in datasets:
        kinds = sorted({kind for row in rows for kind in row["behaviour"].get(dataset, {})}, key=lambda k: (k == "all", k))
        for kind in kinds:
            for row in rows:
                b = row["behaviour"].get(dataset, {}).get(kind)
                if b is None:
                    continue
                md.append(
                    f"| {dataset} | {kind} | {row['run']} | {b['correctness']:.1f} | {b['tool_calls']:.2f} | "
                    f"{b['redundant_rate']:.1f} | {b['insufficient_rate']:.1f} | {b['redundant_when_solved']:.1f} |"
                )
                table.append({"dataset": dataset, "kind": kind, "run": row["run"]} | {k: b[k] for k in BEHAVIOUR_FIELDS})
    out = Path(out)
    md_path = out.with_name(out.name + "_behaviour.md")
    md_path.write_text("\n".join(md) + "\n")
    with out.with_name(out.name + "_behaviour.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return md_path


BEHAVIOUR_FIELDS = ("questions", "samples", "correctness", "tool_calls", "redundant_rate", "insufficient_rate", "redundant_when_solved")


def columns(rows: list[dict]) -> list[str]:
    names = {name for row in rows for name in row["datasets"]}
    return [n for n in PAPER_TABLE if n in names] + sorted(names - set(PAPER_TABLE))


def write_table(rows: list[dict], out: Path) -> tuple[Path, Path]:
    names = columns(rows)
    shared = [n for n in names if all(n in row["datasets"] for row in rows)]
    md = ["| run | " + " | ".join(f"{n} P/Effi" for n in names) + " | Avg P / Avg Effi |", "|---" * (len(names) + 2) + "|"]
    table = []
    for row in rows:
        cells = [f"{row['datasets'][n][0]:.1f} / {row['datasets'][n][1]:.1f}" if n in row["datasets"] else "-" for n in names]
        avg_p = sum(row["datasets"][n][0] for n in shared) / len(shared) if shared else float("nan")
        avg_e = sum(row["datasets"][n][1] for n in shared) / len(shared) if shared else float("nan")
        md.append(f"| {row['run']} | " + " | ".join(cells) + f" | {avg_p:.1f} / {avg_e:.1f} |")
        record = {"run": row["run"]}
        for n in names:
            p, e = row["datasets"].get(n, (None, None))
            record[f"{n}_correctness"], record[f"{n}_efficiency"] = p, e
        record["avg_correctness"], record["avg_efficiency"] = round(avg_p, 2), round(avg_e, 2)
        table.append(record)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out.with_suffix(".md"), out.with_suffix(".csv")
    md_path.write_text("\n".join(md) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return md_path, csv_path


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m etagent.evaluation.table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="evaluation output directories (each with summary.json)")
    parser.add_argument("--out", default="runs/table", help="output path without extension")
    args = parser.parse_args(argv)
    rows = summary_rows([Path(r) for r in args.runs])
    md_path, _ = write_table(rows, Path(args.out))
    print(md_path.read_text())
    behaviour = write_behaviour_table(rows, Path(args.out))
    if behaviour is not None:
        print("Tool use per kind of question (redundant: more calls than the question needs; insufficient: fewer):")
        print(behaviour.read_text())


if __name__ == "__main__":
    main()

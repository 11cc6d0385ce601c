"""The ablation's results kept in the repository: of every finished run of scripts/ablations.sh,
the files the ablation table reads, copied out of a run directory (``save``) and back into one
(``restore``), so that a table that takes longer than one sitting is built over several, and so
that anyone can rebuild it from the files it was computed from.

    python -m etagent.evaluation.ablation_results save RUN_DIR results/hard-ablations
    python -m etagent.evaluation.ablation_results restore results/hard-ablations RUN_DIR

A run is kept once it is finished: a starting policy's once its evaluation is there; a variant's
once its evaluation and every point of its learning curve are (one per checkpoint its RL stages
exported, and its start). Kept per run: ``eval/summary.json``, ``curve/step*/eval/summary.json``,
``stage*/rl/metrics.jsonl``, ``stage*/data/scores.jsonl`` (what Pareto selected, for the
curriculum's hop counts) and ``stage*/rl/rollouts/step_*.jsonl`` cut to the two fields the table
reads of them (``index``, ``reward``). No model is kept.

Runs are comparable only from the same starting policies: ``save`` records the SHA-256 of each
starting policy's weights and of the world's questions in ``starts.json``, and refuses a run
directory whose starts differ from those already kept; ``restore`` refuses the same, so results
from another start are never mixed into a table. ``restore`` copies only runs the run directory
does not have; scripts/ablations.sh then finds them done and goes on with the rest.

What this module does not do: run or score anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

from etagent.errors import MissingInput, UserError, exit_on_user_error

# The starting policies' weights and the world's question files, relative to RUN_DIR.
STARTS = (
    "sft/model/model.safetensors",
    "sft-flywheel/model/model.safetensors",
    "ablations/sft-seed-data/model/model.safetensors",
    "toy/questions/rl.jsonl",
    "toy/questions/test.jsonl",
)
REFERENCES = ("seed-sft", "flywheel-sft", "seed-data-sft")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def starts_of(run_dir: Path) -> dict[str, str]:
    missing = [name for name in STARTS if not (run_dir / name).exists()]
    if missing:
        raise MissingInput(f"{run_dir}: no {missing[0]} (run scripts/demo.sh and scripts/ablations.sh there first)")
    return {name: sha256(run_dir / name) for name in STARTS}


def check_same_starts(kept: Path, run_dir: Path) -> dict[str, str]:
    """The run directory's starts, refused where they differ from those kept in ``kept``."""
    starts = starts_of(run_dir)
    record = kept / "starts.json"
    if record.exists():
        before = json.loads(record.read_text())["sha256"]
        differ = [name for name in STARTS if before.get(name) != starts[name]]
        if differ:
            raise UserError(
                f"{run_dir / differ[0]}: sha256 {starts[differ[0]][:12]}, but the results in {kept} start from "
                f"{str(before.get(differ[0]))[:12]} ({record}); runs from other starting policies are not comparable"
            )
    return starts


def finished(run: Path, variant: bool) -> bool:
    """A starting policy's run is finished once its evaluation is there; a variant's once its
    evaluation is and, where its RL exported checkpoints (the curve is measured), a curve point
    for its start and for each checkpoint its stages exported (``models/step_*``) or ended with
    (``model/``; a stage's last step is never also exported under ``models/``, so no two share a
    point)."""
    if not (run / "eval" / "summary.json").exists():
        return False
    exported = len(list(run.glob("stage*/rl/models/step_*")))
    if not variant or exported == 0:
        return True
    expected = 1 + exported + len(list(run.glob("stage*/rl/model")))
    return len(list(run.glob("curve/step*/eval/summary.json"))) >= expected


def kept_files(run: Path) -> list[Path]:
    patterns = (
        "eval/summary.json",
        "curve/step*/eval/summary.json",
        "stage*/rl/metrics.jsonl",
        "stage*/data/scores.jsonl",
        "stage*/rl/rollouts/step_*.jsonl",
    )
    return sorted(p for pattern in patterns for p in run.glob(pattern))


def copy_kept(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.parent.name == "rollouts":
        rows = (json.loads(line) for line in source.read_text().splitlines() if line.strip())
        dest.write_text("".join(json.dumps({"index": r["index"], "reward": r["reward"]}) + "\n" for r in rows))
    else:
        shutil.copyfile(source, dest)


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return result.stdout.strip() or "unknown"


def save(run_dir: Path, kept: Path) -> list[str]:
    """Copy every finished run of ``run_dir/ablations`` not yet in ``kept``; returns their names."""
    ablations = run_dir / "ablations"
    if not ablations.is_dir():
        raise MissingInput(f"{ablations}: no such directory (run scripts/ablations.sh first)")
    starts = check_same_starts(kept, run_dir)
    saved = []
    for run in sorted(p for p in ablations.glob("seed*/*") if p.is_dir() and re.fullmatch(r"seed\d+", p.parent.name)):
        name = f"{run.parent.name}/{run.name}"
        if (kept / name / "eval" / "summary.json").exists() or not finished(run, run.name not in REFERENCES):
            continue
        for source in kept_files(run):
            copy_kept(source, kept / name / source.relative_to(run))
        saved.append(name)
    record = kept / "starts.json"
    runs = json.loads(record.read_text())["runs"] if record.exists() else {}
    runs.update({name: commit() for name in saved})
    kept.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"sha256": starts, "runs": dict(sorted(runs.items()))}, indent=2) + "\n")
    return saved


def restore(kept: Path, run_dir: Path) -> list[str]:
    """Copy every run kept in ``kept`` that ``run_dir/ablations`` lacks; returns their names."""
    if not (kept / "starts.json").exists():
        raise MissingInput(f"{kept / 'starts.json'}: no such file (nothing kept there)")
    check_same_starts(kept, run_dir)
    restored = []
    for run in sorted(p.parent.parent for p in kept.glob("seed*/*/eval/summary.json")):
        name = f"{run.parent.name}/{run.name}"
        target = run_dir / "ablations" / name
        if (target / "eval" / "summary.json").exists():
            continue
        for source in kept_files(run):
            copy_kept(source, target / source.relative_to(run))
        restored.append(name)
    return restored


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m etagent.evaluation.ablation_results", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    save_parser = commands.add_parser("save", help="copy the finished runs of RUN_DIR/ablations into KEPT")
    save_parser.add_argument("run_dir")
    save_parser.add_argument("kept")
    restore_parser = commands.add_parser("restore", help="copy the runs kept in KEPT into RUN_DIR/ablations")
    restore_parser.add_argument("kept")
    restore_parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    if args.command == "save":
        names = save(Path(args.run_dir), Path(args.kept))
        print(f"kept {len(names)} finished runs in {args.kept}" + (f": {', '.join(names)}" if names else ""))
    else:
        names = restore(Path(args.kept), Path(args.run_dir))
        print(f"restored {len(names)} runs into {Path(args.run_dir) / 'ablations'}" + (f": {', '.join(names)}" if names else ""))


if __name__ == "__main__":
    main()

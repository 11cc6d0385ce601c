"""Results kept in the repository: of every finished run of scripts/ablations.sh (or of
scripts/real_model.sh's seeds), the files the ablation table reads, copied out of a run directory
(``save``) and back into one (``restore``), so that a table that takes longer than one sitting is
built over several, and so that anyone can rebuild it from the files it was computed from.

    python -m etagent.evaluation.ablation_results save RUN_DIR results/hard-ablations
    python -m etagent.evaluation.ablation_results restore results/hard-ablations RUN_DIR
    python -m etagent.evaluation.ablation_results save RUN_DIR KEPT --runs . --starts smollm2/model.safetensors ...

The runs are ``RUN_DIR/{--runs}/seed{s}/{name}`` (``--runs`` is ``ablations`` for
scripts/ablations.sh, the default; ``.`` for scripts/real_model.sh). A run is kept once it is
finished: once its evaluation is there and, where its RL exported checkpoints (a variant whose
learning curve is measured), once every point of its curve is (its start and one per
checkpoint). Kept per run: ``eval/summary.json``, ``curve/step*/eval/summary.json``, every
``rl/metrics.jsonl`` below it, ``stage*/data/scores.jsonl`` (what Pareto selected, for the
curriculum's hop counts; cut to ``id``, ``source``, ``mean_correctness``, ``selected``) and every
``rl/rollouts/step_*.jsonl`` cut to the two fields the table reads of them (``index``,
``reward``). No model is kept.

Runs are comparable only from the same start: ``save`` records the SHA-256 of each of the
``--starts`` files (the starting policies' weights and the questions, relative to RUN_DIR; by
default the ablation's) in ``KEPT/starts.json``, and refuses a run directory whose files differ
from those already kept there; ``restore`` checks the files that ``starts.json`` names, so
results from another start are never mixed into a table. ``restore`` copies only runs the run
directory does not have; the scripts then find them done and go on with the rest.

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

# scripts/ablations.sh's start: the starting policies' weights and the world's question files,
# relative to RUN_DIR
ABLATION_STARTS = (
    "sft/model/model.safetensors",
    "sft-flywheel/model/model.safetensors",
    "ablations/sft-seed-data/model/model.safetensors",
    "toy/questions/rl.jsonl",
    "toy/questions/test.jsonl",
)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_same_starts(kept: Path, run_dir: Path, names: tuple[str, ...], runs: str) -> dict[str, str]:
    """The SHA-256 of the run directory's start files, refused where they, or the runs' folder,
    differ from those kept in ``kept``."""
    missing = [name for name in names if not (run_dir / name).is_file()]
    if missing:
        raise MissingInput(f"{run_dir / missing[0]}: no such file (the run's start; run its script there first)")
    starts = {name: sha256(run_dir / name) for name in names}
    record = kept / "starts.json"
    if record.exists():
        before = json.loads(record.read_text())
        if sorted(before["sha256"]) != sorted(names) or before["runs_dir"] != runs:
            raise UserError(
                f"{record}: kept runs of RUN_DIR/{before['runs_dir']} from {', '.join(sorted(before['sha256']))}, "
                f"not of RUN_DIR/{runs} from {', '.join(sorted(names))}"
            )
        differ = [name for name in names if before["sha256"][name] != starts[name]]
        if differ:
            raise UserError(
                f"{run_dir / differ[0]}: sha256 {starts[differ[0]][:12]}, but the results in {kept} start from "
                f"{before['sha256'][differ[0]][:12]} ({record}); runs from another start are not comparable"
            )
    return starts


def finished(run: Path) -> bool:
    """A run is finished once its evaluation is there and, where its RL exported checkpoints (the
    learning curve is measured), once it has a curve point for its start and for each checkpoint
    its stages exported (``models/step_*``) or ended with (``model/``; a stage's last step is
    never also exported under ``models/``, so no two share a point)."""
    if not (run / "eval" / "summary.json").exists():
        return False
    exported = len(list(run.glob("**/rl/models/step_*")))
    if exported == 0:
        return True
    expected = 1 + exported + len(list(run.glob("**/rl/model")))
    return len(list(run.glob("curve/step*/eval/summary.json"))) >= expected


def kept_files(run: Path) -> list[Path]:
    patterns = (
        "eval/summary.json",
        "curve/step*/eval/summary.json",
        "**/rl/metrics.jsonl",
        "stage*/data/scores.jsonl",
        "**/rl/rollouts/step_*.jsonl",
    )
    return sorted({p for pattern in patterns for p in run.glob(pattern)})


# the fields kept of a JSONL file's rows (the rest, texts and objectives, is not read by the table)
KEPT_FIELDS = {"rollouts": ("index", "reward"), "scores.jsonl": ("id", "source", "mean_correctness", "selected")}


def copy_kept(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fields = KEPT_FIELDS.get(source.parent.name) or KEPT_FIELDS.get(source.name)
    if fields is None:
        shutil.copyfile(source, dest)
        return
    rows = (json.loads(line) for line in source.read_text().splitlines() if line.strip())
    dest.write_text("".join(json.dumps({key: row[key] for key in fields}, separators=(",", ":")) + "\n" for row in rows))


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return result.stdout.strip() or "unknown"


def save(run_dir: Path, kept: Path, runs: str = "ablations", starts: tuple[str, ...] = ABLATION_STARTS) -> list[str]:
    """Copy every finished run of ``run_dir/runs`` not yet in ``kept``; returns their names."""
    root = run_dir / runs
    if not root.is_dir():
        raise MissingInput(f"{root}: no such directory (run its script first)")
    hashes = check_same_starts(kept, run_dir, starts, runs)
    saved = []
    for run in sorted(p for p in root.glob("seed*/*") if p.is_dir() and re.fullmatch(r"seed\d+", p.parent.name)):
        name = f"{run.parent.name}/{run.name}"
        if (kept / name / "eval" / "summary.json").exists() or not finished(run):
            continue
        for source in kept_files(run):
            copy_kept(source, kept / name / source.relative_to(run))
        saved.append(name)
    record = kept / "starts.json"
    kept_runs = json.loads(record.read_text())["runs"] if record.exists() else {}
    kept_runs.update({name: commit() for name in saved})
    kept.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"runs_dir": runs, "sha256": hashes, "runs": dict(sorted(kept_runs.items()))}, indent=2) + "\n")
    return saved


def restore(kept: Path, run_dir: Path) -> list[str]:
    """Copy every run kept in ``kept`` that the run directory lacks; returns their names."""
    record = kept / "starts.json"
    if not record.exists():
        raise MissingInput(f"{record}: no such file (nothing kept there)")
    before = json.loads(record.read_text())
    check_same_starts(kept, run_dir, tuple(before["sha256"]), before["runs_dir"])
    restored = []
    for run in sorted(p.parent.parent for p in kept.glob("seed*/*/eval/summary.json")):
        name = f"{run.parent.name}/{run.name}"
        target = run_dir / before["runs_dir"] / name
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
    save_parser = commands.add_parser("save", help="copy the finished runs of RUN_DIR/RUNS into KEPT")
    save_parser.add_argument("run_dir")
    save_parser.add_argument("kept")
    save_parser.add_argument("--runs", default="ablations", help="the folder of RUN_DIR that holds seed*/ (default: ablations)")
    save_parser.add_argument("--starts", nargs="+", default=list(ABLATION_STARTS), help="the start's files, relative to RUN_DIR")
    restore_parser = commands.add_parser("restore", help="copy the runs kept in KEPT into RUN_DIR")
    restore_parser.add_argument("kept")
    restore_parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    if args.command == "save":
        names = save(Path(args.run_dir), Path(args.kept), args.runs, tuple(args.starts))
        print(f"kept {len(names)} finished runs in {args.kept}" + (f": {', '.join(names)}" if names else ""))
    else:
        names = restore(Path(args.kept), Path(args.run_dir))
        print(f"restored {len(names)} runs into {args.run_dir}" + (f": {', '.join(names)}" if names else ""))


if __name__ == "__main__":
    main()

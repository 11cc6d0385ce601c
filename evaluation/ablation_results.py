"""Results kept in the repository: of every finished run of scripts/ablations.sh (or of
scripts/real_model.sh's seeds), the files the ablation table reads, copied out of a run directory
(``save``) and back into one (``restore``), so that a table that takes longer than one sitting is
built over several, and so that anyone can rebuild it from the files it was computed from.

    python -m etagent.evaluation.ablation_results save RUN_DIR results/hard-ablations --settings stages=2 ...
    python -m etagent.evaluation.ablation_results restore results/hard-ablations RUN_DIR --settings stages=2 ...
    python -m etagent.evaluation.ablation_results save RUN_DIR KEPT --runs . --starts smollm2/model.safetensors ...

The runs are ``RUN_DIR/{--runs}/seed{s}/{name}`` (``--runs`` is ``ablations`` for
scripts/ablations.sh, the default; ``.`` for scripts/real_model.sh). A run is kept once it is
finished: once its evaluation is there and, where its RL exported checkpoints (a variant whose
learning curve is measured), once every point of its curve is (its start and one per
checkpoint), or else once each of its stages but the last was evaluated (the toy's table has the
first stage's row). Kept per run: ``eval/summary.json``, ``stage*/eval/summary.json``,
``curve/step*/eval/summary.json``, every ``rl/metrics.jsonl`` below it,
``stage*/data/scores.jsonl`` (what Pareto selected, for the curriculum's hop counts; cut to
``id``, ``source``, ``mean_correctness``, ``selected``) and every ``rl/rollouts/step_*.jsonl`` cut
to the two fields the table reads of them (``index``, ``reward``). No model is kept. A run is
copied into a temporary folder and renamed into place, and ``starts.json`` is replaced whole, so
a kill leaves a run kept whole or not at all; saves and restores into one KEPT take turns (a lock
in it).

Runs are comparable only from the same start and settings: ``save`` records the SHA-256 of each
of the ``--starts`` files (the starting policies' weights and the questions, relative to RUN_DIR;
by default the ablation's) and the ``--settings`` (the script's budget: stages, steps, samples,
curve points, extra overrides) in ``KEPT/starts.json``, and refuses a run directory whose files or
settings differ from those already kept there; ``restore`` checks the same, so results from
another start or budget are never mixed into a table. ``restore`` copies only runs the run
directory has not finished; the scripts then find them done and go on with the rest.
``starts.json`` also names, per kept run, the commit checked out when it was kept.

What this module does not do: run or score anything.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def locked(kept: Path) -> Iterator[None]:
    """Saves and restores into one KEPT take turns (two ablation processes save side by side)."""
    kept.mkdir(parents=True, exist_ok=True)
    with open(kept / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def check_same_start(kept: Path, run_dir: Path, names: tuple[str, ...], runs: str, settings: dict[str, str]) -> dict[str, str]:
    """The SHA-256 of the run directory's start files, refused where they, the runs' folder or the
    settings differ from those kept in ``kept``."""
    check_start_files(run_dir, names)
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
        if before["settings"] != settings:
            raise UserError(
                f"{record}: kept runs made with settings {format_settings(before['settings'])}, not "
                f"{format_settings(settings)}; runs of another budget are not comparable"
            )
    return starts


def check_start_files(run_dir: Path, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not (run_dir / name).is_file()]
    if missing:
        raise MissingInput(f"{run_dir / missing[0]}: no such file (the run's start; run its script there first)")


def format_settings(settings: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(settings.items())) or "(none)"


def exports(run: Path) -> list[Path]:
    """The checkpoints a run's RL stages exported (``models/step_N``; not an export a kill left
    half-written, ``step_N.tmp``)."""
    return [p for p in run.glob("**/rl/models/step_*") if re.fullmatch(r"step_\d+", p.name)]


def finished(run: Path) -> bool:
    """A run is finished once its evaluation is there and, where its RL exported checkpoints (the
    learning curve is measured), once it has a curve point for its start and for each checkpoint
    its stages exported (``models/step_N``) or ended with (``model/``; a stage's last step is
    never also exported under ``models/``, so no two share a point); else once each of its stages
    but the last has its own evaluation (scripts/ablations.sh evaluates them after the run's)."""
    if not (run / "eval" / "summary.json").exists():
        return False
    exported = len(exports(run))
    if exported:
        expected = 1 + exported + len(list(run.glob("**/rl/model")))
        return len(list(run.glob("curve/step*/eval/summary.json"))) >= expected
    stages = sorted(int(m.group(1)) for p in run.glob("stage*") if (m := re.fullmatch(r"stage(\d+)", p.name)))
    return all((run / f"stage{k}" / "eval" / "summary.json").exists() for k in stages[:-1])


def kept_files(run: Path) -> list[Path]:
    """What is kept of a run, its evaluation's summary last (a restored run is done once it is
    there)."""
    patterns = (
        "stage*/eval/summary.json",
        "curve/step*/eval/summary.json",
        "**/rl/metrics.jsonl",
        "stage*/data/scores.jsonl",
        "**/rl/rollouts/step_*.jsonl",
    )
    return sorted({p for pattern in patterns for p in run.glob(pattern)}) + [run / "eval" / "summary.json"]


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


def save(
    run_dir: Path, kept: Path, runs: str = "ablations", starts: tuple[str, ...] = ABLATION_STARTS, settings: dict[str, str] | None = None
) -> list[str]:
    """Copy every finished run of ``run_dir/runs`` not yet in ``kept``; returns their names."""
    settings = settings or {}
    root = run_dir / runs
    if not root.is_dir():
        raise MissingInput(f"{root}: no such directory (run its script first)")
    check_start_files(run_dir, starts)  # before KEPT is made: a refused save writes nothing
    with locked(kept):
        hashes = check_same_start(kept, run_dir, starts, runs, settings)
        saved = []
        for run in sorted(p for p in root.glob("seed*/*") if p.is_dir() and re.fullmatch(r"seed\d+", p.parent.name)):
            name = f"{run.parent.name}/{run.name}"
            target = kept / name
            if target.is_dir() or not finished(run):
                continue
            partial = target.with_name(f".{run.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)  # a save killed midway
            for source in kept_files(run):
                copy_kept(source, partial / source.relative_to(run))
            os.replace(partial, target)
            saved.append(name)
        record = kept / "starts.json"
        kept_runs = json.loads(record.read_text())["runs"] if record.exists() else {}
        kept_runs.update({name: commit() for name in saved})
        fresh = record.with_name(".starts.json.partial")
        fresh.write_text(
            json.dumps({"runs_dir": runs, "settings": settings, "sha256": hashes, "runs": dict(sorted(kept_runs.items()))}, indent=2) + "\n"
        )
        os.replace(fresh, record)
    return saved


def restore(kept: Path, run_dir: Path, settings: dict[str, str] | None = None) -> list[str]:
    """Copy every run kept in ``kept`` that the run directory has not finished; returns their
    names."""
    record = kept / "starts.json"
    if not record.exists():
        raise MissingInput(f"{record}: no such file (nothing kept there)")
    with locked(kept):
        before = json.loads(record.read_text())
        check_same_start(kept, run_dir, tuple(before["sha256"]), before["runs_dir"], settings or {})
        restored = []
        for name in before["runs"]:
            run, target = kept / name, run_dir / before["runs_dir"] / name
            if (target / "eval" / "summary.json").exists():
                continue
            for source in kept_files(run):
                copy_kept(source, target / source.relative_to(run))
            restored.append(name)
    return restored


def parse_settings(pairs: list[str]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--settings {pair!r}: give KEY=VALUE")
        settings[key] = value
    return settings


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
    for sub in (save_parser, restore_parser):
        sub.add_argument("--settings", nargs="*", default=[], metavar="KEY=VALUE", help="the run's budget, which kept runs must share")
    args = parser.parse_args(argv)
    settings = parse_settings(args.settings)
    if args.command == "save":
        names = save(Path(args.run_dir), Path(args.kept), args.runs, tuple(args.starts), settings)
        print(f"kept {len(names)} finished runs in {args.kept}" + (f": {', '.join(names)}" if names else ""))
    else:
        names = restore(Path(args.kept), Path(args.run_dir), settings)
        print(f"restored {len(names)} runs into {args.run_dir}" + (f": {', '.join(names)}" if names else ""))


if __name__ == "__main__":
    main()

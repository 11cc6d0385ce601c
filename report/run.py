"""``etagent report RUN_DIR``: the run's report page, ``RUN_DIR/report.html`` (or ``--out FILE``).

    python -m etagent.report.run runs/demo [--max-trajectories N]

One HTML file that opens from disk, with no server and no network: the evaluation tables side by
side with the behaviour table per kind of question, the SFT and RL curves by step, the radar chart
and Pareto scatters, a browser over the evaluation samples and RL rollouts (all of them, or an
even sample of ``--max-trajectories`` over the run's steps and datasets), and the pipeline as it
ran (each stage's folder, status, times, counts, commit and inputs, from the manifests). A run
still going, or one with files missing, gives a report that lists what is missing at its top;
only a ``RUN_DIR`` that is not a directory, or a setting out of its range, is an error.

The report is not a Hydra stage (it has no preset, resumes nothing and writes no manifest): its
few settings are command-line options, each declared once in :class:`ReportSettings` (type and
range, checked by ``etagent.settings.validate`` as a stage's are; the default beside them) with
its doc in the option's help.

It reads the run's files and writes one file; it trains, samples and scores nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from functools import cache
from pathlib import Path

from etagent.errors import MissingInput, UserError, exit_on_user_error
from etagent.records import write_atomically
from etagent.report.collect import collect
from etagent.report.page import render
from etagent.settings import PositiveInt, group, validate


@group
class ReportSettings:
    """The report's settings, one command-line option each (``max_trajectories`` is
    ``--max-trajectories``); what each means is its option's help."""

    max_trajectories: PositiveInt = 20000


@cache
def tokenizer_for(model: str):
    """The evaluated model's tokenizer, to split responses by token origin; None where the model
    folder is gone (the page then shows the responses without origins)."""
    if not (Path(model) / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def write_report(run_dir: str | os.PathLike, settings: ReportSettings, out: str | os.PathLike | None = None) -> Path:
    started = time.time()
    run = collect(run_dir, settings.max_trajectories, tokenizer_for)
    path = Path(out) if out else Path(run_dir) / "report.html"
    # a name in the run folder that is not UTF-8 (os.walk gives its bytes as surrogates) is shown
    # as its escapes: the page is for reading, and it is written whole or not at all
    write_atomically(path, render(run, settings.max_trajectories).encode("utf-8", "backslashreplace"))
    sampled = f" (a sample of the run's {run.trajectories_found})" if run.trajectories_found > len(run.trajectories) else ""
    print(
        f"report: {len(run.stages)} stage folders, {len(run.curves)} curves, {len(run.evaluations)} evaluations, "
        f"{len(run.images)} charts, {len(run.trajectories)} trajectories{sampled}, {len(run.problems)} problems listed "
        f"({time.time() - started:.1f} s)\n  wrote {path} ({path.stat().st_size / 1e6:.1f} MB)"
    )
    return path


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="etagent report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's directory (the demo's: runs/demo)")
    parser.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")
    parser.add_argument(
        "--max-trajectories",
        type=int,
        default=ReportSettings.max_trajectories,
        help="how many trajectories the page's browser holds at most (default: %(default)s): a run with more gets an even sample, "
        "the same share of each RL step and evaluation dataset, and the page grows with each one held",
    )
    args = parser.parse_args(argv)
    settings = ReportSettings(max_trajectories=args.max_trajectories)
    validate(ReportSettings, dataclasses.asdict(settings))
    if not Path(args.run_dir).is_dir():
        raise MissingInput(f"{args.run_dir}: no such directory")
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise UserError(f"--out {out}: is a folder; name the HTML file to write, e.g. {out / 'report.html'}")
        if not out.parent.is_dir():
            raise UserError(f"--out {out}: its folder {out.parent} does not exist")
        if out.is_file() and not is_report(out):
            raise UserError(f"--out {out}: is a file the report did not write (it never writes over the run's files); name a new file")
    write_report(args.run_dir, settings, args.out)


def is_report(path: Path) -> bool:
    """Whether ``path`` is a page this command wrote (its head names it), so writing it again
    replaces no one's data."""
    with path.open("rb") as f:
        return b"<title>etagent report: " in f.read(400)


if __name__ == "__main__":
    main()

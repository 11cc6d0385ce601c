"""``etagent report RUN_DIR``: the run's report page, ``RUN_DIR/report.html`` (or ``--out FILE``).

    python -m report.run runs/demo

One HTML file that opens from disk, with no server and no network: the pipeline as it ran (each
stage's folder, status, times, counts and inputs, from the manifests), the SFT and RL curves by
step, the evaluation tables side by side with the behaviour table per kind of question, the radar
chart and Pareto scatters, and a browser over every evaluation sample and RL rollout. A run still
going, or one with files missing, gives a report that lists what is missing at its top; only a
``RUN_DIR`` that is not a directory is an error.

It reads the run's files and writes one file; it trains, samples and scores nothing.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import cache
from pathlib import Path

from etagent.errors import MissingInput, UserError, exit_on_user_error
from report.collect import collect
from report.page import render


@cache
def tokenizer_for(model: str):
    """The evaluated model's tokenizer, to split responses by token origin; None where the model
    folder is gone (the page then shows the responses without origins)."""
    if not (Path(model) / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    started = time.time()
    run = collect(run_dir, tokenizer_for)
    path = Path(out) if out else Path(run_dir) / "report.html"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(run), encoding="utf-8")
    tmp.replace(path)
    print(
        f"report: {len(run.stages)} stage folders, {len(run.curves)} curves, {len(run.evaluations)} evaluations, "
        f"{len(run.images)} charts, {len(run.trajectories)} trajectories, {len(run.problems)} problems listed "
        f"({time.time() - started:.1f} s)\n  wrote {path} ({path.stat().st_size / 1e6:.1f} MB)"
    )
    return path


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="etagent report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's directory (the demo's: runs/demo)")
    parser.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")
    args = parser.parse_args(argv)
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
    write_report(args.run_dir, args.out)


def is_report(path: Path) -> bool:
    """Whether ``path`` is a page this command wrote (its head names it), so writing it again
    replaces no one's data."""
    with path.open("rb") as f:
        return b"<title>etagent report: " in f.read(400)


if __name__ == "__main__":
    main()

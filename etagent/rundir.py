"""An output directory owned by one run at a time, resumed only with the settings it was made with.

Every stage writes into an ``out_dir`` and resumes from what is already there. Two things make
that safe, and :func:`claim_output` does both before any work starts:

- **one writer**: an exclusive ``flock`` on ``out_dir/.lock``, held while the stage runs (the
  kernel drops it when the process dies, ``kill -9`` included, so a crashed run never leaves a
  stale lock). A second run on the same directory is refused with the first one's pid.
- **the same settings**: the directory's ``manifest.json`` holds the resolved config of the run
  that wrote it. A rerun whose config differs in a key that changes the output (anything but the
  stage's ``free`` keys: addresses, concurrency, batch sizes, the output path...) is refused,
  naming each differing key with both values, since resuming would mix records made two ways
  under one manifest. Keys present on only one side (a toolkit upgrade added or removed one) are
  not compared.

The claim then writes a manifest with ``status: running``, so a run killed before its end leaves
its settings behind for the next one to check; the stage's final :func:`write_manifest` replaces
it. This module does not decide what a stage resumes (each stage skips the records it finds).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from etagent.errors import OutputBusy, UserError
from etagent.records import write_manifest

LOCK_NAME = ".lock"

# The keys no stage's output depends on: where things run and how fast.
ALWAYS_FREE = ("out_dir", "ray.*", "run_name")


class SettingsChanged(UserError):
    """A rerun on an output directory made with different settings."""


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def changed_settings(before: dict, now: dict, free: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """(key, value before, value now) for every key both configs have, not matched by a ``free``
    pattern (fnmatch: ``tools.*.concurrency``), whose values differ."""
    patterns = (*ALWAYS_FREE, *free)
    old, new = flatten(before), flatten(json.loads(json.dumps(now, default=str)))
    return [
        (key, old[key], new[key])
        for key in sorted(old.keys() & new.keys())
        if old[key] != new[key] and not any(fnmatchcase(key, p) or fnmatchcase(key, p + ".*") for p in patterns)
    ]


def _lock(out: Path, stage: str):
    """Take the exclusive lock on ``out`` (or refuse, naming the holder); returns the open handle
    that holds it."""
    path = out / LOCK_NAME
    handle = open(path, "a+")  # noqa: SIM115 -- the open handle is the lock; claim_output closes it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise OutputBusy(
            f"{out} is being written by another run ({holder}); wait for it to finish, or set out_dir to another directory"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, {stage}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


# The directories this process holds, with how many claims are open on each (a stage may claim a
# directory its caller already holds).
_HELD: dict[Path, list] = {}


@contextmanager
def claim_output(out_dir: str | os.PathLike, *, stage: str, config: dict, free: Sequence[str] = (), resumes: bool = True) -> Iterator[Path]:
    """Hold ``out_dir`` for the block: lock it, check its manifest's settings against ``config``
    (unless the stage does not ``resume``: it rewrites all its outputs on every run) and mark it
    running. A claim on a directory this process already holds only checks."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = out.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
    else:
        _HELD[key] = [_lock(out, stage), 1]
    try:
        if resumes:
            check_settings(out, config, free)
        write_manifest(out, stage=stage, config=config, started_at=time.time(), status="running")
        yield out
    finally:
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            _HELD.pop(key)[0].close()


def check_settings(out: Path, config: dict, free: Sequence[str] = ()) -> None:
    """Refuse to resume ``out`` when its manifest was written with other settings."""
    manifest_path = out / "manifest.json"
    if not manifest_path.exists():
        return
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise UserError(f"{manifest_path}: not valid JSON ({exc}); move the directory aside or delete the manifest") from None
    differences = changed_settings(manifest.get("config") or {}, config, free)
    if differences:
        listed = "; ".join(f"{key}: {old!r} then, {new!r} now" for key, old, new in differences[:8])
        more = f" (and {len(differences) - 8} more)" if len(differences) > 8 else ""
        raise SettingsChanged(
            f"{out} was written by a run with other settings ({listed}{more}): resuming would mix outputs made two ways. "
            "Rerun with the earlier settings to resume, or set out_dir to a new directory"
        )

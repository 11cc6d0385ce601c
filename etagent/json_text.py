"""JSON that no writer can choke on: the one place the toolkit decodes JSON it reads from files.

:func:`decode_json` turns any bytes into a JSON value or a :class:`etagent.errors.RecordError`
naming the file and line: bytes that are not UTF-8, JSON that does not parse, nesting deeper than
:data:`MAX_NESTING` (Python's json module, and every writer after it, recurses once per level), a
lone surrogate (it reads into a str no UTF-8 writer can write). ``etagent.records``' readers and
the checks of a model folder's files (``etagent.settings``) read through it.

It sits at the bottom of the core beside ``etagent.settings`` and ``etagent.errors`` and imports
nothing else of it. What it does not do: validate records (``etagent.records``) or read parquet.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

from etagent.errors import RecordError

# JSON nested deeper than this is refused where it is read. Python's json module recurses once per
# level, and so does every walk over the value after it (json.dumps in a writer, copy.deepcopy):
# a value that reads at one depth of the call stack fails in whichever writer meets it at another.
# pyarrow's parquet reader refuses a schema nested past 100 levels too (a list is two of them); no
# format we read nests past 10.
MAX_NESTING = 100

# A JSON string, and a bracket: what the nesting scan steps through (brackets outside strings).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")
_STRING_OR_BRACKET = re.compile(f"{_STRING.pattern}|{_BRACKET.pattern}")
_NESTING_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# A \uD800-\uDFFF escape is half of a UTF-16 surrogate pair. JSON may hold one alone; Python's json
# reads it into a str that no UTF-8 writer can write (UnicodeEncodeError, with the output half
# written), so a lone one is refused where it is read. A pair (an emoji written with
# ensure_ascii) reads as the one character it encodes.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with any surrogate written as its escape, so that a message naming it prints."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _nesting_error(text: str, path, line: int | None, always: bool = False) -> RecordError | None:
    """A RecordError naming where the JSON ``text`` first nests deeper than MAX_NESTING (the line
    of a whole file), or None where it does not (``always``: the error even then, as when Python's
    own reader ran out of stack)."""
    if text.count("[") + text.count("{") > MAX_NESTING and (
        always or max(itertools.accumulate(map(_NESTING_STEP.get, _BRACKET.findall(_STRING.sub("", text)))), default=0) > MAX_NESTING
    ):  # the depth counted at C speed; where it passes the limit, found step by step
        depth = 0
        for match in _STRING_OR_BRACKET.finditer(text):
            depth += _NESTING_STEP.get(match.group(), 0)
            if depth > MAX_NESTING:
                where = line if line is not None else text.count("\n", 0, match.start()) + 1
                return RecordError(
                    path,
                    where,
                    "(line)" if line is not None else "(file)",
                    f"nested deeper than {MAX_NESTING} levels (arrays and objects inside each other); no record nests so deep",
                )
    if always:
        return RecordError(path, line, "(line)" if line is not None else "(file)", "nested too deep for Python's JSON reader")
    return None


def _surrogate_error(text: str, value: Any, path, line: int | None) -> RecordError | None:
    """A RecordError naming the first field of ``value`` (read from ``text``) whose text, or key,
    holds a lone surrogate, or None."""
    if not _SURROGATE_ESCAPE.search(text):
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        field, item = stack.pop()
        if isinstance(item, dict):  # a key is a string too: pushed as one, named by its own path
            stack += reversed([(f"{field}.{key}" if field else key, child) for key, child in item.items()])
            stack += [(f"{field}.{key}" if field else key, key) for key in item if _SURROGATE.search(key)]
        elif isinstance(item, list):
            stack += reversed([(f"{field}[{i}]", child) for i, child in enumerate(item)])
        elif isinstance(item, str) and (found := _SURROGATE.search(item)):
            if line is None:
                lone = _LONE_SURROGATE_ESCAPE.search(text) or _SURROGATE_ESCAPE.search(text)
                line = text.count("\n", 0, lone.start()) + 1
            return RecordError(
                path,
                line,
                printable(field or "(record)"),
                f"holds a lone surrogate \\u{ord(found.group()):04x} (half of a UTF-16 pair, no character: no UTF-8 file can hold it); "
                "correct the text",
            )
    return None


def parse_json(data: bytes, path, line: int | None) -> Any:
    """The JSON value ``data`` holds. Raises ValueError where it does not parse (bytes that are not
    UTF-8 included: :func:`iter_jsonl` tells a line cut off by a killed writer by it), and
    :class:`RecordError` where it parses into what no stage can carry: nesting deeper than
    MAX_NESTING, a lone surrogate."""
    text = data.decode("utf-8")
    try:
        value = json.loads(text)
    except RecursionError:
        raise _nesting_error(text, path, line, always=True) from None
    error = _nesting_error(text, path, line) or _surrogate_error(text, value, path, line)
    if error is not None:
        raise error
    return value


def unparsable(error: ValueError, data: bytes, path, line: int | None) -> RecordError:
    """The RecordError for JSON ``data`` (a line numbered ``line``, or a whole file) that raised
    ``error`` in :func:`_parse_json`: where, and why."""
    field = "(line)" if line is not None else "(file)"
    if isinstance(error, UnicodeDecodeError):
        start = data.rfind(b"\n", 0, error.start) + 1
        where = line if line is not None else data.count(b"\n", 0, error.start) + 1
        return RecordError(path, where, field, f"not UTF-8: byte {data[error.start]:#04x} at column {error.start - start + 1}")
    if isinstance(error, json.JSONDecodeError):
        where = line if line is not None else error.lineno
        return RecordError(path, where, field, f"not valid JSON: {error.msg} at column {error.colno}")
    return RecordError(path, line, field, f"not valid JSON: {first_line(error)}")  # an integer of over 4300 digits


def decode_json(data: bytes, path: str | os.PathLike, line: int | None = None) -> Any:
    """The JSON value in ``data``, a line numbered ``line`` of ``path`` or (``line`` None) the whole
    file, or a :class:`RecordError` naming the file, the line and what is wrong: bytes that are
    not UTF-8, JSON that does not parse, nesting deeper than MAX_NESTING levels, or a lone
    surrogate (named with its field). Every JSON reader of the toolkit reads through it, so no
    value it returns can crash a writer later. A UTF-8 byte-order mark at the start of a file is
    read past."""
    if line in (None, 1):
        data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return parse_json(data, path, line)
    except RecordError:
        raise
    except ValueError as error:
        raise unparsable(error, data, path, line) from None


def read_json_file(path: str | os.PathLike) -> Any:
    """A whole JSON file, read as :func:`decode_json` reads it: one that does not read is a
    :class:`RecordError` naming the file and line."""
    path = Path(path)
    return decode_json(path.read_bytes(), path)

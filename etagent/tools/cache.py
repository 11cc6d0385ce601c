"""A persistent cache of tool results, shared by every process of a run.

SQLite in WAL mode, one row per (tool, backend, normalised query, parameters). Many processes
may read and write the same file at once (each opens its own connection; writers wait up to
``busy_timeout_s`` for the lock). Only successful results are stored: a failed web search is
tried again next time (the reference cached failures forever).

``mode="replay"`` makes the cache authoritative: a miss raises :class:`CacheMiss` and the backend
is never called, so a run can be reproduced offline from a cache recorded earlier.

:func:`import_reference_json` loads the reference's JSON search cache (ARPO's
``search_cache.json``: a flat object mapping a query to its formatted result text).

What this does not do: expire entries (delete the file, or rows, to refresh), or cache Python
calls (code may be non-deterministic; the sandbox is fast enough).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from etagent.errors import MissingInput

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    backend TEXT NOT NULL,
    query TEXT NOT NULL,
    params TEXT NOT NULL,
    value TEXT NOT NULL,
    created REAL NOT NULL
)
"""


class CacheMiss(LookupError):
    """Replay mode found no entry for a call."""


def normalise_query(query: str) -> str:
    """Lower case with runs of whitespace collapsed: queries that differ only there share a row."""
    return " ".join(query.lower().split())


def cache_key(tool: str, backend: str, query: str, params: dict[str, Any]) -> str:
    material = json.dumps([tool, backend, normalise_query(query), params], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(material.encode()).hexdigest()


class ToolCache:
    """get/put of JSON values keyed by a tool call; thread-safe, multi-process safe."""

    def __init__(self, path: str | os.PathLike, mode: str = "readwrite", busy_timeout_s: float = 30.0):
        if mode not in ("readwrite", "replay"):
            raise ValueError(f"cache mode must be readwrite or replay, got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if mode == "replay" and not self.path.exists():
            raise MissingInput(f"{self.path}: replay mode needs an existing cache file")
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, check_same_thread=False, isolation_level=None)
        self._set_up(busy_timeout_s)

    def _set_up(self, busy_timeout_s: float) -> None:
        """Switch to WAL and create the table, retrying while another process holds the file.

        SQLite answers "database is locked" at once, without waiting on the busy timeout, when
        the journal mode changes or a WAL is being recovered while another connection opens the
        same file; four processes opening a new cache together hit it. So the setup retries for
        as long as a write would wait.
        """
        deadline = time.monotonic() + busy_timeout_s
        delay = 0.01
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
                with self._lock:
                    self._db.execute(SCHEMA)
                return
            except sqlite3.OperationalError as error:
                if ("locked" not in str(error) and "busy" not in str(error)) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def get(self, tool: str, backend: str, query: str, params: dict[str, Any]) -> Any | None:
        """The stored value, or None on a miss (replay mode raises CacheMiss instead)."""
        key = cache_key(tool, backend, query, params)
        with self._lock:
            row = self._db.execute("SELECT value FROM results WHERE key = ?", (key,)).fetchone()
        if row is not None:
            return json.loads(row[0])
        if self.mode == "replay":
            raise CacheMiss(f"{self.path}: no cached {tool}/{backend} result for {query!r} (replay mode never calls the backend)")
        return None

    def put(self, tool: str, backend: str, query: str, params: dict[str, Any], value: Any) -> None:
        """Store a successful result (an existing entry is replaced)."""
        if self.mode == "replay":
            return
        key = cache_key(tool, backend, query, params)
        row = (
            key,
            tool,
            backend,
            normalise_query(query),
            json.dumps(params, sort_keys=True),
            json.dumps(value, ensure_ascii=False),
            time.time(),
        )
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM results").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def import_reference_json(cache: ToolCache, path: str | os.PathLike, backend: str, params: dict[str, Any]) -> int:
    """Load the reference's JSON search cache ({query: formatted result}) into cache.

    ``backend`` and ``params`` must be what the search tool that will read these entries uses
    (see ``SearchTool.cache_params``), or lookups will miss. Returns the number of entries.
    """
    from etagent.records import read_json_file

    data = read_json_file(path)
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object mapping queries to result strings")
    for query, text in data.items():
        cache.put("search", backend, query, params, {"text": text, "documents": []})
    return len(data)

"""The agent's tools: the Python sandbox (``sandbox``), search backends and the search tool
(``search``), the persistent cache (``cache``) and the concurrent executor (``executor``).

A tool is an async callable ``tool(input: str) -> ToolOutput`` with a ``name``; it never raises
for anything its input does. ``ToolExecutor`` runs batches of calls and turns every outcome,
including timeouts and crashes, into a ``ToolCallRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolOutput:
    """A tool's answer: the text inserted in <result>, whether the call worked, and whether it
    came from the cache. ``failure`` is set when the tool itself failed (the retriever did not
    answer, the sandbox broke), as opposed to a call whose input failed (code that raised, an
    empty query): a short cause, counted by the stages to tell a degraded run from a bad model."""

    text: str
    ok: bool
    cached: bool = False
    details: dict = field(default_factory=dict)
    failure: str | None = None


def truncate(text: str, max_chars: int) -> str:
    """The reference's truncation: the first max_chars characters plus "..."."""
    return text if len(text) <= max_chars else text[:max_chars] + "..."

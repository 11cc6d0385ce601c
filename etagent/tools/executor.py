"""Run tool calls concurrently and turn every outcome into a ToolCallRecord.

:class:`ToolExecutor` holds the configured tools. ``run(calls)`` runs a batch at once, each tool
under its own concurrency limit and per-call timeout, and returns one record per call in order:
tool, input, output, ok, seconds, cached. Nothing raises into the caller: an unknown tool, a
timeout, a crashed backend or a replay-mode cache miss all become records with ``ok=False`` and
an output text the model can read.

Budgets are per trajectory, so the agent loop enforces them; it answers an over-budget call with
:func:`budget_exhausted_record` (an explicit message, never silence and never an unexecuted call
left for the model to hallucinate a result to).

:func:`build_executor` makes the tools from the ``tools`` config group (configs/tools/*.yaml);
:func:`check_tools` refuses, before a stage claims its output folder, what building them would.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any

from omegaconf import MISSING

from etagent.config import register_schema
from etagent.errors import SettingError
from etagent.protocol import ToolCall
from etagent.records import ToolCallRecord
from etagent.settings import FREE, Fraction, OneOf, PositiveFloat, PositiveInt, group
from etagent.tools import ToolOutput
from etagent.tools.sandbox import SandboxLimits

Tool = Callable[[str], Any]  # async (input) -> ToolOutput, with a .name


class ToolExecutor:
    """Concurrent execution of tool calls with per-tool limits."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        concurrency: dict[str, int] | None = None,
        timeout_s: dict[str, float] | None = None,
        on_close: Sequence[Callable] = (),
    ):
        self.tools = {tool.name: tool for tool in tools}
        self.concurrency = {name: (concurrency or {}).get(name, 32) for name in self.tools}
        self.timeout_s = {name: (timeout_s or {}).get(name, 120.0) for name in self.tools}
        self._on_close = list(on_close)
        self._semaphores: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Semaphore] = {}

    def _semaphore(self, name: str) -> asyncio.Semaphore:
        key = (asyncio.get_running_loop(), name)
        if key not in self._semaphores:
            self._semaphores[key] = asyncio.Semaphore(self.concurrency[name])
        return self._semaphores[key]

    async def run_one(self, call: ToolCall) -> ToolCallRecord:
        start = time.perf_counter()
        tool = self.tools.get(call.tool)
        if tool is None:
            output = ToolOutput(f"Tool execute failed: no tool named {call.tool!r} (available: {', '.join(self.tools)})", ok=False)
        else:
            try:
                async with self._semaphore(call.tool):
                    output = await asyncio.wait_for(tool(call.input), self.timeout_s[call.tool])
            except asyncio.TimeoutError:
                output = ToolOutput(
                    f"Tool execute failed: {call.tool} did not answer within {self.timeout_s[call.tool]:g} seconds",
                    ok=False,
                    failure="timeout",
                )
            except Exception as exc:  # a tool must never take the agent loop down with it
                output = ToolOutput(f"Tool execute failed: {type(exc).__name__}: {exc}", ok=False, failure=type(exc).__name__)
        return ToolCallRecord(
            tool=call.tool,
            input=call.input,
            output=output.text,
            ok=output.ok,
            seconds=time.perf_counter() - start,
            cached=output.cached,
            failure=output.failure,
        )

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolCallRecord]:
        """Run calls concurrently; one record per call, in the order given."""
        return list(await asyncio.gather(*(self.run_one(call) for call in calls)))

    def run_sync(self, calls: Sequence[ToolCall]) -> list[ToolCallRecord]:
        return asyncio.run(self.run(calls))

    def close(self) -> None:
        for close in self._on_close:
            close()

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# How every budget message begins (the agent loop recognises one in a prefix given as text).
BUDGET_MESSAGE_START = "Tool budget exhausted:"


def budget_exhausted_record(call: ToolCall, used: int, limit: int, scope: str) -> ToolCallRecord:
    """The record for a call over its trajectory's budget (scope: the tool name, or "tool")."""
    text = f"{BUDGET_MESSAGE_START} {used} {scope} calls made, the limit is {limit}. No more {scope} calls will run; answer with the information you have."
    return ToolCallRecord(tool=call.tool, input=call.input, output=text, ok=False, seconds=0.0, budget_exhausted=True)


@group
class PythonToolConfig:
    """``tools.python`` (configs/tools/_base.yaml documents each field)."""

    backend: Annotated[str, OneOf("sandbox", "sandbox_fusion")] = MISSING
    isolation: Annotated[str, OneOf("auto", "namespaces", "rlimits")] = MISSING
    interpreter: str | None = MISSING
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_output_chars: PositiveInt = MISSING
    concurrency: Annotated[PositiveInt, FREE] = MISSING
    preload: list[str] = MISSING
    sandbox_fusion_url: str | None = MISSING


@group
class LocalSearchConfig:
    """``tools.search.local``: the retriever service (where it runs may change on a resumed run)."""

    url: Annotated[str, FREE] = MISSING
    api: Annotated[str, OneOf("retrieve", "search")] = MISSING
    method: Annotated[str, OneOf("dense", "bm25", "hybrid")] | None = MISSING
    token_env: Annotated[str | None, FREE] = MISSING


@group
class WebSearchConfig:
    """``tools.search.web``: a web search API."""

    api_key_env: Annotated[str, FREE] = MISSING
    endpoint: str | None = MISSING
    max_results: PositiveInt = MISSING
    max_chars: PositiveInt = MISSING
    rate_per_s: PositiveFloat = MISSING
    zone: str = MISSING


@group
class SearchCacheConfig:
    """``tools.search.cache``: cached search results."""

    path: str | None = MISSING
    mode: Annotated[str, OneOf("readwrite", "replay")] = MISSING


@group
class SearchToolConfig:
    """``tools.search``."""

    backend: Annotated[str, OneOf("local", "serper", "brightdata", "bing")] = MISSING
    top_k: PositiveInt = MISSING
    max_doc_chars: PositiveInt = MISSING
    timeout_s: Annotated[PositiveFloat, FREE] = MISSING
    attempts: Annotated[PositiveInt, FREE] = MISSING
    concurrency: Annotated[PositiveInt, FREE] = MISSING
    local: LocalSearchConfig = field(default_factory=LocalSearchConfig)
    web: WebSearchConfig = field(default_factory=WebSearchConfig)
    # a cache changes where results come from, not what they are
    cache: Annotated[SearchCacheConfig, FREE] = field(default_factory=SearchCacheConfig)


@group
class ToolsConfig:
    """The ``tools`` config group (configs/tools/), the schema Hydra checks it against at load."""

    # how many failures a run tolerates, not what any call returns
    max_failure_share: Annotated[Fraction, FREE] = MISSING
    python: PythonToolConfig = field(default_factory=PythonToolConfig)
    search: SearchToolConfig = field(default_factory=SearchToolConfig)


register_schema("tools", ToolsConfig)


def check_tools(cfg: ToolsConfig) -> None:
    """What building the tools of a ``tools`` group would refuse, refused before a stage claims
    its output folder: a SandboxFusion backend without its URL, a web search whose API key is not
    in the environment, a cache replayed from a file that is not there, and a sandbox that cannot
    give the code the isolation asked for with the interpreter asked for (it is started and
    stopped: a tenth of a second). Nothing is written (a cache's file is made only by the run)."""
    py, se = cfg.python, cfg.search
    if py.backend == "sandbox_fusion" and not py.sandbox_fusion_url:
        raise SettingError(
            "tools.python.sandbox_fusion_url", "is null, and tools.python.backend=sandbox_fusion sends code to it: give its URL"
        )
    if se.backend != "local" and not os.environ.get(se.web.api_key_env):
        raise SettingError(
            "tools.search.web.api_key_env",
            f"is {se.web.api_key_env}, which is not set in the environment, and tools.search.backend={se.backend} needs the API key in it",
        )
    if se.cache.path and se.cache.mode == "replay" and not Path(se.cache.path).is_file():
        raise SettingError("tools.search.cache.path", f"no file at {se.cache.path!r}, and tools.search.cache.mode=replay only reads it")
    if py.backend == "sandbox":
        python_sandbox(py).close()


def python_sandbox(py: PythonToolConfig):
    """The python tool's sandbox, started: a sandbox that cannot give the code its isolation, or a
    Python that cannot import the standard library, refuses the run now (SandboxError, exit 2)
    instead of failing every call of it."""
    from etagent.tools.sandbox import PythonSandbox

    backend = PythonSandbox(
        python=py.interpreter, limits=py.limits, isolation=py.isolation, preload=tuple(py.preload), max_concurrency=py.concurrency
    )
    return backend.start()


def build_executor(cfg: ToolsConfig) -> ToolExecutor:
    """The tools described by a ``tools`` config group (configs/tools/)."""
    from etagent.tools.cache import ToolCache
    from etagent.tools.sandbox import PythonTool, SandboxFusion
    from etagent.tools.search import RetrieverClient, SearchTool, WebSearch

    py = cfg.python
    limits = py.limits
    if py.backend == "sandbox":
        backend = python_sandbox(py)  # started here, before any rollout
    elif py.backend == "sandbox_fusion":
        backend = SandboxFusion(py.sandbox_fusion_url, limits=limits)
    else:
        raise SettingError("tools.python.backend", f"must be sandbox or sandbox_fusion, got {py.backend!r}")
    python_tool = PythonTool(backend, max_output_chars=py.max_output_chars)

    se = cfg.search
    if se.backend == "local":
        search_backend = RetrieverClient(
            se.local.url,
            api=se.local.api,
            top_k=se.top_k,
            max_doc_chars=se.max_doc_chars,
            method=se.local.method,
            timeout_s=se.timeout_s,
            attempts=se.attempts,
            token=os.environ.get(se.local.token_env) if se.local.token_env else None,
        )
    elif se.backend in ("serper", "brightdata", "bing"):
        web = se.web
        search_backend = WebSearch(
            se.backend,
            api_key_env=web.api_key_env,
            endpoint=web.endpoint,
            max_results=web.max_results,
            max_chars=web.max_chars,
            rate_per_s=web.rate_per_s,
            timeout_s=se.timeout_s,
            attempts=se.attempts,
            zone=web.zone,
        )
    else:
        raise SettingError("tools.search.backend", f"must be local, serper, brightdata or bing, got {se.backend!r}")
    cache = ToolCache(se.cache.path, mode=se.cache.mode) if se.cache.path else None
    search_tool = SearchTool(search_backend, cache)
    return ToolExecutor(
        [python_tool, search_tool],
        concurrency={"python": py.concurrency, "search": se.concurrency},
        # the sandbox enforces the code's own timeout; this outer bound covers start-up too
        timeout_s={"python": py.limits.timeout_s + 30, "search": se.timeout_s * se.attempts + 10},
        on_close=[backend.close] + ([cache.close] if cache else []),
    )


def failure_counts(calls: Iterable[ToolCallRecord]) -> dict:
    """How many calls the tools themselves failed (``failure`` set), by tool and cause:
    ``{"calls": 223, "failed": 155, "share": 0.695, "by_tool": {"search": {"ConnectError": 150,
    "timeout": 5}}}``. Calls over their budget never reached a tool and are not counted."""
    counted = failed = 0
    by_tool: dict[str, Counter] = {}
    for call in calls:
        if call.budget_exhausted:
            continue
        counted += 1
        if call.failure:
            failed += 1
            by_tool.setdefault(call.tool, Counter())[call.failure] += 1
    return _failure_summary(counted, failed, by_tool)


def merge_failure_counts(parts: Sequence[dict]) -> dict:
    """The :func:`failure_counts` of several parts (ranks, workers) as one."""
    calls, failed = sum(p["calls"] for p in parts), sum(p["failed"] for p in parts)
    by_tool: dict[str, Counter] = {}
    for part in parts:
        for tool, causes in part["by_tool"].items():
            by_tool.setdefault(tool, Counter()).update(causes)
    return _failure_summary(calls, failed, by_tool)


def _failure_summary(calls: int, failed: int, by_tool: dict[str, Counter]) -> dict:
    return {
        "calls": calls,
        "failed": failed,
        "share": round(failed / calls, 4) if calls else 0.0,
        "by_tool": {tool: dict(causes.most_common()) for tool, causes in sorted(by_tool.items())},
    }


def describe_failures(counts: dict) -> str:
    """``155 of 223 tool calls failed (69.5%): search ConnectError 150, search timeout 5``."""
    causes = ", ".join(f"{tool} {cause} {n}" for tool, by_cause in counts["by_tool"].items() for cause, n in by_cause.items())
    return f"{counts['failed']} of {counts['calls']} tool calls failed ({100 * counts['share']:.1f}%)" + (f": {causes}" if causes else "")


def degraded(counts: dict, max_share: float) -> bool:
    """Whether the tools failed on more than ``max_share`` of the calls (``tools.max_failure_share``)."""
    return counts["share"] > max_share

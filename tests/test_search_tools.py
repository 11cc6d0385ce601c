"""Search clients against real HTTP servers on 127.0.0.1, the persistent cache (4 writer
processes, replay mode, the reference's JSON cache), the executor, and `etagent tool`."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import subprocess
import sys
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from etagent.net import ExternalCallError
from etagent.protocol import ToolCall
from etagent.tools import ToolOutput
from etagent.tools.cache import CacheMiss, ToolCache, import_reference_json
from etagent.tools.executor import ToolExecutor, budget_exhausted_record
from etagent.tools.search import BM25Index, RateLimiter, RetrieverClient, SearchTool, WebSearch, format_documents, format_snippets
from tests.support.servers import serve

CORPUS = [
    {"id": "0", "contents": '"Zorvak Telmin"\nZorvak Telmin is a cartographer. Zorvak Telmin was born in 1873 in Quellport.'},
    {"id": "1", "contents": '"Quellport"\nQuellport is a city on the river Amsel. Quellport was founded in 1204.'},
    {"id": "2", "contents": '"Amra Zel"\nAmra Zel is a weaver. Amra Zel was born in 1801 in Dornwick.'},
    {"id": "3", "contents": "x" * 3000},
]


def fixture_retriever():
    """A minimal retriever speaking both contracts over a BM25 index of CORPUS. It stands in for
    the retriever service (retriever/) in these client tests."""
    app = FastAPI()
    index = BM25Index([d["contents"] for d in CORPUS])
    seen = []

    def hits(queries, k):
        ids, scores = index.search(queries, k)
        return [[(CORPUS[i], s) for i, s in zip(row, row_scores)] for row, row_scores in zip(ids, scores)]

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.json()
        seen.append(("retrieve", body))
        return {"result": [[{"document": doc, "score": s} for doc, s in row] for row in hits(body["queries"], body["topk"])]}

    @app.post("/search")
    async def search(request: Request):
        body = await request.json()
        seen.append(("search", body))
        return [doc for doc, _ in hits([body["query"]], body["top_n"])[0]]

    @app.post("/batch_search")
    async def batch_search(request: Request):
        body = await request.json()
        seen.append(("batch_search", body))
        return [[doc for doc, _ in row] for row in hits(body["query"], body["top_n"])]

    return app, seen


@pytest.fixture(scope="module")
def retriever():
    app, seen = fixture_retriever()
    with serve(app) as url:
        yield url, seen


def test_format_documents_and_snippets():
    assert format_documents(["a", "b" * 10], max_doc_chars=4) == "a\n\nbbbb..."
    assert format_snippets(["one", "two", "one", " "], max_results=5, max_chars=2) == "Page 1: on\nPage 2: tw"
    assert format_snippets([], 5, 10) == "No search results found."


@pytest.mark.parametrize("api", ["retrieve", "search"])
def test_retriever_client_speaks_both_contracts(retriever, api):
    url, seen = retriever
    client = RetrieverClient(url, api=api, top_k=2, max_doc_chars=1200)

    async def main():
        single = await client.search("Zorvak Telmin")
        many = await client.documents(["Quellport", "Amra Zel"])
        await client.aclose()
        return single, many

    single, many = asyncio.run(main())
    assert single.documents[0]["id"] == "0" and single.text.startswith('"Zorvak Telmin"\nZorvak Telmin is a cartographer.')
    assert [docs[0]["id"] for docs in many] == ["1", "2"]
    routes = [route for route, _ in seen[-2:]]
    assert routes == (["retrieve", "retrieve"] if api == "retrieve" else ["search", "batch_search"])
    if api == "retrieve":
        assert seen[-1][1] == {"queries": ["Quellport", "Amra Zel"], "topk": 2, "return_scores": True}
    else:
        assert seen[-1][1] == {"query": ["Quellport", "Amra Zel"], "top_n": 2}


def test_retriever_documents_are_truncated_like_the_reference(retriever):
    url, _ = retriever
    client = RetrieverClient(url, top_k=4, max_doc_chars=1200)
    result = asyncio.run(client.search("x" * 3000 + " Zorvak"))
    assert any(len(piece) == 1203 and piece.endswith("...") for piece in result.text.split("\n\n"))


def test_unreachable_retriever_is_an_error_result():
    from tests.support.servers import free_port

    tool = SearchTool(RetrieverClient(f"http://127.0.0.1:{free_port()}", attempts=2, timeout_s=1))
    out = asyncio.run(tool("anything"))
    assert not out.ok and out.text.startswith("Search failed:")


# --- web search ---------------------------------------------------------------------------------


def fake_web_api():
    """Local servers speaking Serper's, Bright Data's and Bing's response formats. Paid APIs cannot
    be called in tests; these check our requests and our parsing of their documented formats."""
    app = FastAPI()
    log = []
    state = {"fail_next": 0}

    @app.post("/serper")
    async def serper(request: Request):
        body = await request.json()
        log.append(("serper", dict(request.headers), body))
        if state["fail_next"]:
            state["fail_next"] -= 1
            return JSONResponse({"error": "busy"}, status_code=503)
        return {
            "organic": [
                {"title": "T1", "link": "https://a", "snippet": f"About {body['q']}."},
                {"title": "T2", "link": "https://b", "snippet": f"About {body['q']}."},
                {"title": "T3", "link": "https://c", "snippet": "Other."},
            ]
        }

    @app.post("/brightdata")
    async def brightdata(request: Request):
        body = await request.json()
        log.append(("brightdata", dict(request.headers), body))
        return {"organic": [{"title": "B1", "link": "https://b1", "description": "Bing says hi."}]}

    @app.get("/bing")
    async def bing(request: Request):
        log.append(("bing", dict(request.headers), dict(request.query_params)))
        return {"webPages": {"value": [{"name": "N", "url": "https://n", "snippet": "Bing API snippet."}]}}

    @app.post("/forbidden")
    async def forbidden():
        return JSONResponse({"error": "bad key"}, status_code=401)

    return app, log, state


@pytest.fixture(scope="module")
def web():
    app, log, state = fake_web_api()
    with serve(app) as url:
        yield url, log, state


def test_web_backends_send_the_key_and_parse_results(web, monkeypatch, caplog):
    url, log, state = web
    monkeypatch.setenv("TEST_SEARCH_KEY", "key-do-not-leak-42")
    caplog.set_level(logging.DEBUG)

    async def main():
        serper = WebSearch("serper", api_key_env="TEST_SEARCH_KEY", endpoint=f"{url}/serper", max_results=5)
        bright = WebSearch("brightdata", api_key_env="TEST_SEARCH_KEY", endpoint=f"{url}/brightdata", zone="z1")
        bing = WebSearch("bing", api_key_env="TEST_SEARCH_KEY", endpoint=f"{url}/bing")
        return await serper.search("Quellport"), await bright.search('the "river"'), await bing.search("巴黎"), repr(serper)

    serper, bright, bing, shown = asyncio.run(main())
    assert serper.text == "Page 1: About Quellport.\nPage 2: Other."  # duplicates dropped
    assert bright.text == "Page 1: Bing says hi." and bing.text == "Page 1: Bing API snippet."
    (_, h1, b1), (_, h2, b2), (_, h3, p3) = log[-3:]
    assert h1["x-api-key"] == "key-do-not-leak-42" and b1["q"] == "Quellport" and b1["gl"] == "us"
    assert (
        h2["authorization"] == "Bearer key-do-not-leak-42" and b2["zone"] == "z1" and "brd_json=1" in b2["url"] and "%22" not in b2["url"]
    )
    assert h3["ocp-apim-subscription-key"] == "key-do-not-leak-42" and p3["mkt"] == "zh-CN"
    assert "key-do-not-leak" not in shown and "key-do-not-leak" not in caplog.text


def test_web_search_retries_transient_errors_and_fails_cleanly(web, monkeypatch):
    url, log, state = web
    monkeypatch.setenv("TEST_SEARCH_KEY", "k")
    state["fail_next"] = 2
    search = WebSearch("serper", api_key_env="TEST_SEARCH_KEY", endpoint=f"{url}/serper", attempts=3)
    before = len(log)
    assert asyncio.run(search.search("q")).text.startswith("Page 1")
    assert len(log) - before == 3  # two 503s, then success
    bad = WebSearch("serper", api_key_env="TEST_SEARCH_KEY", endpoint=f"{url}/forbidden", attempts=3)
    with pytest.raises(ExternalCallError, match="HTTP 401"):
        asyncio.run(bad.search("q"))  # a 4xx is not retried
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR"):
        WebSearch("serper", api_key_env="NO_SUCH_KEY_VAR")


def test_rate_limiter_spaces_requests():
    async def main():
        limiter = RateLimiter(rate=20, burst=1)
        start = time.monotonic()
        for _ in range(11):
            await limiter.acquire()
        return time.monotonic() - start

    assert asyncio.run(main()) >= 0.45  # 10 intervals of 1/20 s after the first


# --- the cache ----------------------------------------------------------------------------------


def _writer(path, worker, n):
    cache = ToolCache(path)
    for i in range(n):
        cache.put("search", "web", f"Query {i % 50}", {"k": 4}, {"text": f"worker {worker} item {i}"})
        assert cache.get("search", "web", f"query {i % 50}", {"k": 4}) is not None
    cache.close()


def _open_and_write(path, barrier):
    barrier.wait()  # every process opens the new file at the same moment
    cache = ToolCache(path)
    cache.put("search", "web", "query", {"k": 4}, {"text": "result"})
    cache.close()


def test_a_new_cache_opened_by_eight_processes_at_once(tmp_path):
    """Opening switches the file to WAL, which SQLite refuses at once (no busy wait) while another
    process is doing the same; without the retry about 1 process in 16 failed, so most of these 24 trials would fail."""
    context = multiprocessing.get_context("fork")
    for trial in range(24):
        barrier = context.Barrier(8)
        path = tmp_path / f"cache{trial}.sqlite"
        workers = [context.Process(target=_open_and_write, args=(path, barrier)) for _ in range(8)]
        for p in workers:
            p.start()
        for p in workers:
            p.join(timeout=60)
        assert [p.exitcode for p in workers] == [0] * 8, f"trial {trial}"


def test_cache_with_four_processes_writing_at_once(tmp_path):
    path = tmp_path / "cache.sqlite"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(path, w, 200)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]
    cache = ToolCache(path)
    assert len(cache) == 50
    assert cache.get("search", "web", "  QUERY   7 ", {"k": 4})["text"].startswith("worker ")
    assert cache.get("search", "web", "query 7", {"k": 5}) is None  # parameters are part of the key
    assert cache.get("search", "other", "query 7", {"k": 4}) is None


class CountingBackend:
    name, params = "counting", {"k": 1}

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    async def search(self, query):
        from etagent.tools.search import SearchResult

        self.calls += 1
        if self.fail:
            raise ExternalCallError("service down")
        return SearchResult(f"result for {query}", [])


def test_search_tool_caches_successes_only_and_replays(tmp_path):
    path = tmp_path / "c.sqlite"
    failing = CountingBackend(fail=True)
    tool = SearchTool(failing, ToolCache(path))
    assert not asyncio.run(tool("q")).ok and not asyncio.run(tool("q")).ok
    assert failing.calls == 2  # a failure is not cached: tried again

    backend = CountingBackend()
    tool = SearchTool(backend, ToolCache(path))
    first, second = asyncio.run(tool("Quellport")), asyncio.run(tool("quellport"))
    assert first.ok and not first.cached and second.cached and second.text == "result for Quellport"
    assert backend.calls == 1

    replay_backend = CountingBackend()
    replay = SearchTool(replay_backend, ToolCache(path, mode="replay"))
    assert asyncio.run(replay("QUELLPORT")).cached
    with pytest.raises(CacheMiss):
        asyncio.run(replay("never seen"))
    assert replay_backend.calls == 0  # replay never touches the backend
    executor = ToolExecutor([replay])
    [record] = executor.run_sync([ToolCall("search", "never seen")])
    assert not record.ok and "CacheMiss" in record.output and "replay mode" in record.output


def test_import_reference_json_cache(tmp_path):
    ref = tmp_path / "search_cache.json"
    ref.write_text(json.dumps({"capital of france": "Page 1: Paris is the capital."}))
    cache = ToolCache(tmp_path / "c.sqlite")
    backend = CountingBackend()
    assert import_reference_json(cache, ref, backend.name, backend.params) == 1
    out = asyncio.run(SearchTool(backend, cache)("Capital of France"))
    assert out.cached and out.text == "Page 1: Paris is the capital." and backend.calls == 0
    ref.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        import_reference_json(cache, ref, "b", {})


# --- the executor -------------------------------------------------------------------------------


class FakeTool:
    """A scripted tool for testing the executor's control flow (limits, timeouts, errors)."""

    def __init__(self, name, delay=0.0, raises=None):
        self.name, self.delay, self.raises = name, delay, raises
        self.active = self.peak = 0

    async def __call__(self, text):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            if self.raises:
                raise self.raises
            return ToolOutput(f"{self.name}:{text}", ok=True)
        finally:
            self.active -= 1


def test_executor_never_raises_and_keeps_order():
    slow, boom, fine = FakeTool("slow", delay=5), FakeTool("boom", raises=RuntimeError("kaput")), FakeTool("fine", delay=0.01)
    executor = ToolExecutor([slow, boom, fine], timeout_s={"slow": 0.2})
    calls = [ToolCall("fine", "a"), ToolCall("slow", "b"), ToolCall("boom", "c"), ToolCall("nope", "d"), ToolCall("fine", "e")]
    start = time.monotonic()
    records = executor.run_sync(calls)
    assert time.monotonic() - start < 2
    assert [r.input for r in records] == ["a", "b", "c", "d", "e"]
    assert records[0].ok and records[0].output == "fine:a" and records[4].output == "fine:e"
    assert not records[1].ok and "did not answer within 0.2 seconds" in records[1].output
    assert not records[2].ok and records[2].output == "Tool execute failed: RuntimeError: kaput"
    assert not records[3].ok and "no tool named 'nope'" in records[3].output
    assert all(r.seconds >= 0 for r in records)


def test_executor_per_tool_concurrency_limit():
    tool = FakeTool("t", delay=0.05)
    executor = ToolExecutor([tool], concurrency={"t": 3})
    records = executor.run_sync([ToolCall("t", str(i)) for i in range(12)])
    assert all(r.ok for r in records) and tool.peak == 3


def test_budget_exhausted_record_is_explicit():
    record = budget_exhausted_record(ToolCall("search", "q"), used=6, limit=6, scope="search")
    assert record.budget_exhausted and not record.ok
    assert record.output.startswith("Tool budget exhausted: 6 search calls made, the limit is 6.")


def test_python_and_search_through_one_executor(retriever):
    from etagent.config import load_settings
    from etagent.tools.executor import build_executor

    url, _ = retriever
    cfg = load_settings("tools", "tiny", [f"tools.search.local.url={url}", "tools.python.limits.timeout_s=5"])
    with build_executor(cfg) as executor:
        records = executor.run_sync([ToolCall("python", "print(6 * 7)"), ToolCall("search", "Zorvak Telmin"), ToolCall("python", "")])
    assert records[0].output == "42" and records[0].ok
    assert records[1].ok and "born in 1873" in records[1].output
    assert not records[2].ok and "empty" in records[2].output


# --- the command line ---------------------------------------------------------------------------


def test_etagent_tool_cli(retriever, tmp_path):
    url, _ = retriever

    def run(*args, stdin=None):
        return subprocess.run(
            [sys.executable, "-m", "etagent.launcher", "tool", *args], input=stdin, capture_output=True, text=True, timeout=120
        )  # noqa: E731

    out = run("python", stdin="x = 6\nx * 7\n")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert line["output"] == "42" and line["ok"] and line["tool"] == "python" and "isolation" in line
    code_file = tmp_path / "code.py"
    code_file.write_text("1/0")
    out = run("python", str(code_file), "tools.python.limits.timeout_s=5")
    assert out.returncode == 1 and "ZeroDivisionError" in json.loads(out.stdout)["output"]
    out = run("search", "--query", "Quellport", f"tools.search.local.url={url}")
    assert out.returncode == 0 and "founded in 1204" in json.loads(out.stdout)["output"]


def test_retriever_client_works_across_event_loops(retriever):
    """Stages run one asyncio loop per batch: the client must not reuse a pool bound to a closed loop."""
    url, _ = retriever
    tool = SearchTool(RetrieverClient(url, top_k=1))
    for _ in range(3):
        out = asyncio.run(tool("Quellport"))
        assert out.ok and "Quellport" in out.text

"""The retrieval service: FastAPI over an index built by etagent.retriever.build.

    python -m etagent.retriever.server [--preset tiny|paper] [overrides]     # or: etagent retriever serve
    python -m etagent.retriever.server index_dir=runs/toy/index serve.port=8000

Routes (both contracts users already have clients for):

- ``POST /retrieve`` (Search-R1): ``{queries: [...], topk, return_scores, method?}`` ->
  ``{result: [[{document: {id, contents, title}, score}, ...], ...]}`` (without
  ``return_scores``, each hit is the document itself; ``title`` where the corpus has one);
- ``POST /search`` (the paper's): ``{query, top_n, return_score}`` -> ``[{id, contents}, ...]``,
  or ``[[docs], [scores]]`` with ``return_score``;
- ``POST /batch_search``: ``{query: [...], top_n, return_score}`` -> ``[[docs], ...]`` (or
  ``[[[docs]...], [[scores]...]]``);
- ``GET /health``: document count, index type, encoder, methods, uptime, requests served.

``method`` is ``dense`` (faiss over the encoder's vectors), ``bm25`` or ``hybrid`` (reciprocal
rank fusion of both, k=60); the default is ``serve.default_method``.

Concurrency: a request's queries are worked on in chunks of ``serve.max_batch``, one chunk at a
time: the chunk is queued for the micro-batcher (which coalesces the queries waiting from all
requests into batches of up to ``serve.max_batch``, waiting at most ``serve.max_wait_ms`` for
company) and encoded and searched in one worker thread, and the request's next chunk is queued only
once its last one is answered. So batches from different requests interleave: a query arriving
while a request of thousands is worked on waits for the batch in progress and at most one chunk of
each other request, not for the whole of them. BM25 runs chunk by chunk too, in the default thread
pool. Nothing blocks the event loop. Each response carries its chunks' summed timings in
``X-Encode-Ms``, ``X-Search-Ms`` and ``Server-Timing``.

Clients that leave: between chunks the request checks whether its client is still connected; if
not, the rest of its queries are abandoned (no more encoding or searching for them), one line is
logged and the route answers 499 to nobody. The chunk in progress when the client left (and a
request of a single chunk) is finished, not interrupted.

Limits: what one request may cost is bounded by ``serve.max_queries`` (queries per request: the
searches, document lookups and size of the answer) and ``serve.max_query_chars`` (the characters
of all its queries together: what is tokenized and encoded), with ``serve.max_topk`` hits per
query. ``serve.max_body_bytes`` only bounds what is read before the body is parsed; it is set above
anything the other limits admit. A request over a limit gets HTTP 422 naming the limit, its key
and the request's value; so do other malformed requests (a missing field, an unknown method).

Safety: binds 127.0.0.1 unless ``serve.host`` says otherwise; with ``serve.token_env`` set, POST
routes need ``Authorization: Bearer <token>``. What real training runs send is answered as
Search-R1's server answers it: an empty list of queries gets an empty result, and an empty or
blank query gets no hits while the others in its request are searched. Nothing is unpickled and
nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from omegaconf import OmegaConf
from pydantic import AfterValidator, BaseModel, ConfigDict

from etagent.errors import MissingInput, SettingError, UserError, exit_on_user_error
from etagent.retriever.config import EncoderSettings, ServeConfig
from etagent.retriever.encoder import check_encoder

log = logging.getLogger("etagent.retriever.server")
RRF_K = 60
# seconds an idle keep-alive connection stays open: longer than clients keep one for reuse (see main)
KEEP_ALIVE_S = 75


class Index:
    """The loaded index: faiss, BM25 (if built), the document store and the encoder."""

    def __init__(self, index_dir: Path, serve: ServeConfig, encoder: EncoderSettings):
        from etagent.retriever.build import import_faiss

        faiss = import_faiss()

        self.dir = Path(index_dir)
        if not (self.dir / "index.faiss").exists():
            raise MissingInput(f"{self.dir}: no index.faiss (build it first: python -m etagent.retriever.build index_dir={self.dir})")
        self.faiss = faiss.read_index(str(self.dir / "index.faiss"))
        self.index_type = type(self.faiss).__name__
        if isinstance(self.faiss, faiss.IndexIVF):
            self.faiss.nprobe = serve.nprobe
        if isinstance(self.faiss, faiss.IndexHNSW):
            self.faiss.hnsw.efSearch = serve.ef_search
        if serve.faiss_gpu and faiss.get_num_gpus() > 0:
            options = faiss.GpuMultipleClonerOptions()
            options.useFloat16, options.shard = True, True
            self.faiss = faiss.index_cpu_to_all_gpus(self.faiss, co=options)
        self.bm25 = None
        if (self.dir / "bm25").exists():
            from etagent.tools.search import BM25Index

            self.bm25 = BM25Index.load(self.dir / "bm25")
        from etagent.retriever.encoder import Encoder

        self.encoder = Encoder(encoder)
        self.size = self.faiss.ntotal
        self._db_path = self.dir / "docs.sqlite"
        self._local = threading.local()

    def methods(self) -> list[str]:
        return ["dense", "bm25", "hybrid"] if self.bm25 is not None else ["dense"]

    def documents(self, positions: list[int]) -> dict[int, dict]:
        """{position: {id, contents[, title]}} from the document store (one connection per thread);
        ``title`` where the corpus had one, as Search-R1's hits carry it."""
        if not hasattr(self._local, "db"):
            self._local.db = sqlite3.connect(f"file:{self._db_path}?mode=ro", uri=True, check_same_thread=False)
        unique = sorted(set(positions))
        rows = self._local.db.execute(
            f"SELECT position, id, title, contents FROM docs WHERE position IN ({','.join('?' * len(unique))})", unique
        ).fetchall()
        return {
            position: {"id": doc_id, "contents": contents} | ({"title": title} if title is not None else {})
            for position, doc_id, title, contents in rows
        }

    def dense(self, queries: list[str], k: int) -> tuple[list[list[tuple[int, float]]], float, float]:
        """Hits per query, plus encode and search milliseconds."""
        t0 = time.perf_counter()
        vectors = self.encoder.encode_queries(queries)
        t1 = time.perf_counter()
        scores, ids = self.faiss.search(vectors, min(k, self.size))
        t2 = time.perf_counter()
        hits = [[(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0] for row_ids, row_scores in zip(ids, scores)]
        return hits, (t1 - t0) * 1000, (t2 - t1) * 1000

    def with_documents(self, hits: list[list[tuple[int, float]]]) -> list[list[tuple[dict, float]]]:
        """Hits with their documents, fetched in one query."""
        docs = self.documents([p for row in hits for p, _ in row]) if any(hits) else {}
        return [[(docs[p], s) for p, s in row] for row in hits]

    def lexical(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        ids, scores = self.bm25.search(queries, k)
        return [list(zip(row_ids, row_scores)) for row_ids, row_scores in zip(ids, scores)]


def reciprocal_rank_fusion(rankings: list[list[tuple[dict, float]]], k: int) -> list[tuple[dict, float]]:
    """Fuse ranked (document, score) lists: score(d) = sum over lists of 1 / (RRF_K + rank of d),
    best first (ties by document id)."""
    fused: dict[str, float] = {}
    documents: dict[str, dict] = {}
    for ranking in rankings:
        for rank, (doc, _) in enumerate(ranking, start=1):
            fused[doc["id"]] = fused.get(doc["id"], 0.0) + 1.0 / (RRF_K + rank)
            documents[doc["id"]] = doc
    best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
    return [(documents[doc_id], score) for doc_id, score in best]


@dataclass
class _Pending:
    query: str
    k: int
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)


class MicroBatcher:
    """Coalesces dense-search queries from concurrent requests into batches.

    Requests put their queries in a queue; one task takes everything waiting (up to
    ``max_batch``, then waiting at most ``max_wait_ms`` for more), runs encode, search and the
    document lookup for the whole batch in a single worker thread, and resolves each query's
    future with its hits and the batch's timings. While a batch runs the next one gathers, so
    under load batches grow by themselves and a lone request is not delayed. The queue is first
    come, first served: fairness between requests comes from each request queueing one chunk at a
    time (``create_app``), so that a large request never holds the queue.
    """

    def __init__(self, index: Index, max_batch: int, max_wait_ms: float):
        self.index, self.max_batch, self.max_wait = index, max_batch, max_wait_ms / 1000
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def search(self, queries: list[str], k: int) -> list[tuple[list[tuple[int, float]], dict]]:
        loop = asyncio.get_running_loop()
        pending = [_Pending(q, k, loop.create_future()) for q in queries]
        for p in pending:
            self.queue.put_nowait(p)
        return list(await asyncio.gather(*(p.future for p in pending)))

    def _encode_and_search(self, queries: list[str], k: int):
        # a query asked twice in one batch (the rollouts of one prompt often search alike) is
        # encoded and searched once: the same string gives the same vector and the same hits
        unique = list(dict.fromkeys(queries))
        hits, encode_ms, search_ms = self.index.dense(unique, k)
        found = dict(zip(unique, self.index.with_documents(hits)))
        return [found[q] for q in queries], encode_ms, search_ms

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            # everything already waiting joins at once; then wait up to max_wait for more
            while len(batch) < self.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            started = time.perf_counter()
            k = max(p.k for p in batch)
            try:
                hits, encode_ms, search_ms = await loop.run_in_executor(self.worker, self._encode_and_search, [p.query for p in batch], k)
            except Exception:  # a query the encoder or index cannot take: find it, and fail it alone
                await self._one_by_one(batch, started)
                continue
            for p, row in zip(batch, hits):
                self._answer(p, row, encode_ms, search_ms, started, len(batch))

    @staticmethod
    def _answer(p: _Pending, row, encode_ms: float, search_ms: float, started: float, size: int) -> None:
        timing = {"encode_ms": encode_ms, "search_ms": search_ms, "queue_ms": (started - p.queued_at) * 1000, "batch": size}
        if not p.future.done():  # a request whose client went away may have been cancelled
            p.future.set_result((row[: p.k], timing))

    async def _one_by_one(self, batch: list[_Pending], started: float) -> None:
        """A batch that failed, again query by query: each query's request gets its own answer or
        its own error, so one bad query never fails the requests batched beside it. (Only on
        failure: the batch is the fast path.)"""
        loop = asyncio.get_running_loop()
        for p in batch:
            try:
                [row], encode_ms, search_ms = await loop.run_in_executor(self.worker, self._encode_and_search, [p.query], p.k)
            except Exception as exc:
                log.warning("a query failed on its own (%s: %s); its request alone gets the error", type(exc).__name__, exc)
                if not p.future.done():
                    p.future.set_exception(exc)
                continue
            self._answer(p, row, encode_ms, search_ms, started, 1)


# ---------------------------------------------------------------------------------------------
# Requests


def _encodable(text: str) -> str:
    """A query that is text: a lone surrogate (JSON's ``"\\ud800"``) is not, and no encoder takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid text: a lone surrogate at character {exc.start}") from None
    return text


Query = Annotated[str, AfterValidator(_encodable)]


class StrictRequest(BaseModel):
    """Request fields as their types say and nothing else: ``topk`` is an integer, not ``"3"``
    or ``true`` (pydantic's strict mode). Fields a client adds are ignored, as before."""

    model_config = ConfigDict(strict=True)


class RetrieveRequest(StrictRequest):
    queries: list[Query]
    topk: int = 3
    return_scores: bool = False
    method: Literal["dense", "bm25", "hybrid"] | None = None


class SearchRequest(StrictRequest):
    query: Query
    top_n: int = 10
    return_score: bool = False


class BatchSearchRequest(StrictRequest):
    query: list[Query]
    top_n: int = 10
    return_score: bool = False


class ClientLeft(Exception):
    """The client disconnected while its request was worked on; the message says how far it got."""


class Guard:
    """ASGI middleware in front of every route: checks the bearer token of POST requests (401),
    refuses a body over max_bytes, chunked or not, before the app reads it (422), and counts
    requests. (Plain ASGI: FastAPI's decorator middleware costs milliseconds per request.)"""

    def __init__(self, app, max_bytes: int, token: str | None, state: dict):
        self.app, self.max_bytes, self.token, self.state = app, max_bytes, token, state

    async def _refuse(self, send, status: int, detail: str) -> None:
        body = JSONResponse({"detail": detail}, status_code=status)
        await send({"type": "http.response.start", "status": status, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state["requests"] += 1
        headers = dict(scope["headers"])
        if self.token and scope["method"] == "POST" and headers.get(b"authorization", b"") != f"Bearer {self.token}".encode():
            return await self._refuse(send, 401, "missing or wrong bearer token")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(
                send, 422, f"request body of {length.decode()} bytes is over the limit of {self.max_bytes} (serve.max_body_bytes)"
            )
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away before sending its request
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(
                    send,
                    422,
                    f"request body of more than {self.max_bytes} bytes is over the limit of {self.max_bytes} (serve.max_body_bytes)",
                )
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def check_method(index: Index, serve: ServeConfig, index_dir: Path) -> None:
    if serve.default_method not in index.methods():
        raise SettingError(
            "serve.default_method", f"is {serve.default_method}, and {index_dir} has no BM25 index (build.bm25=true builds one)"
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts: a port in use (or an address this
    machine does not have) is a one-line error, not a server that starts and dies."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} (serve.host, serve.port): {exc.strerror}") from None
    sock.listen(2048)
    return sock


def check_limits(queries: list[str], k: int, serve: ServeConfig) -> None:
    """A request over the service's limits is refused with 422, naming the limit's setting."""
    if len(queries) > serve.max_queries:
        raise HTTPException(422, f"{len(queries)} queries in one request; the limit is {serve.max_queries} (serve.max_queries)")
    chars = sum(len(q) for q in queries)
    if chars > serve.max_query_chars:
        raise HTTPException(
            422, f"{chars} characters of queries in one request; the limit is {serve.max_query_chars} (serve.max_query_chars)"
        )
    if not 1 <= k <= serve.max_topk:
        raise HTTPException(422, f"topk must be between 1 and {serve.max_topk} (serve.max_topk), got {k}")


async def run_queries(
    state: dict, serve: ServeConfig, http: Request, queries: list[str], k: int, method: str
) -> tuple[list[list[tuple[dict, float]]], dict]:
    """Hits per query, searched ``serve.max_batch`` at a time, with the chunks' summed timings.
    An empty or blank query has no hits (a model wrote ``<search></search>``); the others are
    searched as usual. Raises ClientLeft when the client disconnects before the last chunk."""
    index: Index = state["index"]
    if method not in index.methods():
        raise HTTPException(422, f"method {method!r} is not available (this index has: {', '.join(index.methods())})")
    asked = [i for i, q in enumerate(queries) if q.strip()]
    rows: list[list[tuple[dict, float]]] = [[] for _ in queries]
    timing = {"encode_ms": 0.0, "search_ms": 0.0}
    for start in range(0, len(asked), serve.max_batch):
        # Starlette's check is a receive() cancelled before it can wait: it sees only a disconnect
        # uvicorn has already recorded, never blocks, and costs microseconds per chunk
        if start and await http.is_disconnected():
            raise ClientLeft(f"{start} of {len(asked)} queries searched, {len(asked) - start} abandoned")
        chunk = asked[start : start + serve.max_batch]
        found, chunk_timing = await search_non_blank(state, [queries[i] for i in chunk], k, method)
        for i, row in zip(chunk, found):
            rows[i] = row
        for key in timing:
            timing[key] += chunk_timing[key]
    return rows, timing


async def search_non_blank(state: dict, queries: list[str], k: int, method: str) -> tuple[list[list[tuple[dict, float]]], dict]:
    """Hits of non-blank queries by ``method``: dense through the micro-batcher, bm25 in a thread,
    hybrid as the reciprocal-rank fusion of both (each 50 deep at least)."""
    index: Index = state["index"]
    timing = {"encode_ms": 0.0, "search_ms": 0.0}
    if method in ("dense", "hybrid"):
        depth = k if method == "dense" else max(k, 50)
        answers = await state["batcher"].search(queries, depth)
        dense = [hits for hits, _ in answers]
        timing = {key: max(t[key] for _, t in answers) for key in ("encode_ms", "search_ms")}
    if method == "dense":
        return dense, timing
    depth = k if method == "bm25" else max(k, 50)
    t0 = time.perf_counter()
    lexical = await asyncio.to_thread(lambda: index.with_documents(index.lexical(queries, depth)))
    timing["search_ms"] += (time.perf_counter() - t0) * 1000
    if method == "bm25":
        return lexical, timing
    return [reciprocal_rank_fusion([d, b], k) for d, b in zip(dense, lexical)], timing


def timed_response(body, timing: dict) -> JSONResponse:
    """``body`` as JSON with the encode and search times in headers (and as Server-Timing)."""
    headers = {
        "X-Encode-Ms": f"{timing['encode_ms']:.2f}",
        "X-Search-Ms": f"{timing['search_ms']:.2f}",
        "Server-Timing": f"encode;dur={timing['encode_ms']:.2f}, search;dur={timing['search_ms']:.2f}",
    }
    return JSONResponse(body, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(http: Request, exc: RequestValidationError) -> Response:
        # the reasons without the values: a value that is not text (a lone surrogate) cannot be
        # written back into a JSON answer, and the client has it anyway
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(ClientLeft)
    async def client_left(http: Request, exc: ClientLeft) -> Response:
        client = f"{http.client.host}:{http.client.port}" if http.client else "?"
        log.info("client %s left %s before its answer: %s", client, http.url.path, exc)
        # 499 (nginx's "client closed request"): nobody reads it, but uvicorn wants a response
        return Response(status_code=499)


def create_app(index_dir: Path, serve: ServeConfig, encoder: EncoderSettings, index: Index | None = None) -> FastAPI:
    """The app over the index in ``index_dir``, loaded at start-up unless given."""
    token = os.environ.get(serve.token_env) if serve.token_env else None
    if serve.token_env and not token:
        raise SettingError("serve.token_env", f"is {serve.token_env}, and that environment variable is empty")
    state = {"index": index, "batcher": None, "started": time.time(), "requests": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state["index"] is None:
            state["index"] = await asyncio.to_thread(Index, index_dir, serve, encoder)
        check_method(state["index"], serve, index_dir)
        state["batcher"] = MicroBatcher(state["index"], serve.max_batch, serve.max_wait_ms)
        state["batcher"].start()
        log.info(
            "serving %d documents (%s, %s) on %s:%s",
            state["index"].size,
            state["index"].index_type,
            state["index"].encoder.describe(),
            serve.host,
            serve.port,
        )
        yield
        await state["batcher"].stop()

    app = FastAPI(title="etagent retriever", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(Guard, max_bytes=serve.max_body_bytes, token=token, state=state)
    add_error_handlers(app)

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest, http: Request):
        check_limits(request.queries, request.topk, serve)
        rows, timing = await run_queries(state, serve, http, request.queries, request.topk, request.method or serve.default_method)
        if request.return_scores:
            result = [[{"document": doc, "score": score} for doc, score in row] for row in rows]
        else:
            result = [[doc for doc, _ in row] for row in rows]
        return timed_response({"result": result}, timing)

    @app.post("/search")
    async def search(request: SearchRequest, http: Request):
        check_limits([request.query], request.top_n, serve)
        [row], timing = await run_queries(state, serve, http, [request.query], request.top_n, serve.default_method)
        docs = [doc for doc, _ in row]
        return timed_response([docs, [s for _, s in row]] if request.return_score else docs, timing)

    @app.post("/batch_search")
    async def batch_search(request: BatchSearchRequest, http: Request):
        check_limits(request.query, request.top_n, serve)
        rows, timing = await run_queries(state, serve, http, request.query, request.top_n, serve.default_method)
        docs = [[doc for doc, _ in row] for row in rows]
        return timed_response([docs, [[s for _, s in row] for row in rows]] if request.return_score else docs, timing)

    @app.get("/health")
    async def health():
        index = state["index"]
        return {
            "status": "ok" if index is not None else "loading",
            "documents": index.size if index else 0,
            "index": index.index_type if index else None,
            "encoder": index.encoder.describe() if index else None,
            "methods": index.methods() if index else [],
            "default_method": serve.default_method,
            "uptime_s": round(time.time() - state["started"], 1),
            "requests": state["requests"],
        }

    return app


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    [cfg] = stage_configs("retriever", argv, prog="python -m etagent.retriever.server", doc=__doc__, resumes=False)
    log.info("config:\n%s", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    settings = cfg
    serve = settings.serve
    if serve.torch_threads:
        import torch

        torch.set_num_threads(serve.torch_threads)
    # everything that can refuse to start does so here, before uvicorn: exit 2 with one line
    index_dir = Path(settings.index_dir)
    if not index_dir.is_dir():
        raise SettingError(
            "index_dir",
            f"{str(index_dir)!r} is not a folder (build the index first: python -m etagent.retriever.build index_dir={index_dir})",
        )
    check_encoder(settings.encoder)
    sock = bind(serve.host, serve.port)
    index = Index(index_dir, serve, settings.encoder)
    check_method(index, serve, index_dir)
    app = create_app(index_dir, serve, settings.encoder, index=index)
    # An idle connection is kept well past the 5 s for which HTTP clients (httpx's keepalive_expiry,
    # our RetrieverClient's) keep one for reuse. With uvicorn's own 5 s the server could close a
    # connection just as a client sent its next request on it: an httpx.ReadError under load.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()

"""Run a real ASGI app (FastAPI) with uvicorn on 127.0.0.1 in a background thread, for tests;
hold a request until its client gives up; wait for a server started in a subprocess to answer
its health check."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, port: int | None = None):
    """Serve app on 127.0.0.1 until the block ends; yields the base URL (http://127.0.0.1:PORT)."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def until_the_client_leaves(request, limit_s: float = 60.0) -> None:
    """Hold a request in a scripted server until its client disconnects (at most ``limit_s``): a
    server that never answers within a client's timeout, whatever the machine's load. A fixed
    sleep a little longer than the timeout races with it: an event loop stalled past both finds
    the reply and the timeout due together and may take the reply (a CI run saw a 1 s sleep
    answer a client with a 0.3 s timeout)."""
    deadline = time.monotonic() + limit_s
    while not await request.is_disconnected() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def wait_until_healthy(url: str, proc: subprocess.Popen, log_tail: Callable[[], str], timeout_s: float = 600) -> None:
    """Poll ``url/health`` until it answers ok; fail with the server's log if it exits or never does.

    The deadline only bounds a server that will never answer. Starting one (imports, the encoder,
    the index) takes about 12 s on 2 idle cores, but the tests run at niceness 10 beside the
    policies' training, and beside the other worker's test, which may run 4 processes: in one CI
    run a retriever was still starting after 120 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).json()["status"] == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        assert proc.poll() is None, log_tail()[-2000:]
        if time.monotonic() > deadline:
            proc.kill()  # so that its log can be read to the end
            proc.wait()
            raise AssertionError(f"the retriever did not answer {url}/health within {timeout_s:.0f} s; its log ends:\n{log_tail()[-2000:]}")
        time.sleep(0.3)

"""Headless Chromium driven over the DevTools protocol, for the tests that look at a page.

Debian's ``chromium`` package (scripts/test.sh installs it where it can) is started with a
DevTools port; this module speaks the protocol's JSON messages over its websocket (the
``websockets`` package, already installed with uvicorn): open a page, evaluate JavaScript in it,
take a screenshot, and collect every console error and uncaught exception the page raised.
No browser download and no driver binary: the protocol is Chromium's own.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from websockets.sync.client import connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, BINARIES) if path), None)


class Browser:
    def __init__(self, binary: str, width: int = 1400, height: int = 1000):
        self.profile = tempfile.mkdtemp(prefix="etagent-chromium-")
        self.connection = ExitStack()  # websockets' client closes through its context manager
        self.socket = None
        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # the tests run as root in containers
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.process.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError(f"{binary} did not open its DevTools port")
            time.sleep(0.1)
        port = port_file.read_text().splitlines()[0]
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
        self.socket = self.connection.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30))
        self.next_id = 0
        self.events: list[dict] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            message = json.loads(self.socket.recv(timeout=max(deadline - time.time(), 0.01)))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        for message in self.events:
            if message.get("method") == event:
                return message
        while time.time() < deadline:
            message = json.loads(self.socket.recv(timeout=max(deadline - time.time(), 0.01)))
            self.events.append(message)
            if message.get("method") == event:
                return message
        raise TimeoutError(event)

    def open(self, path: Path) -> None:
        self.events.clear()
        self.send("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, out: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def errors(self) -> list[str]:
        """Every console error, uncaught exception and error log entry since the page was opened."""
        found = []
        for message in self.events:
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"]))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"])
        return found

    def close(self) -> None:
        self.connection.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

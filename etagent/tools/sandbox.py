"""The Python tool: model-written code run in an isolated, throw-away process.

:class:`PythonSandbox` starts one fork server (``zygote.py``, a separate interpreter that has
already imported ``preload``) and sends it each call over a Unix socket; the server forks a fresh
process per call, so no state survives from one call to the next and a call starts in about
5 ms instead of the 30-40 ms of a new interpreter.

Isolation, per call (``isolation="namespaces"``, the default where the kernel allows it):

- **identity**: new user namespace; outside it the code runs as ``nobody`` (when the toolkit runs
  as root) or as the invoking user, with every capability dropped and ``no_new_privs`` set;
- **filesystem**: a minimal root (tmpfs) holding read-only binds of the interpreter, its
  site-packages, /usr, /lib*, /bin and a few /etc files; the project tree, home directories and
  /work are not visible. /tmp is a fresh size-limited tmpfs (the working directory), gone after
  the call;
- **network**: a new network namespace with no interfaces up: nothing is reachable, not even
  the host's 127.0.0.1;
- **processes**: the code runs as PID 1 of a new PID namespace, so when it ends or is killed the
  kernel kills everything it started (daemons included); ``RLIMIT_NPROC`` caps the number of
  processes (it applies even to root because the namespace has no capability on the host);
- **resources**: wall-clock timeout (the server kills the namespace), address space, CPU
  seconds, file size, open files, ``oom_score_adj=1000`` (if memory runs out the kernel kills the
  sandbox first), output capture capped per stream;
- **environment**: replaced by a fixed minimal one (no API keys or tokens), stdin is /dev/null.

What it does not protect against: kernel vulnerabilities (there is no seccomp filter and no
virtual machine); CPU contention (a busy loop uses a core until its timeout); memory pressure
from many concurrent calls each under its own address-space limit; side channels; reading
files that are world-readable in the bound directories (the interpreter and its packages).

Where namespaces are unavailable (``isolation="rlimits"``, chosen by ``auto`` when ``unshare``
fails, for instance in an unprivileged container): resource limits, a new session, a temporary
working directory removed afterwards and, when running as root, the ``nobody`` identity still
apply, but there is **no network isolation**, the host filesystem is visible (writable wherever
the identity may write), and a process that leaves the session (``setsid``) can outlive the call,
and the host. The reason is logged once and exposed as :attr:`PythonSandbox.isolation_note`.

Lifetime: the server and every process of every call die with the host process (the one that
started the sandbox), ``kill -9`` included, within milliseconds, and the server removes its
directory (``$TMPDIR/etagent-sandbox-*``: its socket and, with ``rlimits``, the calls' working
directories) first; ``zygote.py``'s docstring says how, and what is not covered. A directory is
left only when the server is killed by SIGKILL too (with its host's whole cgroup, say): the next
sandbox started on the machine removes it (:func:`_remove_abandoned_directories`).

:class:`SandboxFusion` is a second backend with the same interface: a SandboxFusion server (the
service verl uses) over HTTP. :class:`PythonTool` turns either backend's result into the text
inserted in ``<result>`` (the reference's format) and an ok flag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from omegaconf import MISSING

from etagent.errors import UserError
from etagent.net import ExternalCallError, post_json
from etagent.settings import PositiveFloat, PositiveInt, group
from etagent.tools import ToolOutput, truncate
from etagent.tools.zygote import print_last_expression

log = logging.getLogger(__name__)

# Standard-library modules model code uses most. Adding numpy and sympy (the paper preset does)
# saves their import time (about 0.5 s) in calls that use them, and costs a few milliseconds in
# every call (a larger process to fork).
DEFAULT_PRELOAD = (
    "math",
    "cmath",
    "fractions",
    "decimal",
    "itertools",
    "functools",
    "collections",
    "statistics",
    "random",
    "re",
    "json",
    "datetime",
    "string",
    "heapq",
    "bisect",
)
# Imported once when a sandbox starts, besides the preloaded modules (PythonSandbox._probe): what
# model-written code imports most, the pure-Python modules a call cannot import unless it can read
# the interpreter's files.
PROBED_MODULES = ("csv", "textwrap", "dataclasses", "typing", "copy", "operator", "fractions", "statistics")
PROBE_TIMEOUT_S = 20.0
SANDBOX_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@group
class SandboxLimits:
    """Per-call limits. cpu_seconds defaults to the timeout rounded up, plus one."""

    timeout_s: PositiveFloat = MISSING
    memory_mb: PositiveInt = MISSING
    file_size_mb: PositiveInt = MISSING
    open_files: PositiveInt = MISSING
    processes: PositiveInt = MISSING
    tmpfs_mb: PositiveInt = MISSING
    max_output_bytes: PositiveInt = MISSING
    cpu_seconds: PositiveInt | None = MISSING

    def for_zygote(self, timeout_s: float) -> dict:
        return {
            "memory_mb": self.memory_mb,
            "cpu_seconds": self.cpu_seconds or math.ceil(timeout_s) + 1,
            "file_size_mb": self.file_size_mb,
            "open_files": self.open_files,
            "processes": self.processes,
            "tmpfs_mb": self.tmpfs_mb,
            "environment": SANDBOX_ENVIRONMENT,
        }


@dataclass
class ExecutionResult:
    """What one run produced. ``error`` is set when the sandbox itself failed."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0


# A unix socket's address holds 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


class SandboxError(UserError, RuntimeError):
    """The sandbox cannot give the tool what it promises (the isolation asked for, or a Python
    that imports its standard library): the run is refused at start rather than degraded."""


def _receive(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the sandbox server closed the connection")
        data += chunk
    return data


def _remove_abandoned_directories() -> None:
    """Remove the directories of sandbox servers that are gone.

    The second line of clean-up: a server removes its own directory when it exits, so this finds
    those of servers killed by SIGKILL. A directory is abandoned when its socket refuses
    connections: a listening socket exists exactly as long as some process holds it, whatever the
    PID namespace of that process (a /tmp may be shared between containers) and however PIDs have
    been reused since, which a test of the owner's PID could not tell. A server creates
    ``zygote.sock`` only once it listens, so one still starting is not taken for a dead one.
    """
    for path in Path(tempfile.gettempdir()).glob("etagent-sandbox-*"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)  # a server with a full backlog answers EAGAIN, not a wait
        try:
            probe.connect(str(path / "zygote.sock"))
        except ConnectionRefusedError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # no socket (a server starting, or not a server's directory), not ours, busy
            pass
        finally:
            probe.close()


class PythonSandbox:
    """Runs Python code through the fork server; safe to share across coroutines and threads.

    ``python`` is the interpreter the code runs with (default: this one); its packages are what
    the code can import. ``max_concurrency`` bounds calls in flight per sandbox.
    """

    def __init__(
        self,
        *,
        python: str | None = None,
        limits: SandboxLimits,
        isolation: str = "auto",
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        max_concurrency: int = 32,
    ):
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ValueError(f"isolation must be auto, namespaces or rlimits, got {isolation!r}")
        # an absolute path: the server starts in its own directory (sys.executable is relative when
        # Python was found through a relative PATH entry)
        self.python = os.path.abspath(python or sys.executable) if os.sep in (python or sys.executable) else shutil.which(python) or python
        self.limits = limits
        self.requested_isolation = isolation
        self.preload = tuple(preload)
        self.max_concurrency = max_concurrency
        self.isolation: str | None = None
        self.isolation_note = ""
        self.zygote_pid: int | None = None
        self._process: subprocess.Popen | None = None
        self._dir: str | None = None
        # Set only once the server has said it is ready: concurrent first calls wait in start()
        # until then (a live but still starting process must not be used).
        self._socket_path: str | None = None
        self._lock = threading.Lock()
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        _sandboxes.add(self)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> PythonSandbox:
        with self._lock:
            if self._ready():
                return self
            self._socket_path = None
            self._stop_server()  # one that died, leaving its directory to us
            _remove_abandoned_directories()
            # the server owns this directory from now on: it removes it when it exits, since it
            # outlives a host killed by SIGKILL, which cannot (see zygote.py)
            self._dir = tempfile.mkdtemp(prefix="etagent-sandbox-")
            socket_path = os.path.join(self._dir, "zygote.sock.new")  # the longest the server binds
            if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_BYTES:
                os.rmdir(self._dir)
                raise SandboxError(
                    f"TMPDIR is too long for the sandbox's unix socket: {socket_path} has {len(os.fsencode(socket_path))} bytes, "
                    f"over the {MAX_SOCKET_PATH_BYTES} a socket address holds; set TMPDIR to a shorter folder"
                )
            env = dict(SANDBOX_ENVIRONMENT, HOME=self._dir, TMPDIR=self._dir)
            command = [
                self.python,
                "-I",
                str(Path(__file__).with_name("zygote.py")),
                "--dir",
                self._dir,
                "--isolation",
                self.requested_isolation,
                "--preload",
                ",".join(self.preload),
            ]
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=self._dir)
            line = self._process.stdout.readline()
            try:
                ready = json.loads(line)
            except ValueError:
                self._process.kill()
                error = f"the sandbox server did not start (exit {self._process.wait()}): {line[:300]!r}"
                self._stop_server()
                raise SandboxError(error) from None
            if not ready.get("ready"):
                self._stop_server()
                raise SandboxError(f"the sandbox cannot provide isolation={self.requested_isolation}: {ready.get('error')}")
            self.isolation, self.isolation_note, self.zygote_pid = ready["isolation"], ready["note"], ready["pid"]
            socket_path = os.path.join(self._dir, "zygote.sock")
            failed = self._probe(socket_path)
            if failed:
                self._stop_server()
                raise SandboxError(
                    f"the python sandbox (isolation {self.isolation}) cannot import the standard library with {self.python}: {failed}. "
                    + (
                        "Its files are not readable by the identity calls run as (nobody, when run as root): a Python installed in a "
                        "private home folder; set tools.python.interpreter to one installed elsewhere (e.g. /usr/bin/python3), "
                        "or use isolation namespaces"
                        if self.isolation == "rlimits"
                        else "Check tools.python.interpreter"
                    )
                )
            self._socket_path = socket_path
            if self.isolation != "namespaces":
                log.warning("python sandbox: isolation is %s only: %s", self.isolation, self.isolation_note)
            return self

    def _probe(self, socket_path: str) -> str | None:
        """One call that imports the standard library's modules model code uses most and the
        preloaded ones, as every call runs (identity, limits, working directory); what failed,
        or None. Without it, a sandbox whose calls cannot read the interpreter's files (rlimits
        as nobody, a Python in a 0700 home folder) would answer every call with an ImportError
        that counts as the model's mistake."""
        modules = sorted({*PROBED_MODULES, *self.preload})
        code = f"import {', '.join(modules)}\nprint('ready')"
        limits = self.limits.for_zygote(PROBE_TIMEOUT_S)
        request = json.dumps({"code": code, "timeout": PROBE_TIMEOUT_S, "limits": limits, "max_output_bytes": 65536}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(PROBE_TIMEOUT_S + 30)
                conn.connect(socket_path)
                conn.sendall(struct.pack(">I", len(request)) + request)
                header = _receive(conn, 4)
                response = json.loads(_receive(conn, struct.unpack(">I", header)[0]))
        except (OSError, ValueError) as exc:
            return f"the server did not answer ({type(exc).__name__}: {exc})"
        if "error" in response:
            return response["error"].strip().splitlines()[-1]
        if response.get("stdout", "").strip() != "ready":
            lines = (response.get("stderr") or "").strip().splitlines()
            return lines[-1] if lines else f"exit code {response.get('exit_code')}"
        return None

    def _ready(self) -> bool:
        return self._socket_path is not None and self._process is not None and self._process.poll() is None

    def close(self) -> None:
        with self._lock:
            self._socket_path = None
            self._stop_server()

    def _stop_server(self) -> None:
        """Stop the server and remove its directory; the caller holds the lock."""
        if self._process is not None:
            self._process.stdin.close()  # the server stops its calls and exits on EOF
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process.stdout.close()
            self._process = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)  # the server removed it, unless it was killed
            self._dir = None

    def _forget_in_forked_child(self) -> None:
        """In a process forked from the host: the server is the parent's. Close the inherited end
        of its stdin pipe (held here, it would keep the server and its calls alive after the
        parent dies) and leave its directory alone; a call made here starts a server of its own."""
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._semaphores = {}
        self._socket_path = None
        if self._process is not None:
            self._process.stdin.close()
            self._process.stdout.close()
        self._process = self._dir = self.zygote_pid = None

    def __enter__(self) -> PythonSandbox:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- running ----------------------------------------------------------------------------

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._semaphores[loop]

    async def run(self, code: str, timeout_s: float | None = None) -> ExecutionResult:
        """Run code; never raises for anything the code does (see ExecutionResult.error)."""
        if not self._ready():
            await asyncio.to_thread(self.start)
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        request = {
            "code": code,
            "timeout": timeout,
            "limits": self.limits.for_zygote(timeout),
            "max_output_bytes": self.limits.max_output_bytes,
        }
        async with self._semaphore():
            try:
                reader, writer = await asyncio.open_unix_connection(self._socket_path)
            except OSError as exc:
                return ExecutionResult(error=f"cannot reach the sandbox server: {exc}")
            try:
                data = json.dumps(request).encode()
                writer.write(struct.pack(">I", len(data)) + data)
                await writer.drain()
                # the server enforces the timeout itself; this bound only guards against a hang
                header = await asyncio.wait_for(reader.readexactly(4), timeout + 30)
                body = await asyncio.wait_for(reader.readexactly(struct.unpack(">I", header)[0]), 30)
                response = json.loads(body)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
                return ExecutionResult(error=f"the sandbox server failed to answer: {type(exc).__name__}: {exc}")
            finally:
                writer.close()
        if "error" in response:
            return ExecutionResult(error=response["error"])
        return ExecutionResult(**response)

    def run_sync(self, code: str, timeout_s: float | None = None) -> ExecutionResult:
        return asyncio.run(self.run(code, timeout_s))


# Every PythonSandbox, for _forget_in_forked_child: a process forked from the host (a DataLoader
# worker, a multiprocessing pool) must not hold the parent's servers.
_sandboxes: weakref.WeakSet[PythonSandbox] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sandbox in list(_sandboxes):
        sandbox._forget_in_forked_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SandboxFusion:
    """A SandboxFusion server (``POST {url}/run_code``) behind the same interface as PythonSandbox.

    Isolation is whatever that server provides (it runs code in its own container).
    """

    def __init__(self, url: str, limits: SandboxLimits, attempts: int = 3):
        self.url = url.rstrip("/") + "/run_code"
        self.limits = limits
        self.attempts = attempts
        self.isolation, self.isolation_note = "sandbox-fusion", f"code runs on the SandboxFusion server at {url}"

    def start(self) -> SandboxFusion:
        return self

    def close(self) -> None:
        pass

    async def run(self, code: str, timeout_s: float | None = None) -> ExecutionResult:
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        # the same REPL behaviour as the local sandbox: a bare last expression is printed
        payload = {
            "code": print_last_expression(code),
            "language": "python",
            "run_timeout": timeout,
            "memory_limit_MB": self.limits.memory_mb,
        }
        try:
            async with httpx.AsyncClient() as client:
                body = await post_json(client, self.url, payload, timeout=timeout + 30, attempts=self.attempts)
        except ExternalCallError as exc:
            return ExecutionResult(error=str(exc))
        run = body.get("run_result") or {}
        compile_result = body.get("compile_result") or {}
        if body.get("status") == "SandboxError" or not run:
            return ExecutionResult(error=f"SandboxFusion: {body.get('message') or body.get('status')}")
        return ExecutionResult(
            stdout=run.get("stdout") or "",
            stderr=(compile_result.get("stderr") or "") + (run.get("stderr") or ""),
            exit_code=run.get("return_code"),
            timed_out=run.get("status") == "TimeLimitExceeded",
            seconds=float(run.get("execution_time") or 0.0),
        )


# ---------------------------------------------------------------------------------------------
# The tool: results as the model sees them


_SIGNALS = {9: "SIGKILL (killed, likely out of memory)", 24: "SIGXCPU (CPU time limit exceeded)", 25: "SIGXFSZ (file size limit exceeded)"}


class PythonTool:
    """The ``<python>`` tool over a sandbox backend.

    Returns the stripped stdout on success; on an error the traceback, preceded by whatever the
    code printed before failing (the reference drops that output; we keep it, since the model
    needs it to see how far the code got); on a timeout a message starting with
    ``Execution Timeout``. The text is cut to ``max_output_chars`` plus "..." (1000 in the paper's
    rollouts).
    """

    name = "python"

    def __init__(self, backend: PythonSandbox | SandboxFusion, max_output_chars: int = 1000):
        self.backend = backend
        self.max_output_chars = max_output_chars

    async def __call__(self, code: str) -> ToolOutput:
        if not code.strip():
            return ToolOutput("Error: the <python> block is empty; write the code between <python> and </python>.", ok=False)
        result = await self.backend.run(code)
        details = asdict(result)
        if result.error is not None:
            return ToolOutput(f"Tool execute failed: {result.error}", ok=False, details=details, failure="sandbox failure")
        if result.timed_out:
            limit = self.backend.limits.timeout_s
            return ToolOutput(f"Execution Timeout: the code ran for more than {limit:g} s and was stopped.", ok=False, details=details)
        if result.exit_code == 0:
            return ToolOutput(truncate(result.stdout.strip(), self.max_output_chars), ok=True, details=details)
        parts = [result.stdout.strip(), result.stderr.strip()]
        if result.signal is not None:
            parts.append(f"Process killed by signal {_SIGNALS.get(result.signal, result.signal)}.")
        return ToolOutput(truncate("\n".join(p for p in parts if p), self.max_output_chars), ok=False, details=details)

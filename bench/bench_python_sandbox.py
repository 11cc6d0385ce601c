"""Python tool throughput: our sandbox against a fresh `python -c` subprocess per call.

    python bench/bench_python_sandbox.py [--calls 400] [--concurrency 32]

The peer is the paper's method (docs/paper-code.md §A1.5): `asyncio.create_subprocess_exec(
python, "-c", code)` per call, at most 32 at once, no isolation. Ours runs every call in a fresh
forked process with the full isolation of etagent.tools.sandbox (namespaces where available).
Same snippets, same machine, same run; printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from etagent.config import base_group
from etagent.tools.sandbox import DEFAULT_PRELOAD, PythonSandbox, SandboxLimits
from etagent.tools.zygote import print_last_expression

SHORT = [
    "print(4817 * 2939)",
    "x = [i * i for i in range(100)]\nsum(x)",
    "import math\nprint(math.comb(30, 12))",
    "s = 'tool integrated reasoning'\nprint(s.title().replace(' ', ''))",
    "from fractions import Fraction\nprint(Fraction(3, 7) + Fraction(2, 9))",
    "1/0",
]
SYMPY = ["import sympy\nprint(sympy.factorint(2**32 + 1))"]


async def peer_call(code: str) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", print_last_expression(code), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    await proc.communicate()
    return time.perf_counter() - start


async def measure(call, snippets, calls: int, concurrency: int) -> tuple[float, float]:
    """(calls per second, median latency in ms) for `calls` calls cycling through snippets."""
    limit = asyncio.Semaphore(concurrency)
    latencies = []

    async def one(i):
        async with limit:
            latencies.append(await call(snippets[i % len(snippets)]))

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    return calls / (time.perf_counter() - start), statistics.median(latencies) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for label, snippets, calls in (("short snippets", SHORT, args.calls), ("import sympy", SYMPY, max(20, args.calls // 10))):
        peer = asyncio.run(measure(peer_call, snippets, calls, args.concurrency))
        rows.append((label, "python -c per call (paper)", "none", *peer))
        for preload_label, preload in (("stdlib preload", DEFAULT_PRELOAD), ("+numpy,sympy preload", DEFAULT_PRELOAD + ("numpy", "sympy"))):
            with PythonSandbox(
                limits=base_group(SandboxLimits, "tools", "python.limits", timeout_s=30), preload=preload, max_concurrency=args.concurrency
            ) as sandbox:

                async def ours(code, sandbox=sandbox):
                    start = time.perf_counter()
                    result = await sandbox.run(code)
                    assert result.error is None, result.error
                    return time.perf_counter() - start

                asyncio.run(ours("print(0)"))  # start the server outside the measurement
                measured = asyncio.run(measure(ours, snippets, calls, args.concurrency))
                rows.append((label, f"etagent sandbox, {preload_label}", sandbox.isolation, *measured))
    print(f"{os.cpu_count()} CPUs, concurrency {args.concurrency}, python {sys.version.split()[0]}")
    print(f"{'workload':<16} {'method':<44} {'isolation':<11} {'calls/s':>8} {'p50 ms':>8} {'x peer':>7}")
    for label, method, isolation, rate, p50 in rows:
        peer_rate = next(r[3] for r in rows if r[0] == label and "paper" in r[1])
        print(f"{label:<16} {method:<44} {isolation:<11} {rate:>8.1f} {p50:>8.1f} {rate / peer_rate:>7.2f}")


if __name__ == "__main__":
    main()

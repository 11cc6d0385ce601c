"""Retriever throughput and build cost: our server against the one-request-per-encode design.

    python bench/bench_retriever.py [--requests 600] [--sizes 10000,100000] [--skip-build]
                                    [--concurrency 1,8,32,64] [--rounds 1] [--at COMMIT ...]

Serving: builds a toy index (the default encoder, all-MiniLM-L6-v2, Flat), then serves it twice
on 127.0.0.1, one server at a time: ours (etagent.retriever.server: micro-batched encoding and search in
a worker thread) and the peers' design (FlashRAG's and Search-R1's servers: each request encodes
its own queries and searches inside the request handler, blocking the event loop; see
bench/one_at_a_time_server.py), whose encoder runs on torch as theirs does, while ours runs on
the preset's encoder.runtime (onnxruntime in tiny). Same encoder model, same index, same queries,
same threads.
Reports QPS and p50/p99 latency at each concurrency, and the ratio to the peer. ``--at COMMIT``
serves our server as it was at that commit too (from a git worktree), side by side in the same
run: the old way against the new. ``--rounds`` repeats every server's measurement, the servers
taking turns, so that drift in the machine's speed falls on all of them.

Building: wall time and peak memory of `python -m etagent.retriever.build` for synthetic corpora of the
given sizes (toy-world passages).

Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def server_module(tree: Path) -> str:
    """How the checkout ``tree`` names its server module, made importable from ``tree`` alone.

    Today each stage folder is a module of etagent through a link (etagent/retriever ->
    ../retriever). Commits of 2026-11 mapped them with pyproject's package-dir instead, which this
    venv's editable install serves with an import hook that Python consults after PYTHONPATH: an
    old commit's server would run today's code, so such a checkout gets the links. One from before
    that (stages as top-level packages) is run by its top-level name, the server file's path."""
    if (tree / "etagent" / "retriever").exists():
        return "etagent.retriever.server"
    pyproject = (tree / "pyproject.toml").read_text()
    if "package-dir" not in pyproject:
        return ".".join((tree / "retriever" / "server.py").relative_to(tree).with_suffix("").parts)
    for line in pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n\n", 1)[0].splitlines():
        name, _, folder = (part.strip().strip('"') for part in line.partition("="))
        link = tree / Path(*name.split("."))
        if name.startswith("etagent.") and folder and not link.exists():
            link.symlink_to(Path("..") / folder)
    return "etagent.retriever.server"


def start(command: list[str], url: str, tree: Path = ROOT) -> subprocess.Popen:
    """A server from the checkout ``tree`` (its modules and its configs), once it answers /health."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not start: {command}")


class Connection:
    """A keep-alive HTTP/1.1 connection with just enough protocol for JSON POSTs. The load
    generator shares the 2 cores with the server, so it must cost little: httpx's per-request
    overhead alone capped the measured QPS."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1])


async def load(url: str, queries: list[str], n: int, concurrency: int) -> tuple[float, float, float, int]:
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(concurrency)
    bodies = [json.dumps({"queries": [rng.choice(queries)], "topk": 3, "return_scores": True}).encode() for _ in range(n)]
    latencies, errors = [], 0
    todo = iter(bodies)

    async def worker():
        nonlocal errors
        connection = Connection(host, int(port))
        for body in todo:
            start = time.perf_counter()
            status = await connection.post("/retrieve", body)
            latencies.append(time.perf_counter() - start)
            errors += status != 200
        if connection.writer:
            connection.writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return n / elapsed, latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000, errors


def synthetic_corpus(path: Path, size: int) -> None:
    from etagent.toy.world import make_world

    world = make_world(seed=size, n_people=size - size // 5, n_cities=size // 5)
    with path.open("w") as f:
        for doc in world.corpus():
            f.write(json.dumps(doc) + "\n")


def measure_build(corpus: Path, index_dir: Path) -> tuple[float, float]:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(
        [sys.executable, "-m", "etagent.retriever.build", f"corpus={corpus}", f"index_dir={index_dir}"],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest child so far: meaningful when sizes grow
    return time.perf_counter() - start, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrencies")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per server and concurrency, taking turns")
    parser.add_argument("--at", action="append", default=[], metavar="COMMIT", help="also serve our server as at this commit")
    parser.add_argument("overrides", nargs="*", help="retriever config overrides for both servers, e.g. encoder.kind=transformers")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-"))
    subprocess.run(
        [sys.executable, "-m", "etagent.launcher", "toy", "build", "--out", str(work / "toy")],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "etagent.retriever.build",
            f"corpus={work / 'toy' / 'corpus.jsonl'}",
            f"index_dir={work / 'index'}",
            *args.overrides,
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    queries = [json.loads(line)["question"] for line in (work / "toy" / "questions" / "test.jsonl").read_text().splitlines()]

    rows = []
    port = 18000 + os.getpid() % 1000
    documents = sum(1 for line in (work / "toy" / "corpus.jsonl").read_text().splitlines() if line.strip())
    ours = [
        sys.executable,
        "-m",
        "etagent.retriever.server",
        f"index_dir={work / 'index'}",
        f"serve.port={port}",
        f"serve.torch_threads={args.threads}",
    ]
    servers: dict[str, tuple[list[str], Path]] = {}
    for commit in args.at:  # our server as it was: its own checkout, its own configs
        tree = work / f"at-{commit}"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], check=True, cwd=ROOT, capture_output=True)
        servers[f"etagent at {commit}"] = ([ours[0], "-m", server_module(tree), *ours[3:]], tree)
    servers |= {
        "etagent (micro-batched)": ([*ours, *args.overrides], ROOT),
        "one request per encode": (
            [
                sys.executable,
                str(ROOT / "bench" / "one_at_a_time_server.py"),
                str(work / "index"),
                str(port),
                str(args.threads),
                *args.overrides,
            ],
            ROOT,
        ),
    }
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    try:
        for _ in range(args.rounds):
            for name, (command, tree) in servers.items():
                url = f"http://127.0.0.1:{port}"
                proc = start(command, url, tree)
                try:
                    asyncio.run(load(url, queries, 200, 8))  # warm up
                    for concurrency in concurrencies:
                        n = args.requests if concurrency > 1 else args.requests // 4
                        rows.append((name, concurrency, *asyncio.run(load(url, queries, n, concurrency))))
                finally:
                    proc.terminate()
                    proc.wait()
    finally:
        for commit in args.at:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / f"at-{commit}")], cwd=ROOT, capture_output=True)
    print(
        f"{os.cpu_count()} CPUs, torch threads {args.threads}, encoder all-MiniLM-L6-v2, Flat index over {documents} toy passages, "
        f"{args.requests} requests of 1 query, {args.rounds} round(s)"
    )
    print(f"{'server':<26} {'conc':>4} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'x peer':>7}")
    for concurrency in concurrencies:
        peer = [r[2] for r in rows if r[0] == "one request per encode" and r[1] == concurrency]
        peer_mean = sum(peer) / len(peer)
        for name in servers:
            mine = [r for r in rows if r[0] == name and r[1] == concurrency]
            qps = sum(r[2] for r in mine) / len(mine)
            p50 = sum(r[3] for r in mine) / len(mine)
            p99 = max(r[4] for r in mine)
            errors = sum(r[5] for r in mine)
            each = ", ".join(f"{r[2]:.0f}" for r in mine)
            print(f"{name:<26} {concurrency:>4} {qps:>8.1f} {p50:>8.1f} {p99:>8.1f} {errors:>6} {qps / peer_mean:>7.2f}  ({each})")

    if not args.skip_build:
        print(f"\n{'passages':>9} {'build s':>9} {'peak RSS MB':>12}")
        for size in (int(s) for s in args.sizes.split(",")):
            corpus = work / f"corpus-{size}.jsonl"
            synthetic_corpus(corpus, size)
            seconds, peak = measure_build(corpus, work / f"index-{size}")
            print(f"{size:>9} {seconds:>9.1f} {peak:>12.0f}")


if __name__ == "__main__":
    main()

"""What the rollout benchmarks share: the toy world, an SFT'd toy policy, the real tools (the
Python sandbox and a retriever service on 127.0.0.1 over the toy corpus), and a delay wrapper
that makes a fixed share of tool calls slow.

Not a benchmark itself: the rollout benchmarks (``bench_agent.py``, ``bench_rollout.py``,
``bench_tree_rollout.py``, ``bench_colocated_vllm.py``, ``bench_partial_rollout.py``) import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str) -> None:
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def toy_policy(work: Path, toy: str | None, model: str | None) -> tuple[Path, str]:
    """The toy world and an SFT'd policy: the ones given, else built here (minutes)."""
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    toy_dir = Path(toy) if toy else work / "toy"
    if not toy:
        _run(sys.executable, "-m", "etagent.launcher", "toy", "build", "--out", str(toy_dir))
    if model is None:
        _run(
            sys.executable,
            "-m",
            "etagent.sft.run",
            f"model={toy_dir / 'model'}",
            f"data.path={toy_dir / 'sft.jsonl'}",
            f"out_dir={work / 'sft'}",
            "train.progress_bar=false",
        )
        model = str(work / "sft" / "model")
    return toy_dir, model


@contextlib.contextmanager
def toy_tools(work: Path, toy: Path) -> Iterator:
    """The tiny tools config, its search pointed at a retriever service over the toy corpus that
    runs for the duration."""
    import etagent.tools.executor  # noqa: F401 (registers the tools group's schema, which load_config needs)
    from etagent.config import load_settings

    _run(sys.executable, "-m", "etagent.retriever.build", f"corpus={toy / 'corpus.jsonl'}", f"index_dir={work / 'index'}")
    port = 18500 + os.getpid() % 1000
    server = subprocess.Popen(
        [sys.executable, "-m", "etagent.retriever.server", f"index_dir={work / 'index'}", f"serve.port={port}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield load_settings("tools", "tiny", [f"tools.search.local.url=http://127.0.0.1:{port}"])
    finally:
        server.terminate()
        server.wait()


class SlowTool:
    """A real tool whose answer, on ``share`` of the calls, comes only after ``seconds`` (the
    result itself is the tool's). Which calls are slow is decided by a hash of the call's input,
    so every run delays the same calls."""

    def __init__(self, tool, share: float, seconds: float):
        self.tool, self.share, self.seconds = tool, share, seconds
        self.name = tool.name

    def is_slow(self, text: str) -> bool:
        digest = hashlib.sha256(f"{self.name}\n{text}".encode()).digest()
        return int.from_bytes(digest[:4], "big") < self.share * 2**32

    async def __call__(self, text: str):
        start = time.perf_counter()
        output = await self.tool(text)
        if self.is_slow(text):
            await asyncio.sleep(max(0.0, self.seconds - (time.perf_counter() - start)))
        return output


def slowed(executor, share: float, seconds: float):
    """An executor over the same tools as ``executor``, ``share`` of whose calls answer after
    ``seconds`` (:class:`SlowTool`)."""
    from etagent.tools.executor import ToolExecutor

    return ToolExecutor(
        [SlowTool(t, share, seconds) for t in executor.tools.values()], concurrency=executor.concurrency, timeout_s=executor.timeout_s
    )


def policy_arguments(parser) -> None:
    """``--model`` and ``--toy``: the SFT'd toy policy a rollout benchmark samples from."""
    parser.add_argument("--model", help="an SFT'd toy model directory (default: build the toy world and train one, minutes)")
    parser.add_argument("--toy", help="the toy world directory the model belongs to")


def rl_prompts(toy: Path, count: int) -> list:
    """``count`` questions of the toy's RL pool, spread over it (so every kind of question), as RL prompts."""
    from etagent.question_formats import read_questions
    from etagent.rl.rollout import Prompt

    pool = read_questions(toy / "questions" / "rl.jsonl")
    questions = pool[:: max(1, len(pool) // count)][:count]
    return [Prompt(question=q, index=i, data_source=q.source) for i, q in enumerate(questions)]


def rl_step_generation(engine, executor, prompts: list, cfg) -> tuple[float, dict[str, list[int]]]:
    """One RL step's rollouts (step 1, seed 0) with RL's config ``cfg`` (its agent and rollout
    groups): the seconds they took and every trajectory's token ids by id."""
    from etagent.agent import AgentLoop
    from etagent.rl.rollout import make_rollout, segment_entropy

    settings = cfg.rollout
    loop = AgentLoop(engine, executor, cfg.agent, segment_entropy(settings))
    start = time.perf_counter()
    out = make_rollout(settings).generate(loop, prompts, step=1, seed=0)
    return time.perf_counter() - start, {t.id: t.response_ids for group in out.groups for t in group}

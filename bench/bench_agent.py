"""Agent-loop cost: tokens generated per token kept, and trajectories per second, hf vs vllm
(offline, as RL colocates it, and async, as the sampling stages build it).

    python bench/bench_agent.py [--model DIR] [--questions 40] [--n 2]

Runs the agent loop (the tiny SFT'd toy policy, real tools: the sandbox and the retriever
service) over held-out toy questions with each engine, and reports:

- generated / kept tokens: every token the engine generated, over the policy tokens kept in the
  final trajectories. With engine-side stops the two are the same tokens (1.00).
- the reference design's generated / kept: the paper's client sent no stop strings and cut the
  text at the first closing tag afterwards (docs/paper-code.md §B1.5.1), so every call
  decodes to EOS or max_tokens. We replay each of our generation calls from the same prefix with
  no stop strings (same engine, same seed, same per-call max_tokens) and count what it generates.
- trajectories per second for each engine, same questions, same settings: ``hf``; ``vllm
  offline``, vLLM's ``LLM`` in this process, concurrent calls gathered into one batch at a time;
  ``vllm async``, vLLM's ``AsyncLLM`` in its own process, each trajectory's request joining the
  running batch as it comes.

Without --model, builds the toy world and runs the tiny SFT preset first (a few minutes).
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from pathlib import Path

from toy_setup import toy_policy, toy_tools


class CountingEngine:
    """Wraps an engine and records every request and the tokens it generated."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self.requests, self.generated = [], 0

    async def agenerate(self, requests):
        results = await self.engine.agenerate(requests)
        self.requests += requests
        self.generated += sum(len(s.token_ids) for samples in results for s in samples)
        return results


def run_loop(engine, executor, questions, n, seed):
    from etagent.agent import AgentConfig, AgentLoop
    from etagent.config import base_group

    counting = CountingEngine(engine)
    loop = AgentLoop(
        counting,
        executor,
        base_group(
            AgentConfig,
            "agent",
            max_response_tokens=1024,
            max_segment_tokens=512,
            timeout_s=1200.0,
            seed=seed,
            sampling={"top_p": 1.0, "repetition_penalty": 1.0},
        ),
    )
    states = [loop.new(q, f"{q.id}/{k}") for q in questions for k in range(n)]
    start = time.perf_counter()
    asyncio.run(loop.run(states))
    seconds = time.perf_counter() - start
    kept = sum(sum(s.mask) for s in states)
    return counting, states, kept, seconds


def replay_without_stops(engine, requests) -> int:
    """Tokens the no-stop design generates for the same calls (same prefix, seed and limit)."""
    unstopped = [dataclasses.replace(r, stop=()) for r in requests]
    total = 0
    for start in range(0, len(unstopped), 32):
        total += sum(len(s.token_ids) for samples in engine.generate(unstopped[start : start + 32]) for s in samples)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an SFT'd toy model directory (default: build one)")
    parser.add_argument("--toy", help="the toy world directory the model belongs to")
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--engines", default="hf,vllm offline,vllm async", help="which of them, comma-separated (vllm needs vLLM)")
    args = parser.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-agent-"))
    toy, model = toy_policy(work, args.toy, args.model)
    with toy_tools(work, toy) as tools:
        from etagent.config import base_group
        from etagent.llm import VLLMConfig
        from etagent.llm.hf import HFEngine
        from etagent.llm.vllm_engine import AsyncVLLMEngine, VLLMEngine
        from etagent.question_formats import read_questions
        from etagent.tools.executor import build_executor

        questions = read_questions(toy / "questions" / "test.jsonl")[: args.questions]
        rows = []
        vllm = base_group(VLLMConfig, "engine", "vllm", max_model_len=2048, gpu_memory_utilization=0.5, enforce_eager=True)
        with build_executor(tools) as executor:
            engines = {
                "hf": lambda: HFEngine(model),
                "vllm offline": lambda: VLLMEngine.load(model, vllm, dtype="float32"),
                "vllm async": lambda: AsyncVLLMEngine.load(model, vllm, dtype="float32"),
            }
            for name in args.engines.split(","):
                engine = engines[name]()
                run_loop(engine, executor, questions[:2], 1, seed=99)  # warm up
                counting, states, kept, seconds = run_loop(engine, executor, questions, args.n, seed=0)
                reference = replay_without_stops(engine, counting.requests)
                rows.append((name, len(states), seconds, counting.generated, kept, reference))
                if name == "vllm async":
                    engine.shutdown()  # its engine core's process
                del engine
    print(f"{os.cpu_count()} CPUs; tiny SFT'd toy policy; {args.questions} held-out questions x {args.n}; max 512 tokens per call")
    print(
        f"{'engine':<12} {'trajectories/s':>15} {'generated':>10} {'kept':>8} {'generated/kept':>15} {'no-stop design generated/kept':>31}"
    )
    for name, count, seconds, generated, kept, reference in rows:
        print(f"{name:<12} {count / seconds:>15.2f} {generated:>10} {kept:>8} {generated / kept:>15.3f} {reference / kept:>31.2f}")


if __name__ == "__main__":
    main()

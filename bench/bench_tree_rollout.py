"""ARPO's tree rollout: one RL step's generation with the hf engine's prefix caching, and without.

    python bench/bench_tree_rollout.py --model runs/demo/sft/model --toy runs/demo/toy [--prompts 32]

The toy policy with the real tools, ``--prompts`` RL-pool questions (spread over the pool's kinds), the tiny RL preset's tree
(n 8, 4 roots, beam 2, p 0.5, w 0.2, dH after each tool result) and agent settings, seed 0, step
1. With prefix caching, a trajectory's next segment and every fork start from the keys and values
their source left (a fork resamples from a tool result its parent has already run through the
model); without it, every segment's prompt is prefilled in full. Printed: seconds of generation,
prompt tokens prefilled and taken from the cache, and how many trajectories have the same token
ids in both runs. Run ``--repeats`` times each, alternating; never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from toy_setup import rl_prompts, rl_step_generation, toy_policy, toy_tools


def generate_step(engine, executor, prompts, cfg) -> tuple[float, dict[str, list[int]]]:
    engine.sleep()  # nothing kept from the run before
    return rl_step_generation(engine, executor, prompts, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an SFT'd toy model directory (default: build the toy world and train one, minutes)")
    parser.add_argument("--toy", help="the toy world directory the model belongs to")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-tree-"))
    toy, model = toy_policy(work, args.toy, args.model)
    import etagent.rl  # noqa: F401 (registers configs/rl's schema, which load_config needs)
    from etagent.config import load_settings
    from etagent.llm.hf import HFEngine
    from etagent.tools.executor import build_executor

    cfg = load_settings("rl", "tiny", [f"model={model}"])
    prompts = rl_prompts(toy, args.prompts)
    engines = {
        "with prefix caching": HFEngine(model, max_batch_size=cfg.engine.max_batch_size),
        "without": HFEngine(model, max_batch_size=cfg.engine.max_batch_size, prefix_caching=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    counts, tokens = {}, {}
    with toy_tools(work, toy) as tools, build_executor(tools) as executor:
        generate_step(engines["without"], executor, prompts[:2], cfg)  # warm up (the sandbox, the model)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                before = dict(engine.counts)
                s, tokens[name] = generate_step(engine, executor, prompts, cfg)
                seconds[name].append(s)
                counts[name] = {k: v - before.get(k, 0) for k, v in engine.counts.items()}
                print(f"  {name}: {s:.1f} s", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; toy policy {model}")
    print(f"{len(prompts)} prompts, tree n {cfg.rollout.n}, {cfg.rollout.initial_rollouts} roots, seed 0; {args.repeats} runs each")
    print(f"{'':<20} {'generation s (min/median/max)':>30} {'prefilled':>10} {'from cache':>11} {'trajectories':>13}")
    for name, values in seconds.items():
        values = sorted(values)
        spread = f"{values[0]:.1f} / {values[len(values) // 2]:.1f} / {values[-1]:.1f}"
        c = counts[name]
        print(f"{name:<20} {spread:>30} {c['prefill_tokens']:>10} {c['reused_tokens']:>11} {len(tokens[name]):>13}")
    with_, without = (sorted(seconds[n])[len(seconds[n]) // 2] for n in engines)
    same = sum(tokens["with prefix caching"].get(i) == ids for i, ids in tokens["without"].items())
    print(f"median ratio with / without: {with_ / without:.2f}; same token ids: {same}/{len(tokens['without'])}")


if __name__ == "__main__":
    main()

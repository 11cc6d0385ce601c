"""Partial rollouts (``rollout.partial``) against every group run to its end: RL steps' generation
on the toy, with a long tail of slow tool calls.

    python bench/bench_partial_rollout.py --model runs/demo/sft-flywheel/model --toy runs/demo/toy [--steps 8]

The toy policy on the hf engine (continuous batching), the real tools, the tiny RL preset's
rollout (``--rollout``: group or tree, n 8) and agent settings with the loop streamed (each
trajectory on its own, as the paper presets run it), ``--prompts`` RL-pool prompts per step for
``--steps`` steps. The steps generate only: nothing is trained, so both ways sample from the same
weights and what differs is when a step stops. Two ways, with the tools as they are and with
``--slow-share`` of the calls answering after ``--slow-s`` seconds (the same calls every run):

- ``to the end``: each step runs its groups until every one is complete (RL without partial);
- ``partial``: each step runs ``--extra`` more groups, trains on the first to complete
  (``on_stale=drop``, ``max_staleness`` 1) and carries the rest over.

Printed: trajectories a step trains on per second (over all steps), partial / to the end, and for
partial the share of trajectories carried over, stale token share and the share of groups
dropped. Timings, never asserted; a held-out effect needs training (docs/rl.md, "Partial rollouts").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from toy_setup import policy_arguments, rl_prompts, slowed, toy_policy, toy_tools


def run_steps(rollout, loop, prompts: list, steps: int, per_step: int) -> tuple[float, int, list[dict]]:
    """``steps`` steps' generation, step k's own prompts the k-th ``per_step`` of ``prompts``: the
    seconds, the trajectories the steps would train on, each step's counts."""
    start, trajectories, counts = time.perf_counter(), 0, []
    for step in range(1, steps + 1):
        loop.version = step - 1
        out = rollout.generate(loop, prompts[(step - 1) * per_step : step * per_step], step, seed=0)
        trajectories += sum(len(g) for g in out.groups)
        counts.append(out.counts)
    return time.perf_counter() - start, trajectories, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    policy_arguments(parser)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step trains on")
    parser.add_argument("--extra", type=int, default=8, help="groups a partial step runs beyond them")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slow-share", type=float, default=0.1)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument("--rollout", choices=["tree", "group"], default="group")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etagent-bench-partial-"))
    toy, model = toy_policy(work, args.toy, args.model)
    import etagent.rl  # noqa: F401 (registers configs/rl's schema, which load_config needs)
    from etagent.agent import AgentLoop
    from etagent.config import load_settings
    from etagent.llm.hf import HFEngine
    from etagent.rl.rollout import PartialRollout, make_rollout, rollout_metrics, segment_entropy
    from etagent.tools.executor import build_executor

    overrides = [f"model={model}", f"rollout.kind={args.rollout}", "agent.lockstep=false"]
    cfg = load_settings("rl", "tiny", [*overrides, "rollout.partial=true", f"rollout.partial_extra={args.extra}"])
    settings = cfg.rollout
    prompts = rl_prompts(toy, args.prompts * args.steps + args.extra)
    engine = HFEngine(model, max_batch_size=64, continuous_batching=True)
    rows = []
    with toy_tools(work, toy) as tools, build_executor(tools) as plain:
        slow = slowed(plain, args.slow_share, args.slow_s)
        for label, executor in (("as they are", plain), (f"{args.slow_share:.0%} of calls take {args.slow_s:g} s", slow)):
            loop = AgentLoop(engine, executor, cfg.agent, segment_entropy(settings))
            results = {}
            for name in ("to the end", "partial"):
                rollout = make_rollout(settings)
                if name == "partial":
                    rollout = PartialRollout(rollout, settings, args.prompts, prompts, rank=0)
                engine.sleep()  # no keys and values kept from the run before
                seconds, trajectories, counts = run_steps(rollout, loop, prompts, args.steps, args.prompts)
                results[name] = (seconds, trajectories, rollout_metrics(counts) if name == "partial" else {})
                print(f"  {label}: {name}: {seconds:.1f} s, {trajectories} trajectories", file=sys.stderr, flush=True)
            rows.append((label, results))
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; toy policy {model}; hf engine, continuous batching")
    print(
        f"{args.steps} steps x {args.prompts} prompts, {args.rollout} n {cfg.rollout.n}, partial: {args.extra} extra groups, drop past 1 version"
    )
    print(f"{'tools':<26} {'to the end traj/s':>18} {'partial traj/s':>15} {'ratio':>7} {'carried':>8} {'stale tokens':>13} {'dropped':>8}")
    for label, results in rows:
        (s0, n0, _), (s1, n1, m) = results["to the end"], results["partial"]
        rate0, rate1 = n0 / s0, n1 / s1
        print(
            f"{label:<26} {rate0:>18.1f} {rate1:>15.1f} {rate1 / rate0:>6.2f}x {m['partial/carried_share']:>8.1%} "
            f"{m['partial/stale_token_share']:>13.1%} {m['partial/dropped_share']:>8.1%}"
        )


if __name__ == "__main__":
    main()

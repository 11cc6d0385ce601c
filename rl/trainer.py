"""RL's trainer: setup, one step as named and timed phases (:func:`train_step`), and the loop
over steps with its saves, exports and manifest. rl/run.py's docstring describes the step, phase
by phase; rl/run.py checks the settings and then calls :func:`train`.

What it does not do: read the command line or check settings (rl/run.py), compute the loss
(rl/actor.py) or sample (the engine, rl/engine.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from etagent import protocol
from etagent.agent import AgentLoop, TrajectoryState
from etagent.errors import DegradedRun, TrainingDiverged
from etagent.progress import Progress
from etagent.records import origin_segments, policy_text, write_manifest
from etagent.rl.actor import NonFiniteUpdate, StepBatch, response_logprobs, update
from etagent.rl.algorithm import grpo_advantages, logprob_mismatch
from etagent.rl.batch import TRUNCATED, Batch, BatchPlan, balanced_partition, batch_plan, pack, tempered_rollouts
from etagent.rl.checkpoint import AdapterExport, export_model, latest_checkpoint, load_checkpoint, load_in_flight, save_checkpoint
from etagent.rl.config import RewardSettings, RLConfig
from etagent.rl.distributed import gather_objects, init_distributed, sum_all, training_device
from etagent.rl.engine import ColocatedEngine, colocated_engine
from etagent.rl.paper_reward import validation_score
from etagent.rl.policy import Policy, Reference, gathered, load_policy
from etagent.rl.reward import efficiency_reward, kind_of, raw_correctness, sigma_factor
from etagent.rl.rollout import PartialRollout, Prompt, make_rollout, read_prompt_set, rollout_metrics, segment_entropy
from etagent.threads import FreeCoreThreads
from etagent.timing import phase
from etagent.tools.executor import degraded, describe_failures, failure_counts, merge_failure_counts

log = logging.getLogger("rl")


# ---------------------------------------------------------------------------------------------
# Setup


@dataclass
class Trainer:
    """Everything a step uses, built once by :func:`setup`."""

    cfg: RLConfig
    out: Path
    device: torch.device
    rank: int
    world: int
    seed: int
    plan: BatchPlan
    total: int  # steps of the run
    start: int  # the last step already done (resumed from)
    resumed_metrics: dict
    in_flight: list | None  # partial rollouts' groups in flight at the checkpoint resumed from
    reward: RewardSettings
    policy: Policy
    reference: Reference | None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    prompts: list[Prompt]
    validation: list[Prompt]
    read_as: dict[str, str]  # how each data file was read (etagent.question_formats' Mapping)
    engine: ColocatedEngine
    export: Callable[[Path], None]  # the policy as the stage's output model, into a folder


def read_data(cfg: RLConfig, tokenizer) -> tuple[list[Prompt], list[Prompt], dict[str, str]]:
    """The training and validation prompts (``data.train``, ``data.validation`` at its own split),
    each within ``data.max_prompt_tokens`` under ``tokenizer``, and how each file was read."""
    question_format = cfg.data.question_format
    read = functools.partial(
        read_prompt_set,
        tokenizer=tokenizer,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        question_format=question_format,
        rerender_prompts=cfg.data.rerender_prompts,
    )
    prompts, mapping = read(cfg.data.train)
    read_as = {"data.train": mapping.describe()}
    validation = []
    if cfg.data.validation:
        own_split = dataclasses.replace(question_format, split=cfg.data.validation_split)
        validation, mapping = read(cfg.data.validation, question_format=own_split, split_key="data.validation_split")
        read_as["data.validation"] = mapping.describe()
    return prompts, validation, read_as


def setup_policy(cfg: RLConfig, device: torch.device, lora, trained: bool):
    """The policy to train and its tokenizer, sharded; ``trained``: a checkpoint will bring what
    is trained (with LoRA the adapters, over the base read here), so its weights are not read."""
    return load_policy(
        cfg.model,
        device,
        compute_dtype=getattr(torch, cfg.train.compute_dtype),
        chunk_tokens=cfg.train.logprob_chunk_tokens,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        attn_implementation=cfg.train.attn_implementation,
        weights=not trained or lora is not None,
        temperature=cfg.agent.sampling.temperature,
        lora=lora,
        seed=cfg.train.seed,
    )


def setup_reference(cfg: RLConfig, policy: Policy, device: torch.device, lora) -> Reference | None:
    """The KL term's reference (None without the term): the stage's starting policy, also after a
    resume; with LoRA its base, the policy with the adapters off."""
    if cfg.algorithm.kl_coef == 0:
        return None
    if lora:
        return Reference(policy, adapters_off=True)
    frozen, _ = load_policy(
        cfg.model,
        device,
        compute_dtype=getattr(torch, cfg.train.compute_dtype),
        chunk_tokens=cfg.train.logprob_chunk_tokens,
        attn_implementation=cfg.train.attn_implementation,
        trainable=False,
        temperature=cfg.agent.sampling.temperature,
    )
    return Reference(frozen, adapters_off=False)


def setup(cfg: RLConfig) -> Trainer:
    """The run's state: the process group, the policy and its optimizer (from the last checkpoint
    when there is one), the KL reference, the data, the engine."""
    device = training_device(cfg.train.device)
    rank, world = init_distributed(device)
    plan = batch_plan(cfg.data.prompts_per_step, cfg.rollout.n, cfg.train.mini_batch_prompts, world)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = cfg.train.seed
    random.seed(seed)
    torch.manual_seed(seed)

    checkpoint = latest_checkpoint(out)
    lora = cfg.lora if cfg.lora.enabled else None
    policy, tokenizer = setup_policy(cfg, device, lora, trained=checkpoint is not None)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        eps=cfg.optim.eps,
    )
    state = {"step": 0, "metrics": {}}
    in_flight = None
    if checkpoint:
        state = load_checkpoint(checkpoint, policy, optimizer)
        in_flight = load_in_flight(checkpoint) if cfg.rollout.partial else None
        if rank == 0:
            log.info("resuming after step %d from %s", state["step"], checkpoint)
    reference = setup_reference(cfg, policy, device, lora)
    prompts, validation, read_as = read_data(cfg, tokenizer)  # rl/run.py's plan read them before the claim
    per_step = cfg.data.prompts_per_step
    total = int(cfg.train.max_steps or len(prompts) // per_step * cfg.data.epochs)

    engine = colocated_engine(cfg, policy, tokenizer, device, cfg.train.weight_bucket_mb << 20, lora)
    engine.start(resumed=checkpoint is not None)
    return Trainer(
        cfg=cfg,
        out=out,
        device=device,
        rank=rank,
        world=world,
        seed=seed,
        plan=plan,
        total=total,
        start=state["step"],
        resumed_metrics=state["metrics"],
        in_flight=in_flight,
        reward=cfg.reward,
        policy=policy,
        reference=reference,
        tokenizer=tokenizer,
        optimizer=optimizer,
        prompts=prompts,
        validation=validation,
        read_as=read_as,
        engine=engine,
        export=functools.partial(
            export_model,
            lm=policy.lm,
            tokenizer=tokenizer,
            dtype=getattr(torch, cfg.train.export_dtype),
            bucket_bytes=cfg.train.weight_bucket_mb << 20,
            adapter=AdapterExport(lora, str(cfg.model)) if lora and lora.export == "adapter" else None,
            dropout=policy.dropout,
        ),
    )


# ---------------------------------------------------------------------------------------------
# One step


def train_step(trainer: Trainer, step: int, loop: AgentLoop, greedy: AgentLoop, rollout) -> dict:
    """Step ``step`` (counted from 1) as timed phases; its metrics (summed over ranks)."""
    cfg = trainer.cfg
    loop.policy_version, loop.version = f"step{step - 1}", step - 1
    metrics: dict = {"step": step}
    started = time.perf_counter()
    chosen = step_prompts(trainer.prompts, step, cfg.data.prompts_per_step, trainer.seed)[trainer.rank :: trainer.world]

    with phase("generate", metrics), trainer.engine.reading():
        rollouts = rollout.generate(loop, chosen, step, trainer.seed)
        trainer.engine.sleep()  # vLLM frees its GPU memory for the trainer
    metrics.update(check_tool_failures(trainer, step, rollouts.groups))
    metrics.update(check_engine_failures(trainer, step, rollouts.groups))
    metrics.update(finish_shares(rollouts.groups))
    with phase("reward", metrics):
        factor = sigma_factor(step, trainer.total) if trainer.reward.decay else 1.0
        rows = rewards_of(rollouts.groups, rollouts.prompts, trainer.reward, factor, trainer.tokenizer)
        if cfg.algorithm.truncated == "wrong":
            score_truncated_as_wrong(rows)
    with phase("advantage", metrics):
        scores = torch.tensor([r["reward"] for r in rows])
        served = torch.tensor([r["finish_reason"] != "error" for r in rows])  # failures are left out of the baseline
        advantages = grpo_advantages(scores, torch.tensor([r["index"] for r in rows]), cfg.algorithm.eps, served)
    trajectories = [t for group in rollouts.groups for t in group]
    if trainer.world > 1:
        with phase("balance", metrics):
            trajectories, advantages, imbalance = balance_over_ranks(trainer, trajectories, advantages)
            metrics.update(imbalance)
    advantages = advantages.to(trainer.device)
    pad_id = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else trainer.tokenizer.eos_token_id
    untrained = TRUNCATED if cfg.algorithm.truncated == "mask" else frozenset()
    # partial rollouts: tokens sampled by older weights are left out of the loss, or weighed
    # against those weights by TIS
    stale_tis = cfg.rollout.partial and cfg.rollout.stale_tokens == "tis"
    masked_before = step - 1 if cfg.rollout.partial and cfg.rollout.stale_tokens == "mask" else None
    batch = pack(trajectories, pad_id, untrained, masked_before).to(trainer.device)
    comparable = tempered_rollouts(trajectories)  # the engine's log-probabilities are at the sampling temperature
    if trainer.engine.rollout_logprobs_are_old(stale_tis):
        # sampled by this module with these weights (under the temperature; stale tokens are
        # masked): recomputing would repeat the rollout's forwards
        old = batch.rollout_logprobs
    else:
        with phase("old_logprobs", metrics), gathered(trainer.policy), torch.no_grad():
            old = response_logprobs(trainer.policy, batch, cfg.train.micro_batch_tokens, cfg.train.share_prefixes)
    ref = None
    if trainer.reference is not None:
        with phase("ref_logprobs", metrics), trainer.reference.reading() as reference:
            ref = response_logprobs(reference, batch, cfg.train.micro_batch_tokens, cfg.train.share_prefixes)
    # rollouts from vLLM, or partial ones: corrected by truncated importance sampling against the
    # trainer's old log-probabilities
    tis_cap = cfg.algorithm.tis_cap if trainer.engine.applies_tis(stale_tis) else None
    if tis_cap is not None and not comparable:
        raise RuntimeError("truncated importance sampling needs the rollout's log-probabilities under the sampling temperature")
    with phase("update", metrics):
        trainer.policy.train()
        # the hf engine's log-probabilities are the old ones: their gap to the trainer's forward
        # (batch shapes, dtype) is measured in the update's first mini-batch
        hf_mismatch = trainer.engine.rollout_logprobs_are_old(stale_tis) and comparable
        try:
            metrics.update(update(trainer, StepBatch(batch, advantages, old, ref, rollout_mismatch=hf_mismatch, tis_cap=tis_cap)))
        except NonFiniteUpdate as error:  # before the save phase: the last checkpoint is the last good one
            last = latest_checkpoint(trainer.out)
            raise TrainingDiverged(
                f"RL step {step}: {error}. Nothing of this step was saved; the last checkpoint is "
                f"{last or 'none (the run starts from model)'}. Lower optim.lr (or look at the loss's inputs above) and rerun "
                "with --restart or into a new out_dir"
            ) from None
    with phase("sync", metrics):
        trainer.engine.sync()

    # the rollout's log-probabilities against the recomputed old ones, over the tokens these
    # weights sampled (a stale token's gap is the policy's change, not the engine's numerics);
    # where the rollout's are the old ones, the update measured it (rollout_mismatch above)
    recomputed = comparable and not trainer.engine.rollout_logprobs_are_old(stale_tis)
    fresh = pack(trajectories, pad_id, untrained, step - 1).loss_mask.to(trainer.device) if cfg.rollout.partial else batch.loss_mask
    metrics.update(step_metrics(trainer, rows, batch, old if recomputed else None, fresh, factor, metrics["timing_s/generate"]))
    metrics.update(rollout_metrics(gather_objects(rollouts.counts)))  # tallies differ in keys between ranks
    if trainer.validation and (step % cfg.train.validate_every == 0 or step == trainer.total):
        with phase("validate", metrics):
            metrics.update(validate(trainer, greedy, step))
    with phase("save", metrics):
        save(trainer, step, rows, metrics, rollout.state() if cfg.rollout.partial else None)
    metrics["timing_s/step"] = time.perf_counter() - started
    metrics.update(peak_memory(trainer.device))
    return metrics


def peak_memory(device: torch.device) -> dict:
    """The step's peak of the GPU memory PyTorch allocated on this rank (the log has rank 0's;
    vLLM's own pool is not in it), the count restarted for the next step. Nothing off CUDA."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"memory/peak_allocated_gib": peak}


def check_tool_failures(trainer: Trainer, step: int, groups: list[list[TrajectoryState]]) -> dict:
    """The step's tool failures over every rank, as metrics; over ``tools.max_failure_share`` the
    run stops before updating: rollouts whose searches failed would teach the policy that tools
    do not work. The last checkpoint stays, and a rerun resumes from it once the tools are back."""
    counts = merge_failure_counts(gather_objects(failure_counts(call for group in groups for t in group for call in t.tool_calls)))
    if degraded(counts, trainer.cfg.tools.max_failure_share):
        raise DegradedRun(
            f"step {step}: {describe_failures(counts)}, over tools.max_failure_share={trainer.cfg.tools.max_failure_share}: "
            f"stopped before updating on these rollouts; fix the tools and rerun to resume from the last checkpoint in {trainer.out}"
        )
    return {"tools/calls": counts["calls"], "tools/failed": counts["failed"], "tools/failure_share": counts["share"]}


def finish_shares(groups: list[list[TrajectoryState]]) -> dict:
    """The share of the step's trajectories (over every rank) by why they ended: how many were
    truncated (length, context) is the number to watch with algorithm.truncated."""
    local = Counter(t.finish_reason for group in groups for t in group)
    counts: Counter = sum(gather_objects(local), Counter())
    total = max(sum(counts.values()), 1)
    shares = {f"finish/{reason}": counts.get(reason, 0) / total for reason in FINISH_REASONS}
    return shares | {"finish/truncated": sum(counts.get(r, 0) for r in TRUNCATED) / total}


def check_engine_failures(trainer: Trainer, step: int, groups: list[list[TrajectoryState]]) -> dict:
    """The step's trajectories the engine failed on (``finish_reason == "error"``: a request it
    refused, a prompt past its context), counted by cause over every rank. They are never trained
    on (rl/batch.py masks them, and they are left out of their group's baseline); over
    ``tools.max_failure_share`` of the step's trajectories the run stops before updating, as it
    does for the tools: a step of mostly failures would train on nothing, for its whole budget."""
    causes = Counter((t.error or "no reason given").split(":")[0][:80] for group in groups for t in group if t.finish_reason == "error")
    parts = gather_objects((sum(len(group) for group in groups), causes))
    total = sum(n for n, _ in parts)
    failed: Counter = sum((c for _, c in parts), Counter())
    count = sum(failed.values())
    share = count / max(total, 1)
    if count and share > trainer.cfg.tools.max_failure_share:
        listed = ", ".join(f"{cause} ({n})" for cause, n in failed.most_common(5))
        raise DegradedRun(
            f"step {step}: the engine failed on {count} of {total} trajectories ({share:.1%}: {listed}), over "
            f"tools.max_failure_share={trainer.cfg.tools.max_failure_share}: stopped before updating on them; fix the engine's "
            f"settings and rerun to resume from the last checkpoint in {trainer.out}"
        )
    return {"engine/failed": count, "engine/failure_share": share}


def step_prompts(prompts: list[Prompt], step: int, per_step: int, seed: int) -> list[Prompt]:
    """The prompts of a step (counted from 1): epochs in a seeded order of their own, so the data
    position of a resumed run is the step number alone."""
    steps_per_epoch = len(prompts) // per_step  # the last partial step is dropped, as verl's loader does
    epoch, offset = divmod(step - 1, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(prompts))
    return [prompts[i] for i in order[offset * per_step : (offset + 1) * per_step]]


def balance_over_ranks(
    trainer: Trainer, trajectories: list[TrajectoryState], advantages: torch.Tensor
) -> tuple[list[TrajectoryState], torch.Tensor, dict]:
    """Each mini-batch's sequences, from every rank, dealt out again so that every rank holds the
    plan's number of them and about as many tokens: the ranks' forward and backward passes then
    take about as long, and none waits at the collectives for one that drew the long ones. Once
    its advantage is known a sequence stands alone, and the loss, a token mean over the whole
    mini-batch, is the same whichever rank computes it. Also returns how long the ranks wait, as
    tokens: the largest rank's tokens summed over the mini-batches (each optimizer step waits for
    its slowest rank), over the mean rank's, before and after."""
    size = trainer.plan.mini_batch_sequences_per_rank
    everyone = gather_objects(list(zip(trajectories, advantages.tolist())))
    mine: list = []
    largest_before = largest_after = total = 0
    for start in range(0, len(trajectories), size):
        pool = [item for part in everyone for item in part[start : start + size]]
        tokens = [len(t.prompt_ids) + len(t.response_ids) for t, _ in pool]
        groups = balanced_partition(tokens, trainer.world)
        mine += [pool[i] for i in groups[trainer.rank]]
        largest_before += max(sum(tokens[rank * size : (rank + 1) * size]) for rank in range(trainer.world))
        largest_after += max(sum(tokens[i] for i in group) for group in groups)
        total += sum(tokens)
    mean = total / trainer.world
    imbalance = {"balance/tokens_max_over_mean_before": largest_before / mean, "balance/tokens_max_over_mean_after": largest_after / mean}
    return [t for t, _ in mine], torch.tensor([a for _, a in mine]), imbalance


# Why a trajectory ends (etagent.agent.TrajectoryState.finish_reason), each a metric per step.
FINISH_REASONS = ("answer", "eos", "length", "context", "budget", "timeout", "format", "fake_result", "error")

# What the reward scored, in words, for the run's manifest.
REWARD_READS = {
    "default": "what the policy wrote: its text with tool results emptied, the tool calls that ran, its sampled tokens",
    "paper": "the whole decoded response, tool results included, as the paper's released code (an answer a tool printed counts)",
}


def score_truncated_as_wrong(rows: list[dict]) -> None:
    """``algorithm.truncated=wrong``: a truncated rollout (length, context) scores as a wrong
    answer, raw 0, its format penalty kept. In the default reward it already does: the policy
    cannot close an answer block without stopping (``</answer>`` is a stop string), so a cut
    response holds none of its own and fails the format. Only in the paper's mode, which reads
    tool results too, can a cut response score: an answer block a tool printed (docs/rl.md,
    "Truncated responses")."""
    for row in rows:
        if row["finish_reason"] in TRUNCATED:
            row["raw"], row["reward"] = 0.0, row["f_format"]


def rewards_of(groups: list[list[TrajectoryState]], prompts: list[Prompt], reward: RewardSettings, factor: float, tokenizer):
    """Per trajectory (flat, group by group): the reward terms, the length the reward used.

    The default mode reads only what the policy wrote: the answer and the format from the text
    with every tool result emptied (etagent.records.policy_text), the tool calls from those that
    ran, the length from the sampled tokens. The paper's mode reads the whole decoded response,
    tool results included, as its released code did: an answer a tool printed counts there."""
    rows = []
    for prompt, group in zip(prompts, groups):
        if reward.mode == "paper":  # as the released reward manager decoded it: no special tokens
            scored = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in group]
            lengths, calls = [len(t.response_ids) for t in group], [protocol.count_tool_calls(text) for text in scored]
        else:
            scored = [policy_text(t.response_ids, t.origin, tokenizer) for t in group]
            lengths, calls = [t.n_generated for t in group], [t.executed() for t in group]
        # the group's statistics (the tool-call mean, the length z-scores) are over the members
        # the engine served: a failure is no rollout, and its empty response would move them
        served = [k for k, t in enumerate(group) if t.finish_reason != "error"]
        terms = efficiency_reward(
            prompt.data_source,
            prompt.question.answer,
            [scored[k] for k in served],
            [lengths[k] for k in served],
            reward.sigma_tool * factor,
            reward.sigma_length * factor,
            reward.mode,
            tool_calls=[calls[k] for k in served],
        )
        at = {k: i for i, k in enumerate(served)}
        for k, t in enumerate(group):
            i = at.get(k)
            # a failure scores nothing (its advantage is 0 and its tokens masked: rl/algorithm.py)
            rows.append(
                {
                    "id": t.id,
                    "index": prompt.index,
                    "reward": 0.0 if i is None else terms.rewards[i],
                    "raw": 0.0 if i is None else terms.raw[i],
                    "tool_calls": calls[k],
                    "f_tool": 1.0 if i is None else terms.f_tool[i],
                    "f_length": 1.0 if i is None else terms.f_length[i],
                    "f_format": 0.0 if i is None else terms.f_format[i],
                    "length": lengths[k],
                    "finish_reason": t.finish_reason,
                    "error": t.error,
                    "text": tokenizer.decode(t.response_ids, skip_special_tokens=False),
                    "segments": origin_segments(t.response_ids, t.origin, tokenizer),
                }
            )
    return rows


def step_metrics(
    trainer: Trainer, rows: list[dict], batch: Batch, old: torch.Tensor | None, fresh: torch.Tensor, factor: float, generate_s: float
) -> dict:
    """The rollouts' means over every rank's rows the engine served; given the recomputed ``old``
    log-probabilities (vLLM, or partial rollouts with TIS), the rollout's mismatch with them over
    the policy tokens the current weights sampled (``fresh``, a loss mask)."""
    mask = batch.loss_mask
    served = [r for r in rows if r["finish_reason"] != "error"]  # failures are counted apart (engine/failed)
    local = [
        len(served),
        sum(r["reward"] for r in served),
        sum(r["raw"] for r in served),
        sum(r["tool_calls"] for r in served),
        sum(r["length"] for r in served),
        sum(r["f_format"] < 0 for r in served),
        float(mask.sum()),
    ]
    if old is not None:
        local += [logprob_mismatch(batch.rollout_logprobs, old, fresh)["mean_abs"] * float(fresh.sum()), float(fresh.sum())]
    n, reward, raw, calls, length, bad_format, policy_tokens, *mismatch = sum_all(local, trainer.device)
    n = max(n, 1.0)  # a step whose every trajectory failed stops before this (check_engine_failures)
    metrics = {
        "reward/mean": reward / n,
        "reward/raw": raw / n,
        "reward/sigma_factor": factor,
        "rollout/tool_calls": calls / n,
        "rollout/length": length / n,
        "rollout/bad_format": bad_format / n,
        "rollout/tokens_per_s": policy_tokens / max(generate_s, 1e-9),
    }
    if mismatch:
        metrics["rollout/logprob_mismatch"] = mismatch[0] / max(mismatch[1], 1.0)
    return metrics


def validate(trainer: Trainer, loop: AgentLoop, step: int) -> dict:
    """Greedy rollouts of the validation prompts (this rank's share), the paper's validation score."""
    prompts = trainer.validation[trainer.rank :: trainer.world]
    states = [loop.new(p.question, f"val{step}/{p.index}", seed=0, stage="rl-validation") for p in prompts]
    with trainer.engine.reading():
        asyncio.run(loop.run(states))
    texts = [loop.text(s) for s in states]
    decoded = [trainer.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in states]  # as the paper's
    scores = [validation_score(kind_of(p.data_source), t, p.question.answer) for p, t in zip(prompts, decoded)]
    raw = [raw_correctness(t, p.question.answer, p.data_source) for p, t in zip(prompts, texts)]
    calls = [s.executed() for s in states]
    n, total_score, total_raw, total_calls = sum_all([len(states), sum(scores), sum(raw), sum(calls)], trainer.device)
    n = max(n, 1.0)
    return {"val/score": total_score / n, "val/raw": total_raw / n, "val/tool_calls": total_calls / n, "val/prompts": n}


def save(trainer: Trainer, step: int, rows: list[dict], metrics: dict, in_flight: list | None) -> None:
    """The step's rollouts, then the checkpoint that commits the step (it carries the metrics and,
    with partial rollouts, the groups in flight, so a kill before the metrics line loses
    nothing), then a model export when one is due."""
    cfg = trainer.cfg
    every_rank = gather_objects(rows)
    if trainer.rank == 0:
        (trainer.out / "rollouts").mkdir(exist_ok=True)
        with open(trainer.out / "rollouts" / f"step_{step}.jsonl", "w") as f:
            for part in every_rank:
                for row in part:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if step % cfg.train.save_every == 0 or step == trainer.total:
        save_checkpoint(trainer.out, step, trainer.policy, trainer.optimizer, metrics, cfg.train.keep_checkpoints, in_flight)
    if step == trainer.total:
        trainer.export(trainer.out / "model")
    elif cfg.train.export_every and step % cfg.train.export_every == 0:
        trainer.export(trainer.out / "models" / f"step_{step}")


# ---------------------------------------------------------------------------------------------
# The run


def restore_metrics_log(trainer: Trainer) -> Path:
    """``metrics.jsonl`` up to the resumed step: lines logged after the checkpoint run again, and a
    checkpoint whose line a kill lost brings it back."""
    path = trainer.out / "metrics.jsonl"
    if trainer.rank == 0 and (path.exists() or trainer.start):
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= trainer.start]
        if trainer.start and (not kept or json.loads(kept[-1])["step"] < trainer.start):
            kept.append(json.dumps(trainer.resumed_metrics))
        path.write_text("".join(line + "\n" for line in kept))
    return path


def train(cfg: RLConfig) -> list[dict]:
    """Set up, run the steps left, export the model and write the manifest; return the metrics of
    the steps run. The process group ends with it, however it ends."""
    try:
        return run_steps(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_steps(cfg: RLConfig) -> list[dict]:
    from etagent.tools.executor import build_executor

    started = time.time()
    trainer = setup(cfg)
    metrics_path = restore_metrics_log(trainer)
    wandb_run = None
    if trainer.rank == 0 and cfg.wandb.enabled:
        import wandb

        wandb_run = wandb.init(
            project=cfg.wandb.project,
            name=cfg.wandb.run_name,
            mode=cfg.wandb.mode,
            dir=str(trainer.out),
            config=dataclasses.asdict(cfg),
        )
    tensorboard = None
    if trainer.rank == 0 and cfg.tensorboard.enabled:
        from tensorboardX import SummaryWriter

        # a resumed run drops the steps its killed predecessor logged after the checkpoint, as
        # restore_metrics_log does for metrics.jsonl
        tensorboard = SummaryWriter(str(trainer.out / "tensorboard"), purge_step=trainer.start + 1 if trainer.start else None)
    config = cfg.agent
    history = []
    with build_executor(cfg.tools) as executor:
        rollout_settings = cfg.rollout
        loop = AgentLoop(trainer.engine.generator, executor, config, segment_entropy(rollout_settings))
        # validation reads no entropies
        greedy = AgentLoop(trainer.engine.generator, executor, replace(config, sampling=replace(config.sampling, temperature=0.0)))
        rollout = make_rollout(rollout_settings)
        if rollout_settings.partial:
            rollout = PartialRollout(rollout, rollout_settings, trainer.plan.prompts_per_rank, trainer.prompts, trainer.rank)
            if trainer.in_flight is not None:
                rollout.restore(loop, trainer.in_flight)
        # a line per step in a log (a step is long); rank 0 alone updates it
        progress = Progress("rl", trainer.total, "step", initial=trainer.start, every_s=0)
        # on the CPU, torch's threads follow the cores other processes leave free (etagent/threads.py)
        free_cores = FreeCoreThreads() if trainer.device.type == "cpu" else None
        for step in range(trainer.start + 1, trainer.total + 1):
            if free_cores is not None:
                free_cores.adjust()
            metrics = train_step(trainer, step, loop, greedy, rollout)
            if trainer.rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if wandb_run is not None:
                    wandb_run.log(metrics, step=step)
                if tensorboard is not None:
                    for key, value in metrics.items():
                        if key != "step":
                            tensorboard.add_scalar(key, value, step)
                    tensorboard.flush()
                progress.update(
                    1,
                    reward=f"{metrics['reward/mean']:.3f}",
                    raw=f"{metrics['reward/raw']:.3f}",
                    tool_calls=f"{metrics['rollout/tool_calls']:.2f}",
                    length=f"{metrics['rollout/length']:.0f}",
                    grad_norm=f"{metrics['actor/grad_norm']:.3f}",
                    step_s=f"{metrics['timing_s/step']:.1f}",
                )
            history.append(metrics)
        progress.close()
    if not (trainer.out / "model").exists():
        # a rerun of a run killed between its last checkpoint and its final export
        trainer.export(trainer.out / "model")
    trainer.engine.close()
    if trainer.rank == 0:
        write_manifest(
            trainer.out,
            stage=f"rl/stage{cfg.rl_stage}",
            config=dataclasses.asdict(cfg),
            counts={"prompts": len(trainer.prompts), "steps": trainer.total},
            seed=trainer.seed,
            started_at=started,
            # a rerun of a finished run steps nothing: its last logged step is still the result
            metrics={
                **(history[-1] if history else trainer.resumed_metrics),
                "reward_reads": REWARD_READS[cfg.reward.mode],
                "questions_read": trainer.read_as,
            },
        )
        if wandb_run is not None:
            wandb_run.finish()
        if tensorboard is not None:
            tensorboard.close()
    return history

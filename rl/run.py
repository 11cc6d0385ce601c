"""RL: GRPO with the efficiency reward on a Pareto-selected parquet, one readable step.

    python -m rl.run [--preset tiny|paper] [overrides]           # or: etagent rl ...
    torchrun --nproc_per_node=2 -m rl.run ...                    # FSDP2 across processes

Reads the RL parquet of a curriculum stage (``data.train``, as ``pareto/`` writes it) and a
policy (``model``: a ``save_pretrained`` folder); writes into ``out_dir``: ``metrics.jsonl`` (one
line per step), ``rollouts/step_{k}.jsonl`` (every rollout with its reward terms),
``checkpoints/step_{k}/`` (``model/``, a plain ``save_pretrained`` folder the next stage and
the evaluation load as it is, plus ``optimizer.pt`` and ``state.json``), ``model/`` (the final
policy) and ``manifest.json``. A rerun resumes from the last checkpoint.

One step, as named and timed phases (``timing_s/<phase>`` in the metrics):

1. generate: n rollouts per prompt through the agent loop with the real tools (``rollout.kind``:
   ARPO's entropy-branching tree, or n independent samples; rl/rollout.py), sampled by the
   colocated engine (``engine.kind``): ``hf``, the policy module itself (it shares the weights:
   nothing to copy), or ``vllm``, one vLLM engine per rank in the trainer's process (torchrun),
   asleep outside this phase;
2. reward: the efficiency reward per prompt's group (rl/reward.py), sigmas decayed linearly over
   the run as in the paper;
3. old_logprobs (vllm only): the policy's log-probabilities of the sampled tokens before the
   update, and their mismatch with vLLM's own (a diagnostic). The hf engine samples with the
   policy module and its current weights, so its log-probabilities are the old ones already;
4. ref_logprobs (only with ``algorithm.kl_coef`` > 0): the same under a frozen copy of the
   run's starting policy;
5. advantage: GRPO, the group's mean and unbiased std;
6. update: for each mini-batch of prompts, the dual-clip PPO loss (plus the KL term, when on;
   AEPO's entropy-balanced clipping and entropy-aware advantage, when on) as an exact token mean
   over the mini-batch (micro-batches by token budget), one AdamW step with gradient clipping;
7. sync (vllm only): the updated weights gathered from their shards into the woken engine;
8. save: every ``save_every`` steps and at the end; 9. validate: every ``validate_every`` steps.

The policy is sharded with FSDP2 (``fully_shard`` per decoder layer, then the root; gloo on CPU,
NCCL on GPUs), also in one process. Each rank rolls out its share of the step's prompts; during
generation every layer stays gathered, so ranks that decode different lengths never wait on
each other.

What it does not do: choose a stage's data (pareto/) or chain the stages
(scripts/rl_curriculum.sh runs data, RL and evaluation per stage).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from etagent.agent import AgentConfig, AgentLoop, TrajectoryState
from etagent.records import write_manifest
from etagent.timing import phase
from rl.algorithm import entropy_aware_advantages, grpo_advantages, kl_estimate, logprob_mismatch, masked_sum, policy_loss
from rl.batch import Batch, micro_batches, pack, token_logprobs
from rl.reward import efficiency_reward, raw_correctness, sigma_factor, validation_score
from rl.rollout import Prompt, make_rollout, read_prompts, rollout_metrics

log = logging.getLogger("rl")


# ---------------------------------------------------------------------------------------------
# Setup


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size). Under torchrun, its process group; alone, a group of one (FSDP2 needs
    one; an in-memory store, no port)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def load_policy(path: str | Path, cfg: DictConfig, device: torch.device, world: int, trainable: bool = True):
    """The policy from a save_pretrained folder, sharded with FSDP2 over all ranks (the
    reference model too, frozen: ``trainable=False``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    # parameters stay float32 (the optimizer's copy); bf16 is the compute dtype on GPUs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if not trainable:
        model.requires_grad_(False).eval()
    elif cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world,))
    compute = getattr(torch, cfg.train.compute_dtype)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, tokenizer


@contextmanager
def gathered(model):
    """Every FSDP2 group's parameters gathered for the whole block, so that forward passes issue
    no collectives: generation on each rank runs as many forwards as its own rollouts need."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def build_rollout_engine(cfg: DictConfig, model, tokenizer, path: Path):
    """The colocated rollout engine. ``hf`` samples with the policy module itself; ``vllm`` is one
    engine per rank in this process (vLLM's external launcher under torchrun: every rank
    generates on its own), loaded from the policy's folder and then kept in step by
    :func:`sync_engine` after every update."""
    from etagent.llm import make_engine
    from etagent.llm.hf import HFEngine

    if cfg.engine.kind == "hf":
        return HFEngine.from_model(model, tokenizer, max_batch_size=cfg.engine.max_batch_size)
    return make_engine(OmegaConf.merge(cfg.engine, {"model": str(path), "vllm": {"colocated": True}}))


def check_engine_choice(cfg: DictConfig) -> None:
    """Before anything starts: RL's engine is hf or a colocated vllm, which needs torchrun."""
    if cfg.engine.kind not in ("hf", "vllm"):
        raise ValueError(f"engine.kind must be hf or vllm for RL, got {cfg.engine.kind!r}")
    if cfg.engine.kind == "vllm" and "RANK" not in os.environ:
        raise ValueError("engine.kind=vllm runs one engine per rank under torchrun: launch with scripts/rl.sh or torchrun -m rl.run")


def engine_reads_policy(cfg: DictConfig, model):
    """What generation needs around it: the hf engine runs the sharded policy, so every layer
    stays gathered; vLLM holds its own copy."""
    return gathered(model) if cfg.engine.kind == "hf" else nullcontext()


def full_weights(model, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The policy's whole state dict on every rank, each parameter gathered from its shards and
    cast to the engine's dtype (a 7B model in bf16: 15 GB while the engine's weights are awake)."""
    from torch.distributed.tensor import DTensor

    weights = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        weights[name] = full.detach().to(dtype) if dtype is not None else full.detach()
    return weights


def sync_engine(engine, model, cfg: DictConfig) -> None:
    """The updated weights into the sleeping vLLM engine: its weights woken first, then the
    update, then its KV cache, which keeps the peak memory low."""
    dtype = None if cfg.engine.dtype == "auto" else getattr(torch, cfg.engine.dtype)
    weights = full_weights(model, dtype)
    engine.wake_up(["weights"])
    engine.update_weights(weights)
    del weights
    engine.wake_up(["kv_cache"])


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(out: Path, step: int, model, tokenizer, optimizer, rank: int, metrics: dict, final: bool = False) -> Path:
    """``checkpoints/step_{k}/``: the policy as a plain save_pretrained folder, the optimizer, and
    the step with its metrics (``state.json``: a kill before the metrics line is written loses
    nothing); written to a temporary folder and renamed, so a kill never leaves half of one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    folder = out / "checkpoints" / f"step_{step}"
    if rank == 0:
        tmp = folder.with_name(folder.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        # save_pretrained edits the dict it is given (tied weights): give it a copy each time
        model.save_pretrained(tmp / "model", state_dict=dict(weights), safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, "metrics": metrics}) + "\n")
        tmp.rename(folder)
        if final:
            export_final(out, folder)
    dist.barrier()
    return folder


def export_final(out: Path, checkpoint: Path) -> None:
    """``out_dir/model``: the final checkpoint's policy, copied whole or not at all."""
    tmp = out / "model.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(checkpoint / "model", tmp)
    if (out / "model").exists():
        shutil.rmtree(out / "model")
    tmp.rename(out / "model")


def latest_checkpoint(out: Path) -> Path | None:
    steps = [(int(p.name.split("_")[1]), p) for p in (out / "checkpoints").glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(steps)[1] if steps else None


def load_optimizer(model, optimizer, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(path, map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------
# The step's pieces


def step_prompts(prompts: list[Prompt], step: int, per_step: int, seed: int) -> list[Prompt]:
    """The prompts of a step (counted from 1): epochs in a seeded order of their own, so the data
    position of a resumed run is the step number alone."""
    steps_per_epoch = len(prompts) // per_step  # the last partial step is dropped, as verl's loader does
    epoch, offset = divmod(step - 1, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(prompts))
    return [prompts[i] for i in order[offset * per_step : (offset + 1) * per_step]]


def rewards_of(groups: list[list[TrajectoryState]], prompts: list[Prompt], cfg: DictConfig, factor: float, loop: AgentLoop):
    """Per trajectory (flat, group by group): the reward terms, the length the reward used."""
    rows = []
    for prompt, group in zip(prompts, groups):
        texts = [loop.text(t) for t in group]
        # the paper counted every response token (tool results too); the default counts what the policy wrote
        lengths = [len(t.response_ids) if cfg.reward.mode == "paper" else t.n_generated for t in group]
        terms = efficiency_reward(
            prompt.data_source,
            prompt.question.answer,
            texts,
            lengths,
            cfg.reward.sigma_tool * factor,
            cfg.reward.sigma_length * factor,
            cfg.reward.mode,
        )
        for k, t in enumerate(group):
            rows.append(
                {
                    "id": t.id,
                    "index": prompt.index,
                    "reward": terms.rewards[k],
                    "raw": terms.raw[k],
                    "tool_calls": terms.tool_calls[k],
                    "f_tool": terms.f_tool[k],
                    "f_length": terms.f_length[k],
                    "f_format": terms.f_format[k],
                    "length": lengths[k],
                    "finish_reason": t.finish_reason,
                    "text": texts[k],
                }
            )
    return rows


def update(
    model, optimizer, batch: Batch, advantages: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, cfg: DictConfig, device
) -> dict:
    """One optimizer step per mini-batch of ``mini_batch_prompts`` prompts; the step's metrics.

    Every rank takes the same number of optimizer steps and of micro-batches per step (each
    backward is a collective under FSDP2): a rank with fewer micro-batches runs its first one
    again with the loss multiplied by zero."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    # rank r holds prompts r, r + world, ... of the step, so a global mini-batch of M prompts is
    # M / world consecutive prompts on every rank
    per_mini = cfg.train.mini_batch_prompts // world * cfg.rollout.n
    rows = list(range(batch.input_ids.shape[0]))
    minis = [rows[i : i + per_mini] for i in range(0, len(rows), per_mini)]
    n_minis = int(max_all([len(minis)], device)[0])
    minis += [[]] * (n_minis - len(minis))
    sums = dict.fromkeys(("loss", "clipped_tokens", "dual_clipped_tokens", "entropy", "kl", "policy_tokens", "grad_norm"), 0.0)
    row_tokens = batch.tokens()
    for mini in minis:
        local_tokens = float(batch.loss_mask[mini].sum()) if mini else 0.0
        tokens = max(sum_all([local_tokens], device)[0], 1.0)
        parts = [[mini[i] for i in part] for part in micro_batches([row_tokens[i] for i in mini], cfg.train.micro_batch_tokens)]
        n_parts = int(max_all([len(parts)], device)[0])
        for k in range(n_parts):
            rows_, weight = (parts[k], 1.0) if k < len(parts) else ([0], 0.0)
            micro = batch.select(rows_)
            logprobs, entropy = token_logprobs(model, micro, with_entropy=True)
            micro_advantages = advantages[rows_]
            if cfg.algorithm.entropy_aware_advantage:  # AEPO: standardised over this micro-batch's tokens, as the reference
                micro_advantages = entropy_aware_advantages(micro_advantages, entropy, micro.loss_mask)
            terms = policy_loss(
                logprobs,
                old[rows_, : micro.response_width],
                micro_advantages,
                micro.loss_mask,
                tokens / world,  # gradients are averaged over ranks: this makes it a sum over all tokens / tokens
                cfg.algorithm.clip_low,
                cfg.algorithm.clip_high,
                cfg.algorithm.clip_c,
                cfg.algorithm.entropy_balanced_clipping,
            )
            loss = terms.loss
            if ref is not None:
                # verl's use_kl_loss: the estimator's token mean over the mini-batch, like the policy loss
                kl = masked_sum(kl_estimate(logprobs, ref[rows_, : micro.response_width], cfg.algorithm.kl_estimator), micro.loss_mask)
                loss = loss + cfg.algorithm.kl_coef * kl / (tokens / world)
                sums["kl"] += weight * kl.item()
            (loss * weight).backward()
            sums["loss"] += weight * loss.item() / world
            sums["clipped_tokens"] += weight * terms.clipped_tokens.item()
            sums["dual_clipped_tokens"] += weight * terms.dual_clipped_tokens.item()
            sums["entropy"] += weight * float(masked_sum(entropy, micro.loss_mask))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums["policy_tokens"] += tokens
        sums["grad_norm"] += float(grad_norm) / n_minis
    loss_sum, clipped, dual, entropy, kl = sum_all(
        [sums["loss"], sums["clipped_tokens"], sums["dual_clipped_tokens"], sums["entropy"], sums["kl"]], device
    )
    kl_metrics = {"actor/kl": kl / max(sums["policy_tokens"], 1.0)} if ref is not None else {}
    return kl_metrics | {
        "actor/loss": loss_sum / n_minis,
        "actor/clip_fraction": clipped / max(sums["policy_tokens"], 1.0),
        "actor/dual_clip_fraction": dual / max(sums["policy_tokens"], 1.0),
        # of the distributions the tokens were drawn from, as each mini-batch's forward sees them
        "actor/entropy": entropy / max(sums["policy_tokens"], 1.0),
        "actor/grad_norm": sums["grad_norm"],
        "actor/optimizer_steps": n_minis,
        "actor/policy_tokens": sums["policy_tokens"],
    }


def sum_all(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def max_all(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------
# The run


def response_logprobs(model, batch: Batch, budget: int) -> torch.Tensor:
    """Every response token's log-probability under ``model``, micro-batch by micro-batch (the
    caller gathers the model: ranks may run different numbers of micro-batches)."""
    logprobs = torch.zeros_like(batch.rollout_logprobs)
    for part in micro_batches(batch.tokens(), budget):
        micro = batch.select(part)
        lp, _ = token_logprobs(model, micro)
        logprobs[part, : micro.response_width] = lp.float()
    return logprobs


def validate(model, loop: AgentLoop, prompts: list[Prompt], step: int, cfg: DictConfig, device) -> dict:
    """Greedy rollouts of the validation prompts (this rank's share), the paper's validation score."""
    states = [loop.new(p.question, f"val{step}/{p.index}", seed=0, stage="rl-validation") for p in prompts]
    with engine_reads_policy(cfg, model):
        asyncio.run(loop.run(states))
    texts = [loop.text(s) for s in states]
    scores = [validation_score(p.data_source, t, p.question.answer) for p, t in zip(prompts, texts)]
    raw = [raw_correctness(t, p.question.answer, p.data_source) for p, t in zip(prompts, texts)]
    calls = [s.executed() for s in states]
    n, total_score, total_raw, total_calls = sum_all([len(states), sum(scores), sum(raw), sum(calls)], device)
    n = max(n, 1.0)
    return {"val/score": total_score / n, "val/raw": total_raw / n, "val/tool_calls": total_calls / n, "val/prompts": n}


def run(cfg: DictConfig) -> list[dict]:
    """Train from the last checkpoint in cfg.out_dir (or cfg.model); return the metrics of the steps run."""
    from dataclasses import replace

    from tqdm import tqdm

    from etagent.tools.executor import build_executor

    started = time.time()
    check_engine_choice(cfg)
    device = torch.device(cfg.train.device)
    rank, world = init_distributed(device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(out)
    state = json.loads((checkpoint / "state.json").read_text()) if checkpoint else {"step": 0}
    start = state["step"]
    seed = int(cfg.train.seed)
    random.seed(seed)
    torch.manual_seed(seed)

    policy_path = Path(checkpoint / "model" if checkpoint else cfg.model)
    model, tokenizer = load_policy(policy_path, cfg, device, world)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, eps=cfg.optim.eps
    )
    # the KL term's reference is the stage's starting policy, also after a resume
    reference = load_policy(cfg.model, cfg, device, world, trainable=False)[0] if cfg.algorithm.kl_coef > 0 else None
    if checkpoint:
        load_optimizer(model, optimizer, checkpoint / "optimizer.pt")
        log.info("resuming after step %d from %s", start, checkpoint)
    prompts = read_prompts(cfg.data.train, tokenizer, cfg.data.max_prompt_tokens)
    validation = read_prompts(cfg.data.validation, tokenizer, cfg.data.max_prompt_tokens) if cfg.data.validation else []
    per_step = int(cfg.data.prompts_per_step)
    for name, value in (("data.prompts_per_step", per_step), ("train.mini_batch_prompts", int(cfg.train.mini_batch_prompts))):
        if value % world:
            raise ValueError(f"{name} ({value}) must be a multiple of the number of processes ({world})")
    if len(prompts) < per_step:
        raise ValueError(f"{cfg.data.train} has {len(prompts)} prompts, fewer than data.prompts_per_step ({per_step})")
    total = int(cfg.train.max_steps or len(prompts) // per_step * cfg.data.epochs)

    metrics_path = out / "metrics.jsonl"
    if rank == 0 and (metrics_path.exists() or start):
        # steps logged after the checkpoint run again; a checkpoint whose line a kill lost brings it back
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= start]
        if start and (not kept or json.loads(kept[-1])["step"] < start):
            kept.append(json.dumps(state["metrics"]))
        metrics_path.write_text("".join(line + "\n" for line in kept))
        if start >= total and not (out / "model").exists():
            export_final(out, checkpoint)
    wandb_run = None
    if rank == 0 and cfg.wandb.enabled:
        import wandb

        wandb_run = wandb.init(
            project=cfg.wandb.project,
            name=cfg.wandb.run_name,
            mode=cfg.wandb.mode,
            dir=str(out),
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    engine = build_rollout_engine(cfg, model, tokenizer, policy_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = AgentConfig(**OmegaConf.to_container(cfg.agent, resolve=True))
    history = []
    with build_executor(cfg.tools) as executor:
        loop = AgentLoop(engine, executor, config)
        greedy = AgentLoop(engine, executor, replace(config, temperature=0.0))
        rollout = make_rollout(cfg.rollout)
        progress = tqdm(total=total, initial=start, desc="rl", unit="step", disable=None if rank == 0 else True, dynamic_ncols=True)
        for step in range(start + 1, total + 1):
            metrics: dict = {"step": step}
            step_started = time.perf_counter()
            chosen = step_prompts(prompts, step, per_step, seed)[rank::world]
            loop.policy_version = f"step{step - 1}"

            with phase("generate", metrics), engine_reads_policy(cfg, model):
                rollouts = rollout.generate(loop, chosen, step, seed)
                groups = rollouts.groups
                # vLLM frees its GPU memory for the trainer: level 2 drops the weights too (the sync
                # brings new ones; vLLM keeps its buffers), a no-op elsewhere
                engine.sleep(level=2)
            with phase("reward", metrics):
                factor = sigma_factor(step, total) if cfg.reward.decay else 1.0
                rows = rewards_of(groups, chosen, cfg, factor, loop)
            trajectories = [t for group in groups for t in group]
            batch = pack(trajectories, pad_id).to(device)
            if cfg.engine.kind == "hf":
                # sampled by this module with these weights: recomputing would repeat the rollout's forwards
                old = batch.rollout_logprobs
            else:
                with phase("old_logprobs", metrics), gathered(model), torch.no_grad():
                    old = response_logprobs(model, batch, cfg.train.micro_batch_tokens)
            ref = None
            if reference is not None:
                with phase("ref_logprobs", metrics), gathered(reference), torch.no_grad():
                    ref = response_logprobs(reference, batch, cfg.train.micro_batch_tokens)
            with phase("advantage", metrics):
                scores = torch.tensor([r["reward"] for r in rows])
                advantages = grpo_advantages(scores, torch.tensor([r["index"] for r in rows]), cfg.algorithm.eps).to(device)
            with phase("update", metrics):
                model.train()
                metrics.update(update(model, optimizer, batch, advantages, old, ref, cfg, device))
            if cfg.engine.kind == "vllm":
                with phase("sync", metrics):
                    sync_engine(engine, model, cfg)
            # step metrics, summed over ranks
            mask = batch.loss_mask
            local = [
                len(rows),
                sum(r["reward"] for r in rows),
                sum(r["raw"] for r in rows),
                sum(r["tool_calls"] for r in rows),
                sum(r["length"] for r in rows),
                sum(r["f_format"] < 0 for r in rows),
                float(mask.sum()),
            ]
            n, reward, raw, calls, length, bad_format, policy_tokens = sum_all(local, device)
            metrics.update(
                {
                    "reward/mean": reward / n,
                    "reward/raw": raw / n,
                    "reward/sigma_factor": factor,
                    "rollout/tool_calls": calls / n,
                    "rollout/length": length / n,
                    "rollout/bad_format": bad_format / n,
                    "rollout/tokens_per_s": policy_tokens / max(metrics["timing_s/generate"], 1e-9),
                }
            )
            counts = [None] * world  # the tree rollout's tallies differ in keys between ranks (rounds)
            dist.all_gather_object(counts, rollouts.counts)
            metrics.update(rollout_metrics(counts))
            if cfg.engine.kind == "vllm":
                mismatch = logprob_mismatch(batch.rollout_logprobs, old, mask)["mean_abs"] * float(mask.sum())
                metrics["rollout/logprob_mismatch"] = sum_all([mismatch], device)[0] / max(policy_tokens, 1.0)
            if validation and (step % cfg.train.validate_every == 0 or step == total):
                with phase("validate", metrics):
                    metrics.update(validate(model, greedy, validation[rank::world], step, cfg, device))

            # the rollouts, then the checkpoint that commits the step, then its metrics line
            gathered_rows = [None] * world
            dist.all_gather_object(gathered_rows, rows)
            if rank == 0:
                (out / "rollouts").mkdir(exist_ok=True)
                with open(out / "rollouts" / f"step_{step}.jsonl", "w") as f:
                    for part in gathered_rows:
                        for row in part:
                            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            with phase("save", metrics):
                if step % cfg.train.save_every == 0 or step == total:
                    save_checkpoint(out, step, model, tokenizer, optimizer, rank, metrics, final=step == total)
            metrics["timing_s/step"] = time.perf_counter() - step_started
            if rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if wandb_run is not None:
                    wandb_run.log(metrics, step=step)
                log.info(
                    "step %d/%d: reward %.3f, raw %.3f, tool calls %.2f, length %.0f, grad norm %.3f, %.1f s",
                    step,
                    total,
                    metrics["reward/mean"],
                    metrics["reward/raw"],
                    metrics["rollout/tool_calls"],
                    metrics["rollout/length"],
                    metrics["actor/grad_norm"],
                    metrics["timing_s/step"],
                )
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", raw=f"{metrics['reward/raw']:.3f}")
            history.append(metrics)
        progress.close()
    if cfg.engine.kind == "vllm":
        engine.shutdown()
    if rank == 0:
        write_manifest(
            out,
            stage=f"rl/stage{cfg.rl_stage}",
            config=OmegaConf.to_container(cfg, resolve=True),
            inputs=[cfg.data.train],
            counts={"prompts": len(prompts), "steps": total},
            seed=seed,
            started_at=started,
            # a rerun of a finished run steps nothing: its last logged step is still the result
            metrics=history[-1] if history else state.get("metrics", {}),
        )
        if wandb_run is not None:
            wandb_run.finish()
    return history


def main(argv: list[str] | None = None) -> None:
    from etagent.config import parse_stage_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_stage_args("rl", argv, prog="python -m rl.run", doc=__doc__)
    try:
        run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

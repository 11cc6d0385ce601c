"""The policy's work on a step's batch: the log-probabilities of its tokens (the old ones behind
vLLM, the KL reference's) and the PPO update over the batch plan's mini-batches.

The loss is an exact token mean over each mini-batch across its micro-batches and ranks
(rl/algorithm.py), so how rows are grouped into forward passes changes no number beyond
rounding; micro-batches are rows grouped longest first within ``train.micro_batch_tokens``
computed positions, packed into one sequence without padding where the policy's attention is
flash-attention, padded to their longest row otherwise (rl/batch.py). What
this module does not do: generate, score, or decide the plan (rl/batch.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from etagent.divergence import largest_magnitude
from etagent.rl.algorithm import (
    entropy_aware_advantages,
    entropy_moments,
    entropy_standardisation,
    kl_estimate,
    masked_sum,
    policy_loss,
    truncated_importance_weights,
)
from etagent.rl.batch import Batch, ForwardPass, forward_passes, token_logprobs
from etagent.rl.distributed import max_all, sum_all
from etagent.rl.policy import Policy

if TYPE_CHECKING:  # for the annotations only: the trainer imports this module
    from etagent.rl.trainer import Trainer


class NonFiniteUpdate(RuntimeError):
    """A mini-batch's gradient norm was not finite (raised before its optimizer step; the
    message says which of the loss's inputs were not finite where), or its step left weights
    that are not finite or far past the run's range (etagent/divergence.py). Either way nothing of the step is saved: the trainer stops
    (etagent.errors.TrainingDiverged) before its save phase."""


def non_finite(values: dict[str, torch.Tensor], mask: torch.Tensor) -> list[str]:
    """Which of ``values`` (each (B, R)) hold non-finite numbers at the policy tokens (``mask``)."""
    tokens = mask.bool()
    found = []
    for name, tensor in values.items():
        bad = int((~torch.isfinite(tensor[tokens])).sum())
        if bad:
            found.append(f"{name}: {bad} of {int(tokens.sum())} policy tokens")
    return found


def response_logprobs(policy: Policy, batch: Batch, budget: int, share_prefixes: bool) -> torch.Tensor:
    """Every response token's log-probability under ``policy``, pass by pass (rl/batch.py's
    forward_passes; the caller gathers the policy: ranks may run different numbers of passes)."""
    logprobs = torch.zeros_like(batch.rollout_logprobs)
    rows = list(range(batch.input_ids.shape[0]))
    for step in forward_passes(batch, rows, budget, policy.packs_sequences, share_prefixes):
        micro = batch.forward(step, policy.packs_sequences, policy.eager)
        lp, _ = token_logprobs(policy, micro)
        logprobs[step.rows, : micro.response_width] = lp.float()
    return logprobs


@dataclass
class StepBatch:
    """A step's rollouts as the update reads them: packed (``batch``), their ``advantages``, the
    ``old`` log-probabilities of the sampled tokens and the KL reference's (``ref``, or None).

    ``rollout_mismatch``: also report how far the rollout engine's log-probabilities are from the
    trainer's (``rollout/logprob_mismatch``, mean absolute difference per policy token), measured
    on the first mini-batch, before any optimizer step, when the trainer's weights are still those
    that sampled: for an engine whose log-probabilities serve as the old ones (hf), at no extra
    forward pass.

    ``tis_cap``: the rollouts came from another engine, whose log-probabilities are in
    ``batch.rollout_logprobs``; each token's loss is weighted by truncated importance sampling
    (:func:`etagent.rl.algorithm.truncated_importance_weights`, ``old`` over the rollout's,
    capped), and the metrics say how large the ratios were and how many were cut."""

    batch: Batch
    advantages: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    rollout_mismatch: bool = False
    tis_cap: float | None = None


SUMS = ("loss", "clipped_tokens", "dual_clipped_tokens", "entropy", "kl", "policy_tokens", "grad_norm", "mismatch")
SUMS += ("computed_tokens", "path_tokens")


def update(trainer: Trainer, step: StepBatch) -> dict:
    """One optimizer step per mini-batch of the trainer's plan over the step's batch; the step's
    metrics (summed over ranks). Reads the trainer's policy, optimizer, plan, device and settings
    (``train``, ``algorithm``, ``optim``).

    Every rank takes the same number of optimizer steps and of micro-batches per step (each
    backward is a collective under FSDP2): a rank with fewer micro-batches runs its first one
    again with the loss multiplied by zero."""
    size = trainer.plan.mini_batch_sequences_per_rank
    minis = [list(range(k * size, (k + 1) * size)) for k in range(trainer.plan.optimizer_steps)]
    assert minis[-1][-1] == step.batch.input_ids.shape[0] - 1, "a rank's rollouts are not the plan's"
    sums = dict.fromkeys(SUMS, 0.0)
    weights = None if step.tis_cap is None else truncated_importance_weights(step.old, step.batch.rollout_logprobs, step.tis_cap)
    for number, mini in enumerate(minis):
        mini_batch_update(trainer, step, mini, f"mini-batch {number + 1} of {len(minis)}", weights, sums, first=number == 0)
    return update_metrics(trainer.device, step, sums, minis)


def mini_batch_update(trainer: Trainer, step: StepBatch, mini: list[int], where: str, weights, sums: dict, first: bool) -> None:
    """The loss over one mini-batch's micro-batches, backward, then one optimizer step; adds to
    ``sums``. ``weights``: the batch's truncated importance weights, or None."""
    policy, device, cfg, batch, old = trainer.policy, trainer.device, trainer.cfg, step.batch, step.old
    world = dist.get_world_size()
    problems: list[str] = []  # micro-batches whose loss was not finite, and which of its inputs
    largest_gap = 0.0  # the largest |log-prob - old log-prob| at a policy token
    trained_tokens = sum_all([float(batch.loss_mask[mini].sum())], device)[0]
    tokens = max(trained_tokens, 1.0)  # the loss's divisor: a mini-batch of none (all masked) has a loss of 0
    parts = forward_passes(batch, mini, cfg.train.micro_batch_tokens, policy.packs_sequences, cfg.train.share_prefixes)
    n_parts = int(max_all([len(parts)], device)[0])
    standardisation = None
    if cfg.algorithm.entropy_aware_advantage:  # AEPO: z over the optimizer step's tokens, every rank's
        standardisation = mini_batch_entropy(policy, batch, parts, n_parts, device)
    row_tokens = batch.tokens()
    for k in range(n_parts):
        part, weight = (parts[k], 1.0) if k < len(parts) else (parts[0], 0.0)
        rows = part.rows
        micro = batch.forward(part, policy.packs_sequences, policy.eager)
        sums["computed_tokens"] += weight * micro.tokens()
        sums["path_tokens"] += weight * sum(row_tokens[i] for i in rows)
        logprobs, entropy = token_logprobs(policy, micro, with_entropy=True)
        if step.rollout_mismatch and first:
            gap = (logprobs.detach().float() - batch.rollout_logprobs[rows, : micro.response_width]).abs()
            sums["mismatch"] += weight * float(masked_sum(gap, micro.loss_mask))
        micro_advantages = step.advantages[rows]
        if standardisation is not None:
            micro_advantages = entropy_aware_advantages(micro_advantages, entropy, *standardisation)
        terms = policy_loss(
            logprobs,
            old[rows, : micro.response_width],
            micro_advantages,
            micro.loss_mask,
            tokens / world,  # gradients are averaged over ranks: this makes it a sum over all tokens / tokens
            cfg.algorithm.clip_low,
            cfg.algorithm.clip_high,
            cfg.algorithm.clip_c,
            cfg.algorithm.entropy_balanced_clipping,
            None if weights is None else weights[rows, : micro.response_width],
            cfg.algorithm.log_ratio_clamp,
        )
        loss = terms.loss
        if step.ref is not None:
            # verl's use_kl_loss: the estimator's token mean over the mini-batch, like the policy loss
            kl = masked_sum(kl_estimate(logprobs, step.ref[rows, : micro.response_width], cfg.algorithm.kl_estimator), micro.loss_mask)
            loss = loss + cfg.algorithm.kl_coef * kl / (tokens / world)
            sums["kl"] += weight * kl.item()
        if not math.isfinite(loss.item()):
            problems.append(describe_non_finite_loss(loss, rows, logprobs, old, micro_advantages, weights, micro.loss_mask))
        largest_gap = max(largest_gap, largest_logprob_gap(logprobs, old[rows, : micro.response_width], micro.loss_mask))
        (loss * weight).backward()
        sums["loss"] += weight * loss.item() / world
        sums["clipped_tokens"] += weight * terms.clipped_tokens.item()
        sums["dual_clipped_tokens"] += weight * terms.dual_clipped_tokens.item()
        sums["entropy"] += weight * float(masked_sum(entropy, micro.loss_mask))
    grad_norm = optimizer_step(policy, trainer.optimizer, cfg.optim.grad_clip, device, where, problems, largest_gap)
    sums["policy_tokens"] += trained_tokens
    sums["grad_norm"] += float(grad_norm) / trainer.plan.optimizer_steps


def update_metrics(device: torch.device, step: StepBatch, sums: dict, minis: list[list[int]]) -> dict:
    """The update's metrics from its per-rank sums, summed over ranks."""
    first_tokens = float(step.batch.loss_mask[minis[0]].sum())
    names = ("loss", "clipped_tokens", "dual_clipped_tokens", "entropy", "kl", "mismatch", "computed_tokens", "path_tokens")
    total = dict(zip(names + ("first_tokens",), sum_all([sums[name] for name in names] + [first_tokens], device)))
    policy_tokens = max(sums["policy_tokens"], 1.0)
    extra = {"actor/kl": total["kl"] / policy_tokens} if step.ref is not None else {}
    if step.rollout_mismatch:
        extra["rollout/logprob_mismatch"] = total["mismatch"] / max(total["first_tokens"], 1.0)
    if step.tis_cap is not None:
        extra.update(importance_ratio_metrics(step.old, step.batch, step.tis_cap, device))
    return extra | {
        "actor/loss": total["loss"] / len(minis),
        "actor/clip_fraction": total["clipped_tokens"] / policy_tokens,
        "actor/dual_clip_fraction": total["dual_clipped_tokens"] / policy_tokens,
        # of the distributions the tokens were drawn from, as each mini-batch's forward sees them
        "actor/entropy": total["entropy"] / policy_tokens,
        "actor/grad_norm": sums["grad_norm"],
        "actor/optimizer_steps": len(minis),
        "actor/policy_tokens": sums["policy_tokens"],
        # positions the update's forward passes computed (padding included), against the paths'
        # own tokens: below 1 where prefix trees shared their prompts and branches
        "actor/computed_tokens": total["computed_tokens"],
        "actor/computed_over_path_tokens": total["computed_tokens"] / max(total["path_tokens"], 1.0),
    }


@torch.no_grad()
def mini_batch_entropy(policy: Policy, batch: Batch, parts: list[ForwardPass], n_parts: int, device) -> tuple[float, float]:
    """The mean and std of the token entropies over a mini-batch's policy tokens on every rank,
    under the current weights, for AEPO's entropy-aware advantage: one forward pass without
    gradients over the mini-batch's micro-batches before its update (the statistic needs every
    token before the first backward), as many passes on every rank (each is a collective under
    FSDP2). The reference standardised per micro-batch, which made the step depend on
    ``train.micro_batch_tokens`` and the number of ranks."""
    moments = torch.zeros(3, dtype=torch.float64)
    for k in range(n_parts):
        micro = batch.forward(parts[k] if k < len(parts) else parts[0], policy.packs_sequences, policy.eager)
        _, entropy = token_logprobs(policy, micro, with_entropy=True)
        if k < len(parts):
            moments += entropy_moments(entropy, micro.loss_mask).cpu()
    return entropy_standardisation(torch.tensor(sum_all(moments.tolist(), device), dtype=torch.float64))


def optimizer_step(
    policy: Policy, optimizer: torch.optim.Optimizer, grad_clip: float, device: torch.device, where: str, problems: list[str], gap: float
) -> float:
    """Clip the gradient and step, or raise :class:`NonFiniteUpdate` without stepping when its norm
    is not finite or a micro-batch's loss was not (on any rank: all of them stop), saying what
    the micro-batches found (``problems``, the largest |log-prob - old| ``gap``); also when the
    step itself left weights that are not finite or far past their range. The clipped gradient's
    norm before clipping. (A NaN input can leave the gradient finite: the log-ratio clamp passes
    no gradient to it. Its loss is NaN all the same.)"""
    from torch.distributed.tensor import DTensor

    if policy.weight_check.limit is None:  # from the weights this run (or its resume) starts with
        policy.weight_check.start(max_all([largest_magnitude(policy)], device)[0])
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    if not math.isfinite(float(grad_norm)) or max_all([float(len(problems))], device)[0]:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteUpdate(
            f"{where}: gradient norm {float(grad_norm)}{', a micro-batch loss not finite' if problems else ''}, so its optimizer step was not taken "
            f"(the weights are those before it). On this rank: {' | '.join(problems) or 'every micro-batch loss finite'}; "
            f"largest |log-prob - old log-prob| at a policy token {gap:.4g}"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # a finite gradient can still take a step that overflows, or nearly (a learning rate far too high)
    broken = max_all([float(policy.weight_check.broken(policy))], device)[0]
    if broken:
        raise NonFiniteUpdate(
            f"{where}: its optimizer step (gradient norm {float(grad_norm):.4g}) left "
            f"{int(broken)} parameter values {policy.weight_check.describe()} on a rank"
        )
    return float(grad_norm)


def describe_non_finite_loss(loss, rows, logprobs, old, advantages, weights, mask) -> str:
    """Which of a micro-batch's loss inputs were not finite, and where (for the error the
    optimizer step raises if the gradient is not finite either)."""
    width = logprobs.shape[1]
    inputs = {"log-probabilities": logprobs.detach(), "old log-probabilities": old[rows, :width]}
    inputs["advantages"] = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    if weights is not None:
        inputs["importance weights"] = weights[rows, :width]
    found = non_finite(inputs, mask)
    outside = int((~torch.isfinite(logprobs.detach()[mask == 0])).sum())
    if outside:  # masked positions still reach the sum (0 x NaN is NaN)
        found.append(f"log-probabilities outside the loss mask: {outside}")
    return f"rows {rows}: loss {loss.item()}; " + ("; ".join(found) or "its inputs finite")


def largest_logprob_gap(logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |log-prob - old log-prob| at a policy token: a ratio exp(gap) that overflows
    has a NaN gradient even where clipped."""
    policy_tokens = mask.bool()
    if not policy_tokens.any():
        return 0.0
    return float((logprobs.detach().float() - old.float())[policy_tokens].abs().max())


def importance_ratio_metrics(old: torch.Tensor, batch: Batch, tis_cap: float, device: torch.device) -> dict:
    """How large the trainer-over-rollout probability ratios were, and the share TIS cut."""
    ratio = torch.exp(old.float() - batch.rollout_logprobs.float())
    ratio_sum, truncated, policy_tokens = sum_all(
        [
            float(masked_sum(ratio, batch.loss_mask)),
            float(masked_sum((ratio > tis_cap).float(), batch.loss_mask)),
            float(batch.loss_mask.sum()),
        ],
        device,
    )
    return {
        "rollout_correction/ratio_mean": ratio_sum / max(policy_tokens, 1.0),
        "rollout_correction/truncated_share": truncated / max(policy_tokens, 1.0),
    }

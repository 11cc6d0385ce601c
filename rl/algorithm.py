"""GRPO as small pure functions over tensors: advantages, the clipped policy loss with dual clip,
KL estimators, entropy, the rollout/trainer log-probability mismatch and its correction
(truncated importance sampling), and AEPO's two loss-side switches (entropy-balanced clipping,
the entropy-aware advantage).

Shapes: per-sequence tensors are (B,); per-token tensors are (B, T) with a 0/1 ``mask`` that is
1 on the tokens the policy gradient covers (tokens sampled by the policy in this rollout; see
:class:`etagent.records.TokenOrigin`).

The loss is an exact token mean over a whole mini-batch: :func:`policy_loss` returns the *sum*
of the masked token losses divided by ``tokens``, the number of policy tokens in the whole
mini-batch (all micro-batches, all ranks), so that summing the micro-batch losses (and averaging
gradients over ranks, times the world size) gives the mean over every token of the mini-batch.
The reference approximates this under dynamic batching by weighting each micro-batch's own
token mean by its share of sequences (docs/paper-code.md §C5.3).

What this module does not do: compute rewards (rl/reward.py), generate, or step an optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def grpo_advantages(scores: torch.Tensor, group: torch.Tensor, eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = (s_i - mean of its group) / (unbiased std of its group + eps); a group of one gets
    mean 0 and std 1, as in verl. Members not ``valid`` (trajectories the engine failed on) are
    left out of their group's mean and std, and get advantage 0: a failure is not a score."""
    scores = scores.to(torch.float64)
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    counted = valid.to(scores.dtype)
    _, index, _ = torch.unique(group, return_inverse=True, return_counts=True)
    n_groups = int(index.max()) + 1 if len(index) else 0
    sizes = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, counted)
    total = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, scores * counted)
    mean = total / sizes.clamp(min=1)
    squares = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, (scores - mean[index]) ** 2 * counted)
    std = torch.sqrt(squares / (sizes - 1).clamp(min=1))
    single = sizes <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    advantages = (scores - mean[index]) / (std[index] + eps)
    return torch.where(valid, advantages, torch.zeros_like(advantages)).to(torch.float32)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


@dataclass(frozen=True)
class LossTerms:
    """The loss to backpropagate (already divided by the mini-batch's token count) and its
    metrics summed over this micro-batch's tokens (divide by the same count to report)."""

    loss: torch.Tensor
    clipped_tokens: torch.Tensor
    dual_clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor


def entropy_moments(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) of the token entropies at the masked tokens, in float64: what
    :func:`entropy_standardisation` needs, summed over micro-batches and ranks first."""
    values = entropy.detach()[mask.to(torch.bool)].double()
    return torch.stack([values.new_tensor(float(values.numel())), values.sum(), (values**2).sum()])


def entropy_standardisation(moments: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of the entropies whose :func:`entropy_moments` (summed) are given;
    a std of 0, or of fewer than two tokens, counts as 1 (z is then 0 everywhere)."""
    count, total, squares = (float(x) for x in moments)
    if count == 0:
        return 0.0, 1.0
    mean = total / count
    variance = (squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    std = max(variance, 0.0) ** 0.5
    return mean, std if std > 0 else 1.0


def entropy_aware_advantages(advantages: torch.Tensor, entropy: torch.Tensor, mean: float, std: float, scale: float = 0.2) -> torch.Tensor:
    """AEPO's entropy-aware advantage: A_t (1 + scale z_t), z_t = (H_t - mean) / std, the token
    entropy standardised by the mean and std of the optimizer step's tokens
    (:func:`entropy_standardisation` of their moments over every micro-batch and rank, so that
    neither the micro-batch size nor the number of ranks changes a number), no gradient through
    it. ``advantages`` is (B,) or (B, T); the result is (B, T). The reference standardises over
    each micro-batch and needs an entropy it never computes, so it does nothing there."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(entropy)
    return advantages * (1.0 + scale * (entropy.detach().float() - mean) / std)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tokens: int | torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    entropy_balanced_clipping: bool = False,
    rollout_weights: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> LossTerms:
    """The PPO clipped objective with dual clip, as a sum over masked tokens divided by
    ``tokens``. ``advantages`` is (B,) or (B, T).

    r = exp(logp - logp_old); L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); for A < 0
    also L = min(L, -A c): a very large ratio on a bad action cannot blow the loss up.

    ``entropy_balanced_clipping`` (AEPO): the upper bound becomes (1 + clip_high) r / sg(r), the
    same value with the gradient (1 + clip_high) grad log pi, so a token clipped above still
    moves the policy, scaled by (1 + clip_high) / r; the lower bound is unchanged. Applied to
    every token, as the reference does. It is computed as (1 + clip_high) exp(logp - sg(logp)):
    the same value and gradient, where r / sg(r) is 0 / 0 = NaN once r underflows (a token
    whose old log-probability is 0, a tool result's, at a new one below about -104), and a NaN at
    a masked position still poisons the sum and its gradient.

    ``rollout_weights`` (B, T), from :func:`truncated_importance_weights`, multiply each token's
    clipped loss: the correction for rollouts sampled by another engine than the trainer.

    ``log_ratio_clamp`` (verl's 20): logp - logp_old is clamped to [-c, c] before the exponential,
    so one token whose log-ratio passes float32's exp (88.7) cannot make the loss infinite and
    end the run; a token beyond the clamp passes no gradient through its ratio. None: no clamp."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    if entropy_balanced_clipping:
        upper = (1.0 + clip_high) * torch.exp(logprobs - logprobs.detach())
        bounded = torch.minimum(torch.clamp(ratio, min=1.0 - clip_low), upper)
    else:
        bounded = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = -advantages * bounded
    loss = torch.maximum(unclipped, clipped)
    dual = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_c), loss)
    weighted = dual if rollout_weights is None else dual * rollout_weights
    return LossTerms(
        loss=masked_sum(weighted, mask) / tokens,
        clipped_tokens=masked_sum((clipped > unclipped).to(mask.dtype), mask).detach(),
        dual_clipped_tokens=masked_sum(((advantages < 0) & (loss > -advantages * clip_c)).to(mask.dtype), mask).detach(),
        ratio_sum=masked_sum(ratio, mask).detach(),
    )


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities:
    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1, clamped
    to [-10, 10] (verl's low_var_kl, which the paper's config names)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.clamp(torch.exp(-log_ratio) + log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"KL estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def entropy_from_logprobs(log_probs: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy of the distribution over the last dimension, in nats, from its log-probabilities
    (the trainer has them already: no second log-softmax), ``chunk`` positions at a time so the
    temporaries stay small at a 152k vocabulary."""
    flat = log_probs.reshape(-1, log_probs.shape[-1])
    parts = [torch.special.entr(flat[i : i + chunk].exp()).sum(dim=-1) for i in range(0, flat.shape[0], chunk)]
    return torch.cat(parts).reshape(log_probs.shape[:-1]) if parts else flat.new_zeros(log_probs.shape[:-1])


def truncated_importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling, token level (verl's rollout correction, slime's TIS): the
    rollouts were drawn from the rollout engine's distribution, the loss's old policy is the
    trainer's recomputation under the same weights; each token's loss is weighted by
    min(pi_trainer / pi_rollout, cap), without gradient. Both log-probabilities must be of the
    distribution the tokens were drawn from (under the sampling temperature)."""
    return torch.exp(old_logprobs.float() - rollout_logprobs.float()).clamp(max=cap).detach()


def logprob_mismatch(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probabilities of the sampled tokens are from the
    trainer's recomputation under the same weights (numerics, kernels, precision): mean and max
    absolute difference, and the k3 KL estimate. A diagnostic to log, not a loss term."""
    mask = mask.to(torch.bool)
    if not mask.any():
        return {"mean_abs": 0.0, "max_abs": 0.0, "k3": 0.0}
    difference = (rollout_logprobs.float() - trainer_logprobs.float())[mask]
    return {
        "mean_abs": difference.abs().mean().item(),
        "max_abs": difference.abs().max().item(),
        "k3": kl_estimate(trainer_logprobs.float()[mask], rollout_logprobs.float()[mask], "k3").mean().item(),
    }

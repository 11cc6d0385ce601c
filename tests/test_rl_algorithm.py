"""GRPO's pure functions on hand-computed values: advantages, the dual-clip loss, the exact token
mean over micro-batches, KL estimators, entropy, the rollout/trainer mismatch and its truncated importance sampling."""

from __future__ import annotations

import math

import pytest
import torch

from etagent.rl.algorithm import (
    entropy_from_logprobs,
    grpo_advantages,
    kl_estimate,
    logprob_mismatch,
    policy_loss,
    truncated_importance_weights,
)


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 3.0, 3.0])
    group = torch.tensor([7, 7, 9, 7, 7, 4, 4])
    a = grpo_advantages(scores, group)
    half = 0.5 / math.sqrt(1 / 3)  # group 7: mean 0.5, unbiased std sqrt(1/3)
    assert a.tolist() == pytest.approx([half, -half, 2.0, half, -half, 0.0, 0.0], abs=1e-5)
    # group 9 has one member: mean 0, std 1, so A = s / (1 + eps); group 4: std 0, so A = 0
    for g in (7, 4):
        members = scores[group == g]
        assert a[group == g].tolist() == pytest.approx(((members - members.mean()) / (members.std() + 1e-6)).tolist(), abs=1e-6)


def test_policy_loss_clip_and_dual_clip_by_hand():
    ratios = torch.tensor([[1.5, 1.5, 5.0, 0.5, 0.5, 1.0]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0, 2.0]])
    old = torch.zeros_like(ratios)
    mask = torch.ones_like(ratios)
    terms = policy_loss(torch.log(ratios), old, advantages, mask, tokens=6)
    # per token: -1.2 (clipped high), 1.5, min(5, 3) = 3 (dual clip), -0.5, 0.8 (clipped low), -2
    assert terms.loss.item() == pytest.approx((-1.2 + 1.5 + 3.0 - 0.5 + 0.8 - 2.0) / 6)
    assert terms.clipped_tokens.item() == 2 and terms.dual_clipped_tokens.item() == 1
    assert terms.ratio_sum.item() == pytest.approx(10.0)
    # masked tokens count for nothing; the divisor is what the caller says
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    assert policy_loss(torch.log(ratios), old, advantages, mask, tokens=2).loss.item() == pytest.approx((-1.2 - 0.5) / 2)
    # (B,) advantages broadcast over the tokens
    per_sequence = policy_loss(torch.log(ratios), old, torch.tensor([-1.0]), torch.ones_like(ratios), tokens=6)
    assert per_sequence.loss.item() == pytest.approx((1.5 + 1.5 + 3.0 + 0.8 + 0.8 + 1.0) / 6)


def test_summed_micro_batch_losses_are_the_exact_token_mean_of_the_mini_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 9, requires_grad=True)
    old = torch.randn(5, 9)
    advantages = torch.randn(5)
    mask = (torch.rand(5, 9) > 0.3).float()
    mask[4, :] = 0
    mask[4, 0] = 1  # a sequence with one policy token: weighted by tokens, not by sequences
    tokens = int(mask.sum())

    whole = policy_loss(logits, old, advantages, mask, tokens).loss
    (grad_whole,) = torch.autograd.grad(whole, logits)
    token_losses = torch.maximum(
        -advantages[:, None] * torch.exp(logits - old), -advantages[:, None] * torch.exp(logits - old).clamp(0.8, 1.2)
    )
    token_losses = torch.where(advantages[:, None] < 0, torch.minimum(token_losses, -advantages[:, None] * 3.0), token_losses)
    assert whole.item() == pytest.approx(((token_losses * mask).sum() / mask.sum()).item(), rel=1e-6)

    parts = [slice(0, 2), slice(2, 3), slice(3, 5)]
    accumulated = sum(policy_loss(logits[p], old[p], advantages[p], mask[p], tokens).loss for p in parts)
    (grad_parts,) = torch.autograd.grad(accumulated, logits)
    assert accumulated.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grad_parts, grad_whole, atol=1e-7)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.0, -1.0, 1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.0, 0.5, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.0, math.e - 2, math.exp(-1) + 1 - 1])
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-50.0]), "k3").item() == 10.0  # 49, clamped
    assert kl_estimate(torch.tensor([-50.0]), torch.tensor([0.0]), "k3").item() == 10.0  # e^50 - 51, clamped
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(logp, ref, "k4")


def test_entropy_and_mismatch():
    assert entropy_from_logprobs(torch.log_softmax(torch.zeros(3, 8), -1)).tolist() == pytest.approx([math.log(8)] * 3)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logprobs(torch.log_softmax(peaked, -1)).item() == pytest.approx(0.0, abs=1e-6)
    a = torch.tensor([[-1.0, -2.0, -3.0]])
    b = torch.tensor([[-1.0, -2.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = logprob_mismatch(a, b, mask)
    assert m["mean_abs"] == pytest.approx(0.25) and m["max_abs"] == pytest.approx(0.5)
    assert logprob_mismatch(a, a, mask) == {"mean_abs": 0.0, "max_abs": 0.0, "k3": 0.0}


def test_truncated_importance_sampling_on_a_mismatched_rollout_by_hand():
    """A rollout engine that put probability 0.1, 0.5, 0.9 and 0.8 on four sampled tokens the
    trainer (same weights) gives 0.4, 0.5, 0.3 and 0.8: weights min(p_trainer / p_rollout, 2) =
    2 (4, truncated), 1, 1/3, 1; the new policy moved each token's probability by the ratio r."""
    rollout = torch.log(torch.tensor([[0.1, 0.5, 0.9, 0.8]]))
    old = torch.log(torch.tensor([[0.4, 0.5, 0.3, 0.8]]))
    r = torch.tensor([[1.1, 1.5, 0.7, 1.0]])
    new = (old + torch.log(r)).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is a tool's: not counted
    weights = truncated_importance_weights(old, rollout, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 1.0, 1 / 3, 1.0], rel=1e-6)
    terms = policy_loss(new, old, advantages, mask, tokens=3, rollout_weights=weights)
    # per token: -1.1 (unclipped), -1.2 (clipped at 1 + 0.2), 0.8 (A < 0, clipped at 1 - 0.2)
    assert terms.loss.item() == pytest.approx((2.0 * -1.1 + 1.0 * -1.2 + (1 / 3) * 0.8) / 3, rel=1e-6)
    terms.loss.backward()
    # d/dlogp of -w A r is -w A r where unclipped; clipped tokens pass no gradient
    assert new.grad.tolist()[0] == pytest.approx([2.0 * -1.1 / 3, 0.0, 0.0, 0.0], abs=1e-6)
    assert not weights.requires_grad
    # without the weights the first token counts once, as an on-policy rollout would
    plain = policy_loss(new.detach(), old, advantages, mask, tokens=3)
    assert plain.loss.item() == pytest.approx((-1.1 - 1.2 + 0.8) / 3, rel=1e-6)


def test_a_trajectory_the_engine_failed_on_is_left_out_of_its_groups_baseline():
    """Group 0: scores 1, 0, and -1 for a trajectory the engine failed on (the format penalty of
    an empty response): its advantage is 0 and the others' are as if it were not there; group 1
    keeps its own. A group whose every member failed has advantages 0."""
    scores = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.3, -1.0, -1.0])
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, True, False, True, True, False, False])
    a = grpo_advantages(scores, group, valid=valid)
    without = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.3]), torch.tensor([0, 0, 1, 1]))
    assert a[[0, 1, 3, 4]].tolist() == pytest.approx(without.tolist())
    assert a[[2, 5, 6]].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("clip_c", [3.0, 1e30])
def test_a_log_ratio_past_floats_exponential_gives_a_finite_loss_and_gradient(clip_c):
    """log pi - log pi_old = 100 (and -100) on policy tokens: exp(100) is infinite in float32,
    so without a clamp the loss or its gradient is not finite (even where the dual clip caps the
    loss's value), and the run ends. The clamp at 20 (verl's, algorithm.log_ratio_clamp) keeps
    both finite; a token past it passes no gradient through its ratio, and the tokens inside it
    get the gradient they get alone. With the dual clip's constant lifted (1e30), the negative
    advantage's term is the clamped ratio itself, e^20."""
    logprobs = torch.tensor([[100.0, -100.0, 0.1, -0.1]], requires_grad=True)
    old = torch.zeros(1, 4)
    advantages = torch.tensor([[-1.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    terms = policy_loss(logprobs, old, advantages, mask, tokens=4, clip_c=clip_c)
    terms.loss.backward()
    assert math.isfinite(terms.loss.item()) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, :2].tolist() == [0.0, 0.0]
    inner = torch.tensor([[0.1, -0.1]], requires_grad=True)
    alone = policy_loss(inner, old[:, 2:], advantages[:, 2:], mask[:, 2:], tokens=4, clip_c=clip_c)
    alone.loss.backward()
    assert logprobs.grad[0, 2:].tolist() == pytest.approx(inner.grad[0].tolist())
    extreme = min(math.exp(20.0), clip_c)  # the first token's term: -A r, r clamped, capped by the dual clip
    assert terms.loss.item() == pytest.approx(extreme / 4 + alone.loss.item(), rel=1e-5)

    unclamped_logprobs = logprobs.detach().clone().requires_grad_()
    unclamped = policy_loss(unclamped_logprobs, old, advantages, mask, tokens=4, clip_c=clip_c, log_ratio_clamp=None)
    unclamped.loss.backward()
    assert not (math.isfinite(unclamped.loss.item()) and torch.isfinite(unclamped_logprobs.grad).all())

"""Rollouts as training tensors, and the policy's log-probabilities of them.

Prompts are left-padded to the longest prompt and responses right-padded to the longest
response, so every response token sits in the same column range of every row and per-token
tensors are (B, R). Token ids are the rollout's own (never re-tokenized). The loss mask is 1 on
the tokens the policy sampled in this rollout (``TokenOrigin.SAMPLED``): tool results and given
text have no log-probability under the policy that generated the rollout.

:func:`batch_plan` splits a step over the ranks and into mini-batches counted in sequences;
:func:`micro_batches` cuts a mini-batch into forward passes within a token budget.

What this module does not do: compute losses (rl/algorithm.py) or shard anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etagent.agent import TrajectoryState
from etagent.errors import SettingError
from etagent.records import TokenOrigin


@dataclass
class Batch:
    """B sequences: ``input_ids``/``attention_mask``/``position_ids`` are (B, P + R); the rest are
    per response token, (B, R)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompt_width: int

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    def select(self, rows: list[int]) -> Batch:
        """These rows, with the columns that are padding in all of them cut off (a micro-batch
        of short sequences costs what they cost, not what the longest of the step does)."""
        index = torch.tensor(rows, dtype=torch.long)
        attention = self.attention_mask[index]
        used = attention.any(dim=0).nonzero().flatten()
        left = min(int(used[0]), self.prompt_width - 1) if len(used) else 0
        right = max(int(used[-1]) + 1, self.prompt_width + 1) if len(used) else self.prompt_width + 1
        responses = right - self.prompt_width
        return Batch(
            self.input_ids[index, left:right],
            attention[:, left:right],
            self.position_ids[index, left:right],
            self.loss_mask[index, :responses],
            self.rollout_logprobs[index, :responses],
            self.prompt_width - left,
        )

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.loss_mask.to(device),
            self.rollout_logprobs.to(device),
            self.prompt_width,
        )

    def tokens(self) -> list[int]:
        """Real (non-padding) tokens per row."""
        return self.attention_mask.sum(dim=1).tolist()


def pack(trajectories: list[TrajectoryState], pad_id: int) -> Batch:
    """The trajectories as one batch. ``rollout_logprobs`` are the engine's log-probabilities under
    the sampling temperature (the hf engine's always; vLLM's at T = 1), else its raw ones
    (:func:`tempered_rollouts` says which)."""
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    response_width = max(1, max(len(t.response_ids) for t in trajectories))
    rows = len(trajectories)
    input_ids = torch.full((rows, prompt_width + response_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    loss_mask = torch.zeros(rows, response_width)
    logprobs = torch.zeros(rows, response_width)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, prompt_width - p : prompt_width] = torch.tensor(t.prompt_ids)
        attention[i, prompt_width - p : prompt_width + r] = 1
        if r:
            input_ids[i, prompt_width : prompt_width + r] = torch.tensor(t.response_ids)
            loss_mask[i, :r] = torch.tensor([float(o == TokenOrigin.SAMPLED) for o in t.origin])
            # of the distribution the tokens were drawn from (logits / T), where the engine gave them
            logprobs[i, :r] = torch.tensor(t.tempered_logprobs if t.tempered_logprobs is not None else t.logprobs)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(input_ids, attention, position_ids, loss_mask, logprobs, prompt_width)


def tempered_rollouts(trajectories: list[TrajectoryState]) -> bool:
    """Whether every trajectory's log-probabilities are under its sampling temperature, so that
    :func:`pack`'s ``rollout_logprobs`` compare with the trainer's."""
    return all(t.tempered_logprobs is not None for t in trajectories)


def token_logprobs(policy, batch: Batch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of every response token under ``policy`` (an rl.policy.Policy) (B, R),
    and the entropy of the distribution each was drawn from when asked. Padding positions hold
    junk: mask them."""
    return policy(batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_width, with_entropy)


def micro_batches(tokens: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive rows grouped so that each group's padded size (rows x its longest row) stays
    within ``max_tokens``; a row longer than the budget goes alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row, n in enumerate(tokens):
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class BatchPlan:
    """How a step's data splits over the ranks and into optimizer steps. Mini-batches are counted
    in sequences, as verl counts them (``ppo_mini_batch_size`` x n), so the same preset makes the
    same optimizer steps of the same number of sequences on 1, 2, 4, 8 or 16 ranks."""

    prompts_per_rank: int  # rank r rolls out prompts r, r + world, ... of the step
    sequences_per_rank: int
    mini_batch_sequences_per_rank: int
    optimizer_steps: int  # per RL step, on every rank


def batch_plan(prompts_per_step: int, n: int, mini_batch_prompts: int, world: int) -> BatchPlan:
    """The plan for ``prompts_per_step`` prompts x ``n`` rollouts, optimizer steps of
    ``mini_batch_prompts`` x ``n`` sequences, over ``world`` ranks; a setting that does not divide
    evenly is an error naming the key."""
    for key, value in (("data.prompts_per_step", prompts_per_step), ("rollout.n", n), ("train.mini_batch_prompts", mini_batch_prompts)):
        if value < 1:
            raise SettingError(key, f"must be at least 1, got {value}")
    if prompts_per_step % world:
        raise SettingError("data.prompts_per_step", f"{prompts_per_step} is not a multiple of the number of processes ({world})")
    if prompts_per_step % mini_batch_prompts:
        raise SettingError(
            "data.prompts_per_step", f"{prompts_per_step} is not a multiple of train.mini_batch_prompts ({mini_batch_prompts})"
        )
    if mini_batch_prompts * n % world:
        raise SettingError(
            "train.mini_batch_prompts",
            f"a mini-batch of train.mini_batch_prompts x rollout.n = {mini_batch_prompts} x {n} sequences "
            f"does not split evenly over {world} processes",
        )
    return BatchPlan(
        prompts_per_rank=prompts_per_step // world,
        sequences_per_rank=prompts_per_step // world * n,
        mini_batch_sequences_per_rank=mini_batch_prompts * n // world,
        optimizer_steps=prompts_per_step // mini_batch_prompts,
    )

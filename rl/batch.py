"""Rollouts as training tensors, and the policy's log-probabilities of them.

Prompts are left-padded to the longest prompt and responses right-padded to the longest
response, so every response token sits in the same column range of every row and per-token
tensors are (B, R). Token ids are the rollout's own (never re-tokenized). The loss mask is 1 on
the tokens the policy sampled in this rollout (``TokenOrigin.SAMPLED``): tool results and given
text have no log-probability under the policy that generated the rollout.

:func:`batch_plan` splits a step over the ranks and into mini-batches counted in sequences, and
:func:`balanced_partition` re-deals each mini-batch's sequences over the ranks by tokens;
:func:`micro_batches` groups a mini-batch's rows, longest first, into forward passes within a
token budget, and :meth:`Batch.micro` makes each one: padded (the least padding, for attention
implementations that need a rectangle: sdpa, eager, on CPU) or packed into one sequence without
any padding (flash-attention on GPUs).

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

    def micro(self, rows: list[int], packed: bool) -> MicroBatch:
        """These rows as one forward pass. Padded: each row its own sequence, its real tokens
        from column 0, padding after them up to the longest row of the pass (a pass of short
        rows costs what they cost, not what the longest of the step does; and no query position
        is left with nothing to attend to, which CUDA's attention kernels can turn into NaN
        gradients). Packed: the rows' real tokens one after another in a single sequence whose
        position ids restart at 0 for each row, so that no padding token is computed;
        transformers' flash-attention reads such position ids as separate sequences (and its
        other attention implementations as a block-diagonal mask)."""
        device = self.input_ids.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        attention = self.attention_mask[index]
        prompt_lengths = attention[:, : self.prompt_width].sum(dim=1).tolist()
        response_lengths = attention[:, self.prompt_width :].sum(dim=1).tolist()
        width = max(max(response_lengths), 1)
        loss_mask, rollout_logprobs = self.loss_mask[index, :width], self.rollout_logprobs[index, :width]
        columns = torch.arange(width, device=device)
        length = max(p + r for p, r in zip(prompt_lengths, response_lengths))
        shape = (1, sum(prompt_lengths) + sum(response_lengths)) if packed else (len(rows), length)
        input_ids = torch.zeros(shape, dtype=torch.long, device=device)
        position_ids = torch.zeros(shape, dtype=torch.long, device=device)
        attention_mask = None if packed else torch.zeros(shape, dtype=torch.long, device=device)
        scored = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        offset = 0  # where row i starts in the flattened (b x L) positions
        for i, (row, p, r) in enumerate(zip(rows, prompt_lengths, response_lengths)):
            line, start = (0, offset) if packed else (i, 0)
            input_ids[line, start : start + p + r] = self.input_ids[row, self.prompt_width - p : self.prompt_width + r]
            position_ids[line, start : start + p + r] = torch.arange(p + r, device=device)
            if attention_mask is not None:
                attention_mask[i, : p + r] = 1
            # response token j is predicted at position p - 1 + j; past the response, junk (masked)
            scored[i] = torch.where(columns < r, offset + p - 1 + columns, offset)
            offset += p + r if packed else length
        return MicroBatch(rows, input_ids, attention_mask, position_ids, scored, loss_mask, rollout_logprobs)

    def row_tokens(self, row: int) -> tuple[list[int], int]:
        """Row ``row``'s real tokens (prompt and response), and its prompt's length."""
        attention = self.attention_mask[row]
        prompt = int(attention[: self.prompt_width].sum())
        response = int(attention[self.prompt_width :].sum())
        ids = self.input_ids[row, self.prompt_width - prompt : self.prompt_width + response].tolist()
        return ids, prompt

    def forward(self, step: ForwardPass, packed: bool, eager: bool) -> MicroBatch:
        """A :class:`ForwardPass` of this batch as its tensors."""
        return self.micro_tree(step.rows, eager) if step.tree else self.micro(step.rows, packed)

    def micro_tree(self, rows: list[int], eager: bool = False) -> MicroBatch:
        """These rows as one forward pass over the prefix tree of their tokens (:func:`prefix_tree`):
        each token that rows share (the prompt, every segment and tool result before a fork) is
        computed once, attending to its ancestors alone (a 4D mask; boolean for sdpa, additive
        for ``eager``), at the position it has in each row (its depth). Each row's response
        token is scored where its previous token sits in the tree, against the row's own token
        (``targets``): the same numbers as the rows' own passes, the shared positions' gradient
        the sum over the rows that hold them, as each row's copy would give."""
        device = self.input_ids.device
        sequences, prompts = zip(*(self.row_tokens(row) for row in rows))
        tree = prefix_tree(list(sequences))
        width = max(max(len(s) - p for s, p in zip(sequences, prompts)), 1)
        scored = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (sequence, prompt, nodes) in enumerate(zip(sequences, prompts, tree.nodes)):
            r = len(sequence) - prompt
            scored[i, :r] = torch.tensor(nodes[prompt - 1 : prompt - 1 + r])
            targets[i, :r] = torch.tensor(sequence[prompt:])
        mask = ancestor_mask(tree.parents)[None, None]
        if eager:  # eager attention adds its mask to the scores
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        loss_mask, rollout_logprobs = self.loss_mask[rows, :width], self.rollout_logprobs[rows, :width]
        return MicroBatch(
            rows,
            torch.tensor([tree.tokens], device=device),
            mask.to(device),
            torch.tensor([tree.depths], device=device),
            scored.to(device),
            loss_mask,
            rollout_logprobs,
            targets.to(device),
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


# Truncated trajectories: cut by their response budget or a segment's cap, or by the context.
TRUNCATED = frozenset({"length", "context"})


def pack(
    trajectories: list[TrajectoryState], pad_id: int, untrained: frozenset[str] = frozenset(), masked_before: int | None = None
) -> Batch:
    """The trajectories as one batch. ``rollout_logprobs`` are the engine's log-probabilities under
    the sampling temperature (the hf engine's always; vLLM's at T = 1), else its raw ones
    (:func:`tempered_rollouts` says which). The loss mask is 1 at the tokens the policy sampled,
    except in a trajectory the engine failed on (``finish_reason == "error"``) or one whose
    finish reason is in ``untrained`` (truncated ones, with ``algorithm.truncated=mask``): none
    of its tokens is trained on, whatever it sampled; and with ``masked_before``, at tokens
    sampled by weights of an older version (partial rollouts' ``stale_tokens=mask``)."""
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
            if t.finish_reason != "error" and t.finish_reason not in untrained:
                sampled = [o == TokenOrigin.SAMPLED for o in t.origin]
                if masked_before is not None:
                    sampled = [s and v >= masked_before for s, v in zip(sampled, t.token_versions())]
                loss_mask[i, :r] = torch.tensor(sampled, dtype=torch.float32)
            # of the distribution the tokens were drawn from (logits / T), where the engine gave them
            logprobs[i, :r] = torch.tensor(t.tempered_logprobs if t.tempered_logprobs is not None else t.logprobs)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(input_ids, attention, position_ids, loss_mask, logprobs, prompt_width)


def tempered_rollouts(trajectories: list[TrajectoryState]) -> bool:
    """Whether every trajectory's log-probabilities are under its sampling temperature, so that
    :func:`pack`'s ``rollout_logprobs`` compare with the trainer's."""
    return all(t.tempered_logprobs is not None for t in trajectories)


@dataclass
class MicroBatch:
    """Some rows of a :class:`Batch` as one forward pass (:meth:`Batch.micro`). ``input_ids`` and
    ``position_ids`` are (b, L): b = the rows when padded (each row from column 0, padding on the
    right), 1 when packed (then ``attention_mask`` is None: the position ids tell the sequences
    apart). ``scored`` (rows, R) holds, for each response
    token, the flat index into the (b x L) positions of the one that predicts it; ``loss_mask`` and
    ``rollout_logprobs`` are the rows' own (rows, R)."""

    rows: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    scored: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    targets: torch.Tensor | None = None  # a prefix tree's (rows, R): the token each scored position predicts

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    def tokens(self) -> int:
        """Positions the forward pass computes, padding included."""
        return self.input_ids.numel()


def token_logprobs(policy, micro: MicroBatch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of every response token of ``micro``'s rows under ``policy`` (an
    etagent.rl.policy.Policy) (rows, R), and the entropy of the distribution each was drawn from when
    asked. Positions past a row's response hold junk: mask them."""
    return policy(micro.input_ids, micro.attention_mask, micro.position_ids, micro.scored, with_entropy, micro.targets)


def micro_batches(tokens: list[int], max_tokens: int, packed: bool, names: list[int] | None = None) -> list[list[int]]:
    """Rows grouped into forward passes of at most ``max_tokens`` computed positions: packed, the
    sum of the rows' tokens; padded, the rows times the longest of them. The rows go longest
    first, each into the first group it fits (first-fit decreasing), so that padded groups hold
    rows of similar lengths and packed groups are full; a row longer than the budget goes alone.
    Each group lists its rows in their batch order; ``names``: what to call row i (default i)."""
    groups: list[list[int]] = []
    costs: list[tuple[int, int]] = []  # per group: its rows' tokens, and its longest row
    for row in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        n = tokens[row]
        for k, (total, longest) in enumerate(costs):
            cost = total + n if packed else (len(groups[k]) + 1) * max(longest, n)
            if cost <= max_tokens:
                groups[k].append(row)
                costs[k] = (total + n, max(longest, n))
                break
        else:
            groups.append([row])
            costs.append((n, n))
    return [sorted(group if names is None else [names[i] for i in group]) for group in groups]


@dataclass
class PrefixTree:
    """Token sequences as the trie of their tokens: ``tokens[k]``, ``parents[k]`` (-1 at a root)
    and ``depths[k]`` (its position in every sequence that holds it) of node k, a node after its
    parent; ``nodes[i]`` the node of each token of sequence i."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    nodes: list[list[int]]

    def shared(self) -> int:
        """Tokens of the sequences that the tree holds once for several of them."""
        return sum(len(n) for n in self.nodes) - len(self.tokens)


def prefix_tree(sequences: list[list[int]]) -> PrefixTree:
    """The trie of ``sequences``: two sequences share a node as long as their tokens are the same
    from the start (the prompt; an ARPO tree's segments and tool results before a fork), so what
    the node computes is the same in both (causal attention sees only what comes before)."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    nodes_of = []
    for sequence in sequences:
        level, parent, nodes = roots, -1, []
        for token in sequence:
            node = level.get(token)
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(len(nodes))
                children.append({})
                level[token] = node
            nodes.append(node)
            level, parent = children[node], node
        nodes_of.append(nodes)
    return PrefixTree(tokens, parents, depths, nodes_of)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(N, N) boolean: node i attends to node j where j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):  # a parent comes before its children: its row is done
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


# A group of rows is updated as a prefix tree when the tree holds at most this share of the rows'
# tokens (each shared token counted once); above it the group shares too little to pay for the
# tree's dense attention mask (attention over the whole tree: N^2 against the rows' own L^2 each)
# and its rows are padded as usual. Measured on the toy policy, 2 CPU threads, 8 rows: a tree of
# 0.375 of its rows' tokens took 0.66x and 0.60x the flat pass's time, one of 0.56 1.15x, one
# of 0.71 1.6x (docs/rl.md, "The update on prefix trees").
TREE_MAX_SHARE = 0.45


@dataclass(frozen=True)
class ForwardPass:
    """Rows of a mini-batch computed in one forward pass, as a prefix tree or flat (padded, or
    packed under flash-attention)."""

    rows: list[int]
    tree: bool


def forward_passes(batch: Batch, rows: list[int], max_tokens: int, packed: bool, share_prefixes: bool) -> list[ForwardPass]:
    """``rows`` (of ``batch``) as forward passes within ``max_tokens`` computed positions. Without
    ``share_prefixes``, :func:`micro_batches`. With it, rows with the same prompt (a GRPO group,
    an ARPO tree) go together: a group whose prefix tree holds at most ``TREE_MAX_SHARE`` of its
    tokens is a tree pass (several such groups share one pass where their trees fit the budget
    together), the others' rows flat passes."""
    row_tokens = batch.tokens()
    if not share_prefixes:
        return [ForwardPass(part, tree=False) for part in micro_batches([row_tokens[i] for i in rows], max_tokens, packed, rows)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in rows:
        ids, prompt = batch.row_tokens(row)
        groups.setdefault(tuple(ids[:prompt]), []).append(row)
    trees, flat = [], []
    for members in groups.values():
        tree = prefix_tree([batch.row_tokens(row)[0] for row in members])
        total = sum(len(n) for n in tree.nodes)
        (trees if len(members) > 1 and len(tree.tokens) <= TREE_MAX_SHARE * total else flat).append((members, len(tree.tokens)))
    passes = []
    sizes = [size for _, size in trees]
    for part in micro_batches(sizes, max_tokens, packed=True):
        passes.append(ForwardPass(sorted(row for k in part for row in trees[k][0]), tree=True))
    flat_rows = sorted(row for members, _ in flat for row in members)
    passes += [ForwardPass(part, tree=False) for part in micro_batches([row_tokens[i] for i in flat_rows], max_tokens, packed, flat_rows)]
    return passes


def balanced_partition(tokens: list[int], parts: int) -> list[list[int]]:
    """The indices of ``tokens`` in ``parts`` groups of equal size (``len(tokens)`` must divide)
    whose token sums are close: longest first, each to the group with the fewest tokens that still
    has room. That greedy deal is not always the best (tokens 1 1 4 2 2 2 as given split 6 | 6,
    the greedy deal 7 | 5), so where the consecutive groups as given have no larger largest sum
    they are kept: the result is never worse than the order it came in. Each group lists its
    indices in order."""
    size = len(tokens) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        k = min((k for k in range(parts) if len(groups[k]) < size), key=lambda k: (sums[k], k))
        groups[k].append(i)
        sums[k] += tokens[i]
    as_given = [list(range(k * size, (k + 1) * size)) for k in range(parts)]
    if max(sum(tokens[i] for i in group) for group in as_given) <= max(sums):
        return as_given
    return [sorted(group) for group in groups]


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

"""The prompts of an RL run and the rollouts of one step.

:func:`read_prompts` turns the RL parquet (verl's schema, as ``pareto/`` writes it or as the
paper's files are) into questions for the agent loop. Two rollouts, one interface
(``generate(loop, prompts, step, seed) -> StepRollouts``: exactly ``n`` finished trajectories per
prompt, and the step's rollout metrics), chosen by ``rollout.kind``:

- :class:`GroupRollout`: plain GRPO sampling, ``n`` independent rollouts per prompt;
- :class:`TreeRollout`: ARPO's entropy branching (docs/paper-code.md §C1.3), with AEPO's dynamic root
  budget and consecutive-branch penalty as switches (§2.1, §2.2). Where the branch decision
  looks (``rollout.delta_h``): ``after_result``, ARPO's paper (the default): after a tool result
  the path generates its next segment, the entropy of that segment's first tokens against the
  path's initial entropy (its first segment, from the prompt) decides whether it forks at that
  result, and the copy samples its own continuation from there; ``lagged``, ARPO's released code
  (and so the paper's runs): the entropy of the segment that made the call, against the path's
  own first segment, decides whether it forks after the new result, so each path's first
  decision has dH = 0 whatever the entropy. Where the reference is wrong, this follows what it
  intends: the entropy baseline belongs to each trajectory of this step (the reference keys it
  by a slot number reused across steps, so from step 2 on a path is compared with an unrelated
  one), a path with no room left never forks (ARPO's length filter; the copy would end at once,
  identical to its source), the branch draws are seeded, and each trajectory generates within
  its own token budget. The reference grows every tree in rounds, each a barrier on its slowest
  path; here each path decides the moment its own step ends, with the prompt's budget split
  between its paths so the tree is the same whatever order they finish in (:class:`_Tree`), and
  a path that ends with budget left is replaced by fresh rollouts at once (the reference adds one
  per round once all of the prompt's paths have ended).

Each step's seed is the run's plus the step, so a resumed step draws what the uninterrupted one
did. What this module does not do: score the rollouts (rl/reward.py) or turn them into tensors
(rl/batch.py).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from etagent import protocol
from etagent.agent import AgentLoop, SegmentEntropy, TrajectoryState
from etagent.question_formats import DEFAULT_FORMAT, Mapping, QuestionFormat, read_question_rows
from etagent.records import Question, RecordError, TokenOrigin
from etagent.rl.config import RolloutSettings
from etagent.rl.reward import DATA_SOURCES


@dataclass(frozen=True)
class Prompt:
    """One row of the RL parquet: the question the agent loop answers, and what the reward reads
    (``index`` groups its rollouts, ``data_source`` picks the scoring)."""

    question: Question
    index: int
    data_source: str


def read_prompt_set(
    path: str | Path,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    question_format: QuestionFormat = DEFAULT_FORMAT,
    rerender_prompts: bool = False,
    split_key: str = "data.question_format.split",
) -> tuple[list[Prompt], Mapping]:
    """The rows of an RL data source as prompts: our RL parquet (verl's schema, as ``pareto/``
    writes it or as the paper's files are), or any format etagent.question_formats reads (verl's
    GSM8K, Search-R1, FlashRAG, TRL, a ``datasets`` folder). The agent loop renders every question
    with the protocol's prompt, so a row that brings a chat prompt of its own (another system
    prompt, none, or instructions in the user turn) is refused unless ``rerender_prompts``: it
    would train on prompts the data never had. With it, the question read from the row (see
    :mod:`etagent.question_formats`) is rendered with the protocol's prompt. With
    ``max_prompt_tokens``, a longer prompt is an error naming its row, as verl's
    ``truncation=error`` (a cut question would be scored against its full answer). Also returns
    how the rows were read (for the run's manifest)."""
    rows, mapping = read_question_rows(path, question_format, split_key=split_key)
    prompts, seen = [], set()
    for row in rows:
        question = row.question
        if row.prompt is not None:
            roles = [m["role"] for m in row.prompt]
            ours = roles == ["system", "user"] and row.prompt[0]["content"] == protocol.SYSTEM_PROMPT
            if ours:
                if not row.prompt[1]["content"].strip():
                    raise RecordError(path, row.number, "prompt.1.content", "empty question")
                question = question.model_copy(update={"question": row.prompt[1]["content"]})
            elif not rerender_prompts:
                what, field = f"a {' and '.join(roles) or 'no'} turn" + ("s" if len(roles) > 1 else ""), "prompt"
                if roles == ["system", "user"]:
                    what, field = "a system prompt that is not the protocol's (etagent.protocol.SYSTEM_PROMPT)", "prompt.0.content"
                raise RecordError(
                    path,
                    row.number,
                    field,
                    f"{what}, where the agent loop renders the protocol's system prompt and the question: set "
                    f"data.rerender_prompts=true to train on the question ({mapping.describe_field('question')}) with the protocol's prompt",
                )
        if row.index in seen:
            raise RecordError(path, row.number, "extra_info.index", f"{row.index} is not unique: the reward groups rollouts by it")
        seen.add(row.index)
        if max_prompt_tokens is not None:
            length = len(protocol.encode_prompt(tokenizer, question.question))
            if length > max_prompt_tokens:
                raise RecordError(path, row.number, "prompt", f"{length} tokens, over data.max_prompt_tokens ({max_prompt_tokens})")
        source = question.source if question.source in DATA_SOURCES else ("math_effi_rl" if question.kind == "math" else "qa_effi_rl")
        prompts.append(Prompt(question=question, index=row.index, data_source=source))
    return prompts, mapping


def read_prompts(
    path: str | Path,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    question_format: QuestionFormat = DEFAULT_FORMAT,
    rerender_prompts: bool = False,
    split_key: str = "data.question_format.split",
) -> list[Prompt]:
    """The prompts of :func:`read_prompt_set`, without how they were read."""
    return read_prompt_set(path, tokenizer, max_prompt_tokens, question_format, rerender_prompts, split_key)[0]


@dataclass
class StepRollouts:
    """One step's rollouts: ``groups[i]`` holds the ``n`` finished trajectories of
    ``prompts[i]`` (the step's prompts, or with partial rollouts the groups this step completed,
    some begun in earlier steps); ``counts`` are the rollout's own tallies, all sums (``depth``
    and ``staleness_max`` maxima), so that ranks' counts add up (:func:`rollout_metrics` turns
    them into the logged metrics)."""

    groups: list[list[TrajectoryState]]
    counts: dict[str, float]
    prompts: list[Prompt]


def grow(loop: AgentLoop, trees: list[_Tree], enough: Callable[[], bool] | None = None) -> None:
    """Grow the trees: every one to its end, or, with ``enough``, until it says the step has what it
    needs (partial rollouts), when every path still running stops where it is, at its next
    engine call (a request in flight is cancelled; a tool call running is finished), to go on in
    a later step. Each path on its own, or with ``agent.lockstep`` in rounds over every
    unfinished path (where ``enough`` is asked between rounds, so what stops where does not
    depend on timing)."""

    async def streamed() -> None:
        if enough is None:
            await asyncio.gather(*(tree.grow() for tree in trees))
            return
        stop = asyncio.Event()

        def check() -> None:
            if enough():
                stop.set()

        check()
        await asyncio.gather(*(tree.grow(stop, check) for tree in trees))

    async def rounds() -> None:
        while not (enough is not None and enough()):
            stepping = [(tree, path, path.state.segments) for tree in trees for path in tree.paths if not path.state.done]
            if not stepping:
                return
            await loop.step([path.state for _, path, _ in stepping])
            for tree, path, before in stepping:
                tree.after_step(path, before)

    asyncio.run(rounds() if loop.config.lockstep else streamed())


class _Rollout:
    """What both rollout kinds do with a step's prompts: start their trees (:meth:`start`), grow
    every one to its end (in lockstep rounds or streamed, each path deciding on its own step:
    the same trees either way) and count them (:meth:`tally`)."""

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> StepRollouts:
        trees, counts = self.start(loop, prompts, step, seed)
        grow(loop, trees)
        return StepRollouts([tree.group for tree in trees], self.tally(trees, counts), prompts)


class GroupRollout(_Rollout):
    """Plain GRPO rollouts: ``n`` independent samples per prompt (a tree of ``n`` roots that never
    forks)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {n}")
        self.n = n

    def start(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> tuple[list[_Tree], dict[str, float]]:
        """Trajectory ids name the step, the prompt and the sample; every segment's draw comes
        from the step's seed and the trajectory id (:meth:`AgentLoop.new`)."""
        return [_Tree(self, loop, p, step, seed, self.n, self.n, i) for i, p in enumerate(prompts)], {}

    def tally(self, trees: list[_Tree], counts: dict[str, float]) -> dict[str, float]:
        executed = sum(t.executed_here() for tree in trees for t in tree.group)
        return {**counts, "tool_calls_executed": counts.get("tool_calls_executed", 0.0) + executed}


DELTA_H = ("after_result", "lagged")


def arpo_branch_probability(p: float, w: float, delta_h: float) -> float:
    """ARPO: a path forks with probability clamp(p + w dH, 0, 1). The reference draws u and
    branches when clamp(u - w dH, 0, 1) <= p, which is the same event; a larger p branches more."""
    return min(1.0, max(0.0, p + w * delta_h))


def aepo_branches(u: float, p: float, w: float, delta_h: float, consecutive: int) -> bool:
    """AEPO's rule, kept with its own direction: branch when clamp((u + w dH) (1 - 0.05 c), 0, 1)
    >= p, with c the decisions in a row that made copies (AEPO counts rounds in a row in which the
    prompt gained trajectories; here, with no rounds, along the path's lineage). Here a larger p
    branches less (ARPO's opposite); at c = 0 both give the probability p' + w dH with p' = 1 - p."""
    damping = max(0.0, 1.0 - 0.05 * consecutive)
    return min(1.0, max(0.0, (u + w * delta_h) * damping)) >= p


def dynamic_root_count(n: int, h_root: float, h_tool: float) -> int:
    """AEPO's entropy-balanced root budget: clamp(floor(n sigmoid(0.5 (H_root - H_tool))) + 1, 1, n):
    a prompt whose first step is more uncertain than its steps after tool results gets more
    roots, the others keep more of the budget for branching."""
    return min(n, max(1, math.floor(n / (1.0 + math.exp(-0.5 * (h_root - h_tool)))) + 1))


class TreeRollout(_Rollout):
    """ARPO's tree rollout: ``initial_rollouts`` roots per prompt out of a budget of ``n``; at
    tool results a path may fork (a copy that then samples on independently: the agent loop seeds
    each segment by trajectory id), with probability clamp(p + w dH, 0, 1) where dH is read as
    ``delta_h`` says (module docstring), at most ``beam_size - 1`` copies per decision. Each path
    decides the moment its own step ends, never waiting for another path: see :class:`_Tree` for
    how the budget is shared so that the tree does not depend on the order paths finish in."""

    def __init__(self, settings: RolloutSettings):
        # ARPO's numbers (the paper's stages: n 16, 8 roots, beam 2, p 0.5, w 0.2), AEPO's switches
        # and where dH is read: RL's rollout group (configs/rl/_base.yaml says what each means)
        if settings.n < 1 or not 1 <= settings.initial_rollouts <= settings.n:
            raise ValueError(f"the tree rollout needs 1 <= initial_rollouts <= n, got {settings.initial_rollouts} and {settings.n}")
        if settings.beam_size < 1:
            raise ValueError(f"rollout.beam_size must be >= 1, got {settings.beam_size}")
        if settings.entropy not in ("topk", "exact"):
            raise ValueError(f"rollout.entropy must be topk or exact, got {settings.entropy!r}")
        if settings.delta_h not in DELTA_H:
            raise ValueError(f"rollout.delta_h must be one of {', '.join(DELTA_H)}, got {settings.delta_h!r}")
        self.s = settings

    def _entropy(self, state: TrajectoryState, segment: int) -> float:
        if self.s.entropy == "topk":
            if len(state.entropies) <= segment:
                raise ValueError("the tree rollout reads each segment's top-k entropy: set rollout.top_logprobs > 0")
            return state.entropies[segment]
        if len(state.entropies_exact) <= segment:
            raise ValueError(
                "rollout.entropy=exact needs exact entropies (the hf engine, rollout.top_logprobs > 0); use rollout.entropy=topk with vllm"
            )
        return state.entropies_exact[segment]

    def branch_point(self, loop: AgentLoop, t: TrajectoryState, before: int) -> tuple[int, int | None, float] | None:
        """The branch point of a path that has just taken a step (it had ``before`` segments):
        (the number of its tool results before the point, the segment a copy resamples (None: a
        copy of the whole path), dH), or None where it has none."""
        forked = t.provenance.operation == "fork"
        if self.s.delta_h == "after_result":
            # the segment just generated right after a tool result, other than the one a fork was
            # made to resample (that result's decision was its source's)
            k = t.segments - 1
            if t.segments > before and k >= 1 and not (forked and k == t.provenance.branch_segment):
                return k, k, self._entropy(t, k) - self._entropy(t, 0)
            return None
        if t.done or loop.room(t) <= 0:
            return None
        own_first = t.provenance.branch_segment if forked else 0
        return t.segments, None, self._entropy(t, t.segments - 1) - self._entropy(t, own_first)

    def branches(self, u: float, delta_h: float, consecutive: int) -> bool:
        """One draw's decision: ARPO's rule, or AEPO's with its consecutive-branch penalty."""
        s = self.s
        if s.branch_penalty:
            return aepo_branches(u, s.branch_probability, s.entropy_weight, delta_h, consecutive)
        return u < arpo_branch_probability(s.branch_probability, s.entropy_weight, delta_h)

    def root_counts(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> tuple[list[int], dict[str, float]]:
        """Roots per prompt: ``initial_rollouts``, or AEPO's dynamic count from one probe
        trajectory per prompt (run to its end with tools, then discarded, as in AEPO): H_root is
        its first segment's entropy, H_tool the mean over all of its segments, the first one
        included, as AEPO's code takes it."""
        if not self.s.dynamic_roots:
            return [self.s.initial_rollouts] * len(prompts), {}
        probes = [loop.new(p.question, f"step{step}/{p.index}/probe", seed=seed + step, stage="rl", round=step) for p in prompts]
        asyncio.run(loop.run(probes))
        counts = []
        for probe in probes:
            if not probe.segments:  # the engine failed it: no entropy to go by
                counts.append(self.s.initial_rollouts)
                continue
            entropies = [self._entropy(probe, k) for k in range(probe.segments)]
            counts.append(dynamic_root_count(self.s.n, entropies[0], sum(entropies) / len(entropies)))
        probe_calls = float(sum(p.executed_here() for p in probes))
        return counts, {"dynamic_prompts": float(len(counts)), "dynamic_roots": float(sum(counts)), "tool_calls_executed": probe_calls}

    def start(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> tuple[list[_Tree], dict[str, float]]:
        """The prompts' trees, their roots not yet run (AEPO's probes are, to count them)."""
        roots, counts = self.root_counts(loop, prompts, step, seed)
        return [_Tree(self, loop, p, step, seed, n_roots, self.s.n, i) for i, (p, n_roots) in enumerate(zip(prompts, roots))], counts

    def tally(self, trees: list[_Tree], counts: dict[str, float]) -> dict[str, float]:
        """The trees' counts, with those of their start (``counts``: AEPO's probes)."""
        counts = dict(counts)
        groups = [tree.group for tree in trees]
        counts["roots"] = float(sum(tree.roots for tree in trees))
        counts["branches"] = float(sum(t.branches for t in trees))
        counts["fill_ins"] = float(sum(t.fill_ins for t in trees))
        counts["depth"] = float(max((t.segments for g in groups for t in g), default=0))
        counts["tool_calls_executed"] = counts.get("tool_calls_executed", 0.0) + sum(t.executed_here() for g in groups for t in g)
        decisions = [d for tree in trees for d in tree.decisions]
        counts["delta_h_sum"] = math.fsum(d for _, _, d in decisions)  # exact: the same in any order of decisions
        for r, branched, _ in decisions:
            counts[f"decisions_result{r}"] = counts.get(f"decisions_result{r}", 0.0) + 1
            counts[f"branched_result{r}"] = counts.get(f"branched_result{r}", 0.0) + branched
        return counts


@dataclass
class _Path:
    """A path of a tree and what it may still add: ``budget`` trajectories to its prompt's group
    (its copies, their copies, and fresh rollouts), ``key`` its place in the group's order, and
    ``consecutive`` AEPO's count of decisions in a row, along its lineage, that made copies."""

    state: TrajectoryState
    key: tuple
    budget: int
    consecutive: int = 0


class _Tree:
    """One prompt's tree. Every path runs on its own: when one of its steps (a segment and its
    tool call) ends, it decides at once whether to fork, and a copy starts at once.

    Nothing a path does may depend on when other paths finish, or the same seeds would give
    another tree on every run. So the prompt's budget is split between its paths rather than
    shared first-come (ARPO's reference spends it on whichever paths it visits first in a round,
    which needs the round's barrier): the roots share ``n - roots`` as evenly as they can; a fork
    takes one from its source's budget, and the rest is halved between the two, the source
    keeping the odd one (so a tree that forks at every decision is the reference's balanced
    one: 2 roots of 16 give 4, 8, 16 paths); a path that ends with budget left is replaced by that
    many fresh rollouts at once (the reference waits until all of the prompt's paths have ended,
    then gives the fresh rollouts whatever budget is left). Each draw is seeded by the step, the
    path and the decision, and the group is ordered by the tree's structure (each path followed
    by what it made, in the order of its branch points), so a resumed step, a lockstep run and a
    streamed one give the same group, path for path."""

    def __init__(
        self, rollout: TreeRollout | GroupRollout, loop: AgentLoop, prompt: Prompt, step: int, seed: int, roots: int, n: int, position: int
    ):
        self.rollout, self.loop, self.prompt, self.step, self.seed = rollout, loop, prompt, step, seed
        self.roots = roots
        self.order = (step, position)  # the step it began in, and its place among that step's trees
        extra = n - roots
        self.paths = [_Path(self.fresh(f"step{step}/{prompt.index}/{i}"), (i,), extra // roots + (i < extra % roots)) for i in range(roots)]
        self.branches = self.fill_ins = 0
        self.decisions: list[tuple[int, int, float]] = []  # (tool results before the branch point, branched, dH)

    def fresh(self, id: str) -> TrajectoryState:
        return self.loop.new(self.prompt.question, id, seed=self.seed + self.step, stage="rl", round=self.step)

    @property
    def group(self) -> list[TrajectoryState]:
        return [path.state for path in sorted(self.paths, key=lambda path: path.key)]

    @property
    def complete(self) -> bool:
        """Every path has ended (a path that ends with budget left has made its fresh rollouts
        already): the group has its n trajectories."""
        return all(path.state.done for path in self.paths)

    async def grow(self, stop: asyncio.Event | None = None, stepped: Callable[[], None] = lambda: None) -> None:
        """Every unfinished path's walk, and through them every path's they add (see
        :func:`grow` for ``stop``); ``stepped`` is called after each step of a path."""
        await asyncio.gather(*(self.walk(path, stop, stepped) for path in list(self.paths) if not path.state.done))

    async def walk(self, path: _Path, stop: asyncio.Event | None = None, stepped: Callable[[], None] = lambda: None) -> None:
        """One path step after step to its end (or until ``stop``), each path it adds walking
        beside it at once."""
        others = []
        while not path.state.done and not (stop is not None and stop.is_set()):
            before = path.state.segments
            if not await self.loop.advance(path.state, stop):
                break
            others += [asyncio.ensure_future(self.walk(new, stop, stepped)) for new in self.after_step(path, before)]
            stepped()
        await asyncio.gather(*others)

    def oldest_version(self, current: int) -> int:
        """The oldest version of the weights any of its segments was sampled with (``current``
        when it has none yet)."""
        return min((v for path in self.paths for v in path.state.segment_versions), default=current)

    def state(self) -> dict:
        """The tree as data, without its loop and rollout (partial rollouts' checkpoints)."""
        fields = ("prompt", "step", "seed", "roots", "order", "paths", "branches", "fill_ins", "decisions")
        return {name: getattr(self, name) for name in fields}

    @classmethod
    def restored(cls, rollout: TreeRollout | GroupRollout, loop: AgentLoop, state: dict) -> _Tree:
        tree = cls.__new__(cls)
        tree.rollout, tree.loop = rollout, loop
        tree.__dict__.update(state)
        return tree

    def after_step(self, path: _Path, before: int) -> list[_Path]:
        """The paths one step of ``path`` adds: its copies, if its branch point decides so, then,
        if it has ended, fresh rollouts for the budget it has left."""
        t, added = path.state, []
        point = self.rollout.branch_point(self.loop, t, before) if path.budget > 0 else None
        if point is not None:
            s = self.rollout.s
            results, at_segment, delta_h = point
            for k in range(s.beam_size - 1):
                if path.budget == 0:
                    break
                u = random.Random(f"arpo/{self.seed}/{self.step}/{t.id}/{results}/{k}").random()
                branched = self.rollout.branches(u, delta_h, path.consecutive)
                self.decisions.append((results, int(branched), delta_h))
                if branched:
                    rest = path.budget - 1
                    copy = t.fork(f"{t.id}.{results}.{k}", at_segment=at_segment)
                    added.append(_Path(copy, path.key + ((results, k),), rest // 2))
                    path.budget = rest - rest // 2
            # AEPO's count moves at every decision: one more if it made copies, else back to 0
            path.consecutive = path.consecutive + 1 if added else 0
            for new in added:
                new.consecutive = path.consecutive
            self.branches += len(added)
        if t.done and path.budget > 0:
            # after every branch point of the path (a fork's results number at most its segments)
            after = t.segments + 1
            added += [_Path(self.fresh(f"{t.id}+{j}"), path.key + ((after, j),), 0) for j in range(path.budget)]
            self.fill_ins += path.budget
            path.budget = 0
        self.paths += added
        return added


def token_staleness(t: TrajectoryState, version: int) -> list[int]:
    """Per response token, how many versions older than ``version`` the weights that sampled it
    are (0 for a token of these weights, or one the policy did not sample)."""
    return [version - v if o == TokenOrigin.SAMPLED and v < version else 0 for o, v in zip(t.origin, t.token_versions())]


def stale_tokens(t: TrajectoryState, version: int) -> list[bool]:
    """Per response token: sampled by weights older than ``version`` (partial rollouts)."""
    return [staleness > 0 for staleness in token_staleness(t, version)]


class PartialRollout:
    """Partial rollouts with bounded staleness (``rollout.partial``), around a group or tree
    rollout: each step runs ``extra`` more groups than it trains on; generation ends when the
    step's groups are complete, and the unfinished ones carry over into the next step as they are,
    with the version of the weights each segment was sampled with (APRIL, verl's partial
    rollout). Which groups a step trains on, by ``on_stale``:

    - ``drop``: the first ``quota`` to complete (oldest first when several complete in the same
      round), and at the start of a step a carried group with a token sampled more than
      ``max_staleness`` versions ago is dropped;
    - ``wait``: the ``quota`` oldest groups in flight (by the step they began in, then their
      place in it), generation waiting for them; no token is ever more than ceil(extra / quota)
      versions old, which the trainer refuses above ``max_staleness``.

    Groups are keyed by prompt index in a step's batch, so a prompt already in flight is not
    started again: the step's own prompts that are, and the groups a drop leaves missing, are
    replaced from ``pool`` (seeded by the step). Its state, the groups in flight, is what
    :meth:`state` returns and :meth:`restore` takes: RL keeps it in each checkpoint, so a
    resumed run carries over what the uninterrupted one did."""

    def __init__(self, rollout: GroupRollout | TreeRollout, settings: RolloutSettings, quota: int, pool: list[Prompt], rank: int):
        if settings.on_stale not in ("drop", "wait"):
            raise ValueError(f"rollout.on_stale must be drop or wait, got {settings.on_stale!r}")
        self.rollout, self.quota, self.extra = rollout, quota, settings.partial_extra
        self.max_staleness, self.on_stale = settings.max_staleness, settings.on_stale
        self.pool, self.rank = pool, rank
        self.in_flight: list[_Tree] = []

    def fresh_prompts(self, chosen: list[Prompt], step: int, seed: int) -> list[Prompt]:
        """The prompts to start this step: the step's own, but those in flight, topped up from
        the pool to ``quota + extra`` groups in flight."""
        busy = {tree.prompt.index for tree in self.in_flight}
        fresh = [p for p in chosen if p.index not in busy]
        missing = self.quota + self.extra - len(self.in_flight) - len(fresh)
        if missing > 0:
            taken = busy | {p.index for p in fresh}
            spare = [p for p in self.pool if p.index not in taken]
            fresh += random.Random(f"partial/{seed}/{step}/{self.rank}").sample(spare, min(missing, len(spare)))
        return fresh

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> StepRollouts:
        """The step's ``quota`` groups (``prompts``: the step's own, see :meth:`fresh_prompts`)."""
        prompts = self.fresh_prompts(prompts, step, seed)
        version = loop.version
        dropped = 0
        if self.on_stale == "drop":
            kept = [tree for tree in self.in_flight if version - tree.oldest_version(version) <= self.max_staleness]
            dropped, self.in_flight = len(self.in_flight) - len(kept), kept
        in_flight_before = len(self.in_flight)
        started, counts = self.rollout.start(loop, prompts, step, seed)
        self.in_flight += started
        if len(self.in_flight) < self.quota:
            raise ValueError(f"partial rollouts: {len(self.in_flight)} groups in flight, fewer than the step's {self.quota}")

        def oldest() -> list[_Tree]:
            return sorted(self.in_flight, key=lambda tree: tree.order)[: self.quota]

        if self.on_stale == "wait":
            enough = lambda: all(tree.complete for tree in oldest())  # noqa: E731
        else:
            enough = lambda: sum(tree.complete for tree in self.in_flight) >= self.quota  # noqa: E731
        grow(loop, self.in_flight, enough)
        taken = sorted((tree for tree in self.in_flight if tree.complete), key=lambda tree: tree.order)[: self.quota]
        self.in_flight = [tree for tree in self.in_flight if all(tree is not t for t in taken)]
        counts = self.rollout.tally(taken, counts)
        trajectories = [t for tree in taken for t in tree.group]
        stale = [staleness for t in trajectories for staleness in token_staleness(t, version) if staleness]
        sampled = sum(t.n_generated for t in trajectories)
        counts |= {
            "partial_trajectories": float(len(trajectories)),
            "partial_carried": float(sum(tree.order[0] < step for tree in taken for _ in tree.paths)),
            "partial_versions_spanned": float(sum(len(set(t.segment_versions)) for t in trajectories)),
            "partial_sampled_tokens": float(sampled),
            "partial_stale_tokens": float(len(stale)),
            "partial_staleness_sum": float(sum(stale)),
            "staleness_max": float(max(stale, default=0)),
            "partial_groups_before": float(in_flight_before + dropped),
            "partial_dropped": float(dropped),
        }
        return StepRollouts([tree.group for tree in taken], counts, [tree.prompt for tree in taken])

    def state(self) -> list[dict]:
        """The groups in flight, as data (RL's checkpoints keep it)."""
        return [tree.state() for tree in self.in_flight]

    def restore(self, loop: AgentLoop, state: list[dict]) -> None:
        self.in_flight = [_Tree.restored(self.rollout, loop, part) for part in state]


def rollout_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The step's rollout metrics from every rank's counts: the tool calls the rollouts executed
    (a fork's copied calls counted once, in its source; AEPO's probes included), and for the tree
    the roots, branches and fill-ins summed, the most segments of any path (``depth``), the mean
    dH over branch decisions, the branch rate at each tool result (``branch_rate_result{r}``:
    the decisions made at a path's r-th result), and AEPO's mean dynamic root count. With
    partial rollouts: the share of the step's trajectories begun in an earlier step, the versions
    of the weights each spans (mean), the share of sampled tokens that are stale and their
    staleness in versions (mean over stale tokens, max), and the share of carried groups dropped
    for staleness (of those in flight at the step's start)."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = max(total.get(key, 0.0), value) if key in ("depth", "staleness_max") else total.get(key, 0.0) + value
    metrics = {"rollout/tool_calls_executed": total.get("tool_calls_executed", 0.0)}
    if "partial_trajectories" in total:
        trajectories, sampled = total["partial_trajectories"], total["partial_sampled_tokens"]
        metrics |= {
            "partial/carried_share": total["partial_carried"] / trajectories,
            "partial/versions_spanned": total["partial_versions_spanned"] / trajectories,
            "partial/stale_token_share": total["partial_stale_tokens"] / sampled if sampled else 0.0,
            "partial/staleness_mean": total["partial_staleness_sum"] / total["partial_stale_tokens"]
            if total["partial_stale_tokens"]
            else 0.0,
            "partial/staleness_max": total["staleness_max"],
            "partial/dropped_share": total["partial_dropped"] / total["partial_groups_before"] if total["partial_groups_before"] else 0.0,
        }
    if "gateway_turns" in total:
        later = total["gateway_later_turns"]
        metrics |= {
            "gateway/fork_rate": total["gateway_forks"] / later if later else 0.0,
            "gateway/realign_rate": total["gateway_realigns"] / later if later else 0.0,
            "gateway/turns_per_session": total["gateway_turns"] / max(total["gateway_sessions"], 1.0),
            "gateway/not_ended_share": total["gateway_not_ended"] / max(total["gateway_sessions"], 1.0),
        }
    if "roots" not in total:
        return metrics
    decisions = sum(v for k, v in total.items() if k.startswith("decisions_result"))
    metrics |= {f"rollout/{k}": total[k] for k in ("roots", "branches", "fill_ins", "depth")}
    metrics["rollout/mean_delta_h"] = total["delta_h_sum"] / decisions if decisions else 0.0
    for key in sorted((k for k in total if k.startswith("decisions_result")), key=lambda k: int(k.removeprefix("decisions_result"))):
        r = key.removeprefix("decisions_result")
        metrics[f"rollout/branch_rate_result{r}"] = total[f"branched_result{r}"] / total[key]
    if "dynamic_prompts" in total:
        metrics["rollout/dynamic_roots_mean"] = total["dynamic_roots"] / total["dynamic_prompts"]
    return metrics


def segment_entropy(settings: RolloutSettings) -> SegmentEntropy | None:
    """What the agent loop asks the engine for, to measure segment entropies: only the tree reads
    them, so a group rollout asks for no top log-probabilities (vLLM would compute and
    detokenize ``top_logprobs`` entries at every position of every segment for nothing)."""
    return SegmentEntropy(settings.top_logprobs, settings.entropy_window) if settings.kind == "tree" else None


def make_rollout(settings: RolloutSettings):
    """The rollout of RL's ``rollout`` group: kind ``group``, ``tree`` or ``gateway``."""
    if settings.kind == "group":
        return GroupRollout(settings.n)
    if settings.kind == "tree":
        return TreeRollout(settings)
    if settings.kind == "gateway":
        from etagent.rl.harness import GatewayRollout  # it builds on this module's types

        return GatewayRollout(settings.n, settings.gateway)
    raise ValueError(f"rollout.kind must be group, tree or gateway, got {settings.kind!r}")

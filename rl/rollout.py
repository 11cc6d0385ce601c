"""The prompts of an RL run and the rollouts of one step.

:func:`read_prompts` turns the RL parquet (verl's schema, as ``pareto/`` writes it or as the
paper's files are) into questions for the agent loop. Two rollouts, one interface
(``generate(loop, prompts, step, seed) -> StepRollouts``: exactly ``n`` finished trajectories per
prompt, and the step's rollout metrics), chosen by ``rollout.kind``:

- :class:`GroupRollout`: plain GRPO sampling, ``n`` independent rollouts per prompt;
- :class:`TreeRollout`: ARPO's entropy branching (paper_rl.md §1.3), with AEPO's dynamic root
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
  one), a prompt whose paths have all ended gets all of its missing rollouts at once (the
  reference adds one per round), a path with no room left never forks (ARPO's length filter; the
  copy would end at once, identical to its source), the branch draws are seeded, and each
  trajectory generates within its own token budget.

Each step's seed is the run's plus the step, so a resumed step draws what the uninterrupted one
did. What this module does not do: score the rollouts (rl/reward.py) or turn them into tensors
(rl/batch.py).
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from etagent import protocol
from etagent.agent import AgentLoop, SegmentEntropy, TrajectoryState
from etagent.question_formats import DEFAULT_FORMAT, QuestionFormat, read_question_rows
from etagent.records import Question, RecordError
from etagent.rl.config import RolloutSettings
from etagent.rl.reward import DATA_SOURCES


@dataclass(frozen=True)
class Prompt:
    """One row of the RL parquet: the question the agent loop answers, and what the reward reads
    (``index`` groups its rollouts, ``data_source`` picks the scoring)."""

    question: Question
    index: int
    data_source: str


def read_prompts(
    path: str | Path,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    question_format: QuestionFormat = DEFAULT_FORMAT,
    rerender_prompts: bool = False,
) -> list[Prompt]:
    """The rows of an RL data source as prompts: our RL parquet (verl's schema, as ``pareto/``
    writes it or as the paper's files are), or any format etagent.question_formats reads (verl's
    GSM8K, Search-R1, FlashRAG, TRL, a ``datasets`` folder). The agent loop renders every question
    with the protocol's prompt, so a row that brings a chat prompt of its own (another system
    prompt, none, or instructions in the user turn) is refused unless ``rerender_prompts``: it
    would train on prompts the data never had. With it, the question read from the row (see
    :mod:`etagent.question_formats`) is rendered with the protocol's prompt. With
    ``max_prompt_tokens``, a longer prompt is an error naming its row, as verl's
    ``truncation=error`` (a cut question would be scored against its full answer)."""
    rows, mapping = read_question_rows(path, question_format)
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
    return prompts


@dataclass
class StepRollouts:
    """One step's rollouts: ``groups[i]`` holds the ``n`` finished trajectories of prompt i;
    ``counts`` are the rollout's own tallies, all sums, so that ranks' counts add up
    (:func:`rollout_metrics` turns them into the logged metrics)."""

    groups: list[list[TrajectoryState]]
    counts: dict[str, float] = field(default_factory=dict)


class GroupRollout:
    """Plain GRPO rollouts: ``n`` independent samples per prompt."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {n}")
        self.n = n

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> StepRollouts:
        """Trajectory ids name the step, the prompt and the sample; every segment's draw comes
        from the step's seed and the trajectory id (:meth:`AgentLoop.new`)."""
        states = [
            loop.new(p.question, f"step{step}/{p.index}/{k}", seed=seed + step, stage="rl", round=step)
            for p in prompts
            for k in range(self.n)
        ]
        asyncio.run(loop.run(states))
        counts = {"tool_calls_executed": float(sum(t.executed_here() for t in states))}
        return StepRollouts([states[i * self.n : (i + 1) * self.n] for i in range(len(prompts))], counts)


DELTA_H = ("after_result", "lagged")


def arpo_branch_probability(p: float, w: float, delta_h: float) -> float:
    """ARPO: a path forks with probability clamp(p + w dH, 0, 1). The reference draws u and
    branches when clamp(u - w dH, 0, 1) <= p, which is the same event; a larger p branches more."""
    return min(1.0, max(0.0, p + w * delta_h))


def aepo_branches(u: float, p: float, w: float, delta_h: float, consecutive: int) -> bool:
    """AEPO's rule, kept with its own direction: branch when clamp((u + w dH) (1 - 0.05 c), 0, 1)
    >= p, with c the rounds in a row this prompt gained trajectories. Here a larger p branches
    less (ARPO's opposite); at c = 0 both give the probability p' + w dH with p' = 1 - p."""
    damping = max(0.0, 1.0 - 0.05 * consecutive)
    return min(1.0, max(0.0, (u + w * delta_h) * damping)) >= p


def dynamic_root_count(n: int, h_root: float, h_tool: float) -> int:
    """AEPO's entropy-balanced root budget: clamp(floor(n sigmoid(0.5 (H_root - H_tool))) + 1, 1, n):
    a prompt whose first step is more uncertain than its steps after tool results gets more
    roots, the others keep more of the budget for branching."""
    return min(n, max(1, math.floor(n / (1.0 + math.exp(-0.5 * (h_root - h_tool)))) + 1))


class TreeRollout:
    """ARPO's tree rollout: ``initial_rollouts`` roots per prompt out of a budget of ``n``; at
    tool results a path may fork (a copy that then samples on independently: the agent loop seeds
    each segment by trajectory id), with probability clamp(p + w dH, 0, 1) where dH is read as
    ``delta_h`` says (module docstring). Sources are visited in creation order, each forking at
    most ``beam_size - 1`` times per decision while the prompt's budget lasts; a prompt whose
    paths have all ended is filled up with fresh rollouts from the prompt. Each group is the
    prompt's trajectories in creation order: roots, then branches and fill-ins as they were
    made."""

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

    def _candidates(
        self, loop: AgentLoop, group: list[TrajectoryState], stepped: dict[int, int]
    ) -> list[tuple[TrajectoryState, int | None, float]]:
        """This round's branch points of one prompt's paths: (source, the segment the copy resamples
        (None: a copy of the whole path), dH)."""
        candidates = []
        for t in group:
            if id(t) not in stepped:
                continue
            forked = t.provenance.operation == "fork"
            if self.s.delta_h == "after_result":
                # a segment generated in this round right after a tool result, other than the one a
                # fork was made to resample (that result's decision was its source's)
                k = t.segments - 1
                if t.segments > stepped[id(t)] and k >= 1 and not (forked and k == t.provenance.branch_segment):
                    candidates.append((t, k, self._entropy(t, k) - self._entropy(t, 0)))
            elif not t.done and loop.room(t) > 0:
                own_first = t.provenance.branch_segment if forked else 0
                candidates.append((t, None, self._entropy(t, t.segments - 1) - self._entropy(t, own_first)))
        return candidates

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

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> StepRollouts:
        roots, counts = self.root_counts(loop, prompts, step, seed)
        trees = [_Tree(self, loop, p, step, seed, n_roots) for p, n_roots in zip(prompts, roots)]

        async def grow_all() -> None:
            if not loop.config.lockstep:
                await asyncio.gather(*(tree.grow() for tree in trees))
                return
            while any(tree.growing for tree in trees):  # rounds over every prompt's paths at once
                stepped = [tree.start_round() for tree in trees]
                await loop.step([t for tree in trees if tree.growing for t in tree.group if not t.done])
                for tree, before in zip(trees, stepped):
                    if before is not None:
                        tree.end_round(before)

        asyncio.run(grow_all())
        groups = [tree.group for tree in trees]
        counts["roots"] = float(sum(roots))
        counts["branches"] = float(sum(t.branches for t in trees))
        counts["fill_ins"] = float(sum(t.fill_ins for t in trees))
        counts["rounds"] = float(max((t.rounds for t in trees), default=0))
        counts["tool_calls_executed"] = counts.get("tool_calls_executed", 0.0) + sum(t.executed_here() for g in groups for t in g)
        decisions = [d for tree in trees for d in tree.decisions]
        counts["delta_h_sum"] = sum(d for _, _, d in decisions)
        for r, branched, _ in decisions:
            counts[f"decisions_round{r}"] = counts.get(f"decisions_round{r}", 0.0) + 1
            counts[f"branched_round{r}"] = counts.get(f"branched_round{r}", 0.0) + branched
        return StepRollouts(groups, counts)


class _Tree:
    """One prompt's tree, grown in rounds of its own paths: each round, every unfinished path
    advances one step (a segment and its tool call) on its own; when all have, the branch
    decisions are made in creation order with the prompt's own seeded draws. Prompts do not wait
    for each other, and a tree is the same whatever else runs beside it."""

    def __init__(self, rollout: TreeRollout, loop: AgentLoop, prompt: Prompt, step: int, seed: int, roots: int):
        self.rollout, self.loop, self.prompt, self.step, self.seed = rollout, loop, prompt, step, seed
        self.rng = random.Random(f"arpo/{seed}/{step}/{prompt.index}")  # the same on a resumed step
        self.group: list[TrajectoryState] = []
        for _ in range(roots):
            self.group.append(self.fresh())
        self.branches = self.fill_ins = self.rounds = self.consecutive = 0
        self.decisions: list[tuple[int, int, float]] = []  # (round, branched, dH)

    def fresh(self) -> TrajectoryState:
        p = self.prompt
        return self.loop.new(
            p.question, f"step{self.step}/{p.index}/{len(self.group)}", seed=self.seed + self.step, stage="rl", round=self.step
        )

    @property
    def growing(self) -> bool:
        return any(not t.done for t in self.group)

    async def grow(self) -> None:
        """Round after round of this prompt's own paths, until all have ended."""
        while self.growing:
            stepped = self.start_round()
            await asyncio.gather(*(self.loop.advance(t) for t in self.group if not t.done))
            self.end_round(stepped)

    def start_round(self) -> dict[int, int] | None:
        """The unfinished paths' segment counts before a round (None: nothing left to grow)."""
        if not self.growing:
            return None
        self.rounds += 1
        return {id(t): t.segments for t in self.group if not t.done}

    def end_round(self, stepped: dict[int, int]) -> None:
        """The branch decisions after a round (in creation order, with this prompt's draws), then
        the fill-ins of a prompt whose paths have all ended."""
        s, group = self.rollout.s, self.group
        gained = 0
        for source, at_segment, delta_h in self.rollout._candidates(self.loop, group, stepped):
            for _ in range(s.beam_size - 1):
                if len(group) >= s.n:
                    break
                u = self.rng.random()
                if s.branch_penalty:
                    branched = aepo_branches(u, s.branch_probability, s.entropy_weight, delta_h, self.consecutive)
                else:
                    branched = u < arpo_branch_probability(s.branch_probability, s.entropy_weight, delta_h)
                self.decisions.append((self.rounds, int(branched), delta_h))
                if branched:
                    group.append(source.fork(f"step{self.step}/{self.prompt.index}/{len(group)}", at_segment=at_segment))
                    self.branches += 1
                    gained += 1
        if all(t.done for t in group) and len(group) < s.n:
            while len(group) < s.n:
                group.append(self.fresh())
                self.fill_ins += 1
                gained += 1
        # AEPO's counter moves only in rounds that added trajectories
        self.consecutive = self.consecutive + 1 if gained else 0


def rollout_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The step's rollout metrics from every rank's counts: the tool calls the rollouts executed
    (a fork's copied calls counted once, in its source; AEPO's probes included), and for the tree
    the roots, branches and fill-ins summed, the most rounds any rank ran, the mean dH over
    branch decisions, the branch rate of each round, and AEPO's mean dynamic root count."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = max(total.get(key, 0.0), value) if key == "rounds" else total.get(key, 0.0) + value
    metrics = {"rollout/tool_calls_executed": total.get("tool_calls_executed", 0.0)}
    if "roots" not in total:
        return metrics
    decisions = sum(v for k, v in total.items() if k.startswith("decisions_round"))
    metrics |= {f"rollout/{k}": total[k] for k in ("roots", "branches", "fill_ins", "rounds")}
    metrics["rollout/mean_delta_h"] = total["delta_h_sum"] / decisions if decisions else 0.0
    for key in sorted((k for k in total if k.startswith("decisions_round")), key=lambda k: int(k.removeprefix("decisions_round"))):
        r = key.removeprefix("decisions_round")
        metrics[f"rollout/branch_rate_round{r}"] = total[f"branched_round{r}"] / total[key]
    if "dynamic_prompts" in total:
        metrics["rollout/dynamic_roots_mean"] = total["dynamic_roots"] / total["dynamic_prompts"]
    return metrics


def segment_entropy(settings: RolloutSettings) -> SegmentEntropy | None:
    """What the agent loop asks the engine for, to measure segment entropies: only the tree reads
    them, so a group rollout asks for no top log-probabilities (vLLM would compute and
    detokenize ``top_logprobs`` entries at every position of every segment for nothing)."""
    return SegmentEntropy(settings.top_logprobs, settings.entropy_window) if settings.kind == "tree" else None


def make_rollout(settings: RolloutSettings) -> GroupRollout | TreeRollout:
    """The rollout of RL's ``rollout`` group: kind ``group`` or ``tree``."""
    if settings.kind == "group":
        return GroupRollout(settings.n)
    if settings.kind == "tree":
        return TreeRollout(settings)
    raise ValueError(f"rollout.kind must be group or tree, got {settings.kind!r}")

"""The flywheel's algorithm for one question: an initial rollout, then rounds of evolution.

Per question (docs/paper-code.md §A2.5, §A2.6):

1. **initial**: the policy rolls out from the prompt (budgets 6 python, 6 search) and the answer
   is judged.
2. Up to ``rounds`` times: the parent is the trajectory evolved next (round 1: the initial one;
   then the best one not yet evolved: highest score first, where a score is math's 0/1 or QA's
   F1, then fewer tool calls, earlier first on ties; the best overall once all were evolved). A
   correct parent gets, concurrently:

   - **A1_rerollout**: a fresh rollout from the prompt;
   - **A2_redundancy_fix**: the editor names the first redundant step and writes its corrected
     form; the trajectory is cut there, the corrected step's call run, and the policy continues;
   - **A3_rewrite**: the editor rewrites each reasoning block, given the trajectory so far; every
     tool call, result and the answer stay byte-identical (checked; a rewrite that changes them
     is refused and counted).

   A wrong parent gets **B0_locate_flaw** (the editor names the first flawed step), then
   concurrently **B1_new_step** (the self-reflector, the policy model itself, analyses the
   flawed step and writes its replacement, which is run and continued from) and
   **B2_step_hint** (the steps up to the flawed one, then a whole "use a tool" hint sentence,
   then the policy continues); and, concurrently with that chain, **B3_trajectory_hint** (the
   final reasoning reopened, the hint appended, the policy continues).
3. Every new trajectory is judged and kept, with its operation, parent, round and the step it
   edited (:class:`etagent.records.Provenance`); a round that makes nothing ends the rounds.

Judging: QA by F1 from ``qa_pass_mark`` on (0.8 in the presets; the paper's evaluation
normalisation, articles removed, rather than the reference's raw whitespace F1); math by the rule (math equivalence against every gold answer), then the LLM judge
where one is configured and the rule said no.

Continuations after an edit run with their own budgets (10 python, 10 search), counting the calls
already in the prefix. A prefix's tokens come from the parent's token ids where they match, so
SFT trains on what the policy generated; text the policy did not sample here (an edited step, a
rewritten reasoning block, a hint) is ``GIVEN``, tool output ``TOOL``.

Fixed against the reference: the step hint is the whole sentence (not one random character of
it), the rewrite keeps the editor's case and never doubles ``<think>``, a hint on a trajectory
without an answer keeps its steps, the log is kept per trajectory (provenance) and per operation
(outcome, reply), every random choice is seeded, and a question that hits its time limit keeps
what it made.

What this module does not do: read or write files (``etagent.flywheel.run``), or filter trajectories for
SFT (``etagent.flywheel.export``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Annotated

from omegaconf import MISSING

from etagent import protocol, scoring
from etagent.agent import AgentLoop, Budgets
from etagent.flywheel import prompts
from etagent.flywheel.steps import (
    EditorReplyError,
    clean_step,
    format_steps,
    parse_flaw_reply,
    parse_redundancy_reply,
    reopen_final_think,
    replace_step,
    rewrite_problems,
    split_steps,
    step_hint_prefix,
    think_blocks,
)
from etagent.llm.text import TextModel
from etagent.net import ExternalCallError
from etagent.records import Judgement, Question, Trajectory
from etagent.settings import FREE, Fraction, NonNegativeInt, PositiveFloat, PositiveInt, Seed, group

log = logging.getLogger("flywheel")

INITIAL = "initial"
CORRECT_OPERATIONS = ("A1_rerollout", "A2_redundancy_fix", "A3_rewrite")
WRONG_OPERATIONS = ("B0_locate_flaw", "B1_new_step", "B2_step_hint", "B3_trajectory_hint")
OPERATIONS = (INITIAL,) + CORRECT_OPERATIONS + WRONG_OPERATIONS
# The operations that cannot run without an editor (B1 and B2 need B0's step number).
NEEDS_EDITOR = frozenset({"A2_redundancy_fix", "A3_rewrite", "B0_locate_flaw", "B1_new_step", "B2_step_hint"})
# Per operation: attempted, its model reply parsed (or no reply needed), a trajectory made, judged correct;
# also counted where they happen: rejected (A3), skipped_no_editor, model_errors.
STAT_FIELDS = ("attempted", "parsed", "succeeded", "correct")


def derived_seed(*parts) -> int:
    """A 63-bit seed from any parts (run seed, question id, operation, round): every request the
    flywheel makes is seeded from what it is, so a rerun asks the same thing."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@group
class FlywheelSettings:
    """The ``flywheel`` config group: names and types only, like every stage schema; the values,
    and what each means, are in configs/flywheel/_base.yaml."""

    rounds: NonNegativeInt = MISSING
    continuation_python_calls: NonNegativeInt = MISSING
    continuation_search_calls: NonNegativeInt = MISSING
    qa_pass_mark: Fraction = MISSING
    concurrency: Annotated[PositiveInt, FREE] = MISSING  # flywheel/run.py: questions at once, and seconds each
    question_timeout_s: PositiveFloat = MISSING
    seed: Seed = MISSING
    reply_chars: Annotated[PositiveInt, FREE] = MISSING  # of each raw editor reply kept in the log


@dataclass
class QuestionRun:
    """What one question's evolution has made so far (kept when its time limit passes)."""

    question: Question
    trajectories: list[Trajectory] = field(default_factory=list)
    evolved: list[str] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    stats: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    rounds: int = 0

    def count(self, operation: str, stat: str) -> None:
        self.stats[operation][stat] += 1

    def stats_json(self) -> dict[str, dict[str, int]]:
        """Per operation: the four counts (zeros included), then any other outcome counted."""
        return {op: {**dict.fromkeys(STAT_FIELDS, 0), **counts} for op, counts in self.stats.items()}

    def event(self, round: int, operation: str, outcome: str, **details) -> None:
        self.events.append({"round": round, "operation": operation, "outcome": outcome, **details})


def select_parent(trajectories: list[Trajectory], evolved: list[str]) -> Trajectory:
    """The best trajectory not yet evolved (the best overall when all were)."""

    def key(t: Trajectory) -> tuple[float, int]:
        score = t.judgement.score if t.judgement is not None and t.judgement.score is not None else 0.0
        return (-score, t.tool_calls_written or 0)

    ranked = sorted(trajectories, key=key)  # stable: earlier trajectories win ties
    return next((t for t in ranked if t.id not in evolved), ranked[0])


class Flywheel:
    """Evolves questions with a policy (an agent loop), a self-reflector, an optional editor and
    an optional LLM judge for math."""

    def __init__(
        self,
        loop: AgentLoop,
        reflector: TextModel,
        editor: TextModel | None,
        settings: FlywheelSettings,
        judge: scoring.LLMJudge | None = None,
        stage: str = "flywheel",
    ):
        self.loop, self.reflector, self.editor, self.settings, self.judge, self.stage = loop, reflector, editor, settings, judge, stage
        response_tokens = loop.config.max_response_tokens
        self.continuation_budgets = Budgets(settings.continuation_python_calls, settings.continuation_search_calls, None, response_tokens)

    # -- the algorithm ----------------------------------------------------------------------

    async def evolve(self, run: QuestionRun) -> None:
        """Fill ``run`` with the question's trajectories (it keeps them if this is cancelled)."""
        q = run.question
        run.count(INITIAL, "attempted")
        run.count(INITIAL, "parsed")
        initial = await self._finish(run, INITIAL, self.loop.new(q, f"{q.id}/initial", stage=self.stage, round=0))
        run.trajectories.append(initial)
        for round in range(1, self.settings.rounds + 1):
            parent = run.trajectories[0] if round == 1 else select_parent(run.trajectories, run.evolved)
            run.evolved.append(parent.id)
            run.rounds = round
            if parent.correct:
                made = await asyncio.gather(
                    self.rerollout(run, parent, round), self.redundancy_fix(run, parent, round), self.rewrite(run, parent, round)
                )
            else:
                (b1, b2), b3 = await asyncio.gather(self.flaw_repairs(run, parent, round), self.trajectory_hint(run, parent, round))
                made = [b1, b2, b3]
            new = [t for t in made if t is not None]
            if not new:
                run.event(round, "round", "nothing made; rounds end")
                break
            run.trajectories += new

    # -- correct parents --------------------------------------------------------------------

    async def rerollout(self, run: QuestionRun, parent: Trajectory, round: int) -> Trajectory | None:
        """A1: a fresh rollout from the prompt (its parent is the trajectory this round evolved)."""
        op, q = "A1_rerollout", run.question
        run.count(op, "attempted")
        run.count(op, "parsed")
        state = self.loop.new(q, f"{q.id}/r{round}/{op}", stage=self.stage, round=round, parent=parent.id)
        return await self._finish(run, op, state)

    async def redundancy_fix(self, run: QuestionRun, parent: Trajectory, round: int) -> Trajectory | None:
        op, q = "A2_redundancy_fix", run.question
        if not self._can_run(run, op, round):
            return None
        steps = split_steps(parent.text)
        messages = [{"role": "user", "content": prompts.REDUNDANCY_PROMPT.format(question=q.question, steps=format_steps(steps))}]
        reply = await self._ask(run, op, round, self.editor, messages, stop=protocol.STOP_STRINGS)
        if reply is None:
            return None
        try:
            fix = parse_redundancy_reply(reply, len(steps))
        except EditorReplyError as error:
            run.event(round, op, "unparsed", reason=str(error), reply=self._clip(reply))
            return None
        run.count(op, "parsed")
        if fix is None:
            run.event(round, op, "no redundant step", reply=self._clip(reply))
            return None
        prefix = replace_step(steps, fix.step, fix.corrected_step)
        run.event(round, op, "edited", step=fix.step, analysis=self._clip(fix.analysis))
        return await self._continue(run, op, round, parent, prefix, edited_step=fix.step)

    async def rewrite(self, run: QuestionRun, parent: Trajectory, round: int) -> Trajectory | None:
        op, q = "A3_rewrite", run.question
        if not self._can_run(run, op, round):
            return None
        blocks = think_blocks(parent.text)
        if not blocks:
            run.event(round, op, "no reasoning block to rewrite")
            return None
        messages = [{"role": "user", "content": prompts.REWRITE_PROMPT.format(question=q.question, trajectory=parent.text)}]
        rewritten, position = "", 0
        for i, (start, end) in enumerate(blocks):
            rewritten += parent.text[position:start]  # the original text up to this block's content
            reply = await self._ask(run, op, round, self.editor, messages, prefill=rewritten, stop=("</think>",), part=i)
            if reply is None:
                return None
            rewritten += reply.split("</think>", 1)[0].strip()
            position = end
        rewritten += parent.text[position:]
        problems = rewrite_problems(parent.text, rewritten)
        if problems:
            run.event(round, op, "rejected", reason="; ".join(problems))
            run.count(op, "rejected")
            return None
        run.count(op, "parsed")
        if rewritten == parent.text:
            run.event(round, op, "unchanged")
            return None
        return await self._continue(run, op, round, parent, rewritten)

    # -- wrong parents ----------------------------------------------------------------------

    async def flaw_repairs(self, run: QuestionRun, parent: Trajectory, round: int) -> tuple[Trajectory | None, Trajectory | None]:
        """B0, then B1 and B2 on the step it names."""
        op, q = "B0_locate_flaw", run.question
        if not self._can_run(run, op, round):
            for skipped in ("B1_new_step", "B2_step_hint"):
                self._can_run(run, skipped, round)
            return None, None
        steps = split_steps(parent.text)
        messages = [{"role": "user", "content": prompts.FLAW_PROMPT.format(question=q.question, steps=format_steps(steps))}]
        reply = await self._ask(run, op, round, self.editor, messages, stop=("Analysis:",))
        if reply is None:
            return None, None
        try:
            step = parse_flaw_reply(reply, len(steps))
        except EditorReplyError as error:
            run.event(round, op, "unparsed", reason=str(error), reply=self._clip(reply))
            return None, None
        run.count(op, "parsed")
        run.count(op, "succeeded")
        run.event(round, op, "located", step=step)
        b1, b2 = await asyncio.gather(self.new_step(run, parent, round, steps, step), self.step_hint(run, parent, round, step))
        return b1, b2

    async def new_step(self, run: QuestionRun, parent: Trajectory, round: int, steps: list[str], step: int) -> Trajectory | None:
        op, q = "B1_new_step", run.question
        run.count(op, "attempted")
        shown = format_steps(steps[:step])
        flaw = [{"role": "user", "content": prompts.FLAW_PROMPT.format(question=q.question, steps=shown)}]
        prefill = prompts.ANALYSIS_PREFILL.format(step=step)
        analysis = await self._ask(run, op, round, self.reflector, flaw, prefill=prefill, part="analysis")
        if analysis is None:
            return None
        analysis = (prefill.split("Analysis:", 1)[1] + analysis).strip()
        ask = prompts.NEW_STEP_PROMPT.format(question=q.question, steps=shown, analysis=analysis)
        reply = await self._ask(run, op, round, self.reflector, [{"role": "user", "content": ask}], stop=protocol.STOP_STRINGS, part="step")
        if reply is None:
            return None
        try:
            new = clean_step(reply)
        except EditorReplyError as error:
            run.event(round, op, "unparsed", reason=str(error), reply=self._clip(reply))
            return None
        run.count(op, "parsed")
        run.event(round, op, "rewrote step", step=step, analysis=self._clip(analysis))
        return await self._continue(run, op, round, parent, replace_step(steps, step, new), edited_step=step)

    async def step_hint(self, run: QuestionRun, parent: Trajectory, round: int, step: int) -> Trajectory | None:
        op = "B2_step_hint"
        run.count(op, "attempted")
        try:
            prefix = step_hint_prefix(parent.text, step, self._hint(run, op, round))
        except EditorReplyError as error:  # the flawed step is the final one: no tool step to cut after
            run.event(round, op, "not applicable", reason=str(error))
            return None
        run.count(op, "parsed")
        return await self._continue(run, op, round, parent, prefix, edited_step=step)

    async def trajectory_hint(self, run: QuestionRun, parent: Trajectory, round: int) -> Trajectory | None:
        op = "B3_trajectory_hint"
        run.count(op, "attempted")
        run.count(op, "parsed")
        prefix = reopen_final_think(parent.text, self._hint(run, op, round))
        return await self._continue(run, op, round, parent, prefix)

    # -- helpers ----------------------------------------------------------------------------

    def _can_run(self, run: QuestionRun, op: str, round: int) -> bool:
        if self.editor is None and op in NEEDS_EDITOR:
            run.count(op, "skipped_no_editor")
            run.event(round, op, "skipped: no editor configured")
            return False
        run.count(op, "attempted")
        return True

    def _hint(self, run: QuestionRun, op: str, round: int) -> str:
        rng = random.Random(derived_seed(self.settings.seed, run.question.id, round, op))
        return rng.choice(prompts.hints_for(run.question.kind))

    def _clip(self, text: str) -> str:
        return text[: self.settings.reply_chars]

    async def _ask(self, run: QuestionRun, op: str, round: int, model: TextModel, messages, *, part="", **kwargs) -> str | None:
        seed = derived_seed(self.settings.seed, run.question.id, round, op, part)
        try:
            return await model.complete(messages, seed=seed, **kwargs)
        except ExternalCallError as error:
            run.event(round, op, "model failed", reason=str(error))
            run.count(op, "model_errors")
            return None

    async def _continue(
        self, run: QuestionRun, op: str, round: int, parent: Trajectory, prefix: str, edited_step: int | None = None
    ) -> Trajectory:
        """The policy continues from ``prefix`` (a trailing call is run first; a prefix that
        already ends with the answer is finished as it is: ``AgentLoop.from_prefix``)."""
        q = run.question
        state = self.loop.from_prefix(
            q,
            f"{q.id}/r{round}/{op}",
            prefix,
            source=parent,
            budgets=self.continuation_budgets,
            stage=self.stage,
            operation=op,
            round=round,
            parent=parent.id,
            edited_step=edited_step,
        )
        return await self._finish(run, op, state)

    async def _finish(self, run: QuestionRun, op: str, state) -> Trajectory:
        await self.loop.run([state])
        record = self.loop.to_record(state)
        record.provenance.operation = op
        # only what SFT needs: the ids and where each came from (log-probabilities are not kept)
        record.logprobs = record.tempered_logprobs = None
        record.judgement = await self.judgement(run.question, record.prediction)
        run.count(op, "succeeded")
        if record.correct:
            run.count(op, "correct")
        return record

    async def judgement(self, q: Question, prediction: str) -> Judgement:
        """QA: F1 over the threshold; math: the rule, then the LLM judge if configured."""
        rule = scoring.rule_judgement(prediction, q.answer, q.kind, qa_pass_mark=self.settings.qa_pass_mark)
        if q.kind != "math" or rule.verdict or self.judge is None or not prediction.strip():
            return rule
        judged = await self.judge.ajudge(q.question, q.answer, prediction)
        return judged if judged.verdict is not None else rule

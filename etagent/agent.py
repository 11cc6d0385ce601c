"""The multi-turn tool-integrated reasoning loop, over token ids.

A trajectory is the prompt's token ids plus response token ids, each with its origin
(:class:`etagent.records.TokenOrigin`): ``SAMPLED`` by the policy in this rollout, ``GIVEN`` policy
text it did not sample here (a prefix, an edited step, a hint), or ``TOOL`` output inserted by the
loop. Its text is always decoded from those ids, special tokens included; nothing is
re-tokenized, so what SFT and RL train on is exactly what was generated and scored.

:class:`AgentLoop` runs every trajectory on its own (:meth:`AgentLoop.run_one`), so none waits
for another one's long segment or slow tool call; the engine batches whatever segments are
pending at the time (the hf engine batches continuously). With ``lockstep`` it runs rounds
instead (:meth:`AgentLoop.step`: a segment of every unfinished trajectory in one engine call,
then all of their tool calls), which, with an engine that decodes each call by itself, gives the
same tokens every run. One step of a trajectory (:meth:`AgentLoop.advance`):

1. a tool call left at the end of a prefix (a prefix whose last step is a call) runs first;
2. the engine generates the next segment, stopping at ``</python>``, ``</search>``,
   ``</answer>`` or ``<result>`` (engine-side stops), EOS or a token limit (the trajectory's
   response budget, and the engine's context length);
3. the segment is parsed (:func:`etagent.protocol.parse_segment`); a tool call within its budgets
   runs through the tools executor, an over-budget call is answered at once with an explicit
   budget message (never left unexecuted for the model to invent a result), and a segment that
   ends the trajectory sets its finish reason;
4. the result, wrapped by :func:`etagent.protocol.format_result`, is tokenized on its own and
   appended as ``TOOL`` tokens, cut to the response budget that remains (its closing tag kept).

Each segment is sampled with a seed derived from the trajectory's seed, id and segment number, so
a trajectory does not depend on what else runs beside it or on the order in which tool calls
finish, up to the rounding of the logits, which batch shapes move at about 1e-6 (exactly, in
lockstep with an engine that decodes each call by itself); RL gives each step's
trajectories their own seed (:meth:`AgentLoop.new`), so an epoch does not replay the last one's
draws. :meth:`AgentLoop.request`, :meth:`AgentLoop.take_segment` and :meth:`AgentLoop.run_calls`
are the pieces of a step.

Finish reasons: ``answer`` (``</answer>`` generated), ``eos`` (EOS before an answer), ``length``
(the response budget or the context is spent), ``fake_result`` (the policy wrote ``<result>``
itself; the trajectory ends there), ``budget`` (it kept calling tools after being told its budget
was spent), ``timeout`` (the wall-clock limit passed; ``timeout_s: null`` turns it off for
reproducible runs), ``error`` (the engine failed this request; ``error`` says why), ``format``
(a stop string the parser does not see as a call).

Also here, for the flywheel and RL: continue from a partial trajectory
(:meth:`AgentLoop.from_prefix`: the source's own token ids and tool-call records where it has
them, its own budgets, a trailing unexecuted call run before continuing), append a hint
(:meth:`AgentLoop.inject`, ``GIVEN`` text, trained by SFT as the paper's data trains it), and fork
a trajectory at any generated segment (:meth:`TrajectoryState.fork`) for branching.

What this module does not do: choose what to branch (rl/), score answers (etagent.scoring), or
write files (etagent.sampling).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import time
from dataclasses import asdict, dataclass, field

from omegaconf import MISSING
from tokenizers.decoders import DecodeStream

from etagent import protocol
from etagent.config import register_schema
from etagent.llm import GenerationRequest, Sample, Sampling, exact_segment_entropy, topk_segment_entropy
from etagent.records import Provenance, Question, TokenOrigin, ToolCallRecord, Trajectory
from etagent.settings import NonNegativeInt, PositiveFloat, PositiveInt, Seed, group
from etagent.tools.executor import BUDGET_MESSAGE_START, budget_exhausted_record

# Engine-side stops: the tools' closing tags, the end of the answer, and the opening of a result
# (a policy never writes one; if it does, it is inventing tool output).
STOPS = protocol.TOOL_STOPS + (protocol.ANSWER_STOP, "<result>")


@dataclass(frozen=True)
class Budgets:
    """What one trajectory may spend: executed calls per tool and in total (None: no total limit;
    the paper's RL uses a total of 6 instead of per-tool limits), and response tokens (generated
    plus inserted)."""

    python: int = 6
    search: int = 6
    total: int | None = None
    response_tokens: int = 4096


@group
class AgentConfig:
    """Budgets and sampling for the loop (the paper's rollout numbers are the defaults); also the
    schema of the ``agent`` config group (configs/agent/), which Hydra fills in place (so not
    frozen)."""

    # Executed calls allowed per trajectory, per tool; and in total (None: no total limit).
    max_python_calls: NonNegativeInt = MISSING
    max_search_calls: NonNegativeInt = MISSING
    max_tool_calls: NonNegativeInt | None = MISSING
    # Over-budget calls answered with the budget message before the trajectory is ended.
    max_budget_messages: NonNegativeInt = MISSING
    # Tokens of response (generated plus inserted), and tokens per generation call.
    max_response_tokens: PositiveInt = MISSING
    max_segment_tokens: PositiveInt = MISSING
    # Wall-clock seconds per trajectory; None: no limit (reproducible runs, RL).
    timeout_s: PositiveFloat | None = MISSING
    sampling: Sampling = field(default_factory=Sampling)
    # Base seed of every segment's sampling (None: unseeded).
    seed: Seed | None = MISSING
    # Rounds (one engine call for a segment of every unfinished trajectory, then their tool calls)
    # instead of every trajectory on its own: reproducible with an engine that decodes each call
    # by itself (the hf engine's continuous_batching off).
    lockstep: bool = MISSING

    def budgets(self) -> Budgets:
        return Budgets(self.max_python_calls, self.max_search_calls, self.max_tool_calls, self.max_response_tokens)


register_schema("agent", AgentConfig)


@dataclass(frozen=True)
class SegmentStart:
    """Where a generated segment began: response length, tool calls and budget messages so far."""

    token: int
    tool_calls: int
    budget_messages: int


@dataclass
class TrajectoryState:
    """A trajectory being generated. ``origin``/``logprobs`` align with ``response_ids``."""

    id: str
    question: Question
    prompt_ids: list[int]
    budgets: Budgets
    seed: int | None = None
    response_ids: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # under the sampling temperature; None once a segment came from an engine without them
    tempered_logprobs: list[float] | None = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    # Per generated segment: where it began, ARPO's top-k entropy, and the exact one.
    segment_starts: list[SegmentStart] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    entropies_exact: list[float] = field(default_factory=list)
    # the weights each generated segment was sampled with (AgentLoop.version): a trajectory carried
    # over RL steps (rollout.partial) holds segments of several
    segment_versions: list[int] = field(default_factory=list)
    budget_messages: int = 0
    # tool-call records a fork copied from its source (those calls ran once, in the source)
    forked_calls: int = 0
    # a call at the end of a prefix that has not run yet: it runs before the next generation
    trailing_call: protocol.ToolCall | None = None
    # Why it ended; every segment but the last ended at a tool call, so this is why the last one
    # did: answer (its answer closed), eos, length (agent.max_response_tokens, or a segment's cap
    # agent.max_segment_tokens), context (the engine's context), budget (tool-budget messages
    # used up), timeout, format or fake_result (a stop it cannot go on from), error (the engine
    # failed it: ``error`` says why). length and context are truncations (rl's algorithm.truncated).
    finish_reason: str | None = None
    error: str | None = None
    policy_version: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    provenance: Provenance = field(default_factory=Provenance)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def segments(self) -> int:
        return len(self.segment_starts)

    @property
    def mask(self) -> list[int]:
        """1 where SFT trains (policy text, sampled or given), 0 at tool output."""
        return [0 if o == TokenOrigin.TOOL else 1 for o in self.origin]

    @property
    def n_generated(self) -> int:
        """Tokens the policy sampled in this rollout (what RL's default length counts)."""
        return sum(1 for o in self.origin if o == TokenOrigin.SAMPLED)

    def token_versions(self) -> list[int]:
        """Per response token, the version of the weights that sampled its segment (a segment's
        tool result carries the segment's version; tokens before the first segment, -1)."""
        versions = [-1] * len(self.response_ids)
        for k, start in enumerate(self.segment_starts):
            end = self.segment_starts[k + 1].token if k + 1 < self.segments else len(self.response_ids)
            versions[start.token : end] = [self.segment_versions[k]] * (end - start.token)
        return versions

    def executed(self, tool: str | None = None) -> int:
        """Calls that ran (budget messages excluded, calls of a prefix included), of one tool or all."""
        return sum(1 for c in self.tool_calls if not c.budget_exhausted and (tool is None or c.tool == tool))

    def executed_here(self) -> int:
        """Calls this trajectory ran itself: :meth:`executed` less those a fork copied from its
        source (what tree rollouts save over independent samples)."""
        return sum(1 for c in self.tool_calls[self.forked_calls :] if not c.budget_exhausted)

    def append(self, ids: list[int], origin: TokenOrigin, logprobs: list[float] | None = None, tempered: list[float] | None = None) -> None:
        self.response_ids += ids
        self.origin += [int(origin)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if self.tempered_logprobs is not None:
            if origin == TokenOrigin.SAMPLED and tempered is None:
                self.tempered_logprobs = None
            else:
                self.tempered_logprobs += tempered if tempered is not None else [0.0] * len(ids)

    def fork(self, new_id: str, at_segment: int | None = None) -> TrajectoryState:
        """An independent copy with a new id (so its own random draws), for branching.

        ``at_segment=None`` copies everything. ``at_segment=k`` keeps the trajectory as it was just
        before its generated segment k began (after the tool result that preceded it), ready to
        sample segment k again; ``k == segments`` is the current end of an unfinished trajectory.
        The copy has its own wall clock, and its provenance is the parent's with
        ``operation="fork"``, the parent's id and the branch point."""
        if at_segment is not None and not 0 <= at_segment <= self.segments:
            raise ValueError(f"fork of {self.id}: segment {at_segment} does not exist (it has {self.segments})")
        if at_segment == self.segments and self.done:
            raise ValueError(f"fork of {self.id}: it has finished ({self.finish_reason}); fork at an earlier segment to resample")
        twin = copy.deepcopy(self)
        twin.id = new_id
        twin.started_at = time.monotonic()  # the branch's own wall clock
        branch_token = len(self.response_ids)
        if at_segment is not None:
            if at_segment < self.segments:
                start = self.segment_starts[at_segment]
                branch_token = start.token
                for name in ("response_ids", "origin", "logprobs"):
                    setattr(twin, name, getattr(twin, name)[: start.token])
                if twin.tempered_logprobs is not None:
                    twin.tempered_logprobs = twin.tempered_logprobs[: start.token]
                twin.tool_calls = twin.tool_calls[: start.tool_calls]
                twin.budget_messages = start.budget_messages
                twin.segment_starts = twin.segment_starts[:at_segment]
                twin.segment_versions = twin.segment_versions[:at_segment]
                twin.entropies, twin.entropies_exact = twin.entropies[:at_segment], twin.entropies_exact[:at_segment]
                twin.finish_reason = twin.error = None
        twin.forked_calls = len(twin.tool_calls)
        twin.provenance = self.provenance.model_copy(
            update=dict(
                operation="fork",
                parent=self.id,
                branch_segment=self.segments if at_segment is None else at_segment,
                branch_token=branch_token,
            )
        )
        return twin


@dataclass(frozen=True)
class SegmentEntropy:
    """How the loop measures each generated segment's entropy, which ARPO's tree branches on (RL
    passes its ``rollout`` group's settings; no other stage reads entropies, so none asks for
    log-probabilities beyond the sampled token's): the top log-probabilities per position, over a
    segment's first ``window`` positions."""

    top_logprobs: int
    window: int


class AgentLoop:
    def __init__(self, engine, executor, config: AgentConfig, entropy: SegmentEntropy | None = None):
        self.engine, self.executor, self.config = engine, executor, config
        self.entropy = entropy
        self.tokenizer = engine.tokenizer
        # ARPO normalises entropy by ln |V| with |V| the tokenizer's vocabulary
        self.vocab_size = len(self.tokenizer)
        # the weights trajectories are sampled from; a trainer sets both after each update (the
        # version counts updates, and is recorded per segment)
        self.policy_version: str | None = None
        self.version = 0

    # -- creating trajectories --------------------------------------------------------------

    def new(self, question: Question, id: str, *, seed: int | None = None, budgets: Budgets | None = None, **provenance) -> TrajectoryState:
        """A trajectory of ``question`` from its prompt. ``seed`` replaces the config's base seed
        (RL passes one per step); ``provenance`` fills :class:`Provenance` fields."""
        return TrajectoryState(
            id,
            question,
            protocol.encode_prompt(self.tokenizer, question.question),
            budgets or self.config.budgets(),
            seed=self.config.seed if seed is None else seed,
            policy_version=self.policy_version,
            provenance=Provenance(**{"operation": "rollout", **provenance}),
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def from_prefix(
        self,
        question: Question,
        id: str,
        prefix: str,
        *,
        source: Trajectory | None = None,
        seed: int | None = None,
        budgets: Budgets | None = None,
        **provenance,
    ) -> TrajectoryState:
        """A trajectory that continues from partial trajectory text (a flywheel edit, a hint).

        ``prefix`` is the response text to continue from. Where ``source`` (the trajectory the
        prefix was cut from) has token ids, the longest run of its ids that decodes to the start
        of ``prefix`` is kept as it is (sampled ids become ``GIVEN``, tool output stays ``TOOL``);
        the rest of the prefix is tokenized, ``<result>`` spans as ``TOOL``. Tool-call records
        come from ``source`` for the results it has, and are rebuilt from the text otherwise
        (``rebuilt=True``); they count against ``budgets`` (the flywheel's continuations have
        their own). A prefix that ends with a complete tool call and no result (an editor's
        corrected step ending at ``</python>``) has that call run before generation goes on; one
        that already ends with ``</answer>`` is finished (``answer``) as it is.
        """
        state = self.new(question, id, seed=seed, budgets=budgets, **{"operation": "prefix", **provenance})
        kept = self._reusable_ids(source, prefix) if source is not None else 0
        if kept:
            origin = source.response_origin or [TokenOrigin.GIVEN if m else TokenOrigin.TOOL for m in source.response_mask]
            for token, o in zip(source.response_ids[:kept], origin[:kept]):
                state.append([token], TokenOrigin.TOOL if o == TokenOrigin.TOOL else TokenOrigin.GIVEN)
        consumed = len(self.tokenizer.decode(state.response_ids, skip_special_tokens=False))
        for start, end, is_result in _spans(prefix):
            start = max(start, consumed)
            if start < end:
                state.append(self.tokenize(prefix[start:end]), TokenOrigin.TOOL if is_result else TokenOrigin.GIVEN)
        state.tool_calls = _calls_from_text(prefix)
        if source is not None:  # the source's own records where they are the same calls
            state.tool_calls = _match_records(state.tool_calls, source.tool_calls)
        state.budget_messages = sum(c.budget_exhausted for c in state.tool_calls)
        # the last piece of policy text: does it end with a call that has no result yet?
        pieces = protocol.split_result_segments(prefix)
        if pieces and not pieces[-1][1]:
            call = protocol.parse_segment(pieces[-1][0])
            if isinstance(call, protocol.ToolCall) and pieces[-1][0].rstrip().endswith(f"</{call.tool}>"):
                state.trailing_call = call
        if state.trailing_call is None and prefix.rstrip().endswith(protocol.ANSWER_STOP):
            state.finish_reason = "answer"
        return state

    def _reusable_ids(self, source: Trajectory, prefix: str) -> int:
        """How many of ``source``'s response ids decode to a start of ``prefix``."""
        if not source.response_ids:
            return 0
        stream, text, kept = DecodeStream(skip_special_tokens=False), "", 0
        for i, token in enumerate(source.response_ids):
            piece = stream.step(self.tokenizer.backend_tokenizer, token)
            if piece is None:
                continue  # an incomplete character: decided by the token that completes it
            text += piece
            if not prefix.startswith(text):
                break
            kept = i + 1
        return kept

    def inject(self, state: TrajectoryState, text: str) -> None:
        """Append text the policy did not sample here (a hint): ``GIVEN``, so SFT trains on it as
        the paper's data does, and RL's policy gradient does not."""
        state.append(self.tokenize(text), TokenOrigin.GIVEN)

    # -- running ----------------------------------------------------------------------------

    async def run(self, states: list[TrajectoryState]) -> list[TrajectoryState]:
        """Run every trajectory to its end: each on its own (:meth:`run_one`), or with
        ``lockstep`` in rounds (:meth:`step`)."""
        if self.config.lockstep:
            while any(not s.done for s in states):
                await self.step(states)
        else:
            await asyncio.gather(*(self.run_one(s) for s in states))
        return states

    async def step(self, states: list[TrajectoryState]) -> None:
        """One round over the unfinished trajectories: the calls left at the end of prefixes, then
        one engine call for a segment of each, then all of their tool calls."""
        trailing: list[tuple[TrajectoryState, protocol.ToolCall]] = []
        for s in states:
            if not s.done and s.trailing_call is not None:
                self._call_or_refuse(s, s.trailing_call, trailing)
                s.trailing_call = None
        await self.run_calls(trailing)
        active = [s for s in states if self.ready(s)]
        if not active:
            return
        results = await self.engine.agenerate([self.request(s) for s in active])
        pending: list[tuple[TrajectoryState, protocol.ToolCall]] = []
        for s, [sample] in zip(active, results):
            self.take_segment(s, sample, pending)
        await self.run_calls(pending)

    async def run_one(self, state: TrajectoryState) -> TrajectoryState:
        """Advance one trajectory segment after segment until it finishes, never waiting for
        another one: the engine batches whatever segments are pending at the time."""
        while not state.done:
            await self.advance(state)
        return state

    async def advance(self, s: TrajectoryState, stop: asyncio.Event | None = None) -> bool:
        """One step of a trajectory: a call left at the end of its prefix, then its next segment
        and that segment's tool call. With ``stop``: if it is set before the segment comes back,
        the engine's request is cancelled and the trajectory is left as it was before the
        segment, to be continued later (RL's partial rollouts); a tool call already running is
        finished first. Returns False if it stopped so."""
        if s.trailing_call is not None:
            pending: list[tuple[TrajectoryState, protocol.ToolCall]] = []
            self._call_or_refuse(s, s.trailing_call, pending)
            s.trailing_call = None
            await self.run_calls(pending)
        if not self.ready(s):
            return True
        call = asyncio.ensure_future(self.engine.agenerate([self.request(s)]))
        if stop is not None:
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not call.done():
                call.cancel()  # the engines drop a cancelled request's rows
                return False
        [[sample]] = await call
        pending = []
        self.take_segment(s, sample, pending)
        await self.run_calls(pending)
        return True

    def _seed(self, state: TrajectoryState) -> int | None:
        if state.seed is None:
            return None
        digest = hashlib.sha256(f"{state.seed}/{state.id}/{state.segments}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    def room(self, state: TrajectoryState) -> int:
        """Response tokens the trajectory may still add: its budget, within the engine's context."""
        context = self.engine.max_model_len - len(state.prompt_ids) - len(state.response_ids)
        return min(state.budgets.response_tokens - len(state.response_ids), context)

    def cut_reason(self, state: TrajectoryState) -> str:
        """Why a trajectory with no room left was cut: ``context`` when the engine's context is
        what ran out (the model cannot hold more), ``length`` when its response budget did
        (``agent.max_response_tokens``)."""
        context = self.engine.max_model_len - len(state.prompt_ids) - len(state.response_ids)
        return "context" if context <= state.budgets.response_tokens - len(state.response_ids) else "length"

    def _over_budget(self, state: TrajectoryState, tool: str) -> tuple[int, int, str] | None:
        b = state.budgets
        limit = b.python if tool == protocol.PYTHON else b.search
        if state.executed(tool) >= limit:
            return state.executed(tool), limit, tool
        if b.total is not None and state.executed() >= b.total:
            return state.executed(), b.total, "tool"
        return None

    def _call_or_refuse(self, state: TrajectoryState, call: protocol.ToolCall, pending: list) -> None:
        """Queue a call within budget; answer an over-budget one with the budget message."""
        over = self._over_budget(state, call.tool)
        if over is None:
            pending.append((state, call))
            return
        state.budget_messages += 1
        record = budget_exhausted_record(call, *over)
        state.tool_calls.append(record)
        self._insert_result(state, record.output)
        if state.budget_messages > self.config.max_budget_messages:
            state.finish_reason = "budget"

    def _insert_result(self, state: TrajectoryState, output: str) -> None:
        """Append a wrapped tool result as TOOL tokens, cut to the room left (closing tag kept)."""
        ids = self.tokenize(protocol.format_result(output))
        room = self.room(state)
        if len(ids) > room:
            closing = self.tokenize("\n</result>")
            opening = self.tokenize("<result>\n")
            if room < len(opening) + len(closing) + 1:
                state.finish_reason = self.cut_reason(state)  # no room for even an empty result
                return
            ids = ids[: room - len(closing)] + closing
        state.append(ids, TokenOrigin.TOOL)

    async def run_calls(self, pending: list[tuple[TrajectoryState, protocol.ToolCall]]) -> None:
        """Run the queued calls concurrently and append each result to its trajectory."""
        records = await self.executor.run([call for _, call in pending]) if pending else []
        for (s, _), record in zip(pending, records):
            s.tool_calls.append(record)
            if not s.done:
                self._insert_result(s, record.output)

    def ready(self, s: TrajectoryState) -> bool:
        """Whether the trajectory generates again: not finished, within its wall-clock limit
        (else ``timeout``) and with room left (else ``length``)."""
        timeout = self.config.timeout_s
        if not s.done and timeout is not None and time.monotonic() - s.started_at > timeout:
            s.finish_reason = "timeout"
        if not s.done and self.room(s) <= 0:
            s.finish_reason = self.cut_reason(s)
        return not s.done

    def request(self, s: TrajectoryState) -> GenerationRequest:
        """The request for the trajectory's next segment (seeded by its seed, id and segment
        number, so its draw does not depend on what else the engine decodes)."""
        c = self.config
        return GenerationRequest(
            prompt_ids=tuple(s.prompt_ids + s.response_ids),
            max_new_tokens=min(c.max_segment_tokens, self.room(s)),
            stop=STOPS,
            logprobs=self.entropy.top_logprobs if self.entropy else 0,
            logprobs_window=self.entropy.window if self.entropy else None,
            seed=self._seed(s),
            session=s.question.id,
            sampling=c.sampling,
        )

    def take_segment(self, s: TrajectoryState, sample: Sample, pending: list) -> None:
        """Append a generated segment and act on how it ended: finish the trajectory, or queue its
        tool call in ``pending`` (an over-budget call is answered at once)."""
        if sample.finish_reason == "error":
            s.finish_reason, s.error = "error", sample.error
            return
        s.segment_starts.append(SegmentStart(len(s.response_ids), len(s.tool_calls), s.budget_messages))
        s.policy_version = self.policy_version  # the weights its latest segment came from
        s.segment_versions.append(self.version)
        s.append(list(sample.token_ids), TokenOrigin.SAMPLED, list(sample.logprobs), sample.tempered_logprobs)
        if self.entropy and self.entropy.top_logprobs > 0:  # one per segment, 0 for an empty one (ARPO reads them by segment)
            s.entropies.append(topk_segment_entropy(sample.top_logprobs or [], self.vocab_size, self.entropy.window))
        if self.entropy:
            exact = exact_segment_entropy(sample.entropy, self.vocab_size, self.entropy.window)
            if exact is not None:
                s.entropies_exact.append(exact)
        if sample.finish_reason == "eos":
            s.finish_reason = "eos"
        elif sample.finish_reason == "length":  # the segment's cap (agent.max_segment_tokens), or no room left
            s.finish_reason = self.cut_reason(s) if self.room(s) <= 0 else "length"
        elif sample.stop == protocol.ANSWER_STOP:
            s.finish_reason = "answer"
        elif sample.stop == "<result>":
            s.finish_reason = "fake_result"
        else:
            call = protocol.parse_segment(self.tokenizer.decode(sample.token_ids, skip_special_tokens=False))
            if isinstance(call, protocol.ToolCall):
                self._call_or_refuse(s, call, pending)
            else:  # a stop string the parser does not see
                s.finish_reason = "format"

    # -- results ----------------------------------------------------------------------------

    def to_record(self, state: TrajectoryState) -> Trajectory:
        """The trajectory as an artifact record (text decoded from the token ids, as generated)."""
        text = self.text(state)
        return Trajectory(
            id=state.id,
            text=text,
            tool_calls=state.tool_calls,
            prediction=protocol.extract_answer(text),
            n_tokens=len(state.response_ids),
            n_generated=state.n_generated,
            tool_calls_executed=state.executed(),
            tool_calls_written=protocol.count_tool_calls(text),
            finish_reason=state.finish_reason or "",
            error=state.error,
            prompt_ids=state.prompt_ids,
            response_ids=state.response_ids,
            response_mask=state.mask,
            response_origin=state.origin,
            logprobs=state.logprobs,
            tempered_logprobs=state.tempered_logprobs,
            entropies=state.entropies,
            entropies_exact=state.entropies_exact or None,
            sampling={**asdict(self.config.sampling), "seed": state.seed},
            policy_version=state.policy_version,
            provenance=state.provenance,
        )

    def text(self, state: TrajectoryState) -> str:
        return self.tokenizer.decode(state.response_ids, skip_special_tokens=False)


def _spans(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, is_result) character spans of a trajectory's text, in order."""
    spans, pos = [], 0
    for piece, is_result in protocol.split_result_segments(text):
        spans.append((pos, pos + len(piece), is_result))
        pos += len(piece)
    return spans


def _match_records(rebuilt: list[ToolCallRecord], recorded: list[ToolCallRecord]) -> list[ToolCallRecord]:
    """Each call read back from a prefix, replaced by the source's record of the same call (tool,
    input and output), in order; calls an edit added or changed keep their rebuilt record."""
    out, next_source = [], 0
    for call in rebuilt:
        match = next(
            (
                i
                for i in range(next_source, len(recorded))
                if (recorded[i].tool, recorded[i].input, recorded[i].output.strip()) == (call.tool, call.input, call.output.strip())
            ),
            None,
        )
        if match is None:
            out.append(call)
        else:
            out.append(recorded[match])
            next_source = match + 1
    return out


def _calls_from_text(text: str) -> list[ToolCallRecord]:
    """Tool-call records read back from text: each result with the call written just before it."""
    records, policy = [], ""
    for piece, is_result in protocol.split_result_segments(text):
        if not is_result:
            policy = piece
            continue
        call = protocol.parse_segment(policy)
        output = protocol.unwrap_result(piece)
        if output is None:  # wrapped otherwise (imported data): its content
            output = piece[len("<result>") : -len("</result>")].strip("\n")
        tool, code = (call.tool, call.input) if isinstance(call, protocol.ToolCall) else ("unknown", "")
        budget = output.startswith(BUDGET_MESSAGE_START)
        records.append(ToolCallRecord(tool=tool, input=code, output=output, ok=not budget, budget_exhausted=budget, rebuilt=True))
        policy = ""
    return records

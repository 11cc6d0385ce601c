"""The multi-turn tool-integrated reasoning loop, over token ids.

A trajectory is the prompt's token ids plus response token ids with a mask: 1 where the policy
generated the token, 0 where it was inserted (tool results, hints). Its text is always decoded
from those ids; nothing is re-tokenized, so what SFT and RL train on is exactly what the policy
generated.

:class:`AgentLoop` advances many trajectories at once, in rounds:

1. one batched engine call generates the next segment of every active trajectory, stopping at
   ``</python>``, ``</search>``, ``</answer>`` or ``<result>`` (engine-side stops), EOS or a
   token limit;
2. each segment is parsed (:func:`etagent.protocol.parse_segment`); a tool call within its
   budgets joins the round's batch of calls, an over-budget call is answered at once with an
   explicit budget message (never left unexecuted for the model to invent a result), and a
   segment that ends the trajectory sets its finish reason;
3. all pending calls run concurrently through the tools executor; each result, wrapped by
   :func:`etagent.protocol.format_result`, is tokenized on its own and appended with mask 0.

Results are appended in a fixed order, and each segment is sampled with a seed derived from the
trajectory's id and segment number, so a run does not depend on batch composition or on the
order in which tool calls finish.

Finish reasons: ``answer`` (``</answer>`` generated), ``eos`` (EOS before an answer), ``length``
(the response budget is spent), ``fake_result`` (the policy wrote ``<result>`` itself; the
trajectory ends there), ``budget`` (it kept calling tools after being told its budget was spent),
``timeout`` (the question's wall-clock limit passed).

Also here, for the flywheel and RL: start from a partial trajectory (:meth:`AgentLoop.from_prefix`,
budgets seeded from the calls already in it), inject a hint (:meth:`AgentLoop.inject`, mask 0),
and fork a trajectory (:meth:`TrajectoryState.fork`) for branching.

What this module does not do: choose what to branch (rl/), score answers (etagent.scoring), or
write files (etagent.sampling).
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field

from etagent import protocol
from etagent.llm import GenerationRequest, exact_segment_entropy, topk_segment_entropy
from etagent.records import Question, ToolCallRecord, Trajectory
from etagent.tools.executor import budget_exhausted_record

# Engine-side stops: the tools' closing tags, the end of the answer, and the opening of a result
# (a policy never writes one; if it does, it is inventing tool output).
STOPS = protocol.TOOL_STOPS + (protocol.ANSWER_STOP, "<result>")


@dataclass(frozen=True)
class AgentConfig:
    """Budgets and sampling for the loop (the paper's rollout numbers are the defaults)."""

    # Executed calls allowed per trajectory, per tool; and in total (None: no total limit; the
    # paper's RL uses a total of 6 instead of per-tool limits).
    max_python_calls: int = 6
    max_search_calls: int = 6
    max_tool_calls: int | None = None
    # Over-budget calls answered with the budget message before the trajectory is ended.
    max_budget_messages: int = 2
    # Tokens of response (generated plus inserted), and tokens per generation call.
    max_response_tokens: int = 4096
    max_segment_tokens: int = 4096
    # Wall-clock seconds per trajectory.
    timeout_s: float = 1200.0
    # Sampling.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Top log-probabilities returned per position, and positions per segment, for ARPO's entropy.
    logprobs: int = 10
    entropy_window: int = 20
    # Base seed of every segment's sampling (None: unseeded).
    seed: int | None = None


@dataclass
class TrajectoryState:
    """A trajectory being generated. ``mask``/``logprobs`` align with ``response_ids``."""

    id: str
    question: Question
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    # Per generated segment: ARPO's top-k entropy, and the exact one where the engine has it.
    entropies: list[float] = field(default_factory=list)
    entropies_exact: list[float] = field(default_factory=list)
    segments: int = 0
    budget_messages: int = 0
    # calls already in a prefix this trajectory continues from (they count against budgets)
    prefix_calls: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    provenance: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def executed(self, tool: str | None = None) -> int:
        """Calls that ran (budget messages excluded, calls in a prefix included), of one tool or all."""
        ran = sum(1 for c in self.tool_calls if not c.budget_exhausted and (tool is None or c.tool == tool))
        return ran + sum(n for t, n in self.prefix_calls.items() if tool is None or t == tool)

    def append(self, ids: list[int], mask_value: int, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.mask += [mask_value] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fork(self, new_id: str) -> TrajectoryState:
        """An independent copy (branching): same tokens, calls and budgets, new id."""
        twin = copy.deepcopy(self)
        twin.id = new_id
        twin.provenance = {**self.provenance, "parent": self.id, "op": "fork"}
        return twin


class AgentLoop:
    def __init__(self, engine, executor, config: AgentConfig = AgentConfig()):
        self.engine, self.executor, self.config = engine, executor, config
        self.tokenizer = engine.tokenizer
        # ARPO normalises entropy by ln |V| with |V| the tokenizer's vocabulary
        self.vocab_size = len(self.tokenizer)

    # -- creating trajectories --------------------------------------------------------------

    def new(self, question: Question, id: str, **provenance) -> TrajectoryState:
        return TrajectoryState(id, question, protocol.encode_prompt(self.tokenizer, question.question), provenance=provenance)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def from_prefix(self, question: Question, id: str, prefix: str, **provenance) -> TrajectoryState:
        """A trajectory that continues from partial trajectory text (a flywheel edit).

        Result spans are inserted text (mask 0); the rest counts as policy text (mask 1). The
        tool budgets count the calls already in the prefix (complete pairs outside results).
        """
        state = self.new(question, id, **provenance)
        for piece, is_result in protocol.split_result_segments(prefix):
            state.append(self.tokenize(piece), 0 if is_result else 1)
        policy_text = protocol.strip_results(prefix)
        state.prefix_calls = {tool: protocol.count_valid_tags(policy_text, tool) for tool in protocol.TOOLS}
        return state

    def inject(self, state: TrajectoryState, text: str) -> None:
        """Append text the policy did not write (a hint): mask 0."""
        state.append(self.tokenize(text), 0)

    # -- running ----------------------------------------------------------------------------

    async def run(self, states: list[TrajectoryState]) -> list[TrajectoryState]:
        """Advance every trajectory until it finishes."""
        while any(not s.done for s in states):
            await self.step(states)
        return states

    def _seed(self, state: TrajectoryState) -> int | None:
        if self.config.seed is None:
            return None
        digest = hashlib.sha256(f"{self.config.seed}/{state.id}/{state.segments}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    def _over_budget(self, state: TrajectoryState, tool: str) -> tuple[int, int, str] | None:
        c = self.config
        limit = c.max_python_calls if tool == protocol.PYTHON else c.max_search_calls
        if state.executed(tool) >= limit:
            return state.executed(tool), limit, tool
        if c.max_tool_calls is not None and state.executed() >= c.max_tool_calls:
            return state.executed(), c.max_tool_calls, "tool"
        return None

    async def step(self, states: list[TrajectoryState]) -> None:
        """One round: a segment for every active trajectory, then their tool calls."""
        c = self.config
        now = time.monotonic()
        for s in states:
            if not s.done and now - s.started_at > c.timeout_s:
                s.finish_reason = "timeout"
            if not s.done and len(s.response_ids) >= c.max_response_tokens:
                s.finish_reason = "length"
        active = [s for s in states if not s.done]
        if not active:
            return
        requests = [
            GenerationRequest(
                prompt_ids=tuple(s.prompt_ids + s.response_ids),
                temperature=c.temperature,
                top_p=c.top_p,
                top_k=c.top_k,
                min_p=c.min_p,
                repetition_penalty=c.repetition_penalty,
                max_new_tokens=min(c.max_segment_tokens, c.max_response_tokens - len(s.response_ids)),
                stop=STOPS,
                logprobs=c.logprobs,
                seed=self._seed(s),
                session=s.question.id,
            )
            for s in active
        ]
        results = await self.engine.agenerate(requests)
        pending: list[tuple[TrajectoryState, protocol.ToolCall]] = []
        for s, [sample] in zip(active, results):
            s.append(list(sample.token_ids), 1, list(sample.logprobs))
            s.segments += 1
            if sample.top_logprobs:
                s.entropies.append(topk_segment_entropy(sample.top_logprobs, self.vocab_size, c.entropy_window))
            exact = exact_segment_entropy(sample.entropy, self.vocab_size, c.entropy_window)
            if exact is not None:
                s.entropies_exact.append(exact)
            if sample.finish_reason == "eos":
                s.finish_reason = "eos"
            elif sample.finish_reason == "length":
                s.finish_reason = "length"
            elif sample.stop == protocol.ANSWER_STOP:
                s.finish_reason = "answer"
            elif sample.stop == "<result>":
                s.finish_reason = "fake_result"
            else:
                segment = self.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
                call = protocol.parse_segment(segment)
                if not isinstance(call, protocol.ToolCall):  # a stop string the parser does not see
                    s.finish_reason = "format"
                    continue
                over = self._over_budget(s, call.tool)
                if over is None:
                    pending.append((s, call))
                    continue
                s.budget_messages += 1
                record = budget_exhausted_record(call, *over)
                s.tool_calls.append(record)
                s.append(self.tokenize(protocol.format_result(record.output)), 0)
                if s.budget_messages > c.max_budget_messages:
                    s.finish_reason = "budget"
        records = await self.executor.run([call for _, call in pending]) if pending else []
        for (s, _), record in zip(pending, records):
            s.tool_calls.append(record)
            s.append(self.tokenize(protocol.format_result(record.output)), 0)

    # -- results ----------------------------------------------------------------------------

    def to_record(self, state: TrajectoryState) -> Trajectory:
        """The trajectory as an artifact record (text decoded from the token ids)."""
        text = self.text(state)
        return Trajectory(
            id=state.id,
            text=text,
            tool_calls=state.tool_calls,
            prediction=protocol.extract_answer(text),
            n_tokens=len(state.response_ids),
            finish_reason=state.finish_reason or "",
            prompt_ids=state.prompt_ids,
            response_ids=state.response_ids,
            response_mask=state.mask,
            logprobs=state.logprobs,
            entropies=state.entropies,
            entropies_exact=state.entropies_exact or None,
            provenance=state.provenance,
        )

    def text(self, state: TrajectoryState) -> str:
        return self.tokenizer.decode(state.response_ids, skip_special_tokens=True)

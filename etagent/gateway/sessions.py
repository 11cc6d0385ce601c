"""A harness's session as the engine saw it: every turn's ids, and the training sequences they form.

Each request's messages are checked against what the session holds (the messages it was sent
and the replies it gave, and the token ids of both) and the turn is classified:

- ``start``: the session's first turn; its prompt is the chat rendered from scratch.
- ``clean``: the messages extend the held ones; the prompt is the held ids plus the suffix (the
  end of the last assistant turn and the new messages), and rendering the whole chat from
  scratch gives the same ids.
- ``realign``: the messages extend the held ones, but rendering from scratch gives other ids
  (a template that strips earlier reasoning or trims whitespace, BPE that does not round-trip).
  The prompt is still the held ids plus the suffix: the engine sees the tokens it generated, and
  nothing re-rendered is trained on. ``drift`` counts the positions that would have differed.
- ``fork``: the harness changed the history (edited, dropped or rewrote earlier turns). A new
  training sequence starts from the chat rendered from scratch; earlier replies are then in its
  prompt, never trained on twice.

A segment is one training sequence: its ids, a mask (1 for generated tokens, 0 for prompts,
tool results and template text), the generated tokens' log-probabilities and policy versions.
What this module does not do: serve HTTP (server.py) or generate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from etagent.gateway.formats import Call, Message, TemplateUnstable


@dataclass
class Turn:
    """One chat completion, exactly as the engine was given and returned it."""

    kind: str  # start, clean, realign or fork
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the engine's: eos, stop, length
    policy_version: int
    segment: int  # the index of the segment this turn extends
    drift: int = 0  # realign: positions where a from-scratch rendering differs from the held ids
    calls: tuple[Call, ...] = ()  # the tool calls parsed from the output
    stop: str | None = None  # the stop string that ended it, if one did
    tempered: list[float] | None = None  # log-probabilities under the sampling temperature, where the engine gives them


@dataclass
class Segment:
    """One training sequence built from the session's turns."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]  # per token: the policy version that generated it, -1 for context

    @classmethod
    def of_prompt(cls, prompt: list[int]) -> Segment:
        return cls(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))

    def add(self, ids: list[int], generated: bool, logprobs: list[float] | None = None, version: int = -1) -> None:
        self.ids += ids
        self.mask += [int(generated)] * len(ids)
        self.logprobs += list(logprobs) if generated else [0.0] * len(ids)
        self.versions += [version if generated else -1] * len(ids)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two id lists differ (one ending early counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Session:
    """One harness's conversation with the policy (module docstring). ``group`` names the RL
    group it belongs to (n sessions of one question); ``question`` carries what the reward needs
    (its id and gold answers) when the gateway scores it."""

    id: str
    group: str | None = None
    question: dict | None = None
    max_tokens: int | None = None  # generated tokens allowed over the whole session
    history: list[Message] = field(default_factory=list)  # messages sent and replies given, as rendered
    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    state: str = "open"  # open, ended, dropped
    dropped_because: str | None = None
    reward: float | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def generated(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    @property
    def tool_calls(self) -> int:
        """The tool calls the policy made (each one the harness ran and answered)."""
        return sum(len(t.calls) for t in self.turns)

    def budget_left(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens - self.generated

    def next_prompt(self, messages: list[Message], fmt, schemas: list[dict]) -> tuple[str, list[int], int]:
        """The turn's kind, the prompt ids to give the engine and the drift (module docstring)."""
        scratch = fmt.render(messages, schemas)
        if not self.turns:
            return "start", scratch, 0
        held = len(self.history)
        extends = (
            len(messages) > held
            and all(a.same(b) for a, b in zip(messages[:held], self.history))
            and all(m.role != "assistant" for m in messages[held:])
        )
        if not extends:
            return "fork", scratch, 0
        system = [m for m in messages[:1] if m.role == "system"]
        ended_by_eos = self.turns[-1].finish_reason == "eos"
        try:
            prompt = self.segments[-1].ids + fmt.suffix(system, messages[held:], ended_by_eos, schemas)
        except TemplateUnstable:  # the template renders the held turn otherwise when turns follow it
            return "fork", scratch, 0
        differ = first_difference(prompt, scratch)
        if differ is None:
            return "clean", prompt, 0
        return "realign", prompt, max(len(prompt), len(scratch)) - differ

    def record(self, kind: str, prompt: list[int], output, version: int, drift: int, reply: Message, sent: list[Message]) -> Turn:
        """Keep a generated turn: extend (or start) the segment with the prompt's new part and the
        output, and remember the messages and the reply as the harness will send them back."""
        if kind in ("start", "fork"):
            self.segments.append(Segment.of_prompt(prompt))
        else:
            segment = self.segments[-1]
            # what the engine was given must be exactly the held ids plus the new context
            assert prompt[: len(segment.ids)] == segment.ids, "a clean or realigned prompt must extend the held ids"
            segment.add(prompt[len(segment.ids) :], generated=False)
        self.segments[-1].add(list(output.token_ids), True, list(output.logprobs), version)
        turn = Turn(
            kind,
            list(prompt),
            list(output.token_ids),
            list(output.logprobs),
            output.finish_reason,
            version,
            len(self.segments) - 1,
            drift,
            reply.calls,
            output.stop,
            None if output.tempered_logprobs is None else list(output.tempered_logprobs),
        )
        self.turns.append(turn)
        self.history = [*sent, reply]
        return turn

    def drop(self, why: str) -> None:
        """Never train on this session (a harness that went away mid-turn)."""
        self.state, self.dropped_because = "dropped", why

    def summary(self) -> dict:
        kinds = [t.kind for t in self.turns]
        return {
            "session_id": self.id,
            "group": self.group,
            "state": self.state,
            "dropped_because": self.dropped_because,
            "turns": len(self.turns),
            "segments": len(self.segments),
            "kinds": {k: kinds.count(k) for k in ("start", "clean", "realign", "fork")},
            "tool_calls": self.tool_calls,
            "generated_tokens": self.generated,
            "reward": self.reward,
        }

    def trace(self) -> dict:
        """Every turn's ids and every segment, for the harness's own records and for tests."""
        return {
            **self.summary(),
            "turns_detail": [{**t.__dict__, "calls": [c.__dict__ for c in t.calls]} for t in self.turns],
            "segments_detail": [s.__dict__ for s in self.segments],
        }


def reply_message(content: str, calls: list[Call]) -> Message:
    return Message("assistant", content, tuple(calls))

"""An outside agent harness run over the gateway, and its sessions as our trajectories.

:class:`HarnessRunner` serves the gateway over an engine on 127.0.0.1 (once, in a thread of its
own), opens the sessions of a batch of questions, runs the harness command once with
``--tasks FILE`` appended (a JSON line per session: ``base_url``, ``question``, ``seed``) and
returns the sessions. The harness drives each session on the OpenAI API with its own tools and
ends it. :func:`session_trajectory` turns a session into the agent loop's
:class:`~etagent.agent.TrajectoryState`, so that RL's trainer (rollout.kind=gateway) and the
sampling stages (``gateway.harness``) score, train on and write it as they do our own rollouts.

A session the harness did not end (it crashed, timed out, disconnected mid-turn), and one that
forked (the harness rewrote its history, so it spans two sequences), becomes a failed
trajectory, ``finish_reason == "error"`` with the cause: never trained on, left out of its group's
baseline, counted against ``tools.max_failure_share`` as an engine failure is.

What this does not do: run tools (the harness does) or score.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Annotated

from omegaconf import MISSING

from etagent.agent import AgentLoop, SegmentStart, TrajectoryState
from etagent.errors import SettingError
from etagent.gateway.sessions import Session
from etagent.records import Question, TokenOrigin, ToolCallRecord
from etagent.settings import FREE, OneOf, PositiveFloat, check_installed, group

log = logging.getLogger("etagent.gateway.harness")


@group
class GatewaySettings:
    """An outside harness that drives the rollouts through the gateway (the stages' configs
    document each field): its command (null: our own agent loop), the policy's tool-call format
    and the harness's time limit per batch."""

    harness: str | None = MISSING
    format: Annotated[str, OneOf("protocol", "hermes")] = MISSING
    timeout_s: Annotated[PositiveFloat, FREE] = MISSING


def check_gateway(key: str, settings) -> None:
    """A harness command that can start, and the gateway's packages, before a stage claims its
    folder (``key`` names the group: ``gateway``, ``rollout.gateway``)."""
    if not settings.harness:
        return
    program = shlex.split(settings.harness)[0]
    if shutil.which(program) is None:
        raise SettingError(f"{key}.harness", f"starts with {program!r}, which is not a program on PATH")
    check_installed(f"{key}.harness", "uvicorn", f"{key}.harness (the gateway)")


class HarnessRunner:
    """The gateway over ``engine`` and the harness that drives it (module docstring)."""

    def __init__(self, engine, settings: GatewaySettings, max_new_tokens: int, sampling=None):
        self.engine, self.settings, self.max_new_tokens, self.sampling = engine, settings, max_new_tokens, sampling
        self.gateway = None
        self.url = ""

    def _serve(self) -> None:
        import uvicorn

        from etagent.gateway.server import Gateway, create_app

        self.gateway = Gateway(self.engine, self.settings.format, max_new_tokens=self.max_new_tokens, sampling=self.sampling)
        with socket.socket() as probe:  # a free port
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.gateway), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            threading.Event().wait(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def run(
        self, tasks: list[tuple[str, str, dict, int | None]], max_tokens: int | None, version: int = 0
    ) -> tuple[list[Session], str | None]:
        """One session per ``(question text, group, question record, seed)``, driven by one run
        of the harness; the sessions in order, and why the harness failed as a whole (None when
        it exited cleanly). The gateway keeps nothing afterwards."""
        if self.gateway is None:
            self._serve()
        self.gateway.policy_version = version
        sessions = [self.gateway.open(group, record, max_tokens) for _, group, record, _ in tasks]
        lines = [{"base_url": f"{self.url}/s/{s.id}/v1", "question": text, "seed": seed} for s, (text, _, _, seed) in zip(sessions, tasks)]
        failure = self._harness(lines)
        for s in sessions:
            self.gateway.forget(s.id)
        return sessions, failure

    def _harness(self, lines: list[dict]) -> str | None:
        with tempfile.TemporaryDirectory(prefix="etagent-harness-") as folder:
            path = Path(folder) / "tasks.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            command = [*shlex.split(self.settings.harness), "--tasks", str(path)]
            env = dict(os.environ, OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "unused"))
            try:
                done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=self.settings.timeout_s)
            except subprocess.TimeoutExpired:
                return f"it did not finish within timeout_s={self.settings.timeout_s:g}"
        if done.returncode != 0:
            log.warning("the harness exited with status %d; its stderr ends:\n%s", done.returncode, done.stderr[-4000:])
            return f"it exited with status {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}"
        return None


def session_trajectory(
    loop: AgentLoop, session: Session, question: Question, id: str, failure: str | None, **provenance
) -> TrajectoryState:
    """The session as the agent loop's trajectory (a failed one where the session cannot be
    trained on: module docstring)."""
    state = loop.new(question, id, **provenance)
    problem = None
    if session.state != "ended" or not session.turns:
        problem = f"the harness left a session unfinished: {failure or session.dropped_because or f'it is {session.state}'}"
    elif len(session.segments) > 1:
        problem = "the harness rewrote a session's history (it forked): it spans several sequences"
    if problem:
        state.finish_reason, state.error = "error", problem
        return state
    return _fill(state, session)


def _fill(state: TrajectoryState, session: Session) -> TrajectoryState:
    """A one-segment session: the first turn's prompt, then every token after it with its origin
    (sampled, or context: a tool result or template text), log-probabilities, segment starts and
    versions, and the calls the harness ran with their results."""
    segment, first = session.segments[0], session.turns[0]
    state.prompt_ids = list(segment.ids[: len(first.prompt_ids)])
    results = [m.content for m in session.history if m.role == "tool"]
    calls, at = 0, len(first.prompt_ids)
    for turn in session.turns:
        state.append(turn.prompt_ids[at:], TokenOrigin.TOOL)
        state.segment_starts.append(SegmentStart(len(state.response_ids), len(state.tool_calls), 0))
        state.segment_versions.append(turn.policy_version)
        state.append(turn.output_ids, TokenOrigin.SAMPLED, turn.logprobs, turn.tempered)
        for call in turn.calls:
            if calls < len(results):  # a call the harness ran and answered (not one it left at the end)
                single = next(iter(call.arguments.values())) if len(call.arguments) == 1 else None
                given = single if isinstance(single, str) else json.dumps(call.arguments)
                state.tool_calls.append(ToolCallRecord(tool=call.name, input=given, output=results[calls], ok=True))
            calls += 1
        at = len(turn.prompt_ids) + len(turn.output_ids)
    last = session.turns[-1]
    if last.calls:
        state.finish_reason = "budget"  # the harness stopped after a call it did not answer
    elif last.stop == "</answer>":
        state.finish_reason = "answer"
    elif last.stop == "<result>":
        state.finish_reason = "fake_result"
    else:
        state.finish_reason = {"eos": "eos", "length": "length"}.get(last.finish_reason, "format")
    return state

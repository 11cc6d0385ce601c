"""An OpenAI-compatible gateway over a policy engine: a harness drives, the gateway keeps every token.

    POST /sessions                           {group?, question?, max_tokens?} -> {session_id, base_url}
    POST /s/{id}/v1/chat/completions         the OpenAI chat API with function tools (no streaming, n=1)
    POST /s/{id}/reward                      {reward}: the harness's own score for the session
    POST /s/{id}/end                         the session is complete; its segments may be trained on
    GET  /s/{id}                             every turn's ids and every segment (sessions.py)
    GET  /metrics                            turns by kind, the fork rate, sessions by state
    GET  /health

A harness points the ``openai`` client at a session's ``base_url``; each completion renders the
messages in the policy's format (formats.py), classifies the turn against the ids the session
holds (sessions.py), generates from ids with log-probabilities, and answers with the parsed tool
calls. Every turn is tagged with the policy version; :meth:`Gateway.weight_sync` holds new
requests and waits for running ones while a trainer replaces the weights.

A malformed request is answered 400 naming the field (``error.param``), an unknown session 404,
a session past its token budget (or the model's context) a ``length`` finish with no tokens, as
a vLLM server gives. A harness that disconnects mid-turn has its session dropped: never trained
half-done. What this module does not do: run tools (the harness does), score answers or train.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import zlib
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from etagent.gateway.formats import FORMATS, Call, ChatError, Message
from etagent.gateway.sessions import Session, reply_message
from etagent.llm import GenerationRequest, Sampling


class _Open(BaseModel):
    # clients send fields this gateway does not read (refusal, audio, annotations...): ignored
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Open):
    name: str
    arguments: str  # a JSON object, as the OpenAI API sends it


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Open):
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(_Open):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    n: Literal[1] = 1
    stream: Literal[False] = False
    seed: int | None = None


class OpenSession(_Open):
    group: str | None = None
    question: dict[str, Any] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None


class Reward(_Open):
    reward: Annotated[float, Field(allow_inf_nan=False)]


def to_messages(request: ChatRequest) -> list[Message]:
    """The request's messages as they render (``developer`` is the system turn)."""
    messages = []
    for i, m in enumerate(request.messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        calls = []
        for j, call in enumerate(m.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ChatError(f"messages.{i}.tool_calls.{j}.function.arguments", "is not a JSON object")
            calls.append(Call(call.function.name, arguments))
        messages.append(Message("system" if m.role == "developer" else m.role, content, tuple(calls)))
    return messages


async def _unless_gone(work, http: Request | None, session: Session):
    """``work``'s result, unless the harness disconnects first: then the work is cancelled and the
    session dropped (never trained half-done)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.05)
        if http is not None and not task.done() and await http.is_disconnected():
            task.cancel()
            session.drop("the harness disconnected mid-turn")
            raise HTTPException(499, "client closed the request")
    return task.result()


class Gateway:
    """Sessions over one engine, in one format (formats.py), with a policy version and a pause."""

    def __init__(self, engine, tool_format: str, max_new_tokens: int = 1024, seed: int | None = None, sampling: Sampling | None = None):
        # ``sampling``, where given (RL), replaces what requests ask: the policy gradient is of
        # the distribution the trainer assumes, whatever temperature a harness sends
        self.engine, self.tokenizer, self.sampling = engine, engine.tokenizer, sampling
        self.format = FORMATS[tool_format](engine.tokenizer)
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.sessions: dict[str, Session] = {}
        self.policy_version = 0
        self._serving = asyncio.Event()
        self._serving.set()
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._turns: dict[str, asyncio.Lock] = {}

    def open(self, group: str | None = None, question: dict | None = None, max_tokens: int | None = None) -> Session:
        session = Session(uuid.uuid4().hex[:16], group, question, max_tokens)
        self.sessions[session.id] = session
        return session

    def forget(self, session_id: str) -> None:
        """Let go of a session whose turns the caller has taken (RL, evaluation)."""
        self.sessions.pop(session_id, None)
        self._turns.pop(session_id, None)

    def session(self, session_id: str) -> Session:
        if session_id not in self.sessions:
            raise HTTPException(404, f"no session {session_id!r}: open one with POST /sessions")
        return self.sessions[session_id]

    @contextlib.asynccontextmanager
    async def weight_sync(self):
        """Hold new requests and wait for running ones while the weights change; the turns
        after it carry the next policy version."""
        self._serving.clear()
        try:
            await self._idle.wait()
            yield
            self.policy_version += 1
        finally:
            self._serving.set()

    async def complete(self, session: Session, request: ChatRequest, http: Request | None = None) -> dict:
        if session.state != "open":
            raise HTTPException(409, f"session {session.id} is {session.state}")
        messages = to_messages(request)
        schemas = [t.function.model_dump(exclude_none=True) for t in request.tools or []]
        self.format.check_tools([s["name"] for s in schemas])
        # one turn of a session at a time: each turn continues the ids the previous one left
        async with self._turns.setdefault(session.id, asyncio.Lock()):
            while not self._serving.is_set():  # checked again on waking: a sync may have begun since
                await _unless_gone(self._serving.wait(), http, session)
            self._running += 1
            self._idle.clear()
            try:
                return await self._generate(session, request, messages, schemas, http)
            finally:
                self._running -= 1
                if not self._running:
                    self._idle.set()

    async def _generate(self, session: Session, request: ChatRequest, messages: list[Message], schemas: list[dict], http) -> dict:
        kind, prompt, drift = session.next_prompt(messages, self.format, schemas)
        asked = request.max_completion_tokens or request.max_tokens or self.max_new_tokens
        room = [asked, self.engine.max_model_len - len(prompt)]
        if session.budget_left() is not None:
            room.append(session.budget_left())
        if min(room) <= 0:  # past the session's budget or the model's context: nothing generated
            return self._completion(session, "", [], "length", len(prompt), 0)
        version = self.policy_version
        seed = self._seed(session, request)
        generation = GenerationRequest(
            prompt_ids=tuple(prompt),
            max_new_tokens=min(room),
            stop=self.format.stop,
            sampling=self.sampling or Sampling.at(temperature=request.temperature, top_p=request.top_p),
            seed=seed,
            session=session.id,
        )
        sample = (await _unless_gone(self.engine.agenerate([generation]), http, session))[0][0]
        if sample.finish_reason == "error":
            raise HTTPException(500, f"the engine could not serve this turn: {sample.error}")
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=False)
        content, calls = self.format.parse(text)
        if session.state != "open":  # dropped while generating
            raise HTTPException(409, f"session {session.id} is {session.state}")
        session.record(kind, prompt, sample, version, drift, reply_message(content, calls), messages)
        finish = "tool_calls" if calls else ("length" if sample.finish_reason == "length" else "stop")
        return self._completion(session, content, calls, finish, len(prompt), len(sample.token_ids))

    def _seed(self, session: Session, request: ChatRequest) -> int | None:
        """The turn's seed: from the request's (a harness that seeds each session), else from the
        gateway's and the session; either way the turn's number too, so that no two turns draw
        alike. None: unseeded."""
        if request.seed is not None:
            return zlib.crc32(f"{request.seed}/{len(session.turns)}".encode())
        return None if self.seed is None else zlib.crc32(f"{self.seed}/{session.id}/{len(session.turns)}".encode())

    def _completion(self, session: Session, content: str, calls: list[Call], finish: str, prompt_tokens: int, tokens: int) -> dict:
        turn = len(session.turns)
        tool_calls = [
            {"id": f"call_{session.id}_{turn}_{i}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(calls)
        ]
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "id": f"chatcmpl-{session.id}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens},
            "policy_version": self.policy_version if not session.turns else session.turns[-1].policy_version,
        }

    def groups(self) -> dict[str | None, list[Session]]:
        """The ended sessions by group, those dropped left out: what RL trains on."""
        groups: dict[str | None, list[Session]] = {}
        for session in self.sessions.values():
            if session.state == "ended":
                groups.setdefault(session.group, []).append(session)
        return groups

    def metrics(self) -> dict:
        turns = [t for s in self.sessions.values() for t in s.turns]
        kinds = {k: sum(t.kind == k for t in turns) for k in ("start", "clean", "realign", "fork")}
        later = len(turns) - kinds["start"]
        states = [s.state for s in self.sessions.values()]
        return {
            "turns": len(turns),
            **kinds,
            "fork_rate": kinds["fork"] / later if later else 0.0,
            "sessions": {k: states.count(k) for k in ("open", "ended", "dropped")},
            "policy_version": self.policy_version,
        }


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "not_found_error" if status == 404 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def create_app(gateway: Gateway) -> FastAPI:
    """The HTTP face of ``gateway`` (routes in the module docstring)."""
    app = FastAPI(title="etagent gateway")

    @app.exception_handler(RequestValidationError)
    async def invalid(http: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        # a body that is not JSON, or not an object, is located by a character offset or not at all
        where = [str(p) for p in first["loc"][1:]] if first["type"] != "json_invalid" else []
        field = ".".join(where) or "body"
        return _error(400, f"{field}: {first['msg']}", field)

    @app.exception_handler(ChatError)
    async def unrenderable(http: Request, exc: ChatError):
        return _error(400, str(exc), exc.field)

    @app.exception_handler(HTTPException)
    async def http_error(http: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        return {"status": "ok", "format": gateway.format.name, "policy_version": gateway.policy_version}

    @app.post("/sessions")
    async def open_session(body: OpenSession, http: Request):
        session = gateway.open(body.group, body.question, body.max_tokens)
        return {"session_id": session.id, "base_url": f"{str(http.base_url).rstrip('/')}/s/{session.id}/v1"}

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat(session_id: str, body: ChatRequest, http: Request):
        return await gateway.complete(gateway.session(session_id), body, http)

    @app.post("/s/{session_id}/reward")
    async def reward(session_id: str, body: Reward):
        session = gateway.session(session_id)
        session.reward = body.reward
        return session.summary()

    @app.post("/s/{session_id}/end")
    async def end(session_id: str):
        session = gateway.session(session_id)
        if session.state == "open":
            session.state = "ended"
        return session.summary()

    @app.get("/s/{session_id}")
    async def trace(session_id: str):
        return gateway.session(session_id).trace()

    @app.get("/metrics")
    async def metrics():
        return gateway.metrics()

    return app

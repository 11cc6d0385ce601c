"""How a chat with function tools becomes token ids, and generated text becomes tool calls.

A format is chosen by what the policy was trained to write:

- ``protocol``: this toolkit's text protocol (etagent/protocol.py), which the toy model and every
  policy SFT'd here write. Two tools, ``search(query)`` and ``python(code)``. Everything after the
  question is one assistant turn: each call is ``<search> q </search>`` in the model's text and
  each result a ``<result>`` span tokenized on its own, exactly as the agent loop builds it
  (etagent/agent.py). A chat without a system turn gets the protocol's (etagent.protocol.SYSTEM_PROMPT),
  so a harness that knows nothing of it gets the prompt ids our own loop gives. One question per session.
- ``hermes``: the function-calling convention of Qwen2.5 and most open chat models. The tools'
  JSON schemas go into the system turn, each call is a ``<tool_call>{"name", "arguments"}</tool_call>``
  block in the assistant's text, each result a ``tool`` message; the tokenizer's own chat
  template frames every turn.

Every format gives three things: ``render`` (the whole chat from scratch, what a harness that
re-tokenizes would send), ``suffix`` (the ids that follow ids already held: the end of the last
assistant turn and the new messages) and ``parse`` (generated text -> content and tool calls).

What this module does not do: decide whether a turn continues the held ids (sessions.py), check
a request's shape (server.py) or generate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from etagent import protocol
from etagent.agent import STOPS


class ChatError(ValueError):
    """A chat the format cannot render, naming the request field (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class TemplateUnstable(Exception):
    """The chat template does not render an assistant turn's text as given when turns follow it,
    so no suffix continues the held ids (the turn forks)."""


@dataclass(frozen=True)
class Call:
    """One function call: its name and its arguments (a JSON object)."""

    name: str
    arguments: dict

    def key(self) -> tuple[str, str]:
        return self.name, json.dumps(self.arguments, sort_keys=True)


@dataclass(frozen=True)
class Message:
    """A chat message reduced to what renders: role, text and calls. Two messages that render
    alike compare equal (``None`` and ``""`` content, argument key order, call ids do not matter)."""

    role: str
    content: str = ""
    calls: tuple[Call, ...] = ()

    def same(self, other: Message) -> bool:
        return (self.role, self.content, [c.key() for c in self.calls]) == (other.role, other.content, [c.key() for c in other.calls])


def _tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


# A text no template changes: it marks where an assistant turn's content ends in a rendering.
_MARK = "\u2063gateway-mark\u2063"


def _template_suffix(tokenizer, system: list[dict], new: list[dict], ended_by_eos: bool) -> str:
    """The text the chat template puts after an assistant turn's content when ``new`` messages
    follow it and the next assistant turn opens: the turn's end (less the end-of-turn token when
    the model generated it, since the held ids end with it) and the new turns.

    Read from a probe chat (the real system turn, a user turn, an assistant turn holding a mark,
    then ``new``), in context: a template may end an assistant turn one way when it is last and
    another when a tool turn follows, and earlier turns it rewrites (stripped reasoning) do not
    move the mark."""
    probe = [*system, {"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    whole = _template(tokenizer, probe + new, True)
    if whole.count(_MARK) != 1:
        raise TemplateUnstable
    after = whole[whole.index(_MARK) + len(_MARK) :]
    eos = tokenizer.eos_token or ""
    if ended_by_eos and eos and after.startswith(eos):
        after = after[len(eos) :]
    return after


class ProtocolFormat:
    """This toolkit's protocol (module docstring): results inline in one assistant turn."""

    name = "protocol"
    stop = STOPS
    tools = {protocol.SEARCH: "query", protocol.PYTHON: "code"}

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def check_tools(self, names: list[str]) -> None:
        for i, name in enumerate(names):
            if name not in self.tools:
                raise ChatError(
                    f"tools.{i}.function.name", f"is {name!r}; the protocol format has the tools search(query) and python(code)"
                )

    def _split(self, messages: list[Message]) -> int:
        """Where the question's turn ends: the index after the one user message."""
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if len(users) != 1:
            at = f"messages.{users[1]}" if len(users) > 1 else "messages"
            raise ChatError(at, "the protocol format holds one question (one user message) per session")
        for i, m in enumerate(messages[users[0] + 1 :], users[0] + 1):
            if m.role not in ("assistant", "tool"):
                raise ChatError(f"messages.{i}.role", f"is {m.role}; after the question come only assistant and tool messages")
        return users[0] + 1

    def call_text(self, call: Call) -> str:
        """A call as our seed data and the toy policy write it (no spaces inside the tags); a
        policy that spaces them differently re-renders with drift, which the turn realigns."""
        return f"<{call.name}>{call.arguments.get(self.tools[call.name], '')}</{call.name}>"

    def _after_question(self, message: Message) -> list[int]:
        if message.role == "tool":
            return _tokens(self.tokenizer, protocol.format_result(message.content))
        if len(message.calls) > 1:
            raise ChatError("messages", "the protocol format makes one call per assistant message")
        return _tokens(self.tokenizer, message.content + "".join(self.call_text(c) for c in message.calls))

    def render(self, messages: list[Message], schemas: list[dict] = ()) -> list[int]:
        question = self._split(messages)
        head = [{"role": m.role, "content": m.content} for m in messages[:question]]
        if head[0]["role"] != "system":  # the protocol's own instructions, as every stage renders them
            head = [{"role": "system", "content": protocol.SYSTEM_PROMPT}, *head]
        ids = _tokens(self.tokenizer, _template(self.tokenizer, head, True))
        for message in messages[question:]:
            ids += self._after_question(message)
        return ids

    def suffix(self, system: list[Message], new: list[Message], ended_by_eos: bool, schemas: list[dict] = ()) -> list[int]:
        ids: list[int] = []
        for message in new:
            if message.role != "tool":
                raise ChatError(
                    "messages", f"a {message.role} message after the model's turn; the protocol format continues only with tool results"
                )
            ids += self._after_question(message)
        return ids

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """The segment's text before its call, and the call (none for an answer or plain text)."""
        found = protocol.parse_segment(text)
        if not isinstance(found, protocol.ToolCall):
            return text, []
        start = text.rfind(f"<{found.tool}>", 0, text.find(f"</{found.tool}>"))
        return text[: max(start, 0)], [Call(found.tool, {self.tools[found.tool]: found.input})]


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesFormat:
    """Function calls as ``<tool_call>`` JSON blocks, turns framed by the model's chat template."""

    name = "hermes"
    stop: tuple[str, ...] = ()  # a turn ends at the model's end-of-turn token

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.schemas: list[dict] = []

    def check_tools(self, names: list[str]) -> None:
        return None  # any function names

    def tools_text(self, schemas: list[dict]) -> str:
        listed = "\n".join(json.dumps(s, sort_keys=True) for s in schemas)
        return (
            "\n\n# Tools\n\nThese functions are available, each described by a JSON schema:\n<tools>\n"
            f"{listed}\n</tools>\n\nTo call one, write a JSON object with its name and arguments inside tags:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )

    def _turns(self, messages: list[Message], schemas: list[dict]) -> list[dict]:
        turns = []
        for message in messages:
            content = message.content
            if message.calls:
                blocks = [f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in message.calls]
                content = "\n".join(([content] if content else []) + blocks)
            turns.append({"role": message.role, "content": content})
        if schemas:
            if turns and turns[0]["role"] == "system":
                turns[0] = {"role": "system", "content": turns[0]["content"] + self.tools_text(schemas)}
            else:
                turns.insert(0, {"role": "system", "content": self.tools_text(schemas).lstrip()})
        return turns

    def render(self, messages: list[Message], schemas: list[dict] = ()) -> list[int]:
        return _tokens(self.tokenizer, _template(self.tokenizer, self._turns(messages, list(schemas)), True))

    def suffix(self, system: list[Message], new: list[Message], ended_by_eos: bool, schemas: list[dict] = ()) -> list[int]:
        head = self._turns(system, list(schemas))
        return _tokens(self.tokenizer, _template_suffix(self.tokenizer, head, self._turns(new, []), ended_by_eos))

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """Text before the first block, and every block's call; a malformed block leaves the
        whole text as content with no calls (as vLLM's hermes parser does)."""
        eos = self.tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        blocks = list(_TOOL_CALL.finditer(text))
        calls = []
        for block in blocks:
            try:
                call = json.loads(block.group(1))
            except json.JSONDecodeError:
                return text, []
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)):
                return text, []
            calls.append(Call(call["name"], call.get("arguments", {})))
        if not calls:
            return text, []
        return text[: blocks[0].start()].rstrip(), calls


FORMATS = {"protocol": ProtocolFormat, "hermes": HermesFormat}

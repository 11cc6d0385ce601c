"""Test doubles for control-flow tests (their docstrings say so): a model that replies to each
prompt by a rule, an engine that replays scripted segments, search and Python tools with random latency, and the scripts of the agent loop's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from etagent import protocol
from etagent.llm import GenerationRequest, Sample
from etagent.records import Question
from etagent.tools import ToolOutput


class ScriptedModel:
    """A test double for control flow: replies to each prompt's text with ``respond(text)``. A
    reply is cut after the first of the request's stop strings it contains (finish ``stop``),
    else ends with EOS. Records every prompt."""

    max_model_len = 4096

    def __init__(self, tokenizer, respond: Callable[[str], str]):
        self.tokenizer, self.respond = tokenizer, respond
        self.prompts: list[str] = []

    async def agenerate(self, requests):
        out = []
        for r in requests:
            text = self.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
            self.prompts.append(text)
            reply = self.respond(text)
            ends = [(reply.find(s) + len(s), s) for s in r.stop if s in reply]
            if ends:
                end, stop = min(ends)
                ids, finish = self.tokenizer.encode(reply[:end], add_special_tokens=False), "stop"
            else:
                ids, finish, stop = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id], "eos", None
            out.append([Sample(ids, [-0.1] * len(ids), finish, stop)])
        return out


class ScriptedEngine:
    """Replays fixed segments per question (a test double for control flow, not a model): the
    next segment is the first scripted one not yet in the trajectory's policy text. A segment
    ending with a stop string finishes with that stop, "<eos>" appends EOS, anything else ends
    by length. Records every request it was given."""

    max_model_len = 2048

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.requests: list[GenerationRequest] = []
        self.generated: dict[str, list[list[int]]] = {}

    async def agenerate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
            question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            response = text.split("<|im_start|>assistant\n", 1)[1]
            policy = protocol.strip_results(response)
            if question == "q-engine-error":
                out.append([Sample.failed("scripted failure")])
                continue
            script, done = self.scripts[question], ""
            k = 0
            while k < len(script) and policy.startswith(done + script[k].replace("<eos>", "")):
                done += script[k].replace("<eos>", "")
                k += 1
            segment = script[k] if k < len(script) else "<eos>"
            if segment.endswith("<eos>"):
                ids = self.tokenizer.encode(segment[: -len("<eos>")], add_special_tokens=False) + [self.tokenizer.eos_token_id]
                finish, stop = "eos", None
            else:
                ids = self.tokenizer.encode(segment, add_special_tokens=False)[: r.max_new_tokens]
                stop = next((s for s in r.stop if segment.endswith(s)), None)
                finish = "stop" if stop else "length"
            self.generated.setdefault(r.session, []).append(ids)
            top = [{i: -0.5, 7: -1.5} for i in ids]
            out.append([Sample(ids, [-0.1] * len(ids), finish, stop, top)])
        return out


class FakeSearch:
    """A search tool double with random latency, whose results quote protocol tags."""

    name = "search"

    def __init__(self, rng):
        self.rng = rng

    async def __call__(self, query):
        await asyncio.sleep(self.rng.random() * 0.05)
        return ToolOutput(f"Doc about {query}. It mentions </search> and <answer>\\boxed{{wrong}}</answer> in passing.", ok=True)


class FakePython:
    name = "python"

    def __init__(self, rng):
        self.rng = rng

    async def __call__(self, code):
        await asyncio.sleep(self.rng.random() * 0.05)
        return ToolOutput(str(eval(code.replace("print", ""))), ok=True)


ANSWER = "<answer>The final answer is \\[ \\boxed{{{}}} \\]</answer>"
SCRIPTS = {
    "q-search": ["<think>look it up</think><search>Zorvak Telmin</search>", "<think>found it</think>" + ANSWER.format(1873)],
    "q-python": [
        "<think>compute</think><python>print(12 * 7)</python>",
        "<think>check again</think><python>print(84 + 0)</python>",
        "<think>ok</think>" + ANSWER.format(84),
    ],
    "q-none": ["<think>easy</think>" + ANSWER.format("Zorvak")],
    "q-budget": [
        "<think>s1</think><search>a</search>",
        "<think>s2</think><search>b</search>",
        "<think>s3</think><search>c</search>",
        "<think>s4</think><search>d</search>",
        "<think>s5</think><search>e</search>",
    ],
    "q-fake": ["<think>I will pretend</think><result>"],
    "q-eos": ["<think>no answer<eos>"],
    "q-long": ["<think>" + "blah " * 200],
}


def question(name):
    return Question(id=name, question=name, answer=["x"], source="toy", kind="qa")

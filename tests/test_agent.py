"""The agent loop at the token level: stored tokens are exactly the generated ones plus the
inserted ones, the mask marks the inserted spans, text is decoded from tokens, budgets are
answered explicitly, and a run is the same whatever the batch size or tool-completion order."""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from etagent import protocol
from etagent.agent import AgentConfig, AgentLoop
from etagent.llm import GenerationRequest, Sample
from etagent.records import Question
from etagent.tools import ToolOutput
from etagent.tools.executor import ToolExecutor
from tests.trajectories import mask_runs


class ScriptedEngine:
    """Replays fixed segments per question (a test double for control flow, not a model): the
    next segment is the first scripted one not yet in the trajectory's policy text. A segment
    ending with a stop string finishes with that stop, "<eos>" appends EOS, anything else ends
    by length. Records every request it was given."""

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


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy / "model")


def question(name):
    return Question(id=name, question=name, answer=["x"], source="toy", kind="qa")


SCRIPT_CONFIG = AgentConfig(max_search_calls=2, max_budget_messages=1, max_response_tokens=300, logprobs=2)


def run_loop(tokenizer, names, batch_size, seed, config=SCRIPT_CONFIG):
    rng = random.Random(seed)
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([FakeSearch(rng), FakePython(rng)]), config)
    states = [loop.new(question(n), f"{n}/0") for n in names]
    for start in range(0, len(states), batch_size):
        asyncio.run(loop.run(states[start : start + batch_size]))
    return loop, engine, states


def snapshot(loop, states):
    return [
        (
            s.id,
            s.response_ids,
            s.mask,
            [(c.tool, c.input, c.output, c.ok, c.budget_exhausted) for c in s.tool_calls],
            s.finish_reason,
            loop.text(s),
        )
        for s in states
    ]


def test_same_trajectories_whatever_batch_size_and_tool_order(tokenizer):
    names = list(SCRIPTS)
    reference = None
    for batch_size, seed in ((len(names), 0), (1, 1), (3, 2), (len(names), 3)):
        loop, _, states = run_loop(tokenizer, names, batch_size, seed)
        shot = snapshot(loop, states)
        reference = reference or shot
        assert shot == reference


def test_tokens_are_generated_plus_inserted_and_the_mask_marks_insertions(tokenizer):
    loop, engine, states = run_loop(tokenizer, list(SCRIPTS), len(SCRIPTS), 0)
    for s in states:
        # walk the response: runs of mask 1 are exactly the engine's outputs, in order; runs of
        # mask 0 decode to the protocol's result text of the matching tool call
        runs = mask_runs(s.mask, s.response_ids)
        policy_runs = [ids for m, ids in runs if m == 1]
        inserted_runs = [ids for m, ids in runs if m == 0]
        assert policy_runs == engine.generated[s.question.id] and len(policy_runs) == s.segments
        assert [tokenizer.decode(ids) for ids in inserted_runs] == [protocol.format_result(c.output) for c in s.tool_calls]
        assert len(s.logprobs) == len(s.response_ids) and all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask) if m == 0)
        record = loop.to_record(s)
        assert record.text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert record.response_mask == s.mask and record.n_tokens == len(s.response_ids)
    # and every prompt sent to the engine was the prompt plus the response so far, token for token
    by_question = {s.question.id: s for s in states}
    for request in engine.requests:
        s = by_question[request.session]
        full = s.prompt_ids + s.response_ids
        assert len(request.prompt_ids) >= len(s.prompt_ids) and full[: len(request.prompt_ids)] == list(request.prompt_ids)


def test_finish_reasons_and_parsing(tokenizer):
    loop, _, states = run_loop(tokenizer, list(SCRIPTS), len(SCRIPTS), 0)
    by = {s.question.id: s for s in states}
    assert by["q-search"].finish_reason == "answer" and loop.to_record(by["q-search"]).prediction == "1873"
    # the result quoted </search> and an <answer>: neither confused the loop
    assert [c.input for c in by["q-search"].tool_calls] == ["Zorvak Telmin"] and by["q-search"].segments == 2
    assert [c.output for c in by["q-python"].tool_calls] == ["84", "84"] and loop.to_record(by["q-python"]).prediction == "84"
    assert by["q-none"].finish_reason == "answer" and by["q-none"].tool_calls == []
    assert by["q-fake"].finish_reason == "fake_result" and by["q-fake"].tool_calls == []
    assert by["q-eos"].finish_reason == "eos" and by["q-eos"].response_ids[-1] == tokenizer.eos_token_id
    assert by["q-long"].finish_reason == "length" and len(by["q-long"].response_ids) == 300
    assert protocol.validate_format(loop.text(by["q-python"]))


def test_over_budget_calls_get_the_budget_message(tokenizer):
    loop, _, states = run_loop(tokenizer, ["q-budget"], 1, 0)
    [s] = states
    calls = s.tool_calls
    assert [c.budget_exhausted for c in calls] == [False, False, True, True]
    assert [c.input for c in calls] == ["a", "b", "c", "d"]
    assert calls[2].output.startswith("Tool budget exhausted: 2 search calls made, the limit is 2.")
    assert s.finish_reason == "budget"  # a second over-budget call after max_budget_messages=1
    text = loop.text(s)
    assert text.count("Tool budget exhausted") == 2 and "<search>e</search>" not in text


def test_total_budget(tokenizer):
    config = AgentConfig(max_python_calls=6, max_search_calls=6, max_tool_calls=1, max_budget_messages=5)
    loop, _, [s] = run_loop(tokenizer, ["q-python"], 1, 0, config)
    assert [c.budget_exhausted for c in s.tool_calls] == [False, True]
    assert s.tool_calls[1].output.startswith("Tool budget exhausted: 1 tool calls made, the limit is 1.")
    assert s.finish_reason == "answer"


def test_entropies_are_recorded_per_segment(tokenizer):
    loop, engine, [s] = run_loop(tokenizer, ["q-python"], 1, 0)
    import math

    first = engine.generated["q-python"][0]
    expected = -sum(math.exp(lp) * lp for _ in first[:20] for lp in (-0.5, -1.5)) / math.log(len(tokenizer))
    assert len(s.entropies) == 3 and s.entropies[0] == pytest.approx(expected)


def test_prefix_hint_and_fork(tokenizer):
    rng = random.Random(0)
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([FakeSearch(rng), FakePython(rng)]), AgentConfig(max_python_calls=2, max_budget_messages=0))
    prefix = "<think>compute</think><python>print(12 * 7)</python>" + protocol.format_result("84")
    state = loop.from_prefix(question("q-python"), "p/0", prefix, op="flywheel-test")
    assert state.prefix_calls == {"python": 1, "search": 0} and state.executed("python") == 1
    assert tokenizer.decode([t for t, m in zip(state.response_ids, state.mask) if m == 0]) == protocol.format_result("84")
    twin = state.fork("p/1")
    loop.inject(twin, "<think>Wait, let me check once more.</think>")
    assert twin.mask[-1] == 0 and len(twin.response_ids) > len(state.response_ids)
    assert twin.provenance["parent"] == "p/0" and twin.prefix_calls == state.prefix_calls
    asyncio.run(loop.run([state]))
    # the scripted second python call is within budget (1 in the prefix + 1 = 2); then the answer
    assert [c.output for c in state.tool_calls] == ["84"] and state.finish_reason == "answer"

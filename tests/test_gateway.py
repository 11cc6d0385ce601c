"""The OpenAI-compatible gateway (etagent/gateway/): the real ``openai`` client drives sessions
over real engines (the toy model in the protocol format, SmolLM2-135M-Instruct in the hermes
format with its own chat template), and every turn's recorded ids are checked against what the
engine was actually given and returned; chat templates that re-render differently are classified
as predicted; bad requests get the answers an OpenAI server gives."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from etagent import protocol
from etagent.gateway.formats import Call, HermesFormat, Message
from etagent.gateway.server import ChatRequest, Gateway, create_app
from etagent.gateway.sessions import Session
from etagent.llm import Sample
from tests.support.commands import TOKEN
from tests.support.groups import agent_config
from tests.support.servers import serve

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python and print.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    },
]


class Recorded:
    """The real engine, with every request it was given and every sample it returned kept (a spy,
    not a double: generation is the engine's own)."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self.calls: list[tuple[tuple[int, ...], list[int]]] = []

    async def agenerate(self, requests):
        results = await self.engine.agenerate(requests)
        self.calls += [(r.prompt_ids, list(samples[0].token_ids)) for r, samples in zip(requests, results)]
        return results


@pytest.fixture(scope="module")
def toy_engine(toy):
    from etagent.llm.hf import HFEngine

    engine = HFEngine(str(toy / "model"), device="cpu")
    yield engine
    engine.sleep(level=2)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_gguf):
    from etagent.llm.hf import HFEngine

    engine = HFEngine(str(smollm2_gguf), device="cpu")
    yield engine
    engine.sleep(level=2)


def drive(url: str, first: list[dict], turns: int, then) -> str:
    """A harness on the openai client: ``turns`` completions, each reply appended as the client
    returns it, then ``then(message)``'s messages (tool results, a user turn)."""
    session = httpx.post(f"{url}/sessions", json={"group": "q1"}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    messages = list(first)
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24, seed=3)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += then(message)
    httpx.post(f"{url}/s/{session['session_id']}/end")
    return session["session_id"]


def check_recorded(url: str, session_id: str, engine: Recorded, tokenizer, fmt) -> dict:
    """Every turn's prompt and output ids are those the engine was given and returned, token for
    token; each segment is the last turn's prompt plus its output, and its trained (mask 1)
    tokens are exactly the generated ones; each output decodes back to the text the reply was
    read from (its content first, then the calls recorded)."""
    trace = httpx.get(f"{url}/s/{session_id}").json()
    turns = trace["turns_detail"]
    assert [(tuple(t["prompt_ids"]), t["output_ids"]) for t in turns] == engine.calls[-len(turns) :]
    for index, segment in enumerate(trace["segments_detail"]):
        mine = [t for t in turns if t["segment"] == index]
        assert segment["ids"] == mine[-1]["prompt_ids"] + mine[-1]["output_ids"]
        trained = [i for i, m in zip(segment["ids"], segment["mask"]) if m]
        assert trained == [i for t in mine for i in t["output_ids"]]
        assert [lp for lp, m in zip(segment["logprobs"], segment["mask"]) if m] == [lp for t in mine for lp in t["logprobs"]]
    for turn in turns:
        text = tokenizer.decode(turn["output_ids"], skip_special_tokens=False)
        content, calls = fmt.parse(text)
        assert text.startswith(content) and [c.__dict__ for c in calls] == turn["calls"]
    return trace


def test_the_openai_client_drives_the_toy_model_and_every_turn_holds_the_engines_ids(toy_engine):
    engine = Recorded(toy_engine)
    gateway = Gateway(engine, "protocol", max_new_tokens=24, seed=0)

    def results(message):  # a tool result for a call; the untrained toy model may call nothing
        calls = message.tool_calls or []
        return [{"role": "tool", "tool_call_id": c.id, "content": "4"} for c in calls] or [
            {"role": "tool", "tool_call_id": "x", "content": "?"}
        ]

    with serve(create_app(gateway)) as url:
        first = [{"role": "system", "content": protocol.SYSTEM_PROMPT}, {"role": "user", "content": "What is 2 + 2?"}]
        session_id = drive(url, first, 3, results)
        trace = check_recorded(url, session_id, engine, toy_engine.tokenizer, gateway.format)
        metrics = httpx.get(f"{url}/metrics").json()
    assert [t["kind"] for t in trace["turns_detail"]][0] == "start"
    assert all(t["kind"] in ("clean", "realign") for t in trace["turns_detail"][1:])  # the history was sent back as given
    assert trace["segments"] == 1 and metrics["fork_rate"] == 0.0
    # a result follows the held ids as the agent loop inserts it: tokenized on its own
    turns = trace["turns_detail"]
    result = toy_engine.tokenizer(protocol.format_result("?" if not turns[0]["calls"] else "4"), add_special_tokens=False)["input_ids"]
    assert turns[1]["prompt_ids"] == turns[0]["prompt_ids"] + turns[0]["output_ids"] + result


@pytest.mark.slow  # loads SmolLM2 from its GGUF (about 16 s)
def test_smollm2_with_its_own_chat_template_keeps_the_newline_after_the_end_of_turn(smollm2_engine, server):
    """SmolLM2-135M-Instruct in the hermes format: the second turn's prompt is the first turn's
    ids plus what the template puts after an assistant turn (the newline after ``<|im_end|>``
    that verl once dropped) and the new user turn."""
    engine = Recorded(smollm2_engine)
    gateway = Gateway(engine, "hermes", max_new_tokens=24, seed=0)
    tokenizer = smollm2_engine.tokenizer
    with serve(create_app(gateway)) as url:
        first = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
        session_id = drive(url, first, 2, lambda message: [{"role": "user", "content": "Another one?"}])
        trace = check_recorded(url, session_id, engine, tokenizer, gateway.format)
        # the example harness, in its own process, on the same gateway (hermes: the tools in the
        # system turn of SmolLM2's template)
        harness = Path(__file__).resolve().parents[1] / "examples" / "openai_harness.py"
        command = [sys.executable, str(harness), "--gateway", url, "--retriever", server, "--question", "Where is Arden?", "--seed", "0"]
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, RETRIEVER_TOKEN=TOKEN), timeout=300, check=True)
        check_recorded(url, json.loads(done.stdout.splitlines()[-1])["session_id"], engine, tokenizer, gateway.format)
    one, two = trace["turns_detail"]
    bridge = two["prompt_ids"][len(one["prompt_ids"]) + len(one["output_ids"]) :]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(bridge, skip_special_tokens=False)
    if one["output_ids"][-1] == end:  # it ended its turn itself: the bridge starts with the newline
        assert text.startswith("\n<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n")
    else:  # cut at max_tokens: the bridge closes the turn
        assert text.startswith("<|im_end|>\n<|im_start|>user\n")
    assert two["kind"] in ("clean", "realign")


# -- drift over chat templates -----------------------------------------------------------------

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's habit: the reasoning of an assistant turn that is not the last message is dropped
STRIPS_REASONING = CHATML.replace(
    "message['content'] + '<|im_end|>'",
    "((message['content'].split('</think>')[-1].lstrip('\\n')) if (message['role'] == 'assistant' and not loop.last) else message['content']) + '<|im_end|>'",
)
# trims every turn's text: the whitespace a model writes around its tool call is gone
TRIMS_WHITESPACE = CHATML.replace("message['content'] + '<|im_end|>'", "(message['content'] | trim) + '<|im_end|>'")
# no newline after <|im_end|> before a tool turn (verl's dropped newline, written into a template):
# the bridge after the held ids follows the template in context
NEWLINE_BEFORE_USERS_ONLY = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{%- if not loop.last and messages[loop.index0 + 1]['role'] == 'user' %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# keeps only the last assistant turn's text: no suffix can continue the held ids, so the turn forks
DROPS_EARLIER_REPLIES = CHATML.replace(
    "message['content'] + '<|im_end|>'", "('' if (message['role'] == 'assistant' and not loop.last) else message['content']) + '<|im_end|>'"
)


@pytest.mark.parametrize(
    "template, generated, harness_edits, predicted",
    [
        (CHATML, "<think>plan</think>\n", False, "clean"),
        (STRIPS_REASONING, "<think>plan</think>\n", False, "realign"),
        (TRIMS_WHITESPACE, "  <think>plan</think>\n", False, "realign"),
        # the same text under the plain template still drifts: from scratch, BPE merges the
        # newline that opens the turn with the model's first space ("\n " is one token)
        (CHATML, "  <think>plan</think>\n", False, "realign"),
        (NEWLINE_BEFORE_USERS_ONLY, "<think>plan</think>\n", False, "clean"),
        (DROPS_EARLIER_REPLIES, "<think>plan</think>\n", False, "fork"),
        (CHATML, "<think>plan</think>\n", True, "fork"),  # the harness drops the reasoning itself
    ],
)
def test_turns_are_classified_as_predicted_and_nothing_drifted_is_trained(smollm2_tokenizer, template, generated, harness_edits, predicted):
    """A scripted model output (a control-flow test: the text is chosen, the tokenizer and the
    templates are real) with a tool call, sent back by the harness and followed by the tool's
    result. Whatever the template does, the trained tokens are exactly the generated ones, and a
    clean or realigned prompt is the held ids plus the suffix."""
    tokenizer = smollm2_tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        fmt = HermesFormat(tokenizer)
        sent = [Message("system", "Be useful."), Message("user", "Where is Arden?")]
        session = Session("s")
        kind, prompt, _ = session.next_prompt(sent, fmt, [])
        call = '<tool_call>\n{"name": "search", "arguments": {"query": "Arden"}}\n</tool_call>'
        output_ids = tokenizer(generated + call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        content, calls = fmt.parse(tokenizer.decode(output_ids, skip_special_tokens=False))
        assert calls == [Call("search", {"query": "Arden"})]
        reply = Message("assistant", content, tuple(calls))
        session.record(kind, prompt, Sample(output_ids, [-0.5] * len(output_ids), "eos"), 0, 0, reply, sent)
        echoed = Message("assistant", content.split("</think>")[-1].strip(), reply.calls) if harness_edits else reply
        kind, prompt, drift = session.next_prompt([*sent, echoed, Message("tool", "Arden is in the north.")], fmt, [])
        assert kind == predicted and (drift > 0) == (kind == "realign")
        more = tokenizer("It is in the north.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        session.record(kind, prompt, Sample(more, [-0.1] * len(more), "eos"), 0, drift, Message("assistant", "It is in the north."), sent)
    finally:
        tokenizer.chat_template = saved
    last = session.segments[-1]
    assert last.ids == prompt + more
    trained = [i for segment in session.segments for i, m in zip(segment.ids, segment.mask) if m]
    assert trained == output_ids + more  # each reply trained once, nothing re-rendered trained
    if kind in ("clean", "realign"):
        assert (
            len(session.segments) == 1
            and prompt[: len(output_ids) + len(session.turns[0].prompt_ids)] == session.turns[0].prompt_ids + output_ids
        )
    else:
        assert len(session.segments) == 2


# -- the answers an OpenAI server gives ----------------------------------------------------------


class Slow:
    """The real engine, answering only after ``seconds`` (a control-flow test of a harness that
    leaves mid-turn: the delay is scripted, the generation real)."""

    def __init__(self, engine, seconds: float):
        self.engine, self.tokenizer, self.max_model_len, self.seconds = engine, engine.tokenizer, engine.max_model_len, seconds

    async def agenerate(self, requests):
        await asyncio.sleep(self.seconds)
        return await self.engine.agenerate(requests)


def test_bad_requests_are_refused_as_an_openai_server_refuses_them(toy_engine):
    gateway = Gateway(Slow(toy_engine, 1.5), "protocol", max_new_tokens=16, seed=0)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    with serve(create_app(gateway)) as url:
        base = httpx.post(f"{url}/sessions", json={"group": "g", "max_tokens": 8}).json()["base_url"]
        chat = f"{base}/chat/completions"
        for body, field in [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
            ({"messages": question, "temperature": -1}, "temperature"),
            ({"messages": question, "n": 2}, "n"),
            (
                {
                    "messages": [
                        *question,
                        {
                            "role": "assistant",
                            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "search", "arguments": "{oops"}}],
                        },
                    ]
                },
                "messages.1.tool_calls.0.function.arguments",
            ),
            ({"messages": question, "tools": [{"type": "function", "function": {"name": "browse"}}]}, "tools.0.function.name"),
            ({"messages": [*question, {"role": "user", "content": "and 3 + 3?"}]}, "messages.1"),
        ]:
            answer = httpx.post(chat, json=body)
            assert answer.status_code == 400, body
            assert answer.json()["error"]["param"] == field and field in answer.json()["error"]["message"]
        for body in (b"{not json", b"[1, 2]"):  # not JSON, not an object
            answer = httpx.post(chat, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "body", answer.text
        assert httpx.post(f"{url}/s/nosuch/v1/chat/completions", json={"messages": question}).status_code == 404
        assert httpx.post(f"{url}/s/nosuch/end").status_code == 404

        # past the session's budget: a length finish, nothing generated
        client = openai.OpenAI(base_url=base, api_key="unused")
        first = client.chat.completions.create(model="policy", messages=question, max_tokens=64)
        assert first.usage.completion_tokens <= 8
        messages = [
            *question,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "x", "content": "4"},
        ]
        if first.usage.completion_tokens == 8:
            again = client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
            assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 0

        # a harness that leaves mid-turn: its session is dropped, never trained
        left = httpx.post(f"{url}/sessions", json={"group": "g"}).json()
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{left['base_url']}/chat/completions", json={"messages": question}, timeout=0.3)
        for _ in range(100):
            if httpx.get(f"{url}/s/{left['session_id']}").json()["state"] == "dropped":
                break
            time.sleep(0.05)
        assert httpx.get(f"{url}/s/{left['session_id']}").json()["state"] == "dropped"
        httpx.post(f"{base.rsplit('/v1', 1)[0]}/end")
        groups = gateway.groups()
    assert [s.state for s in groups["g"]] == ["ended"]


def test_requests_wait_while_the_weights_change_and_carry_the_new_version(toy_engine):
    gateway = Gateway(toy_engine, "protocol", max_new_tokens=8, seed=0)
    session = gateway.open("g")
    request = ChatRequest(messages=[{"role": "user", "content": "What is 2 + 2?"}])

    async def scenario():
        async with gateway.weight_sync():
            waiting = asyncio.ensure_future(gateway.complete(session, request))
            await asyncio.sleep(0.3)
            assert not waiting.done() and not session.turns  # held while the weights change
        reply = await waiting
        return reply

    reply = asyncio.run(scenario())
    assert gateway.policy_version == 1 and session.turns[0].policy_version == 1 and reply["policy_version"] == 1
    assert json.loads(json.dumps(reply))["choices"][0]["message"]["role"] == "assistant"


# -- the example harness, as a user runs it ------------------------------------------------------


@pytest.mark.slow  # reads the fully trained toy policy (sft_model_full)
def test_the_example_harness_drives_the_trained_toy_policy_through_the_gateway(sft_model_full, toy, server):
    """examples/openai_harness.py in its own process, on the openai client, against the SFT'd toy
    policy and the toy world's retriever: it searches, the results reach the model as ``<result>``
    spans after the held ids, and every turn's ids are what the engine saw."""
    from etagent.llm.hf import HFEngine
    from etagent.scoring import em

    harness = Path(__file__).resolve().parents[1] / "examples" / "openai_harness.py"
    questions = [json.loads(line) for line in (toy / "questions" / "test.jsonl").read_text().splitlines()][:6]
    engine = Recorded(HFEngine(str(sft_model_full / "model"), device="cpu"))
    gateway = Gateway(engine, "protocol", max_new_tokens=256, seed=0)
    right = 0
    with serve(create_app(gateway)) as url:
        for i, q in enumerate(questions):
            command = [sys.executable, str(harness), "--gateway", url, "--retriever", server, "--question", q["question"], "--seed", str(i)]
            done = subprocess.run(
                command, capture_output=True, text=True, env=dict(os.environ, RETRIEVER_TOKEN=TOKEN), timeout=300, check=True
            )
            answer = json.loads(done.stdout.splitlines()[-1])
            trace = check_recorded(url, answer["session_id"], engine, engine.tokenizer, gateway.format)
            assert trace["tool_calls"] == answer["tool_calls"] and trace["state"] == "ended"
            assert all(t["kind"] in ("clean", "realign") for t in trace["turns_detail"][1:])
            right += max(em(protocol.extract_answer(answer["answer"] or ""), gold) for gold in q["answer"])
        metrics = httpx.get(f"{url}/metrics").json()
    engine.engine.sleep(level=2)
    # it searches (the policy calls a tool on about 3 in 4 of these questions at temperature 1)
    assert sum(s.tool_calls for s in gateway.sessions.values()) >= len(questions) // 2
    assert metrics["fork"] == 0 and right >= 1


@pytest.mark.slow  # two RL steps through the harness on the fully trained toy policy
def test_rl_trains_through_the_gateway_on_the_example_harness(sft_model_full, toy, server, tmp_path):
    """``rollout.kind=gateway``: the example harness drives every rollout, and the steps train on
    the sessions' ids: tool calls counted from the harness's calls, no session forked or left
    unfinished, the update's numbers finite, and the rollouts hold the harness's results."""
    from etagent.question_formats import read_questions
    from etagent.records import RLRow, write_rl_parquet
    from tests.support.commands import rl_overrides

    questions = [q for q in read_questions(toy / "questions" / "test.jsonl") if q.source in ("toy_python", "toy_both", "toy_search")]
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions[::10][:12])], tmp_path / "rl.parquet")
    harness = f"{sys.executable} {Path(__file__).resolve().parents[1] / 'examples' / 'openai_harness.py'} --retriever {server}"
    out = tmp_path / "rl"
    overrides = rl_overrides(
        sft_model_full, parquet, server, out, "rollout.kind=gateway", f"rollout.gateway.harness='{harness}'", "train.max_steps=2"
    )
    done = subprocess.run(
        [sys.executable, "-m", "etagent.rl.run", *overrides],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, RETRIEVER_TOKEN=TOKEN),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["gateway/fork_rate"] == 0.0 and m["gateway/not_ended_share"] == 0.0 and m["engine/failed"] == 0
        assert m["rollout/tool_calls"] > 0 and all(v == v for v in m.values() if isinstance(v, float))
    rows = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert any("<result>" in r["text"] for r in rows)


# -- sessions as trajectories --------------------------------------------------------------------


def scripted_session(tokenizer, replies: list[str], results: list[str], end: bool = True) -> Session:
    """A protocol-format session whose model outputs are scripted (a control-flow test: the text is
    chosen, the tokenizer and the rendering are real), each reply followed by the next result."""
    from etagent.gateway.formats import ProtocolFormat

    fmt = ProtocolFormat(tokenizer)
    session = Session("s")
    sent = [Message("user", "In which year was Arden founded?")]
    for i, text in enumerate(replies):
        kind, prompt, drift = session.next_prompt(sent, fmt, [])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        content, calls = fmt.parse(text)
        stop = "</answer>" if text.endswith("</answer>") else ("</search>" if calls else None)
        session.record(
            kind,
            prompt,
            Sample(ids, [-0.25] * len(ids), "stop" if stop else "eos", stop=stop),
            i,
            drift,
            Message("assistant", content, tuple(calls)),
            sent,
        )
        sent = [*session.history, *([Message("tool", results[i])] if i < len(results) else [])]
    session.state = "ended" if end else "open"
    return session


def test_a_session_becomes_the_trajectory_the_trainer_and_the_evaluation_read(toy):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from etagent.agent import AgentLoop
    from etagent.gateway.harness import session_trajectory
    from etagent.records import Question, TokenOrigin

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    loop = AgentLoop(SimpleNamespace(tokenizer=tokenizer), None, agent_config())  # no generation here: only its tokenizer is read
    question = Question(id="q", question="In which year was Arden founded?", answer=["323"], source="toy_search", kind="qa")
    replies = [
        "<think>Look it up.</think><search>Arden</search>",
        "<think>It says 323.</think><answer>The final answer is \\[ \\boxed{323} \\]</answer>",
    ]
    session = scripted_session(tokenizer, replies, ["Arden was founded in 323."])
    state = session_trajectory(loop, session, question, "q/0", None)
    segment = session.segments[0]
    assert state.prompt_ids + state.response_ids == segment.ids and state.prompt_ids == session.turns[0].prompt_ids
    sampled = [i for i, o in zip(state.response_ids, state.origin) if o == TokenOrigin.SAMPLED]
    assert sampled == [i for t in session.turns for i in t.output_ids]
    assert [(c.tool, c.input, c.output) for c in state.tool_calls] == [("search", "Arden", "Arden was founded in 323.")]
    assert state.finish_reason == "answer" and state.segment_versions == [0, 1] and state.executed() == 1
    record = loop.to_record(state)
    assert record.prediction == "323" and "<result>\nArden was founded in 323.\n</result>" in record.text

    # the harness stopped after a call it never answered: no call ran, the trajectory is cut
    cut = session_trajectory(loop, scripted_session(tokenizer, replies[:1], []), question, "q/1", None)
    assert cut.finish_reason == "budget" and cut.executed() == 0
    # a session the harness did not end, and one it forked, are never trained on
    unended = session_trajectory(loop, scripted_session(tokenizer, replies, ["x"], end=False), question, "q/2", "it exited with status 1")
    assert unended.finish_reason == "error" and "unfinished: it exited with status 1" in unended.error
    forked = scripted_session(tokenizer, replies, ["x"])
    forked.segments.append(forked.segments[0])
    assert session_trajectory(loop, forked, question, "q/3", None).finish_reason == "error"


@pytest.mark.slow  # two evaluations of the fully trained toy policy
def test_an_evaluation_through_the_gateway_scores_as_our_own_loop(sft_model_full, toy, server, tmp_path):
    """The same 40 held-out questions evaluated by our agent loop and by the example harness
    through the gateway (``gateway.harness``): the same report, and correctness within 15 points
    (40 questions, one sample each: a binomial spread of about 6 points per run)."""
    from tests.support.commands import eval_command

    harness = f"{sys.executable} {Path(__file__).resolve().parents[1] / 'examples' / 'openai_harness.py'} --retriever {server}"
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN)
    summaries = {}
    for name, extra in (("loop", []), ("gateway", [f"gateway.harness='{harness}'"])):
        out = tmp_path / name
        done = subprocess.run(
            eval_command(sft_model_full, toy, server, out, "n=1", "limit=40", "agent.seed=0", *extra),
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        summaries[name] = json.loads((out / "toy" / "metrics.json").read_text())
    assert summaries["loop"].keys() == summaries["gateway"].keys()
    loop, gateway = (summaries[k]["correctness"] for k in ("loop", "gateway"))
    assert abs(loop - gateway) <= 15, (loop, gateway)

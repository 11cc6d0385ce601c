"""The weight-update check every engine must pass, shared by the hf and vllm tests (and run under
torchrun for the colocated vllm engine: ``python -m torch.distributed.run --nproc_per_node=1
tests/weight_updates.py MODEL_DIR`` prints its findings as JSON).

New weights (another random init of the same shape, its tied lm_head left out as checkpoints
leave it out) must change greedy output and give the new model's log-probabilities; a wrong name, a missing name or a wrong shape must be refused with the
engine unchanged; the original weights must restore greedy output exactly.
"""

from __future__ import annotations

import json
import sys

import torch


def other_weights(model_dir) -> dict[str, torch.Tensor]:
    """The state dict of a differently seeded toy model of the same shape (lm_head included)."""
    from transformers import AutoConfig, AutoTokenizer

    from etagent.toy.model import build_model

    config = AutoConfig.from_pretrained(model_dir)
    other = build_model(
        AutoTokenizer.from_pretrained(model_dir),
        hidden_size=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        seed=123,
    )
    return {k: v.detach().clone() for k, v in other.state_dict().items()}


def forward_logprobs(weights, model_dir, prompt, tokens) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def check_weight_update(engine, model_dir) -> dict:
    """Runs the sequence on ``engine`` and returns what a test asserts on."""
    from transformers import AutoModelForCausalLM

    from etagent import protocol
    from etagent.llm import GenerationRequest, Sampling

    prompt = protocol.encode_prompt(engine.tokenizer, "What is 12 times 7?")
    greedy = GenerationRequest(tuple(prompt), sampling=Sampling.at(temperature=0), max_new_tokens=12)
    original = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
    before = engine.generate([greedy])[0][0]
    new = other_weights(model_dir)
    # the toy model ties lm_head to the embedding: send the update as a checkpoint has it, without
    # the alias; the engine must compute logits with the new embedding all the same
    engine.update_weights({k: v for k, v in new.items() if k != "lm_head.weight"})
    changed = engine.generate([greedy])[0][0]
    expected = forward_logprobs(new, model_dir, prompt, changed.token_ids)
    refusals = []
    for bad in (
        {**new, "model.bogus.weight": torch.zeros(2)},
        {k: v for k, v in new.items() if k != "model.norm.weight"},
        {**new, "model.norm.weight": torch.zeros(3)},
    ):
        try:
            engine.update_weights(bad)
            refusals.append(None)
        except ValueError as error:
            refusals.append(str(error))
    after_refusals = engine.generate([greedy])[0][0]
    engine.update_weights(original)
    restored = engine.generate([greedy])[0][0]
    return {
        "before": before.token_ids,
        "changed": changed.token_ids,
        "changed_logprob_error": max(abs(a - b) for a, b in zip(expected, changed.logprobs)),
        "changed_logprob_shift": max(abs(a - b) for a, b in zip(changed.logprobs, before.logprobs)),
        "refusals": refusals,
        "after_refusals": after_refusals.token_ids,
        "restored": restored.token_ids,
        "restored_logprob_error": max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)),
    }


def assert_weight_update(found: dict) -> None:
    assert found["changed"] != found["before"] or found["changed_logprob_shift"] > 1e-3
    assert found["changed_logprob_error"] < 1e-4  # the engine computes with exactly the new weights
    unknown, missing, shape = found["refusals"]
    assert unknown and "unknown" in unknown and "model.bogus.weight" in unknown
    assert missing and "model.norm.weight" in missing
    assert shape and "has shape (3,)" in shape and "not touched" in shape
    assert found["after_refusals"] == found["changed"]  # a refused update changed nothing
    assert found["restored"] == found["before"] and found["restored_logprob_error"] < 1e-5


if __name__ == "__main__":  # run by path under torchrun: tests.support is not importable here
    from etagent.config import base_group
    from etagent.llm import VLLMConfig
    from etagent.llm.vllm_engine import VLLMEngine

    model_dir = sys.argv[1]
    settings = base_group(
        VLLMConfig,
        "engine",
        "vllm",
        max_model_len=2048,
        gpu_memory_utilization=0.5,
        cpu_kv_cache_gb=0.25,
        enforce_eager=True,
        colocated=True,
    )
    engine = VLLMEngine.load(model_dir, settings, dtype="float32")
    found = check_weight_update(engine, model_dir)
    print("WEIGHT-UPDATE " + json.dumps({**found, "in_process": engine.in_process}), flush=True)

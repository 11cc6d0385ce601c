"""Does RL's colocated engine follow a bf16 LoRA policy? Run under torchrun, one process:

    python -m torch.distributed.run --nproc_per_node=1 tests/support/lora_sync.py ENGINE MODEL_DIR

ENGINE is ``hf``, ``vllm`` (the adapters sent beside the base: rl/engine.py's AdapterEngine) or
``vllm-merged`` (the merged weights streamed into a bf16 engine, the way RL synced LoRA before;
kept to show what the test tells apart). The policy is MODEL_DIR with LoRA (rank 32, alpha 64, on
every projection) over a bf16 base, as configs/rl/paper_1gpu.yaml has it, trained for
``STEPS`` AdamW steps at that preset's learning rate, 1e-5, on a fixed batch with fixed
advantages; the engine is built and synced as the trainer does (``start``, then ``sync`` after
each step). Before the first step and after each, the engine samples seeded continuations of
fixed prompts and reports its log-probabilities of them; the policy's own forward (bf16) and the
starting policy's (the adapters off: B is 0 at the start, so that is the base) score the same
tokens. Prints one line, ``LORA-SYNC {json}``: per step, those three lists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

STEPS = 4
LEARNING_RATE = 1e-5  # configs/rl/paper_1gpu.yaml's optim.lr
PROMPTS = ("Who works as a baker?", "What is 12 times 7?", "Where was Zorvak Telmin born?", "Name a river.")


def main(kind: str, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from etagent import protocol
    from etagent.config import LoraSettings
    from etagent.llm import GenerationRequest, Sampling
    from etagent.rl.adapters import adapters_disabled
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import gathered, load_policy

    device = torch.device("cpu")
    init_distributed(device)
    lora = LoraSettings(
        enabled=True,
        rank=32,
        alpha=64,
        dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    policy, tokenizer = load_policy(model_dir, device, compute_dtype=torch.bfloat16, chunk_tokens=256, lora=lora, seed=1)
    engine = build_engine(kind, policy, tokenizer, model_dir, lora)
    engine.start(resumed=False)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LEARNING_RATE, weight_decay=0.0)
    prompts = [protocol.encode_prompt(AutoTokenizer.from_pretrained(model_dir), q) for q in PROMPTS]
    ids, positions, scored, advantages = training_batch(prompts)

    def measure(step: int) -> dict:
        requests = [
            GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=24, seed=100 * step + k)
            for k, p in enumerate(prompts)
        ]
        policy.eval()
        with engine.reading():
            samples = [s for per_request in engine.generator.generate(requests) for s in per_request]
        found = {"engine": [], "policy": [], "start": []}
        for prompt, sample in zip(prompts, samples):
            tokens = list(sample.token_ids)
            found["engine"] += list(sample.logprobs)
            found["policy"] += score(policy, prompt, tokens)
            with gathered(policy), adapters_disabled(policy.lm):
                found["start"] += score(policy, prompt, tokens)
        return found

    steps = [measure(0)]
    for step in range(1, STEPS + 1):
        policy.train()
        logprobs, _ = policy(ids, torch.ones_like(ids), positions, scored)
        (-(logprobs * advantages).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.sleep()
        engine.sync()
        steps.append(measure(step))
    engine.close()
    return {"steps": steps}


def build_engine(kind: str, policy, tokenizer, model_dir: str, lora):
    from etagent.rl.engine import AdapterEngine, CopiedWeightsEngine, LivePolicyEngine
    from etagent.rl.policy import unhooked_twin

    if kind == "hf":
        from etagent.llm.hf import HFEngine

        twin = unhooked_twin(policy.lm, lora)
        return LivePolicyEngine(HFEngine.from_model(twin, tokenizer), policy, twin)
    from etagent.config import base_group
    from etagent.llm import VLLMConfig
    from etagent.llm.vllm_engine import VLLMEngine

    adapters = kind == "vllm"
    settings = base_group(
        VLLMConfig,
        "engine",
        "vllm",
        max_model_len=512,
        gpu_memory_utilization=0.5,
        cpu_kv_cache_gb=0.25,
        enforce_eager=True,
        colocated=True,
        max_lora_rank=lora.rank if adapters else None,
    )
    generator = VLLMEngine.load(model_dir, settings, dtype="bfloat16")
    if adapters:
        return AdapterEngine(generator, policy, torch.device("cpu"), lora, model_dir)
    return CopiedWeightsEngine(generator, policy, torch.device("cpu"), torch.bfloat16, 1 << 20)


def training_batch(prompts: list[list[int]]):
    """Each prompt followed by fixed tokens, every response position scored, fixed advantages."""
    generator = torch.Generator().manual_seed(0)
    width = max(len(p) for p in prompts) + 32
    rows, scored = [], []
    for k, prompt in enumerate(prompts):
        tail = torch.randint(10, 1000, (width - len(prompt),), generator=generator).tolist()
        rows.append(prompt + tail)
        scored.append([k * width + len(prompt) - 1 + j for j in range(len(tail) - 1)][:31])
    ids = torch.tensor(rows)
    positions = torch.arange(width).expand_as(ids)
    advantages = torch.randn(len(prompts), 1, generator=generator)
    return ids, positions, torch.tensor(scored), advantages


@torch.no_grad()
def score(policy, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    positions = torch.arange(ids.shape[1])[None]
    scored = torch.arange(len(prompt) - 1, ids.shape[1] - 1)[None]
    logprobs, _ = policy(ids, torch.ones_like(ids), positions, scored)
    return logprobs[0].float().tolist()


if __name__ == "__main__":
    found = main(sys.argv[1], str(Path(sys.argv[2])))
    print("LORA-SYNC " + json.dumps(found), flush=True)

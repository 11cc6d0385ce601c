"""The policy's full weights, gathered from their FSDP2 shards a bucket at a time: into the
colocated vLLM engine after every update (:func:`sync_engine`), and into a save_pretrained
folder (rl/checkpoint.py). With LoRA (rl/adapters.py) both get the merged weights.

:func:`stream_weights` walks the model's state dict in order; each parameter is cast to the
target dtype on its shard (so the all-gather moves bf16, not float32) and gathered with
``full_tensor()``; a bucket holds at most ``bucket_bytes`` of gathered tensors (a tensor larger
than the bucket is a bucket of its own) and is handed over one tensor at a time, its tensors
dropped as the consumer moves on. Every rank walks the same names in the same order, because each
gather is a collective. verl streams ``full_tensor()`` per parameter into vLLM's loader the same
way; TRL syncs tensor by tensor.

The sync follows vLLM's sleep mode (vllm/v1/executor/abstract.py, v1/worker/gpu_worker.py in
vLLM 0.32-0.33) and what verl and TRL do around it: the engine sleeps at level 2 while the
trainer steps (its weights and KV cache freed); then PyTorch's cached blocks go back to the
driver (the trainer's freed activations and gradients would otherwise stay reserved by PyTorch,
invisible to vLLM's allocator), the weights wake, the new ones stream in, the cache is emptied
again (the gathered buckets), and only then does the KV cache wake.

What it does not do: decide when to sync (rl/trainer.py) or keep anything between calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from etagent.llm import WeightStream
from etagent.rl.adapters import ADAPTER, base_name, is_adapter_weight, lora_layers, merged_weight


def stream_weights(module: nn.Module, dtype: torch.dtype | None, bucket_bytes: int) -> WeightStream:
    """``module``'s state dict as a :class:`WeightStream` of full tensors in ``dtype`` (None: as
    they are), gathered bucket by bucket when the stream is read. Every rank must read it whole.
    A module with LoRA adapters (rl/adapters.py) streams its merged weights under the base's
    names, and no adapter tensor."""
    items = weight_items(module)
    shapes = {name: shape for name, shape, _, _ in items}
    return WeightStream(shapes, _gather_buckets(items, dtype, bucket_bytes))


def adapter_weights(module: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full LoRA adapter tensors of ``module`` in ``dtype``, under the adapted model's names.
    Every rank must read them all."""
    for name, tensor in module.state_dict().items():
        if is_adapter_weight(name):
            yield name, _full(tensor, dtype)


# (name, shape, source dtype, gather(dtype) -> the full tensor)
Item = tuple[str, tuple[int, ...], torch.dtype, Callable[[torch.dtype | None], torch.Tensor]]


def weight_items(module: nn.Module) -> list[Item]:
    """What :func:`stream_weights` hands over, in state-dict order, each gathered only when read."""
    state = module.state_dict()
    scalings = {f"{name}.base_layer.weight": (name, layer.scaling[ADAPTER]) for name, layer in lora_layers(module)}
    items: list[Item] = []
    for name, tensor in state.items():
        if is_adapter_weight(name):
            continue
        if name in scalings:
            layer, scaling = scalings[name]
            a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            gather = functools.partial(_merged, tensor, a, b, scaling)
        else:
            gather = functools.partial(_full, tensor)
        items.append((base_name(name), tuple(tensor.shape), tensor.dtype, gather))
    return items


def _gather_buckets(items: list[Item], dtype: torch.dtype | None, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    def size(item: Item) -> int:
        _, shape, source, _ = item
        return math.prod(shape) * (dtype or source).itemsize

    start = 0
    while start < len(items):
        end, total = start + 1, size(items[start])
        while end < len(items) and total + size(items[end]) <= bucket_bytes:
            total += size(items[end])
            end += 1
        bucket = [(name, gather(dtype)) for name, _, _, gather in items[start:end]]
        start = end
        while bucket:
            # hand over and forget: once the consumer has copied it, nothing holds the tensor
            yield bucket.pop(0)


@torch.no_grad()
def _merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype | None) -> torch.Tensor:
    return merged_weight(_full(weight, None), _full(a, None), _full(b, None), scaling, dtype)


@torch.no_grad()
def _full(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None:
        tensor = tensor.to(dtype)  # on the shard: the gather moves the target dtype
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def release_cached_memory(device: torch.device) -> None:
    """Return PyTorch's cached, unused blocks to the driver, so that another allocator (vLLM's,
    waking up) can have them. Nothing to do off CUDA."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync_engine(engine, module: nn.Module, device: torch.device, dtype: torch.dtype | None, bucket_bytes: int) -> None:
    """The policy's current weights into the engine (asleep after generation, or awake at the
    start of a run): weights woken, the stream loaded, then the KV cache woken."""
    release_cached_memory(device)
    engine.wake_up(["weights"])
    engine.update_weights(stream_weights(module, dtype, bucket_bytes))
    release_cached_memory(device)
    engine.wake_up(["kv_cache"])

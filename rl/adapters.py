"""LoRA adapters on RL's policy (``lora.enabled``): peft's LoRA layers injected into the
transformers model itself, so that the policy's forward, the hf engine and FSDP2 see the same
module as without them, with only the adapters trainable.

- :func:`add_adapters`: adapters on ``lora.target_modules``, every other weight frozen. The frozen
  base keeps the dtype it was built in (rl/policy.py builds it in the compute dtype: 15 GB at 7B
  instead of a 30 GB float32 copy); the adapters are float32, as AdamW's copy is.
- :func:`initial_weights`: the full state dict the loader broadcasts: the base checkpoint's
  tensors under the adapted model's names (a wrapped layer's weight becomes
  ``<layer>.base_layer.weight``), every A drawn as peft draws it (Kaiming-uniform, from the run's
  seed, so the same seed starts the same adapters) and every B zero, so the adapted policy starts
  as the base exactly.
- :func:`adapters_disabled`: the base alone, for the KL term's reference, without a second copy.
- :func:`merged_weight`: W + scaling · B A of one layer, which rl/weights.py streams into vLLM and
  into exported models under the base's names.
- :func:`save_adapter`: the adapters as peft's adapter folder (``adapter_model.safetensors`` and
  ``adapter_config.json``), which ``PeftModel.from_pretrained(base, folder)`` loads.

What it does not do: adapter dropout (rl/run.py refuses it: the sampler and the trainer must
compute the same function), several adapters, or vLLM's own LoRA serving (the engine gets merged
weights, through the same sync path as full training).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from etagent.config import LoraSettings

ADAPTER = "default"  # peft's name for a model's one adapter


def add_adapters(lm: nn.Module, settings: LoraSettings) -> None:
    """LoRA on ``settings.target_modules`` of ``lm``, in place, on whatever device its weights
    are (the meta device while loading); only the adapters stay trainable."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(settings.peft_config(), lm, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    lm.requires_grad_(False)
    for _, layer in lora_layers(lm):
        for part in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            part.to(torch.float32)
            part.requires_grad_(True)


def lora_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every LoRA-wrapped layer in ``module``."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in module.named_modules() if isinstance(m, LoraLayer)]


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base checkpoint's name for a tensor of the adapted model."""
    return name.replace(".base_layer.", ".")


def initial_weights(lm: nn.Module, checkpoint: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The adapted model's full state dict: ``checkpoint``'s tensors (the base) under the adapted
    names, A Kaiming-uniform as peft initialises it (drawn from ``seed``), B zero."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in lm.state_dict().items():  # the names and the global shapes (meta or sharded)
        if ".lora_A." in name:
            state[name] = nn.init.kaiming_uniform_(torch.empty(tensor.shape), a=math.sqrt(5), generator=generator)
        elif ".lora_B." in name:
            state[name] = torch.zeros(tensor.shape)
        else:
            state[name] = checkpoint[base_name(name)]
    return state


@contextmanager
def adapters_disabled(lm: nn.Module) -> Iterator[None]:
    """``lm`` computes its base alone inside the block (peft's own switch); the adapters are
    trainable again after it."""
    layers = [layer for _, layer in lora_layers(lm)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype | None) -> torch.Tensor:
    """W + scaling · B A (full tensors), computed in float32, in ``dtype`` (None: W's)."""
    return torch.addmm(weight.float(), b.float(), a.float(), alpha=scaling).to(dtype or weight.dtype)


def peft_name(name: str) -> str:
    """An adapter weight's name in peft's saved adapters (its PeftModel prefix, no adapter name)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_adapter(folder: Path, adapters: dict[str, torch.Tensor], settings: LoraSettings, base: str) -> None:
    """``adapters`` (the adapted model's names, full tensors on the host) as peft's adapter
    folder over the model at ``base``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({peft_name(name): tensor.contiguous() for name, tensor in adapters.items()}, str(folder / "adapter_model.safetensors"))
    config = settings.peft_config()
    config.base_model_name_or_path = base
    config.save_pretrained(str(folder))

"""The policy being trained: a transformers causal LM sharded with FSDP2, loaded without ever
holding the whole model on a rank's GPU, whose forward returns what the loss needs (the
response tokens' log-probabilities, and their distributions' entropy) without the full logits.

Loading (:func:`load_policy`) follows verl's and torchtune's recipe: every rank builds the model
with its parameters on the meta device (no memory), shards it (``fully_shard`` per decoder
layer, then the root), allocates only its own shards on its device, and then receives the
weights: rank 0 reads the safetensors checkpoint into host memory and
``set_model_state_dict(..., broadcast_from_rank0=True)`` sends it one tensor at a time, each rank
keeping its shard. At 7B on 4 GPUs that is 7.6 GB of float32 shards per GPU instead of 30 GB of
a whole float32 copy per rank first. A run that resumes skips the checkpoint read: its sharded
training state (rl/checkpoint.py) overwrites the shards.

Log-probabilities (:class:`Policy`'s forward): the decoder's last hidden states of the response
positions go through the output embedding ``chunk_tokens`` positions at a time, each chunk's
logits in float32 only while its log-softmax is taken (and recomputed in the backward pass,
under activation checkpointing), so the peak is a few copies of one chunk's logits, not
(tokens x vocabulary) in float32 several times: at a 151,936 vocabulary and 8k response tokens,
forward and backward, the old way peaked at 18.7 GiB on CPU and this one at 0.97 GiB with 512
positions per chunk (bench/logprob_memory.py measures both). The numbers are the same: the
float32 log-softmax of the same logits.

What it does not do: architectures whose logits are not a plain linear map of the last hidden
state (logit soft-capping, scaled logits), or tensor/sequence parallelism.
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from etagent.config import LoraSettings
from etagent.divergence import WeightCheck
from etagent.rl.adapters import adapters_disabled, add_adapters, initial_weights
from etagent.rl.algorithm import entropy_from_logprobs


class Policy(nn.Module):
    """A causal LM (``lm``, a transformers ``*ForCausalLM``) whose forward returns the response
    tokens' log-probabilities. It is the FSDP2 root, so the output embedding, the final norm and
    the input embedding are gathered for exactly this forward and its backward."""

    def __init__(self, lm: nn.Module, chunk_tokens: int, temperature: float = 1.0):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"the policy's log-probabilities need a sampling temperature > 0, got {temperature}")
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        # the model's own dropout probabilities that training runs without (switch_off_dropout),
        # for exports to write back into their config
        self.dropout: dict[str, float] = {}
        self.weight_check = WeightCheck()  # after every optimizer step (rl/actor.py)
        # the rollouts were sampled from softmax(logits / T): the ratio and the entropy are of that
        # distribution, as verl's actor computes them
        self.temperature = temperature

    @property
    def eager(self) -> bool:
        """Whether attention is transformers' eager one, which takes an additive mask."""
        return self.lm.config._attn_implementation == "eager"

    @property
    def packs_sequences(self) -> bool:
        """Whether a forward pass takes sequences packed into one row, without padding, at no
        extra cost: flash-attention reads the restarting position ids as separate sequences;
        sdpa and eager would attend through a dense block-diagonal mask over the whole row, so
        they get padded micro-batches of similar lengths instead."""
        return self.lm.config._attn_implementation.startswith("flash_attention")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        scored: torch.Tensor,
        with_entropy: bool = False,
        targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities, under the sampling temperature, of the tokens that follow the
        positions ``scored`` names (flat indices into the (B x L) positions, any shape), in
        ``scored``'s shape, and the entropy of each one's distribution when asked (no gradient).
        ``attention_mask`` None with position ids that restart at 0: sequences packed in a row
        (rl/batch.py); a 4D boolean mask: the tokens of a prefix tree, each attending to its
        ancestors, where a position is followed by a different token in each branch, so
        ``targets`` (``scored``'s shape) says which. Entries that score padding hold junk: mask them."""
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        flat = scored.reshape(-1)
        # index_select, not hidden[flat]: in a tree pass ``flat`` names a shared position once per
        # path, and the backward of advanced indexing on CPU adds those repeats in an order that
        # changes from call to call at 2 threads; index_select's backward adds them in index order, so
        # the same seeds give the same update (docs/reproducibility.md)
        responses = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)[None]
        if targets is not None:
            targets = targets.reshape(-1)[None]
        else:  # clamped: a junk entry may point at the very last position, which predicts nothing
            targets = input_ids.reshape(-1)[(flat + 1).clamp(max=input_ids.numel() - 1)][None]
        weight = self.lm.get_output_embeddings().weight
        logprobs, entropy = response_logprobs(responses, weight, targets, self.chunk_tokens, with_entropy, self.temperature)
        return logprobs.reshape(scored.shape), (None if entropy is None else entropy.reshape(scored.shape))


def response_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ weight.T / temperature)[target]`` for (B, T, H) hidden states and
    (B, T) targets, ``chunk_tokens`` positions at a time. With gradients on, each chunk is
    checkpointed: its logits are freed after the forward and recomputed in the backward."""
    batch, width, size = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(-1, size), targets.reshape(-1)
    logprobs, entropies = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        part = (flat_hidden[start : start + chunk_tokens], weight, flat_targets[start : start + chunk_tokens], with_entropy, temperature)
        if torch.is_grad_enabled():
            lp, entropy = checkpoint(_chunk_logprobs, *part, use_reentrant=False)
        else:
            lp, entropy = _chunk_logprobs(*part)
        logprobs.append(lp)
        entropies.append(entropy)
    if not logprobs:  # no response position at all
        empty = hidden.new_zeros(batch, width, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    result = torch.cat(logprobs).reshape(batch, width)
    return result, (torch.cat(entropies).reshape(batch, width) if with_entropy else None)


def _chunk_logprobs(hidden, weight, targets, with_entropy: bool, temperature: float):
    logits = F.linear(hidden, weight).float()  # the output embedding, then float32 as the loss wants
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits  # the log-softmax's backward needs only its output
    logprobs = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logprobs(log_probs)
    return logprobs, entropy


def load_policy(
    path: str | Path,
    device: torch.device,
    *,
    compute_dtype: torch.dtype,
    chunk_tokens: int,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    trainable: bool = True,
    weights: bool = True,
    temperature: float = 1.0,
    lora: LoraSettings | None = None,
    seed: int = 0,
):
    """The policy in ``path`` (a save_pretrained folder), sharded with FSDP2 over every rank, with
    float32 parameters (the optimizer's copy) and ``compute_dtype`` for the forward and backward.
    ``weights=False`` leaves the shards unfilled for a resume to overwrite. A frozen copy
    (``trainable=False``) serves as the KL reference. ``attn_implementation`` is transformers'
    (flash_attention_2 makes :attr:`Policy.packs_sequences` true). ``temperature`` is the rollouts' sampling
    temperature (:class:`Policy`). With ``lora``, adapters on the base (rl/adapters.py): the
    frozen base in ``compute_dtype``, the float32 adapters drawn from ``seed``; a resume reads the
    base and overwrites the adapters. Returns (policy, tokenizer)."""
    from accelerate import init_empty_weights
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    dropout = switch_off_dropout(config)
    # parameters on the meta device; buffers (rotary frequencies) computed for real, because no
    # checkpoint holds them
    with init_empty_weights():
        # with LoRA the base is frozen: kept in the compute dtype, as the forward uses it
        base_dtype = compute_dtype if lora else torch.float32
        lm = AutoModelForCausalLM.from_config(config, dtype=base_dtype, attn_implementation=attn_implementation)
    lm.tie_weights()  # accelerate's meta parameters replace the shared one: tie the output embedding again
    if lora:
        add_adapters(lm, lora)
    if not trainable:
        lm.requires_grad_(False).eval()
    elif gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = Policy(lm, chunk_tokens, temperature)
    policy.dropout = dropout
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(policy, mesh=mesh, mp_policy=precision)
    buffers = {name: buffer.clone() for name, buffer in policy.named_buffers()}
    policy.to_empty(device=device)  # this rank's shards only, uninitialised
    with torch.no_grad():
        for name, buffer in policy.named_buffers():
            buffer.copy_(buffers[name])
    if weights:
        full = read_checkpoint(Path(path), config) if dist.get_rank() == 0 else {}
        if lora and full:
            full = initial_weights(lm, full, seed)
        set_model_state_dict(lm, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    # FSDP2 settles which module is its root at the first forward through it; the hf engine runs
    # the inner model, whose layers would each take themselves for a root if they came first
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        policy(ids, torch.ones_like(ids), torch.arange(2, device=device)[None], torch.zeros(1, dtype=torch.long, device=device))
    policy.reshard()  # the root keeps its parameters gathered after a forward (for the backward)
    return policy, tokenizer


def switch_off_dropout(config) -> dict[str, float]:
    """Set every dropout probability of ``config`` (its text model's: ``attention_dropout``,
    ``hidden_dropout``, GPT-2's ``*_pdrop``, ...) to 0 before the model is built from it, and
    return the ones that were not 0. RL's ratio compares the trainer's log-probabilities with the
    sampler's, which runs without dropout: a trainer with it computes another function (TRL's
    ``disable_dropout`` does the same). Exports write the model's own values back."""
    text = config.get_text_config()
    found = {}
    for key, value in text.to_dict().items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float) and not isinstance(value, bool):
            if value:
                found[key] = value
            setattr(text, key, 0.0)
    return found


def read_checkpoint(path: Path, config) -> dict[str, torch.Tensor]:
    """The full state dict of a save_pretrained folder (one ``model.safetensors`` or the shards its
    index lists), in host memory, with the tied ``lm_head.weight`` the checkpoint leaves out."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json (RL loads safetensors checkpoints)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(path / name))
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


@contextmanager
def gathered(module: nn.Module):
    """Every FSDP2 group's parameters gathered for the whole block, so that forward passes issue
    no collectives: generation on each rank runs as many forwards as its own rollouts need."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def unhooked_twin(lm: nn.Module, lora: LoraSettings | None) -> nn.Module:
    """A module of ``lm``'s class, configuration and adapters with its tensors on the meta device
    and no FSDP2 hooks, for the colocated hf engine to decode with once :func:`lend_gathered` has
    given it ``lm``'s gathered tensors.

    Why: FSDP2 runs its Python hooks around the forward of every sharded layer even while the
    layer's parameters stay gathered, which a decoding step pays once per layer per token.
    bench/bench_hf_engine.py on 24 narrow layers, 2 CPU cores: the twin decoded 1.20x and 1.23x
    as fast as the sharded module (two runs). On an H200 the sharded module decoded at 88.5
    tokens/s against 387 for the plain model (Qwen2.5-0.5B's shape, bf16, 8 rows); how much of
    that the hooks are is not measured (the twin has not run on a GPU)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(lm.config, attn_implementation=lm.config._attn_implementation)
    if lora:
        add_adapters(twin, lora)
    twin.generation_config = lm.generation_config
    return twin


def lend_gathered(twin: nn.Module, lm: nn.Module) -> None:
    """Point every parameter and buffer of ``twin`` (:func:`unhooked_twin`) at ``lm``'s own
    tensor of the same name, tied ones included: inside :func:`gathered` those are the gathered
    parameters, which the twin then computes with, the same function as ``lm`` (no copy). Valid
    until the block ends and they are freed; call it again on every entry."""
    tensors = [*lm.named_parameters(remove_duplicate=False), *lm.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        owner, _, leaf = name.rpartition(".")
        setattr(twin.get_submodule(owner), leaf, tensor)


class Reference:
    """The KL term's reference policy: a frozen copy of the stage's starting policy or, with
    LoRA, the policy itself with its adapters off (its base is the starting policy)."""

    def __init__(self, policy: Policy, adapters_off: bool):
        self.policy, self.adapters_off = policy, adapters_off

    @contextmanager
    def reading(self):
        """The module to compute reference log-probabilities with, gathered, without gradients."""
        switch = adapters_disabled(self.policy.lm) if self.adapters_off else nullcontext()
        with gathered(self.policy), switch, torch.no_grad():
            yield self.policy

"""RL's colocated rollout engine: one object that the trainer calls without asking which kind it is.

The two kinds (``engine.kind``) differ in one fact, whether the engine samples with the policy
module itself, and everything the trainer does around generation follows from it:

==============================  ==========================================  ==========================================
                                ``hf``: the live policy                      ``vllm``: a copy of the weights
==============================  ==========================================  ==========================================
around generation               every layer gathered, lent to a plain twin  nothing (it holds its own copy)
after generation (``sleep``)    its decoding thread ends, caches dropped    asleep, level 2: the weights dropped
                                                                             (with LoRA level 1: the base kept)
after the update (``sync``)     nothing: it is the policy                    the new weights streamed in (rl/weights.py);
                                                                             with LoRA the adapters, beside the base
old log-probabilities           the rollout's own                            recomputed by the trainer
truncated importance sampling   only for stale tokens of partial rollouts    always (``algorithm.tis_cap``)
its log-probabilities' gap      measured in the update's first mini-batch    measured against the recomputed ones
==============================  ==========================================  ==========================================

:func:`check_engine_settings` refuses what an engine kind cannot do; :func:`colocated_engine` builds
one. What this does not do: generate (the agent loop calls :attr:`ColocatedEngine.generator`) or
shape the rollout (rl/rollout.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from etagent.config import LoraSettings
from etagent.errors import SettingError
from etagent.rl.adapters import save_adapter
from etagent.rl.config import RLConfig
from etagent.rl.policy import Policy, gathered, lend_gathered, unhooked_twin
from etagent.rl.weights import adapter_weights, release_cached_memory, sync_engine
from etagent.settings import check_installed


class ColocatedEngine:
    """What the trainer asks of its rollout engine. ``samples_live_policy``: True when the engine
    samples with the trainer's module and its current weights, so that its log-probabilities are
    the old ones; False when it samples with a copy, kept in step by :meth:`sync`."""

    samples_live_policy: bool

    def __init__(self, generator, policy: Policy):
        self.generator = generator  # what the agent loop calls (etagent.llm's Engine)
        self.policy = policy

    def reading(self) -> AbstractContextManager:
        """What generation and validation run inside."""
        return nullcontext()

    def sleep(self) -> None:
        """Called when generation is over: the trainer changes the weights after this returns."""
        self.generator.sleep(level=2)

    def sync(self) -> None:
        """Bring the engine to the policy's current weights (after an update, or on resume)."""

    def start(self, resumed: bool) -> None:
        """Before the first step: the engine began from the stage's starting weights, which a
        resumed policy has moved on from."""
        if resumed:
            self.sync()

    def close(self) -> None:
        """At the end of the run."""

    def applies_tis(self, stale_tokens_tis: bool) -> bool:
        """Whether the update corrects the rollout's log-probabilities by truncated importance
        sampling (partial rollouts with ``stale_tokens=tis`` always are)."""
        return stale_tokens_tis or not self.samples_live_policy

    def rollout_logprobs_are_old(self, stale_tokens_tis: bool) -> bool:
        """Whether the rollout's log-probabilities are the policy's before the update, so that the
        trainer need not recompute them (not when some were sampled by older weights)."""
        return self.samples_live_policy and not stale_tokens_tis


class LivePolicyEngine(ColocatedEngine):
    """``hf``: the policy's own weights generate (etagent/llm/hf.py), through ``twin``, a plain
    module of the policy's architecture (rl/policy.py's :func:`unhooked_twin`) that is lent the
    gathered parameters while generating: the same function as the policy, without FSDP2's
    per-layer hooks."""

    samples_live_policy = True

    def __init__(self, generator, policy: Policy, twin: torch.nn.Module):
        super().__init__(generator, policy)
        self.twin = twin

    @contextmanager
    def reading(self):
        # every layer stays gathered for the whole block, so that ranks decoding different
        # lengths never wait on each other's all-gathers
        with gathered(self.policy):
            lend_gathered(self.twin, self.policy.lm)
            yield


class CopiedWeightsEngine(ColocatedEngine):
    """``vllm``: one vLLM engine per rank in the trainer's process (the external launcher under
    torchrun), loaded from the stage's starting policy and sent the weights after every update."""

    samples_live_policy = False

    def __init__(self, generator, policy: Policy, device: torch.device, weight_dtype: torch.dtype | None, bucket_bytes: int):
        super().__init__(generator, policy)
        self.device, self.weight_dtype, self.bucket_bytes = device, weight_dtype, bucket_bytes

    def sync(self) -> None:
        sync_engine(self.generator, self.policy.lm, self.device, self.weight_dtype, self.bucket_bytes)

    def close(self) -> None:
        self.generator.shutdown()


class AdapterEngine(CopiedWeightsEngine):
    """``vllm`` with ``lora.enabled``: the engine holds the stage's base weights, which never
    change, and serves every request with the policy's LoRA adapter beside them (vLLM's
    ``enable_lora``), sent after every update as peft's adapter folder in float32. The trainer
    computes x W^T + s (x A^T) B^T with the adapters apart from the frozen bf16 base; merged
    into a bf16 weight, an update smaller than half a bf16 step of W would be rounded away (at
    Qwen2.5-7B's shapes and lr 1e-5, most of each step's), so the sampler would lag the policy.
    Asleep at level 1 while the trainer steps: the base is kept (in host memory on a GPU), not
    dropped."""

    def __init__(self, generator, policy: Policy, device: torch.device, lora: LoraSettings, base: str):
        super().__init__(generator, policy, device, None, 0)
        self.lora, self.base = lora, base
        self.folder = Path(tempfile.mkdtemp(prefix="etagent-adapter-"))

    def sleep(self) -> None:
        self.generator.sleep(level=1)

    def sync(self) -> None:
        adapters = {}
        for name, tensor in adapter_weights(self.policy.lm, torch.float32):  # every rank gathers every adapter
            adapters[name] = tensor.cpu()
        release_cached_memory(self.device)
        self.generator.wake_up(["weights"])
        save_adapter(self.folder, adapters, self.lora, self.base)
        self.generator.load_adapter(str(self.folder))
        self.generator.wake_up(["kv_cache"])

    def start(self, resumed: bool) -> None:
        self.sync()  # every request carries the adapter, from the first one

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.folder, ignore_errors=True)


def check_engine_settings(cfg: RLConfig) -> None:
    """Refuse, before any work, an engine RL cannot run colocated or settings it cannot serve."""
    if cfg.engine.kind == "openai":
        raise SettingError("engine.kind", "must be hf or vllm: RL's engine runs in the trainer's process")
    if cfg.engine.kind != "vllm":
        return
    from etagent.llm.vllm_engine import LORA_RANKS, MAX_LOGPROBS  # the module imports vLLM only when an engine is built

    check_installed("engine.kind", "vllm", "engine.kind=vllm")
    if cfg.rollout.kind == "tree" and cfg.rollout.entropy == "exact":
        raise SettingError(
            "rollout.entropy",
            "is exact, which only the hf engine measures (it sees whole distributions); use rollout.entropy=topk with vllm",
        )
    if cfg.lora.enabled and cfg.lora.rank > LORA_RANKS[-1]:
        raise SettingError("lora.rank", f"is {cfg.lora.rank}, and vLLM serves LoRA adapters of rank <= {LORA_RANKS[-1]}")
    if cfg.rollout.top_logprobs > MAX_LOGPROBS:
        raise SettingError(
            "rollout.top_logprobs",
            f"is {cfg.rollout.top_logprobs}, over the vllm engine's limit of {MAX_LOGPROBS} (its max_logprobs): vLLM would refuse "
            f"every request; set it <= {MAX_LOGPROBS} (ARPO: 10)",
        )
    if cfg.engine.vllm.tensor_parallel_size != 1:
        # under the external launcher a tensor-parallel group is several trainer ranks, which
        # would all have to send the same requests at the same steps; each rank samples its own
        raise SettingError(
            "engine.vllm.tensor_parallel_size",
            f"is {cfg.engine.vllm.tensor_parallel_size}: RL's colocated engine is one per rank, each generating its own prompts; set it to 1",
        )
    if "RANK" not in os.environ:
        raise SettingError(
            "engine.kind", "vllm runs one engine per rank under torchrun: launch with scripts/rl.sh or torchrun -m etagent.rl.run"
        )
    if cfg.algorithm.tis_cap is not None and cfg.agent.sampling.temperature != 1:
        # vLLM reports raw log-probabilities; only at T = 1 are they of the distribution sampled from
        raise SettingError(
            "algorithm.tis_cap",
            f"needs vLLM's log-probabilities of the sampled distribution, which it reports at agent.sampling.temperature 1 only "
            f"(it is {cfg.agent.sampling.temperature}): set algorithm.tis_cap=null or agent.sampling.temperature=1",
        )


def colocated_engine(
    cfg: RLConfig, policy: Policy, tokenizer, device: torch.device, bucket_bytes: int, lora: LoraSettings | None
) -> ColocatedEngine:
    """The engine ``engine.kind`` names. The hf engine decodes with the policy's weights (``lora``:
    the policy's adapters, which its twin needs too). A vLLM engine starts from the stage's
    starting weights (``engine.model`` is the policy's own path: configs/rl/_base.yaml) and is sent
    them in ``engine.dtype`` (``auto``: as the policy holds them); a resumed run syncs it."""
    from etagent.llm import make_engine
    from etagent.llm.hf import HFEngine

    if cfg.engine.kind == "hf":
        twin = unhooked_twin(policy.lm, lora)
        generator = HFEngine.from_model(
            twin, tokenizer, max_batch_size=cfg.engine.max_batch_size, continuous_batching=cfg.engine.continuous_batching
        )
        return LivePolicyEngine(generator, policy, twin)
    weight_dtype = None if cfg.engine.dtype == "auto" else getattr(torch, cfg.engine.dtype)
    settings = cfg.engine
    vllm = replace(settings.vllm, colocated=True, max_lora_rank=lora.rank if lora else None)
    generator = make_engine(replace(settings, vllm=vllm))
    if lora:
        return AdapterEngine(generator, policy, device, lora, str(cfg.model))
    return CopiedWeightsEngine(generator, policy, device, weight_dtype, bucket_bytes)

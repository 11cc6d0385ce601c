"""The ``openai`` engine: a pool of OpenAI-compatible servers (``vllm serve``, SGLang).

Two uses:

- a served **policy** for the agent loop: ``agenerate`` sends token-id prompts to
  ``/v1/completions`` and reads the generated token ids back (vLLM's
  ``return_tokens_as_token_ids``), with their log-probabilities, so the loop keeps working on
  token ids;
- **judge, editor and summariser** models: ``chat`` (messages in, text out, the server applying
  the model's chat template).

Every sampling setting is sent, including ``top_k``, ``min_p`` and ``repetition_penalty`` (the
reference's client silently dropped the first two). A request with a ``session`` (the agent loop
uses the question id) is pinned to one server, so that server's prefix cache keeps serving it;
new sessions are spread round-robin. Each call has a timeout and bounded retries on its server,
then fails over to each other server once (and re-pins there). A policy request that fails on
every server comes back as an ``error`` sample; the rest of the batch goes on.

A served policy's weights belong to its servers: ``update_weights`` is refused (restart the
servers on the new checkpoint), and ``sleep``/``wake_up`` do nothing.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

import httpx

from etagent.llm import GREEDY, GenerationRequest, Sample, Sampling
from etagent.net import ExternalCallError, post_json


class OpenAIEngine:
    def __init__(
        self,
        urls: list[str],
        model: str,
        *,
        tokenizer: str | None = None,
        api_key_env: str | None = None,
        timeout_s: float = 600.0,
        attempts: int = 3,
        concurrency: int = 64,
        max_model_len: int = 32768,
    ):
        if not urls:
            raise ValueError("the openai engine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        key = os.environ.get(api_key_env) if api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s, self.attempts, self.concurrency = timeout_s, attempts, concurrency
        self.max_model_len = max_model_len
        self.tokenizer_name = tokenizer
        self._pins: dict[str, int] = {}
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    @functools.cached_property
    def tokenizer(self):
        """The served model's tokenizer, loaded on first use: a served policy's token-id prompts
        need it, a chat (judge, editor) does not, so a judge served elsewhere needs no local copy."""
        if self.tokenizer_name is None:
            raise ValueError(f"{self!r} was given no tokenizer: token-id prompts need one (engine.model)")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_name)

    def __repr__(self) -> str:
        return f"OpenAIEngine({self.urls}, model={self.model!r})"

    # -- transport --------------------------------------------------------------------------

    def _server_order(self, session: str | None) -> list[int]:
        with self._lock:
            if session is None:
                first = next(self._next) % len(self.urls)
            else:
                first = self._pins.setdefault(session, next(self._next) % len(self.urls))
        return [first] + [i for i in range(len(self.urls)) if i != first]

    async def _post(self, path: str, body: dict, session: str | None) -> Any:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.concurrency)
        errors = []
        async with self._semaphores[loop], httpx.AsyncClient() as client:
            for rank, server in enumerate(self._server_order(session)):
                attempts = self.attempts if rank == 0 else 1  # retries on the pinned server, then fail over
                try:
                    answer = await post_json(
                        client, self.urls[server] + path, body, headers=self.headers, timeout=self.timeout_s, attempts=attempts
                    )
                except ExternalCallError as exc:
                    errors.append(str(exc))
                    continue
                if session is not None and rank > 0:
                    with self._lock:
                        self._pins[session] = server
                return answer
        raise ExternalCallError(f"every server failed: {' | '.join(errors)}")

    @staticmethod
    def _sampling(sampling: Sampling, max_new_tokens: int, stop, seed: int | None) -> dict:
        body = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "max_tokens": max_new_tokens,
            "stop": list(stop),
            "include_stop_str_in_output": True,
        }
        if seed is not None:
            body["seed"] = seed
        return body

    # -- lifecycle --------------------------------------------------------------------------

    def update_weights(self, weights: dict) -> None:
        raise RuntimeError(f"{self!r} serves a policy from its servers' own weights; restart them on the new checkpoint")

    def sleep(self, level: int = 1) -> None:
        """Nothing to free in this process."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore in this process."""

    # -- a served policy --------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return asyncio.run(self.agenerate(requests))

    async def _one(self, r: GenerationRequest) -> list[Sample]:
        body = {
            "model": self.model,
            "prompt": list(r.prompt_ids),
            "n": r.n,
            "logprobs": max(1, r.logprobs),
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            **self._sampling(r.sampling, r.max_new_tokens, r.stop, r.seed),
        }
        try:
            answer = await self._post("/completions", body, r.session)
        except ExternalCallError as error:
            return [Sample.failed(str(error)) for _ in range(r.n)]
        choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
        return [self._sample(choice, r) for choice in choices]

    @staticmethod
    def _token_id(token: str) -> int:
        if not token.startswith("token_id:"):
            raise ExternalCallError(
                f"the server did not return token ids ({token!r}): serve the policy with vLLM, which supports return_tokens_as_token_ids"
            )
        return int(token.split(":", 1)[1])

    def _sample(self, choice: dict, request: GenerationRequest) -> Sample:
        k = request.logprobs
        logprobs = choice.get("logprobs") or {}
        tokens = [self._token_id(t) for t in logprobs.get("tokens", [])]
        sampled = [lp if lp is not None else 0.0 for lp in logprobs.get("token_logprobs", [])]
        top = []
        if k > 0:
            window = len(tokens) if request.logprobs_window is None else request.logprobs_window
            for position, token in zip((logprobs.get("top_logprobs") or [])[:window], tokens):
                ranked = sorted(((self._token_id(t), lp) for t, lp in (position or {}).items()), key=lambda item: -item[1])
                chosen = dict(ranked[:k])
                chosen.setdefault(token, (position or {}).get(f"token_id:{token}", 0.0))
                top.append(chosen)
        stop_reason = choice.get("stop_reason")
        if choice.get("finish_reason") == "length":
            finish, stop = "length", None
        elif isinstance(stop_reason, str):
            finish, stop = "stop", stop_reason
        else:
            finish, stop = "eos", None
        tempered = sampled if request.sampling.temperature == 1 else None
        return Sample(tokens, sampled, finish, stop, top, tempered_logprobs=tempered)

    # -- text models (judge, editor, summariser) --------------------------------------------

    async def chat(
        self,
        messages: list[dict],
        sampling: Sampling = GREEDY,
        *,
        max_new_tokens: int = 1024,
        stop: Sequence[str] = (),
        seed: int | None = None,
        session: str | None = None,
    ) -> str:
        """Chat completion, the server applying the model's chat template (the text interface of
        judge, editor and summariser models, which the flywheel's roles also offer for
        engines in this process)."""
        body = {"model": self.model, "messages": messages, **self._sampling(sampling, max_new_tokens, stop, seed)}
        answer = await self._post("/chat/completions", body, session)
        return answer["choices"][0]["message"]["content"] or ""

"""The flywheel's models as roles: the policy, the self-reflector, the editor/judge, the summariser.

Every role is an engine of :mod:`etagent.llm` (``hf`` or ``vllm`` in this process, or ``openai``
for a pool of served models), built from its own ``engine`` config. The policy drives the agent
loop over token ids; the other roles are text models (:class:`TextModel`): a chat rendered with
the role model's own chat template, optionally with the assistant turn pre-filled, generated
through the same engine interface and decoded. The reflector is the policy's own engine (the
paper's "self" reflection), so it costs no second copy of the model.

The questions of a run are evolved concurrently. The hf engine without continuous batching (the
tiny presets, for reproducibility) decodes one call after the other, so it is wrapped in
:class:`etagent.llm.SharedBatches`, which queues the requests of every coroutine and sends them as
one batch at a time (the requests that arrive while a batch runs make the next one). The hf engine
with continuous batching, vLLM's async engine and a pool of servers need none of this: requests
go out as they come and join the running batch.

What this module does not do: decide what to ask (``flywheel.evolve``) or parse replies
(``flywheel.steps``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from omegaconf import DictConfig

from etagent.llm import GenerationRequest, Sampling, SharedBatches, make_engine
from etagent.net import ExternalCallError


def derived_seed(*parts) -> int:
    """A 63-bit seed from any parts (run seed, question id, operation, round)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def build_engine(cfg: DictConfig):
    """An engine for a role; one that decodes a call at a time is shared through :class:`SharedBatches`."""
    engine = make_engine(cfg)
    return SharedBatches(engine) if cfg.kind == "hf" and not cfg.continuous_batching else engine


class TextModel:
    """A role that reads and writes text: chat in, text out, through any engine, sampled with the
    role's :class:`etagent.llm.Sampling` and token cap. Every request is seeded from the caller's
    ``seed`` parts, so a rerun asks the same thing and, on a seeded engine, gets the same answer."""

    def __init__(self, engine, sampling: Sampling, max_new_tokens: int, name: str):
        self.engine, self.sampling, self.max_new_tokens, self.name = engine, sampling, max_new_tokens, name
        self.tokenizer = engine.tokenizer

    def render(self, messages: list[dict], prefill: str = "") -> str:
        """The prompt text: the chat with the assistant turn opened, and ``prefill`` in it."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return prompt + prefill

    async def complete(
        self,
        messages: list[dict],
        *,
        prefill: str = "",
        stop: Sequence[str] = (),
        seed: int | None = None,
        sampling: Sampling | None = None,
        max_new_tokens: int | None = None,
    ) -> str:
        """The model's continuation of the rendered chat (special tokens left out); ``sampling``
        and ``max_new_tokens`` replace the role's for this call."""
        ids = self.tokenizer.encode(self.render(messages, prefill), add_special_tokens=False)
        request = GenerationRequest(
            prompt_ids=tuple(ids),
            sampling=sampling or self.sampling,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            stop=tuple(stop),
            seed=seed,
        )
        [[sample]] = await self.engine.agenerate([request])
        if sample.finish_reason == "error":
            raise ExternalCallError(f"{self.name}: the engine failed the request: {sample.error}")
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)

    async def chat(
        self,
        messages: list[dict],
        sampling: Sampling | None = None,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        session: str | None = None,
    ) -> str:
        """:class:`etagent.llm.openai_engine.OpenAIEngine`'s text interface, so a judge takes
        either (``session`` only pins a server in a pool; nothing to pin here)."""
        return await self.complete(messages, stop=stop, seed=seed, sampling=sampling, max_new_tokens=max_new_tokens)

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

from omegaconf import DictConfig

from etagent.llm import GenerationRequest, SharedBatches, make_engine
from etagent.net import ExternalCallError

# what a role's sampling may set: GenerationRequest's own names
ROLE_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def derived_seed(*parts) -> int:
    """A 63-bit seed from any parts (run seed, question id, operation, round)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def build_engine(cfg: DictConfig):
    """An engine for a role; one that decodes a call at a time is shared through :class:`SharedBatches`."""
    engine = make_engine(cfg)
    return SharedBatches(engine) if cfg.kind == "hf" and not cfg.continuous_batching else engine


class TextModel:
    """A role that reads and writes text: chat in, text out, through any engine.

    ``sampling`` holds the role's settings under :class:`etagent.llm.GenerationRequest`'s names
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); another name is an
    error here, not a setting silently left out. Every request is seeded from the caller's
    ``seed`` parts, so a rerun asks the same thing and, on a seeded engine, gets the same answer."""

    def __init__(self, engine, sampling: dict, name: str):
        unknown = sorted(set(sampling) - set(ROLE_SAMPLING))
        if unknown:
            raise ValueError(f"{name}: unknown sampling settings {', '.join(unknown)} (known: {', '.join(ROLE_SAMPLING)})")
        self.engine, self.name = engine, name
        self.tokenizer = engine.tokenizer
        self.sampling = dict(sampling)

    def render(self, messages: list[dict], prefill: str = "") -> str:
        """The prompt text: the chat with the assistant turn opened, and ``prefill`` in it."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return prompt + prefill

    async def complete(
        self, messages: list[dict], *, prefill: str = "", stop: tuple[str, ...] = (), seed: int | None = None, **overrides
    ) -> str:
        """The model's continuation of the rendered chat (special tokens left out)."""
        ids = self.tokenizer.encode(self.render(messages, prefill), add_special_tokens=False)
        request = GenerationRequest(prompt_ids=tuple(ids), stop=tuple(stop), seed=seed, **{**self.sampling, **overrides})
        [[sample]] = await self.engine.agenerate([request])
        if sample.finish_reason == "error":
            raise ExternalCallError(f"{self.name}: the engine failed the request: {sample.error}")
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)

    async def chat(self, messages: list[dict], *, session: str | None = None, **sampling) -> str:
        """The :class:`etagent.scoring.LLMJudge` interface (a judge of any engine; it says
        ``max_tokens``, as OpenAI's API does)."""
        if "max_tokens" in sampling:
            sampling["max_new_tokens"] = sampling.pop("max_tokens")
        return await self.complete(messages, **sampling)

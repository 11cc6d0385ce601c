"""Text models: a model behind an engine that reads and writes text.

Every model of the toolkit that is not the policy is one: the LLM judge (evaluation, the
flywheel), the flywheel's editor, self-reflector and summariser, radar's redundancy judge. Each is
configured the same way, as a role in its stage's config:

    judge:
      engine: {kind: openai, model: ..., openai: {urls: [...]}}   # the engine group (configs/engine)
      sampling: {temperature: 0.0}                                 # etagent.llm.Sampling
      max_new_tokens: 16
      ...                                                          # the role's own settings

and built by :func:`load_text_model`. :meth:`TextModel.chat` is messages in, text out: a served
model (``openai``) applies its own chat template on the server; a model in this process (``hf``,
``vllm``) has the chat rendered with its tokenizer's template, generated through the engine
interface and decoded. :meth:`TextModel.complete` is the token-level form, which can pre-fill the
assistant's turn (the flywheel's editor writes inside a given prefix).

An ``hf`` engine without continuous batching decodes one call after the other, so concurrent
callers share it through :class:`etagent.llm.SharedBatches` (one batch at a time, the requests
that arrive meanwhile making the next one).

What this module does not do: decide what to ask a model or parse its replies (the stages do).
"""

from __future__ import annotations

from collections.abc import Sequence

from etagent.llm import EngineConfig, GenerationRequest, Sampling, SharedBatches, make_engine
from etagent.llm.openai_engine import OpenAIEngine
from etagent.net import ExternalCallError


def shared_engine(cfg: EngineConfig):
    """The engine of an ``engine`` group, shared through :class:`SharedBatches` where it decodes a
    call at a time (``hf`` without continuous batching), so concurrent callers batch together."""
    engine = make_engine(cfg)
    return SharedBatches(engine) if cfg.kind == "hf" and not cfg.continuous_batching else engine


class TextModel:
    """A model behind an engine, sampled with its own :class:`Sampling` and token cap. Every
    request may be seeded, so a rerun asks the same thing and, on a seeded engine, gets the same
    answer."""

    def __init__(self, engine, sampling: Sampling, max_new_tokens: int, name: str):
        self.engine, self.sampling, self.max_new_tokens, self.name = engine, sampling, max_new_tokens, name

    def render(self, messages: list[dict], prefill: str = "") -> str:
        """The prompt text: the chat with the assistant turn opened, and ``prefill`` in it."""
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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
        and ``max_new_tokens`` replace the model's for this call."""
        tokenizer = self.engine.tokenizer
        ids = tokenizer.encode(self.render(messages, prefill), add_special_tokens=False)
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
        return tokenizer.decode(sample.token_ids, skip_special_tokens=True)

    async def chat(
        self,
        messages: list[dict],
        *,
        stop: Sequence[str] = (),
        seed: int | None = None,
        session: str | None = None,
    ) -> str:
        """The model's reply to a chat. A served model applies its own chat template (and
        ``session`` pins the request to one server of its pool); a model in this process renders
        it here (:meth:`complete`)."""
        if isinstance(self.engine, OpenAIEngine):
            return await self.engine.chat(
                messages, self.sampling, max_new_tokens=self.max_new_tokens, stop=stop, seed=seed, session=session
            )
        return await self.complete(messages, stop=stop, seed=seed)


def load_text_model(role, name: str) -> TextModel:
    """The text model of a role's config (a judge's, the flywheel's editor's or reflector's group):
    its ``engine``, ``sampling`` and ``max_new_tokens``."""
    return TextModel(shared_engine(role.engine), role.sampling, role.max_new_tokens, name)

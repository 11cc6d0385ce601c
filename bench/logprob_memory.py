"""Peak memory of the RL update's log-probabilities, the previous way against rl/policy.py's, on
CPU, at Qwen2.5's vocabulary (151,936 rows in the output embedding) and 8k response tokens.

    python bench/logprob_memory.py                      # both ways, side by side (needs ~20 GB)
    python bench/logprob_memory.py --method chunked     # one way, one JSON line (what a test runs)

- ``full`` (the previous rl/batch.py): the model's logits at every position, the response
  positions cast to float32, a full log-softmax, the targets gathered, the entropy of every
  position; then the backward pass.
- ``chunked`` (rl/policy.py): the decoder's last hidden states, then the output embedding and the
  log-softmax ``--chunk`` positions at a time, each chunk recomputed in the backward pass.

The model is one Qwen2 decoder layer of hidden size ``--hidden`` with the full vocabulary and a
tied output embedding, in float32; the batch is one row of 64 prompt and ``--tokens`` response
tokens. Each measurement runs in a process of its own: the peak resident memory during the
forward and backward pass minus the resident memory just before it (large tensors come from
``mmap`` and go back at ``free``, so resident memory follows what is live). Printed, never
asserted (tests/test_rl_batch.py asserts a bound on the chunked peak).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(method: str, vocab: int, tokens: int, hidden: int, chunk: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from etagent.rl.policy import Policy

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=tokens + 128,
    )
    policy = Policy(Qwen2ForCausalLM(config), chunk_tokens=chunk)
    prompt = 64
    ids = torch.randint(0, vocab, (1, prompt + tokens))
    mask, positions = torch.ones_like(ids), torch.arange(prompt + tokens)[None]
    before = resident_bytes()
    if method == "full":
        logits = policy.lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        logits = logits[:, prompt - 1 : -1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        logprobs = log_probs.gather(-1, ids[:, prompt:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    else:
        scored = torch.arange(prompt - 1, prompt + tokens - 1)[None]  # the positions predicting the response
        logprobs, entropy = policy(ids, mask, positions, scored, with_entropy=True)
    logprobs.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "method": method,
        "vocab": vocab,
        "tokens": tokens,
        "hidden": hidden,
        "chunk": chunk,
        "peak_bytes": peak,
        "entropy": float(entropy.mean()),
    }


def resident_bytes() -> int:
    """Resident memory now; the kernel's peak counter is reset first, so that ru_maxrss measures
    from here on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (ru_maxrss) to the current one
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["full", "chunked"], help="measure one way in this process and print JSON")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    if args.method:
        print(json.dumps(measure(args.method, args.vocab, args.tokens, args.hidden, args.chunk)))
        return
    print(f"log-probabilities and entropy, forward + backward: vocabulary {args.vocab}, {args.tokens} response tokens, float32, CPU")
    print(
        f"{'method':<24} {'peak GiB':>9}   {'(tokens x vocabulary x 4 bytes = ' + format(args.tokens * args.vocab * 4 / 2**30, '.2f') + ' GiB)'}"
    )
    for method in ("full", "chunked"):
        command = [sys.executable, __file__, "--method", method, f"--vocab={args.vocab}", f"--tokens={args.tokens}"]
        command += [f"--hidden={args.hidden}", f"--chunk={args.chunk}"]
        found = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        label = method if method == "full" else f"chunked ({args.chunk} positions)"
        print(f"{label:<24} {found['peak_bytes'] / 2**30:>9.2f}")


if __name__ == "__main__":
    main()

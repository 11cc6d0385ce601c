"""The items of bench/gpu_acceptance.sh, one per call; each ends with one line
``RESULT <item> PASS|FAIL|NOT RUN <what was seen>``. Run through the script, not by hand.

    python bench/gpu_acceptance.py ITEM --work DIR [--smoke]

Items (DIR holds the toy world in DIR/toy, built by the script):

- ``sft``: the SFT paper preset (bf16, gradient checkpointing; ZeRO-3 and flash-attention where
  installed, said in the result) on a random-init model of Qwen2.5-0.5B's shape over the toy
  tokenizer, 40 optimizer steps on the toy seed data at lr 1e-4 (the paper's 5e-6 is for a
  pretrained model): the loss falls and the model reloads.
- ``rl``: the RL paper preset with the hf engine under FSDP2 (bf16, gradient checkpointing), 2
  steps from the SFT item's model on toy Python questions, then a rerun that resumes from the
  sharded checkpoint for a third: finite losses, the checkpoint written and resumed, the bf16
  model exported and loadable.
- ``rl-vllm``: the same with the colocated vLLM engine (sleep, wake, the streamed weight sync):
  the engine's log-probabilities stay the trainer's after each sync. NOT RUN without vLLM.
- ``memory``: a 7B-wide slice (Qwen2.5-7B's widths and vocabulary, 2 decoder layers) sharded by
  rl/policy.py: the peak GPU memory of one update on ``train.micro_batch_tokens`` tokens
  against bench/memory_plan.py's figure for the same slice, the peak of the log-probabilities
  alone on 8192 tokens, and the update's tokens/s and MFU.

``--smoke`` runs sft and rl at toy sizes on whatever device there is and reports SMOKE instead
of PASS: it checks the script, not the GPU path.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM


def result(item: str, ok: bool | None, detail: str, smoke: bool = False) -> None:
    verdict = "NOT RUN" if ok is None else ("FAIL" if not ok else ("SMOKE" if smoke else "PASS"))
    print(f"RESULT {item} {verdict} {detail}", flush=True)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(command: list[str], log: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc


def torchrun(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", module, *args]


def sft(work: Path, smoke: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent.toy.model import build_model

    tokenizer = AutoTokenizer.from_pretrained(work / "toy" / "model")
    shape = dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864)  # Qwen2.5-0.5B
    if smoke:
        shape = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate_size=256)
    start = work / "start"
    build_model(tokenizer, **shape, max_positions=4096, seed=0).save_pretrained(start)
    tokenizer.save_pretrained(start)
    zero3, flash = installed("deepspeed"), installed("flash_attn")
    out = work / "sft"
    overrides = [
        f"model={start}",
        f"data.path={work / 'toy' / 'sft.jsonl'}",
        f"out_dir={out}",
        "cutoff_len=1024",
        "train.max_steps=40",
        # the paper's 5e-6 fine-tunes a pretrained 7B; from a random init 40 steps need more to show a fall
        "train.learning_rate=1e-4",
        "train.logging_steps=5",
        "train.save_steps=20",
        "train.progress_bar=false",
    ]
    if not zero3:
        overrides.append("train.deepspeed=null")
    if not flash:
        overrides.append("attn_implementation=sdpa")
    if smoke and not torch.cuda.is_available():
        overrides += ["train.bf16=false", "model_dtype=float32"]
    proc = run(torchrun("etagent.sft.run", "--preset", "paper", *overrides), work / "sft.log", 1200)
    setting = f"ZeRO-3 {'on' if zero3 else 'NOT RUN (deepspeed not installed)'}, flash-attention {'on' if flash else 'off (sdpa)'}"
    if proc.returncode != 0:
        return result("sft", False, f"exit {proc.returncode}, see {work / 'sft.log'} ({setting})", smoke)
    losses = [entry["loss"] for entry in json.loads((out / "loss_history.json").read_text()) if "loss" in entry]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("What is 12 times 7?")["input_ids"]])).logits
    ok = len(losses) >= 2 and losses[-1] < losses[0] and bool(torch.isfinite(logits).all())
    result("sft", ok, f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over 40 steps at lr 1e-4, reloaded ({setting})", smoke)


def rl(work: Path, smoke: bool, engine: str) -> None:
    item = "rl" if engine == "hf" else "rl-vllm"
    if engine == "vllm" and not installed("vllm"):
        return result(item, None, "vLLM is not installed on this machine")
    if not (work / "sft" / "model").exists():
        return result(item, None, "no model: the sft item failed")
    overrides = ["--preset", "paper", f"engine.kind={engine}"]
    if engine == "vllm":
        overrides += ["engine.vllm.max_model_len=2560", "engine.vllm.gpu_memory_utilization=0.3"]
    rl_run(item, work, work / "sft" / "model", work / f"rl-{engine}", overrides, smoke)


def rl_partial(work: Path, smoke: bool) -> None:
    """The RL paper preset with partial rollouts (hf engine) on a random-init model of
    Qwen2.5-0.5B's shape: 2 steps, then a resume that carries the groups in flight."""
    model = random_model(work / "start-0.5b", work, QWEN_05B if not smoke else TINY)
    overrides = ["--preset", "paper", "engine.kind=hf", "rollout.partial=true", "rollout.partial_extra=2", "algorithm.tis_cap=2"]
    rl_run(
        "rl-partial",
        work,
        model,
        work / "rl-partial",
        overrides,
        smoke,
        extra_metrics=("partial/carried_share", "partial/stale_token_share"),
    )


def rl_lora(work: Path, smoke: bool) -> None:
    """configs/rl/paper_1gpu.yaml (LoRA) with the hf engine (vLLM cannot be carried to the machine)
    on a random-init model of Qwen2.5-7B's widths and depth over the toy vocabulary: 2 steps,
    then a resume for a third, the adapters exported; each step's peak GPU memory."""
    model = random_model(work / "start-7b", work, QWEN_7B if not smoke else TINY)
    overrides = ["--preset", "paper_1gpu", "engine.kind=hf", "lora.export=adapter"]
    rl_run("rl-lora", work, model, work / "rl-lora", overrides, smoke, extra_metrics=("memory/peak_allocated_gib",))


QWEN_05B = dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864)
QWEN_7B = dict(hidden_size=3584, layers=28, heads=28, kv_heads=4, intermediate_size=18944)
TINY = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate_size=256)


def random_model(folder: Path, work: Path, shape: dict) -> Path:
    """A random-init Qwen2 of ``shape`` over the toy tokenizer, saved in bf16 (built on the GPU
    where there is one: a 7B model initialises there in seconds)."""
    import torch
    from transformers import AutoTokenizer

    from etagent.toy.model import build_model

    if not (folder / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(work / "toy" / "model")
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = build_model(tokenizer, **shape, max_positions=8192, seed=0)
        model.to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
    return folder


def rl_run(item: str, work: Path, model: Path, out: Path, preset_overrides: list[str], smoke: bool, extra_metrics=()) -> None:
    """2 RL steps on toy Python questions, then a rerun that resumes for a third: finite losses,
    the checkpoint written and resumed, the model exported."""
    import torch

    from etagent.question_formats import read_questions
    from etagent.records import RLRow, write_rl_parquet

    questions = [q for q in read_questions(work / "toy" / "questions" / "test.jsonl") if q.source == "toy_python"][:8]
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], work / "rl.parquet")
    overrides = [
        *preset_overrides,
        f"model={model}",
        f"data.train={parquet}",
        f"out_dir={out}",
        "data.prompts_per_step=4",
        "rollout.n=4",
        "rollout.initial_rollouts=2",
        "train.mini_batch_prompts=2",
        "train.save_every=1",
        "agent.max_response_tokens=512",
        "agent.max_segment_tokens=256",
        "tools.python.limits.timeout_s=10",
        # no retriever service runs here: a search the policy tries fails, which the item accepts
        # (it checks training, not the tools); the run's guard would otherwise stop at 5% failures
        "tools.max_failure_share=1.0",
        "wandb.enabled=false",
    ]
    flash = installed("flash_attn")
    if not flash:
        overrides.append("train.attn_implementation=sdpa")  # the preset's flash-attention packs micro-batches
    if not torch.cuda.is_available():
        overrides += ["train.device=cpu", "engine.dtype=float32", "train.compute_dtype=float32"]  # engine.device follows train.device
    started = time.perf_counter()
    for steps in (2, 3):
        proc = run(torchrun("etagent.rl.run", *overrides, f"train.max_steps={steps}"), work / f"{item}-{steps}.log", 1200)
        if proc.returncode != 0:
            return result(item, False, f"exit {proc.returncode} at max_steps={steps}, see {work / f'{item}-{steps}.log'}", smoke)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = "resuming after step 2" in (work / f"{item}-3.log").read_text()
    finite = all(math.isfinite(m["actor/loss"]) and math.isfinite(m["actor/grad_norm"]) for m in history)
    exported = sorted(p.name for p in (out / "model").iterdir()) if (out / "model").is_dir() else []
    ok = [m["step"] for m in history] == [1, 2, 3] and finite and resumed and (out / "checkpoints" / "step_3").exists() and exported
    detail = (
        f"losses {[round(m['actor/loss'], 4) for m in history]}, grad norms {[round(m['actor/grad_norm'], 4) for m in history]} "
        f"(0 when a group's rollouts all score alike), resumed {resumed}, model/ holds {exported}, "
        f"micro-batches {'packed (flash-attention)' if flash else 'padded (sdpa; flash-attn not installed)'}, "
        f"{time.perf_counter() - started:.0f} s for both runs"
    )
    for key in extra_metrics:
        detail += f", {key} {[round(m[key], 3) if key in m else None for m in history]}"
    if item == "rl-vllm":
        mismatch = [m["rollout/logprob_mismatch"] for m in history]
        ok = ok and max(mismatch) < 0.05  # bf16 kernels on both sides: rounding, not stale weights
        detail += f", engine/trainer log-prob mismatch {[round(x, 4) for x in mismatch]}"
    result(item, bool(ok), detail, smoke)


def hf_engine(work: Path) -> None:
    """bench/bench_hf_engine.py on Qwen2.5-0.5B's shape in bf16: the hf engine's continuous
    batching against transformers' generate, tokens/s."""
    import torch

    if not torch.cuda.is_available():
        return result("hf-engine", None, "no CUDA GPU")
    shape = ["--hidden", "896", "--layers", "24", "--heads", "14", "--kv-heads", "2", "--dtype", "bfloat16", "--device", "cuda"]
    proc = run([sys.executable, str(ROOT / "bench" / "bench_hf_engine.py"), *shape], work / "hf-engine.log", 900)
    lines = [line for line in (work / "hf-engine.log").read_text().splitlines() if "tokens/s" in line][-6:]
    result("hf-engine", proc.returncode == 0, " | ".join(line.strip() for line in lines) or f"exit {proc.returncode}")


def memory(work: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        return result("memory", None, "no CUDA GPU")
    sys.path.insert(0, str(ROOT / "bench"))
    from memory_plan import build_model, update_parts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent.config import load_settings
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy, response_logprobs

    cfg = load_settings("rl", "paper")
    tokens, chunk = int(cfg.train.micro_batch_tokens), int(cfg.train.logprob_chunk_tokens)
    layers = 2
    planned = build_model(layers)  # the slice on the meta device, as bench/memory_plan.py sees it
    config = planned.config
    folder = work / "slice7b"
    if not (folder / "config.json").exists():
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        AutoTokenizer.from_pretrained(work / "toy" / "model").save_pretrained(folder)
        torch.cuda.empty_cache()
    device = torch.device("cuda", 0)
    init_distributed(device)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    mask, positions = torch.ones_like(ids), torch.arange(tokens, device=device)[None]
    scored = torch.arange(63, tokens - 1, device=device)[None]  # a 64-token prompt, the rest response
    # the same update with LoRA first (configs/rl/paper_1gpu.yaml's adapters; the frozen base in bf16)
    memory_lora(folder, planned, tokens, chunk, ids, mask, positions, scored)
    gc.collect()  # the LoRA policy's FSDP2 hooks hold it in reference cycles: its memory back first
    torch.cuda.empty_cache()
    policy, _ = load_policy(folder, device, compute_dtype=torch.bfloat16, chunk_tokens=chunk, gradient_checkpointing=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    params = sum(p.numel() for p in policy.parameters())

    def step():
        logprobs, _ = policy(ids, mask, positions, scored, with_entropy=True)
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    policy.train()
    step()  # AdamW's moments exist from here on, as in a running trainer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    peak = torch.cuda.max_memory_allocated()
    # bench/memory_plan.py's update phase for this slice on one rank (no vLLM, no CUDA context)
    plan = sum(update_parts(planned, 1, tokens, chunk, checkpointing=True).values())
    # model FLOPs per token (PaLM's 6N + 12LHT; the recomputation of gradient checkpointing is not
    # counted, as MFU does not count it); N excludes the input embedding, a lookup
    flops_per_token = 6 * (params - config.vocab_size * config.hidden_size) + 12 * layers * config.hidden_size * tokens
    rate = tokens / seconds
    mfu = rate * flops_per_token / H100_BF16_FLOPS
    result(
        "memory-update",
        peak <= plan * 1.1,
        f"7B-wide slice of {layers} layers ({params / 1e9:.2f}B parameters), {tokens} tokens: peak {peak / 2**30:.2f} GiB, "
        f"plan {plan / 2**30:.2f} GiB",
    )
    result("throughput", math.isfinite(mfu), f"{rate:.0f} tokens/s, MFU {100 * mfu:.1f}% (6N + 12LHT per token, H100 bf16 989 TFLOP/s)")

    # the log-probabilities alone: hidden states in, their gradient and the weight's out
    optimizer.state.clear()  # the moments go: this measures the log-probabilities alone
    policy.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    hidden = torch.randn(1, 8192, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, config.vocab_size, (1, 8192), device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logprobs, _ = response_logprobs(hidden, weight, targets, chunk, with_entropy=True)
    logprobs.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full = 8192 * config.vocab_size * (2 + 4 + 4)  # bf16 logits, float32 copy, float32 log-softmax
    # autograd adds each chunk's gradient of the output embedding into the one it holds: two of
    # them (bf16) at once; beside them a few copies of one chunk's float32 logits (the log-softmax
    # and its gradient). The first run on an H200 measured 3.11 GiB here; this bound (3.19 GiB at
    # Qwen2.5-7B's widths, chunks of 512) replaced a guess of 2 GiB that left the gradients out.
    weight_gradient = config.vocab_size * config.hidden_size * 2
    bound = 2 * weight_gradient + 4 * chunk * config.vocab_size * 4
    result(
        "memory-logprobs",
        extra <= bound,
        f"8192 tokens x {config.vocab_size}: peak extra {extra / 2**30:.2f} GiB, bound {bound / 2**30:.2f} GiB "
        f"(2 x the output embedding's gradient + 4 chunks of float32 logits; full logits: >= {full / 2**30:.1f} GiB)",
    )


def memory_lora(folder: Path, planned, tokens: int, chunk: int, ids, mask, positions, scored) -> None:
    """One LoRA update on the 7B-wide slice (rl/adapters.py through rl/policy.py, as the trainer
    loads it): its peak against bench/memory_plan.py's LoRA update for the slice, and its
    gradients finite and not all zero."""
    import torch
    from memory_plan import lora_update_parts

    from etagent.config import load_settings
    from etagent.rl.policy import load_policy

    lora = load_settings("rl", "paper_1gpu").lora
    device = ids.device
    policy, _ = load_policy(folder, device, compute_dtype=torch.bfloat16, chunk_tokens=chunk, gradient_checkpointing=True, lora=lora)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5)

    def step() -> float:
        logprobs, _ = policy(ids, mask, positions, scored, with_entropy=True)
        (-logprobs.mean()).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(trained, 1e9))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    policy.train()
    norms = [step()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    norms += [step(), step()]
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / 2
    peak = torch.cuda.max_memory_allocated()
    plan = sum(lora_update_parts(planned, lora, tokens, chunk).values())
    ok = peak <= plan * 1.1 and all(math.isfinite(n) and n > 0 for n in norms)
    result(
        "memory-lora",
        ok,
        f"LoRA rank {lora.rank} on the slice ({sum(p.numel() for p in trained) / 1e6:.1f}M adapter parameters), {tokens} tokens: "
        f"peak {peak / 2**30:.2f} GiB, plan {plan / 2**30:.2f} GiB, gradient norms {[round(n, 3) for n in norms]}, "
        f"{tokens / seconds:.0f} tokens/s",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("item", choices=["sft", "rl", "rl-vllm", "rl-partial", "rl-lora", "hf-engine", "memory"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    try:
        if args.item == "sft":
            sft(args.work, args.smoke)
        elif args.item in ("rl", "rl-vllm"):
            rl(args.work, args.smoke, "hf" if args.item == "rl" else "vllm")
        elif args.item == "rl-partial":
            rl_partial(args.work, args.smoke)
        elif args.item == "rl-lora":
            rl_lora(args.work, args.smoke)
        elif args.item == "hf-engine":
            hf_engine(args.work)
        else:
            memory(args.work)
    except Exception as error:  # an item that crashes is a FAIL with its reason, and the next item runs
        result(args.item, False, f"{type(error).__name__}: {error}", args.smoke)


if __name__ == "__main__":
    main()

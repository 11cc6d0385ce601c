"""The RL update on prefix trees (``train.share_prefixes``, rl/batch.py) against flat padded rows,
on the demo's tree settings, in one run.

    python bench/bench_tree_update.py [--run runs/demo] [--steps 4] [--threads 2] [RL overrides]
    python bench/bench_tree_update.py --toy runs/toy --model MODEL [...]

Reads a finished demo run (``make demo``): its first curriculum stage's RL data
(``rl_data/stage1/rl.parquet``), the policy that stage started from (``sft-flywheel/model``) and
the RL world's retriever index (``rl_index``), which it serves on a free port. With ``--toy``,
the RL data is the toy world's RL pool (``questions/rl.jsonl``) and the index is built over its
RL world's corpus, for ``--model``. Runs the RL stage's
tiny preset (ARPO's tree rollout, 8 rollouts per prompt, the real tools) for ``--steps`` steps
twice from that policy, seed 0: with ``train.share_prefixes=true`` and ``false``. Both runs
sample the same trees at step 1 (the same weights and seeds), so their step-1 losses and
gradient norms agree to rounding; later steps part as rounding moves the weights.

Printed per side, over the steps after the first (a warm-up): the positions the update's forward
passes computed (``actor/computed_tokens``: padding included for flat rows, each shared token
once for trees) against the rows' own tokens, the update's time (``timing_s/update``), the old
log-probabilities' (none with the hf engine), the step's time and its generation's. Printed,
never asserted: tests/test_benches.py runs it on tiny arguments so that it cannot rot.

The last row is the step's compute floor (``--side floor``, a process of its own at the same
thread count): what any trainer of these trees must compute, bare. It reads the trees the
prefix-tree side sampled (its ``rollouts/step_k.jsonl``, each row's prompt and segments encoded
again with the policy's tokenizer) and, per step, computes each tree's tokens once: a forward
pass per wave, where a wave advances every branch by one sampled token or one whole tool result
(the prompts are the first wave), each token attending to its ancestors through the key-value
cache of the waves before; then, per mini-batch of the run's size, one forward and backward pass
over its trees' tokens (the ancestor mask), the mean log-probability of the sampled tokens as
the loss, and an AdamW step. No sampling, stops, tools, rewards or bookkeeping: the step's time
against it says what the machinery around the model costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def serve(index: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "etagent.retriever.server", f"index_dir={index}", f"serve.port={port}"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(480):
        try:
            if httpx.get(f"{url}/health", timeout=1).json()["status"] == "ok":
                return process, url
        except (httpx.HTTPError, ValueError):
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the retriever did not start; see {log}")


def from_toy(toy: Path, work: Path) -> tuple[Path, Path]:
    """The toy world's RL pool as RL data, and an index over its RL world's corpus."""
    from etagent.question_formats import read_questions
    from etagent.records import RLRow, write_rl_parquet

    questions = read_questions(toy / "questions" / "rl.jsonl")
    data = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], work / "rl.parquet")
    index = work / "rl_index"
    subprocess.run(
        [sys.executable, "-m", "etagent.retriever.build", f"corpus={toy / 'rl_world' / 'corpus.jsonl'}", f"index_dir={index}"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return data, index


def run_side(args, work: Path, url: str, share: bool) -> list[dict]:
    out = work / f"share-{share}"
    overrides = [
        f"model={args.model}",
        f"data.train={args.data}",
        f"out_dir={out}",
        f"train.max_steps={args.steps}",
        "train.save_every=1000000",
        f"train.share_prefixes={str(share).lower()}",
        f"tools.search.local.url={url}",
        "train.seed=0",
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "etagent.rl.run", *overrides], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


PROMPT, SAMPLED, TOOL = 0, 1, 2  # where a token of a row comes from


def encoded_trees(rollouts: Path, data: Path, tokenizer) -> list[tuple[list[list[int]], list[list[int]]]]:
    """The trees of one step's rollouts file: per prompt, each row's token ids (its prompt, then its
    segments encoded again) and where each token comes from (PROMPT, SAMPLED, TOOL)."""
    from etagent import protocol
    from etagent.rl.rollout import read_prompt_set

    questions = {prompt.index: prompt.question.question for prompt in read_prompt_set(data)[0]}
    trees: dict[int, tuple[list, list]] = {}
    for line in rollouts.read_text().splitlines():
        row = json.loads(line)
        ids = protocol.encode_prompt(tokenizer, questions[row["index"]])
        origins = [PROMPT] * len(ids)
        for origin, text in row["segments"]:
            segment = tokenizer.encode(text, add_special_tokens=False)
            ids, origins = ids + segment, origins + [TOOL if origin == "tool" else SAMPLED] * len(segment)
        sequences, kinds = trees.setdefault(row["index"], ([], []))
        sequences.append(ids)
        kinds.append(origins)
    return list(trees.values())


def forest(trees) -> tuple[list[int], list[int], list[int], list[int]]:
    """Trees side by side as one forest of prefix tries (etagent.rl.batch.prefix_tree): each
    node's token, parent (-1 at a root), depth and origin."""
    from etagent.rl.batch import prefix_tree

    tokens, parents, depths, origins = [], [], [], []
    for sequences, kinds in trees:
        tree, offset = prefix_tree(sequences), len(tokens)
        origin = [PROMPT] * len(tree.tokens)
        for row, nodes in enumerate(tree.nodes):
            for position, node in enumerate(nodes):
                origin[node] = kinds[row][position]  # a shared node has one origin: the same text before it
        tokens += tree.tokens
        parents += [parent + offset if parent >= 0 else -1 for parent in tree.parents]
        depths += tree.depths
        origins += origin
    return tokens, parents, depths, origins


def run_floor(args) -> dict:
    """The step's compute floor (see the module's docstring), per step after the first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent.rl.batch import ancestor_mask

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32", attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rollouts = Path(args.floor)
    mini = json.loads((rollouts.parent / "manifest.json").read_text())["config"]["train"]["mini_batch_prompts"]

    def decode(trees) -> None:
        tokens, parents, depths, origins = forest(trees)
        # a node's wave: the prompts are wave 0; a sampled token one after its parent; a tool
        # result's tokens all in the wave after the token before the result (prefilled at once)
        wave = []
        for k, parent in enumerate(parents):
            if origins[k] == PROMPT:
                wave.append(0)
            else:
                wave.append(wave[parent] + (0 if origins[k] == TOOL and origins[parent] == TOOL else 1))
        order = sorted(range(len(tokens)), key=lambda k: (wave[k], k))  # parents before children within a wave
        place = {k: i for i, k in enumerate(order)}
        mask = ancestor_mask([place[parents[k]] if parents[k] >= 0 else -1 for k in order])
        ids = torch.tensor([tokens[k] for k in order])[None]
        positions = torch.tensor([depths[k] for k in order])[None]
        cache, done = None, 0
        with torch.inference_mode():
            for w in range(max(wave) + 1):
                end = done + sum(1 for k in order[done:] if wave[k] == w)
                out = model(
                    input_ids=ids[:, done:end],
                    position_ids=positions[:, done:end],
                    attention_mask=mask[None, None, done:end, :end],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=0,
                )
                cache, done = out.past_key_values, end

    def update(trees) -> None:
        tokens, parents, depths, origins = forest(trees)
        ids, positions = torch.tensor(tokens)[None], torch.tensor(depths)[None]
        logits = model(input_ids=ids, position_ids=positions, attention_mask=ancestor_mask(parents)[None, None], use_cache=False).logits[0]
        scored = [k for k in range(len(tokens)) if origins[k] == SAMPLED]
        logprobs = torch.log_softmax(logits[[parents[k] for k in scored]].float(), dim=-1)
        loss = -logprobs.gather(-1, torch.tensor([tokens[k] for k in scored])[:, None]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, computed, path_tokens = [], [], []
    for step in range(1, args.steps + 1):
        trees = encoded_trees(rollouts / f"step_{step}.jsonl", args.data, tokenizer)
        started = time.perf_counter()
        model.eval()
        decode(trees)
        decoded = time.perf_counter()
        model.train()
        for start in range(0, len(trees), mini):
            update(trees[start : start + mini])
        times.append((decoded - started, time.perf_counter() - decoded))
        computed.append(len(forest(trees)[0]))
        path_tokens.append(sum(len(sequence) for sequences, _ in trees for sequence in sequences))
    timed = times[1:]
    return {
        "computed_tokens": statistics.mean(computed[1:]),
        "path_tokens": statistics.mean(path_tokens[1:]),
        "decode_s": statistics.mean(a for a, _ in timed),
        "update_s": statistics.mean(b for _, b in timed),
        "step_s": statistics.median(a + b for a, b in timed),
    }


def run_floor_side(args, rollouts: Path) -> dict:
    """The floor in a process of its own, at the sides' thread count."""
    argv = [sys.executable, __file__, "--floor", str(rollouts), "--model", str(args.model), "--data", str(args.data)]
    argv += ["--steps", str(args.steps), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo", help="a finished demo run")
    parser.add_argument("--toy", type=Path, help="a toy world instead: its RL pool and RL world (with --model)")
    parser.add_argument("--model", type=Path, help="the policy (default: RUN/sft-flywheel/model)")
    parser.add_argument("--data", type=Path, help="the RL data (default: RUN/rl_data/stage1/rl.parquet)")
    parser.add_argument("--index", type=Path, help="the retriever index (default: RUN/rl_index)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per side (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--floor", type=Path, help=argparse.SUPPRESS)  # the floor's side: the prefix-tree side's rollouts
    parser.add_argument("overrides", nargs="*", help="more RL settings for both sides (e.g. data.prompts_per_step=4)")
    args = parser.parse_args()
    if args.floor is not None:
        print("RESULT " + json.dumps(run_floor(args)))
        return
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first is a warm-up)")
    if args.toy is not None and args.model is None:
        raise SystemExit("--toy needs --model")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        index = None
        if args.toy is not None:
            args.data, index = from_toy(args.toy.resolve(), work)
        args.model = (args.model or args.run / "sft-flywheel" / "model").resolve()
        args.data = (args.data or args.run / "rl_data" / "stage1" / "rl.parquet").resolve()
        if args.toy is None:
            index = args.index or args.run / "rl_index"
        index = Path(index).resolve()
        for path in (args.model, args.data, index):
            if not path.exists():
                raise SystemExit(f"{path} does not exist: run `make demo` first, or give --model, --data and --index")
        server, url = serve(index, work / "retriever.log")
        try:
            sides = {share: run_side(args, work, url, share) for share in (True, False)}
        finally:
            server.terminate()
            server.wait(timeout=30)
        floor = run_floor_side(args, work / "share-True" / "rollouts")

    print(f"RL update on prefix trees: {args.model}, {args.data.name}, tiny preset, {args.steps} steps, {args.threads} threads")
    print(f"{'':22s} {'computed tokens':>16s} {'over path tokens':>17s} {'update s':>9s} {'step s':>8s} {'generate s':>11s}")
    for share, history in sides.items():
        timed = history[1:]
        name = "prefix trees" if share else "flat (padded rows)"
        print(
            f"{name:22s} {statistics.mean(m['actor/computed_tokens'] for m in timed):16.0f} "
            f"{statistics.mean(m['actor/computed_over_path_tokens'] for m in timed):17.3f} "
            f"{statistics.median(m['timing_s/update'] for m in timed):9.2f} {statistics.median(m['timing_s/step'] for m in timed):8.2f} "
            f"{statistics.median(m['timing_s/generate'] for m in timed):11.2f}"
        )
    print(
        f"{'compute floor':22s} {floor['computed_tokens']:16.0f} {floor['computed_tokens'] / floor['path_tokens']:17.3f} "
        f"{floor['update_s']:9.2f} {floor['step_s']:8.2f} {floor['decode_s']:11.2f}"
    )
    trees, flat = sides[True][0], sides[False][0]
    print(
        f"step 1 (the same trees on both sides): loss {trees['actor/loss']:.6f} and {flat['actor/loss']:.6f}, "
        f"gradient norm {trees['actor/grad_norm']:.6f} and {flat['actor/grad_norm']:.6f}"
    )


if __name__ == "__main__":
    main()

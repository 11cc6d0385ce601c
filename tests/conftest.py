"""Shared fixtures, each made once per test session: the default toy build, a retriever index
over its corpus, and the retriever service running on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from etagent.config import load_config
from etagent.launcher.main import register_stage_schemas
from etagent.toy.build import run
from tests.servers import free_port, wait_until_healthy

# every stage's config schema, so that a test may load any stage's config (etagent/config.py)
register_stage_schemas()


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The default toy world and tiny model (the one the demo and the later stages use)."""
    out = tmp_path_factory.mktemp("toy")
    run(load_config("toy", "tiny", [f"out_dir={out}"]))
    return out


TOKEN = "test-token-123"


def build_index(corpus: Path, index_dir: Path, *overrides: str, check=True) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "etagent.retriever.build", f"corpus={corpus}", f"index_dir={index_dir}", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=check)


@pytest.fixture(scope="session")
def index_dir(toy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("index")
    build_index(toy / "corpus.jsonl", out)
    return out


@pytest.fixture(scope="session")
def server(index_dir):
    """The retriever serving the toy world's corpus (the test questions' world)."""
    yield from serve_index(index_dir)


@pytest.fixture(scope="session")
def rl_server(toy, tmp_path_factory):
    """The retriever serving the RL pool's world (toy/rl_world/corpus.jsonl, questions/rl.jsonl)."""
    out = tmp_path_factory.mktemp("rl_index")
    build_index(toy / "rl_world" / "corpus.jsonl", out)
    yield from serve_index(out)


def serve_index(index_dir: Path):
    """Start etagent.retriever.server on a free port (token TOKEN), yield its URL until the session ends."""
    port = free_port()
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "etagent.retriever.server",
            f"index_dir={index_dir}",
            f"serve.port={port}",
            "serve.token_env=RETRIEVER_TOKEN",
            "serve.max_body_bytes=200000",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, proc, lambda: proc.stderr.read().decode())
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


# The shared policy's recipe: the tiny preset cut to 4800 of its 7200 steps (cosine decay over the
# shorter run; README, "The toy policy", run 6: about half the held-out questions right). It
# writes the protocol, calls tools and is right on some questions and wrong on others, which is
# what the tests downstream of SFT need (rollouts with tool calls, groups whose rewards differ,
# questions Pareto finds eligible). Measured on 2 cores: 1200 or 2400 steps give a policy that
# calls tools but is right on almost nothing (0% and 5% of 96 chains), so RL's advantages are 0
# and no question is eligible. Whether the full recipe answers held-out questions is its
# acceptance test (sft_model_full, marked slow) and the demo's table.
SHARED_POLICY_RECIPE = ("train.max_steps=4800",)


@pytest.fixture(scope="session")
def sft_model(toy, tmp_path_factory) -> Path:
    """The toy model after a short run of the tiny SFT preset (SHARED_POLICY_RECIPE): a policy that
    writes the protocol and calls tools, for the tests of everything downstream of SFT."""
    out = tmp_path_factory.mktemp("sft")
    subprocess.run(sft_command(toy, out, "threads=2", *SHARED_POLICY_RECIPE), check=True, capture_output=True, timeout=1800)
    return out


@pytest.fixture(scope="session")
def sft_model_full(toy, tmp_path_factory) -> Path:
    """The toy model after the tiny SFT preset as the demo runs it (7200 steps, 6-9 minutes on
    2 cores): for the slow run's tests (the held-out acceptance, the curriculum, GRPO's rise),
    which use it alone, so the slow run trains one policy as the default run does."""
    out = tmp_path_factory.mktemp("sft-full")
    subprocess.run(sft_command(toy, out, "threads=2"), check=True, capture_output=True, timeout=1800)
    return out


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

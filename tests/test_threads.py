"""The CPU trainers' and the hf engine's torch threads follow the cores other processes leave free
(etagent/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from etagent import protocol
from etagent.llm import GenerationRequest
from etagent.llm.hf import HFEngine
from etagent.threads import FreeCoreThreads, allowed_cores, machine_busy_s


@pytest.mark.skipif(machine_busy_s() is None, reason="needs Linux's /proc/stat")
def test_a_busy_neighbour_takes_its_core_from_torchs_threads(monkeypatch):
    """Beside a process that keeps one core busy, the threads drop below the machine's cores
    (to 1 on 2 cores); OMP_NUM_THREADS caps them (the tests' 1). (That they come back up on a
    quiet machine is measured, not tested: the test's own machine is rarely quiet; docs/engines.md.)"""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        threads = FreeCoreThreads(interval_s=0.5)
        cores = threads.cores
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.6)
            assert threads.adjust() < cores or cores == 1
        finally:
            busy.kill()
            busy.wait()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        capped = FreeCoreThreads(interval_s=0.0)
        time.sleep(0.1)
        assert capped.cores == 1 and capped.adjust() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(machine_busy_s() is None or (os.cpu_count() or 1) < 2, reason="needs Linux's /proc/stat and 2 cores")
def test_the_hf_engines_decoding_thread_leaves_a_busy_neighbour_its_core(toy, monkeypatch):
    """The hf engine's forward passes run in its decoding thread, whose torch threads are that
    thread's own: it sets them there, from the free cores, so that beside a process that keeps a
    core busy it decodes on fewer threads than the machine has (evaluation beside two busy
    processes on 2 cores: 108 s at 2 threads, 42 s so; docs/engines.md)."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        engine = HFEngine(str(toy / "model"), max_batch_size=4)
        engine._free_cores = FreeCoreThreads(interval_s=0.2)  # looks every 0.2 s, not 5
        assert engine._free_cores.cores == len(os.sched_getaffinity(0))
        seen = []
        engine.model.register_forward_pre_hook(lambda module, args: seen.append((threading.current_thread().name, torch.get_num_threads())))
        prompt = protocol.encode_prompt(engine.tokenizer, "In which year was Zorvak Telmin born?")
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.4)
            engine.generate([GenerationRequest(tuple(prompt), n=4, max_new_tokens=48, seed=0)])
        finally:
            busy.kill()
            busy.wait()
        decoding = [threads for name, threads in seen if name == "hf-engine-decoding"]
        assert decoding and max(decoding) < os.cpu_count()
    finally:
        torch.set_num_threads(before)


DECODE_AND_PRINT = """
import json, sys
from etagent import protocol
from etagent.llm import GenerationRequest, Sampling
from etagent.llm.hf import HFEngine
engine = HFEngine(sys.argv[1], max_batch_size=8)
prompt = protocol.encode_prompt(engine.tokenizer, "In which year was Zorvak Telmin born?")
request = GenerationRequest(tuple(prompt), n=8, sampling=Sampling.at(1.0), max_new_tokens=48, seed=0)
print(json.dumps([[s.token_ids, s.logprobs] for s in engine.generate([request])[0]]))
"""


def test_the_hf_engine_decodes_the_same_numbers_at_one_and_two_threads(toy):
    """A busy neighbour leaves a run fewer threads (above), so what it samples must not depend on
    how many: the hf engine's tokens and log-probabilities are bitwise the same at 1 and 2 torch
    threads. (torch's CPU flash attention sums a decoding step's few-token queries through MKL,
    whose small products summed in another order at 2 threads than at 1, up to 3e-6 apart, until
    the etagent package set MKL's strict reproducibility, MKL_CBWR, before torch loads MKL.) Each
    count runs in its own process, with MKL_CBWR unset, as a user's shell leaves it."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    samples = []
    for threads in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", DECODE_AND_PRINT, str(toy / "model")],
            env=env | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        samples.append(run.stdout.strip().splitlines()[-1])
    assert samples[0] == samples[1]


ATTENTION_AT_ONE_AND_TWO_THREADS = """
import etagent  # first: it sets MKL's reproducibility before torch loads MKL
import torch
import torch.nn.functional as F
torch.manual_seed(0)
differ = []
for rows in (1, 3, 16, 64):
    for cached in (20, 185, 700):
        for length in (1, 2, 3, 4, 5, 8, 16):
            q, k, v = torch.randn(rows, 4, length, 32), torch.randn(rows, 2, cached, 32), torch.randn(rows, 2, cached, 32)
            mask = torch.ones(rows, 1, length, cached, dtype=torch.bool)
            mask[:, :, :, :3] = False
            for m in (mask, None):
                out = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))
                if not torch.equal(*out):
                    differ.append((rows, cached, length, m is not None))
print(differ)
"""


def test_attention_gives_the_same_numbers_at_one_and_two_threads():
    """The class of the test above, over the shapes decoding and extending a row meet: queries of
    1 to 16 tokens over 20 to 700 cached positions, 1 to 64 rows, grouped heads, with and without
    a padding mask: torch's attention on the CPU is bitwise the same at 1 and 2 threads once the
    etagent package is imported (without it, 1 to 3 token queries differed)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    run = subprocess.run([sys.executable, "-c", ATTENTION_AT_ONE_AND_TWO_THREADS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process's CPU affinity")
def test_the_threads_allowed_follow_openmps_setting_else_the_processs_cores(monkeypatch):
    """OMP_NUM_THREADS's first number (OpenMP also takes one per nesting level, 4,2), else the
    cores this process may run on, which taskset or a container narrows below the machine's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    assert allowed_cores() == 4
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert allowed_cores() == len(os.sched_getaffinity(0))
    narrowed = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", "from etagent.threads import allowed_cores; print(allowed_cores())"],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
    )  # fmt: skip
    assert narrowed.stdout.strip() == "1", narrowed.stderr

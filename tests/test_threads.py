"""The CPU trainers' torch threads follow the cores other processes leave free (etagent/threads.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from etagent.threads import FreeCoreThreads, machine_busy_s


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

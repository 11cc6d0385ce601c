"""Torch threads that follow the cores other processes leave free, for the CPU trainers and the
hf engine's decoding thread.

A torch operation split over two threads waits at its end for both; when another process holds
one of the two cores, every operation waits for the thread that core's scheduler deschedules,
and the step slows far more than by the core taken: the toy's SFT ran at 4.97 steps/s beside one
busy process with two threads against 10.89 with one (17.42 and 11.15 alone; docs/engines.md,
"Threads on a busy machine"). :class:`FreeCoreThreads` looks every ``interval_s`` at how much of
the machine's CPU time the other processes used since its last look (Linux's /proc/stat, less
this process's own) and sets torch's threads to the cores left: all of them on a quiet machine
(or the ``OMP_NUM_THREADS`` the environment sets), fewer beside a busy neighbour, at least one.

What it does not do: anything off Linux (no /proc/stat: the threads stay as they are), or on a
GPU (the trainers call it only when training on the CPU).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

STAT = Path("/proc/stat")


def machine_busy_s() -> float | None:
    """Seconds of CPU time every process of the machine has used since boot (all cores), or None
    where /proc/stat is not there or cannot be read (the threads then stay as they are: a
    decoding step must not fail on it)."""
    try:
        fields = STAT.read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in fields[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    except (OSError, ValueError, IndexError):  # no /proc/stat, or not the layout Linux writes
        return None
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def allowed_cores() -> int:
    """The most threads to use: the first number of ``OMP_NUM_THREADS`` where the environment
    sets it (the tests' 1; OpenMP also takes a list per nesting level, ``4,2``), else the cores
    this process may run on (its affinity, which a container or ``taskset`` narrows)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return len(os.sched_getaffinity(0)) if sys.platform == "linux" else os.cpu_count() or 1


class FreeCoreThreads:
    """Call :meth:`adjust` often (every training step): at most every ``interval_s`` it sets
    torch's threads to the cores the other processes left free over the last interval."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.cores = allowed_cores()
        self.last = (time.monotonic(), machine_busy_s(), time.process_time())
        torch.set_num_threads(self.cores)

    def adjust(self) -> int:
        """The threads torch uses now (changed where the free cores changed). Cheap between two
        looks: the hf engine calls it every decoding step."""
        now = time.monotonic()
        then, busy_then, own_then = self.last
        if now - then < self.interval_s:
            return torch.get_num_threads()
        busy, own = machine_busy_s(), time.process_time()
        self.last = (now, busy, own)
        if busy is None or busy_then is None:
            return torch.get_num_threads()
        others = max(0.0, (busy - busy_then) - (own - own_then)) / (now - then)  # cores the others kept busy
        threads = max(1, min(self.cores, round(self.cores - others)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

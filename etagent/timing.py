"""Named, timed phases for a training step, as verl's trainer reports them.

    metrics = {}
    with phase("generate", metrics):
        ...
    with phase("update", metrics):
        ...
    # metrics == {"timing_s/generate": 12.3, "timing_s/update": 4.5}

A phase that runs twice in one step adds up; nested phases are each timed on their own; a phase
that raises is still recorded. On a GPU the phase waits for queued kernels before it stops the
clock, so each phase is charged with its own work rather than the next one's.

What it does not do: log anywhere (the caller puts the dict in its step metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def phase(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``metrics["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start

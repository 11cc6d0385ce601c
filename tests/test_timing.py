"""Named, timed phases (etagent/timing.py): what a trainer's ``timing_s/<phase>`` metrics hold."""

from __future__ import annotations

import time

import pytest

from etagent.timing import phase


def test_phases_add_up_and_survive_errors():
    metrics: dict[str, float] = {}
    with phase("generate", metrics):
        time.sleep(0.02)
        with phase("reward", metrics):
            time.sleep(0.01)
    with phase("generate", metrics):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), phase("update", metrics):
        raise RuntimeError("boom")
    assert set(metrics) == {"timing_s/generate", "timing_s/reward", "timing_s/update"}
    assert metrics["timing_s/generate"] >= 0.03 and 0.01 <= metrics["timing_s/reward"] < metrics["timing_s/generate"]

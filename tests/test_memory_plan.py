"""bench/memory_plan.py: the per-GPU memory of every RL and SFT phase of the paper presets at
Qwen2.5-7B on 4 and 8 GPUs, from the code's own tensors on the meta device, within the goal
(every phase under 70 GiB of an 80 GB GPU, the weight sync's extra under 2 GiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_paper_presets_fit_an_80_gb_gpu_at_7b():
    result = subprocess.run(
        [sys.executable, "bench/memory_plan.py", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
        check=True,
    )
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert 7.6e9 < plan["params"] < 7.7e9  # Qwen2.5-7B built on the meta device
    assert plan["ok"], json.dumps(plan, indent=1)
    for world in ("4", "8"):
        rl = plan["plans"][world]["rl"]
        assert rl["sync_extra"] < 2 * 2**30
        assert set(rl["phases"]) == {
            "generate (vLLM awake)",
            "old_logprobs (whole policy gathered)",
            "update",
            "sync (weights awake, KV cache asleep)",
            "save + export (vLLM awake)",
        }

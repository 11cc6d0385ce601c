"""Run under torchrun by tests/test_weight_sync.py: every rank shards the policy (FSDP2, gloo),
moves its weights, syncs them into its own stand-in vLLM engine; rank 0 prints what each rank
found as ``SYNC {json}`` lines.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.support.weight_sync_ranks MODEL_DIR BUCKET_BYTES
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from etagent.llm.vllm_engine import VLLMEngine
from etagent.rl.distributed import gather_objects, init_distributed
from etagent.rl.policy import load_policy
from etagent.rl.weights import sync_engine
from tests.support.vllm_standin import StandInLLM


def main(model_dir: str, bucket: int) -> None:
    rank, _ = init_distributed(torch.device("cpu"))
    policy, _ = load_policy(model_dir, torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=512)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * (1 + rank))  # each rank's shard moves differently: the gathered whole shows both
    llm = StandInLLM(model_dir)
    engine = VLLMEngine(llm, model_dir, sleep_mode=True, in_process=True)
    engine.sleep(level=2)
    sync_engine(engine, policy.lm, torch.device("cpu"), torch.bfloat16, bucket)
    expected = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to(torch.bfloat16) for k, v in policy.lm.state_dict().items()
    }
    sizes = [t.numel() * t.element_size() for t in expected.values()]
    found = {
        "rank": rank,
        "equal": all(torch.equal(llm.weights[k], v) for k, v in expected.items()),
        "awake": not llm.llm_engine.is_sleeping(),
        "peak": llm.peak_stream_bytes,
        "largest": max(sizes),
        "model_bytes": sum(sizes),
    }
    for found_on_a_rank in gather_objects(found):  # printed by rank 0 alone: lines from two processes interleave
        if rank == 0:
            print("SYNC " + json.dumps(found_on_a_rank), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # Leave without the interpreter's teardown: now and then (1 run in about 10 on 2 cores) a
    # thread of torch's gloo backend is still joinable when static objects are destroyed, and the
    # process aborts ("terminate called without an active exception") after its work is done and
    # printed. A failure before this line still exits non-zero.
    sys.stdout.flush()
    os._exit(0)

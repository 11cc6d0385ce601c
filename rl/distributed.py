"""The trainer's processes: the process group, and sums and maxima over its ranks.

One process per GPU under torchrun (NCCL), or one process alone (a group of one, so that FSDP2
and the collectives run the same code on a laptop; gloo on CPU). What it does not do: shard the
model (rl/policy.py) or decide what each rank computes (rl/batch.py's plan).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size). Under torchrun, its process group; alone, a group of one (an in-memory
    store, no port)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def training_device(name: str) -> torch.device:
    """``cuda`` is this process's GPU (torchrun's LOCAL_RANK), so every later ``.to(device)`` and
    allocation lands on it; ``cpu`` is the CPU."""
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def sum_all(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def max_all(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def gather_objects(value) -> list:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered

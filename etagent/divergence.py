"""Weights that stopped being numbers: the check both trainers (sft/, rl/) run after every
optimizer step.

A learning rate that is too high, or a loss that overflows, can leave parameters NaN or infinite
after a step whose gradient norm was finite (the step itself overflows). Nothing downstream
notices: the loss is NaN from then on and a model of NaN weights is saved with status
``complete``. The trainers count the parameters that are not finite right after each step and,
if any is, stop before anything is saved (:class:`etagent.errors.TrainingDiverged`): the last
checkpoint on disk is the last good one.

What it does not do: find which input made the step diverge (rl/actor.py names the loss's
inputs that were not finite, when they were).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def non_finite_values(module: torch.nn.Module) -> int:
    """How many parameter values of ``module`` this process holds that are not finite (a
    sharded parameter counts its local shard: sum over ranks for the whole model). One
    synchronisation with the device, whatever the number of tensors."""
    counts = []
    for parameter in module.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        if local.numel():
            counts.append((~torch.isfinite(local.detach())).sum())
    return int(torch.stack(counts).sum()) if counts else 0

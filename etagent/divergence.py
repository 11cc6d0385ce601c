"""Weights that stopped being numbers, or went far past any trained model's: the check both
trainers (sft/, rl/) run after every optimizer step.

A learning rate that is too high, or a loss that overflows, can leave parameters NaN or infinite
after a step whose gradient norm was finite (the step itself overflows), or finite but absurd
(1e37 after one step of a learning rate of 1e36). Nothing downstream notices: the loss is NaN or
meaningless from then on and the model is saved with status ``complete``. The trainers count,
right after each step, the parameter values that are not finite or whose magnitude passes the
run's limit (:class:`WeightCheck`) and, if any does, stop before anything is saved
(:class:`etagent.errors.TrainingDiverged`): the last checkpoint on disk is the last good one.

The limit is the larger of ``LIMIT_FLOOR`` (1e4) and ``LIMIT_OVER_START`` (100) times the largest
magnitude the weights had when the run (or its resume) started. Trained transformers stay far
below 1e4: the largest weight magnitudes measured here (2026-12-05) are 2.13 in the toy policy
after its SFT, 9.25 in SmolLM2-135M-Instruct (its GGUF, dequantised by transformers) and 7.91 in
all-MiniLM-L6-v2; a model that starts with larger weights gets a limit of 100 times its own. An update that multiplies the largest
weight a hundredfold in one run is divergence, not learning.

What it does not do: find which input made the step diverge (rl/actor.py names the loss's
inputs that were not finite, when they were).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

LIMIT_FLOOR = 1e4
LIMIT_OVER_START = 100.0


def _local_tensors(module: torch.nn.Module):
    for parameter in module.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        if local.numel():
            yield local.detach()


def largest_magnitude(module: torch.nn.Module) -> float:
    """The largest |value| among the parameters this process holds (its shards), NaN ignored."""
    values = [torch.nan_to_num(t.float(), nan=0.0).abs().max() for t in _local_tensors(module)]
    return float(torch.stack(values).max()) if values else 0.0


def out_of_range_values(module: torch.nn.Module, limit: float = float("inf")) -> int:
    """How many parameter values of ``module`` this process holds that are not finite or whose
    magnitude is over ``limit`` (a sharded parameter counts its local shard: sum over ranks for
    the whole model). One synchronisation with the device, whatever the number of tensors."""
    counts = [(~(t.abs() <= limit)).sum() for t in _local_tensors(module)]  # NaN fails <=
    return int(torch.stack(counts).sum()) if counts else 0


class WeightCheck:
    """The check of one run. :meth:`start` sets the limit from the largest weight magnitude (over
    every rank, where sharded) before the first optimizer step of this process, so a resumed run
    starts from its checkpoint's weights; :meth:`broken` counts what passes it."""

    def __init__(self) -> None:
        self.limit: float | None = None

    def start(self, largest: float) -> None:
        if self.limit is None:
            self.limit = max(LIMIT_FLOOR, LIMIT_OVER_START * largest)

    def broken(self, module: torch.nn.Module) -> int:
        """Values not finite or over the limit, on this process."""
        return out_of_range_values(module, self.limit if self.limit is not None else float("inf"))

    def describe(self) -> str:
        return f"not finite or over {self.limit:.3g} in magnitude"

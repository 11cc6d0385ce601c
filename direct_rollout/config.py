"""The schema of configs/direct_rollout/ (direct_rollout/run.py): field names and types only. The
values, and what each means, are in configs/direct_rollout/_base.yaml and the presets; registered
with Hydra in direct_rollout/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from omegaconf import MISSING

from etagent.sampling import SamplingConfig
from etagent.settings import Fraction, ModelPath, PositiveInt, group


@group
class DirectRolloutConfig(SamplingConfig):
    """What run_sampling reads (the questions, the engine, the agent, the tools, n), at the top
    level, and direct rollout's own two settings."""

    model: ModelPath = MISSING
    rl_stage: PositiveInt = MISSING
    qa_pass_mark: Fraction = MISSING

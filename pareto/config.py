"""The schema of configs/pareto/ (pareto/run.py): field names and types only. The values, and what
each means, are in configs/pareto/_base.yaml and the presets; registered with Hydra in
pareto/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.pareto.selection import OBJECTIVES
from etagent.settings import Fraction, InputFileOrFolder, OneOf, OutputFolder, PositiveInt, Seed, group


@group
class MixedOutcome:
    math_threshold: Fraction = MISSING
    qa_pass_mark: Fraction = MISSING


@group
class ParetoConfig:
    rl_stage: PositiveInt = MISSING
    # direct rollout's folder, or its trajectories.jsonl
    rollouts: InputFileOrFolder = MISSING
    out_dir: OutputFolder = MISSING
    count: PositiveInt = MISSING
    method: Annotated[str, OneOf("pareto", "random")] = MISSING
    objectives: list[Annotated[str, OneOf(*OBJECTIVES)]] = MISSING
    mixed_outcome: MixedOutcome = field(default_factory=MixedOutcome)
    seed: Seed = MISSING
    split: str = MISSING

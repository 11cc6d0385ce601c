"""The schema of configs/pareto/ (pareto/run.py): field names and types only. The values, and what
each means, are in configs/pareto/_base.yaml and the presets; registered with Hydra in
pareto/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class MixedOutcome:
    math_threshold: float = MISSING
    qa_pass_mark: float = MISSING


@dataclass
class ParetoConfig:
    rl_stage: int = MISSING
    rollouts: str = MISSING
    out_dir: str = MISSING
    count: int = MISSING
    method: str = MISSING
    objectives: list[str] = MISSING
    mixed_outcome: MixedOutcome = field(default_factory=MixedOutcome)
    seed: int = MISSING
    split: str = MISSING

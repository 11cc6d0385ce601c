"""The schema of configs/radar/ (radar/run.py): field names and types only. The values, and what
each means, are in configs/radar/_base.yaml and the presets; registered with Hydra in
radar/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.llm import EngineConfig, Sampling


@dataclass
class RadarJudge:
    """The redundancy judge: the toy world's oracle, or a text model on its own (served) engine."""

    mode: str = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    rounds: int = MISSING
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = MISSING
    max_trajectory_chars: int = MISSING
    batch: int = MISSING


@dataclass
class RadarConfig:
    judge: RadarJudge = field(default_factory=RadarJudge)
    runs: list[str] = MISSING
    labels: list[str] | None = MISSING
    datasets: list[str] | None = MISSING
    tokenizer: str = MISSING
    execution_rule: str = MISSING
    out_dir: str = MISSING

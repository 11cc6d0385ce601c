"""The schema of configs/radar/ (radar/run.py): field names and types only. The values, and what
each means, are in configs/radar/_base.yaml and the presets; registered with Hydra in
radar/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.llm import EngineConfig, Sampling
from etagent.settings import FREE, InputFolder, OneOf, OutputFolder, PositiveInt, TokenizerPath, group


@group
class RadarJudge:
    """The redundancy judge: the toy world's oracle, or a text model on its own (served) engine."""

    mode: Annotated[str, OneOf("toy_oracle", "llm")] = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    rounds: PositiveInt = MISSING
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: PositiveInt = MISSING
    max_trajectory_chars: PositiveInt = MISSING
    batch: Annotated[PositiveInt, FREE] = MISSING


@group
class RadarConfig:
    judge: RadarJudge = field(default_factory=RadarJudge)
    # which runs and datasets are drawn may change on a rerun: each has its own cached verdicts
    runs: Annotated[list[InputFolder], FREE] = MISSING
    labels: Annotated[list[str] | None, FREE] = MISSING
    datasets: Annotated[list[str] | None, FREE] = MISSING
    tokenizer: TokenizerPath = MISSING
    execution_rule: Annotated[str, OneOf("paper", "corrected")] = MISSING
    out_dir: OutputFolder = MISSING

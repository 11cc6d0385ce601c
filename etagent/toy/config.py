"""The schema of configs/toy/tiny.yaml (the toy world's build, etagent/toy/build.py): field names
and types only; the values, and what each means, are in the YAML."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.config import register_stage_schema
from etagent.settings import Fraction, Ge, NonNegativeInt, OutputFolder, PositiveInt, Seed, group
from etagent.tools.executor import ToolsConfig


@group
class ToyWorldSize:
    people: PositiveInt = MISSING
    cities: PositiveInt = MISSING
    training_versions: PositiveInt = MISSING


@group
class ToyQuestionCounts:
    # per kind of question (search, python, both, none)
    train: dict[str, NonNegativeInt] = MISSING
    test_per_kind: PositiveInt = MISSING
    rl: dict[str, NonNegativeInt] = MISSING


@group
class ToySeeds:
    per_question: PositiveInt = MISSING
    # share of each seed behaviour (efficient, redundant, insufficient)
    mix: dict[str, Fraction] = MISSING


@group
class ToyTokenizer:
    # the toy tokenizer's special and word tokens alone take a few hundred
    vocab_size: Annotated[int, Ge(256)] = MISSING


@group
class ToyModel:
    hidden_size: PositiveInt = MISSING
    layers: PositiveInt = MISSING
    heads: PositiveInt = MISSING
    kv_heads: PositiveInt = MISSING
    intermediate_size: PositiveInt = MISSING
    max_positions: PositiveInt = MISSING


@group
class ToyConfig:
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    out_dir: OutputFolder = MISSING
    seed: Seed = MISSING
    world: ToyWorldSize = field(default_factory=ToyWorldSize)
    questions: ToyQuestionCounts = field(default_factory=ToyQuestionCounts)
    seeds: ToySeeds = field(default_factory=ToySeeds)
    tokenizer: ToyTokenizer = field(default_factory=ToyTokenizer)
    model: ToyModel = field(default_factory=ToyModel)


register_stage_schema("toy", ToyConfig)

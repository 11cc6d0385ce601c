"""The schemas of configs/toy/tiny.yaml (the toy world's build, etagent/toy/build.py) and of
configs/toy_hard/tiny.yaml (the hard world's, etagent/toy/hops.py): field names and types only;
the values, and what each means, are in the YAML."""

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


@group
class HardWorldSize:
    people: PositiveInt = MISSING
    cities: PositiveInt = MISSING
    training_versions: PositiveInt = MISSING
    landmark_people: NonNegativeInt = MISSING
    landmark_cities: NonNegativeInt = MISSING
    landmark_start: Fraction = MISSING


@group
class HardQuestionCounts:
    # per question shape (hops0 to hops4, optionally +python: etagent/toy/hops.py)
    train: dict[str, NonNegativeInt] = MISSING
    flywheel: dict[str, NonNegativeInt] = MISSING
    test: dict[str, NonNegativeInt] = MISSING
    rl: dict[str, NonNegativeInt] = MISSING


@group
class HardWorldConfig:
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    out_dir: OutputFolder = MISSING
    seed: Seed = MISSING
    world: HardWorldSize = field(default_factory=HardWorldSize)
    questions: HardQuestionCounts = field(default_factory=HardQuestionCounts)
    seeds: ToySeeds = field(default_factory=ToySeeds)
    tokenizer: ToyTokenizer = field(default_factory=ToyTokenizer)
    model: ToyModel = field(default_factory=ToyModel)


register_stage_schema("toy_hard", HardWorldConfig)

"""The schema of configs/toy/tiny.yaml (the toy world's build, etagent/toy/build.py): field names
and types only; the values, and what each means, are in the YAML."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.tools.executor import ToolsConfig


@dataclass
class ToyWorldSize:
    people: int = MISSING
    cities: int = MISSING
    training_versions: int = MISSING


@dataclass
class ToyQuestionCounts:
    # per kind of question (search, python, both, none)
    train: dict[str, int] = MISSING
    test_per_kind: int = MISSING
    rl: dict[str, int] = MISSING


@dataclass
class ToySeeds:
    per_question: int = MISSING
    # share of each seed behaviour (efficient, redundant, insufficient)
    mix: dict[str, float] = MISSING


@dataclass
class ToyTokenizer:
    vocab_size: int = MISSING


@dataclass
class ToyModel:
    hidden_size: int = MISSING
    layers: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    intermediate_size: int = MISSING
    max_positions: int = MISSING


@dataclass
class ToyConfig:
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    out_dir: str = MISSING
    seed: int = MISSING
    world: ToyWorldSize = field(default_factory=ToyWorldSize)
    questions: ToyQuestionCounts = field(default_factory=ToyQuestionCounts)
    seeds: ToySeeds = field(default_factory=ToySeeds)
    tokenizer: ToyTokenizer = field(default_factory=ToyTokenizer)
    model: ToyModel = field(default_factory=ToyModel)

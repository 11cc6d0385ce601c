"""The schema of configs/flywheel/ (flywheel/run.py and flywheel/export.py): one dataclass per
group, field names and types only. The values, and what each means, are in
configs/flywheel/_base.yaml and the presets; registered with Hydra in flywheel/__init__.py, so a
key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.flywheel.evolve import FlywheelSettings
from etagent.llm import EngineConfig, Sampling
from etagent.question_formats import QuestionFormat
from etagent.settings import FREE, InputData, InputFile, ModelPath, OneOf, OutputFolder, PositiveInt, group
from etagent.tools.executor import ToolsConfig


@group
class ReflectorRole:
    """The policy itself, asked to reflect: a text model on the policy's engine."""

    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: PositiveInt = MISSING


@group
class EditorRole:
    """The editor's model (also the judge's and the summariser's): a text model on its own engine."""

    enabled: bool = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: PositiveInt = MISSING


@group
class JudgeRole:
    """The LLM judge of math answers: the editor's model, asked with these settings."""

    llm: bool = MISSING
    attempts: PositiveInt = MISSING
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: PositiveInt = MISSING


@group
class SummariserRole:
    enabled: bool = MISSING


@group
class ExportSettings:
    out_dir: OutputFolder = MISSING
    max_per_question: PositiveInt = MISSING
    prefer_fewer_calls: bool = MISSING
    require_tool_success: bool = MISSING
    llamafactory: list[Annotated[str, OneOf("alpaca", "sharegpt", "sharegpt_observation")]] = MISSING
    seed_data: InputFile | None = MISSING
    trajectories: list[InputFile] | None = MISSING


@group
class FlywheelConfig:
    model: ModelPath = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    questions: Annotated[InputData, FREE] = MISSING
    question_format: QuestionFormat = field(default_factory=QuestionFormat)
    limit: Annotated[PositiveInt | None, FREE] = MISSING
    partial_input_ok: Annotated[bool, FREE] = MISSING
    out_dir: OutputFolder = MISSING
    flywheel: FlywheelSettings = MISSING
    reflector: ReflectorRole = field(default_factory=ReflectorRole)
    editor: EditorRole = field(default_factory=EditorRole)
    judge: JudgeRole = field(default_factory=JudgeRole)
    summariser: SummariserRole = field(default_factory=SummariserRole)
    # a later step (flywheel/export.py): the flywheel's run does not depend on it
    export: Annotated[ExportSettings, FREE] = field(default_factory=ExportSettings)

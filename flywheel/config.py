"""The schema of configs/flywheel/ (flywheel/run.py and flywheel/export.py): one dataclass per
group, field names and types only. The values, and what each means, are in
configs/flywheel/_base.yaml and the presets; registered with Hydra in flywheel/__init__.py, so a
key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.llm import EngineConfig, Sampling
from etagent.tools.executor import ToolsConfig
from flywheel.evolve import FlywheelSettings


@dataclass
class ReflectorRole:
    """The policy itself, asked to reflect: a text model on the policy's engine."""

    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = MISSING


@dataclass
class EditorRole:
    """The editor's model (also the judge's and the summariser's): a text model on its own engine."""

    enabled: bool = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = MISSING


@dataclass
class JudgeRole:
    """The LLM judge of math answers: the editor's model, asked with these settings."""

    llm: bool = MISSING
    attempts: int = MISSING
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = MISSING


@dataclass
class SummariserRole:
    enabled: bool = MISSING


@dataclass
class ExportSettings:
    out_dir: str = MISSING
    max_per_question: int = MISSING
    prefer_fewer_calls: bool = MISSING
    require_tool_success: bool = MISSING
    llamafactory: list[str] = MISSING
    seed_data: str | None = MISSING


@dataclass
class FlywheelConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    questions: str = MISSING
    limit: int | None = MISSING
    partial_input_ok: bool = MISSING
    out_dir: str = MISSING
    flywheel: FlywheelSettings = MISSING
    reflector: ReflectorRole = field(default_factory=ReflectorRole)
    editor: EditorRole = field(default_factory=EditorRole)
    judge: JudgeRole = field(default_factory=JudgeRole)
    summariser: SummariserRole = field(default_factory=SummariserRole)
    export: ExportSettings = field(default_factory=ExportSettings)

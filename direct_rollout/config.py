"""The schema of configs/direct_rollout/ (direct_rollout/run.py): field names and types only. The
values, and what each means, are in configs/direct_rollout/_base.yaml and the presets; registered
with Hydra in direct_rollout/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.llm import EngineConfig
from etagent.sampling import RayConfig
from etagent.tools.executor import ToolsConfig


@dataclass
class DirectRolloutConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    rl_stage: int = MISSING
    questions: str = MISSING
    limit: int | None = MISSING
    partial_input_ok: bool = MISSING
    out_dir: str = MISSING
    n: int = MISSING
    batch_questions: int = MISSING
    qa_pass_mark: float = MISSING

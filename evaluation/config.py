"""The schema of configs/evaluation/ (evaluation/run.py): field names and types only. The values,
and what each means, are in configs/evaluation/_base.yaml and the presets; registered with Hydra
in evaluation/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.llm import EngineConfig, Sampling
from etagent.sampling import RayConfig
from etagent.tools.executor import ToolsConfig


@dataclass
class EvaluationJudge:
    """The LLM judge of math answers: a text model on its own (served) engine."""

    enabled: bool = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = MISSING
    attempts: int = MISSING
    kinds: list[str] = MISSING
    batch_questions: int = MISSING


@dataclass
class WebSearch:
    backend: str | None = MISSING


@dataclass
class EvaluationConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    judge: EvaluationJudge = field(default_factory=EvaluationJudge)
    datasets: list[str] = MISSING
    data_dir: str = MISSING
    # per dataset name: its questions file, instead of data_dir/{name}/test.jsonl
    files: dict[str, str] = MISSING
    limit: int | None = MISSING
    partial_input_ok: bool = MISSING
    out_dir: str = MISSING
    run_name: str | None = MISSING
    n: int = MISSING
    qa_pass_mark: float = MISSING
    batch_questions: int = MISSING
    bootstrap_rounds: int = MISSING
    seed: int = MISSING
    web_search: WebSearch = field(default_factory=WebSearch)

"""The schema of configs/evaluation/ (evaluation/run.py): each setting declared once with its type,
its constraints and whether a resumed run may change it (``FREE``: the datasets, each in its own
folder with its own manifest; where the question files lie, their content being checked; the
judge's address and pace; the bootstrap). The values, and what each means, are in
configs/evaluation/_base.yaml and the presets; registered with Hydra in evaluation/__init__.py,
so a key that is not a field fails at load (etagent/settings.py)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.gateway.harness import GatewaySettings
from etagent.llm import EngineConfig, Sampling
from etagent.question_formats import QuestionFormat
from etagent.sampling import RayConfig
from etagent.settings import FREE, Fraction, InputData, ModelPath, OneOf, OutputFolder, PositiveInt, Seed, group
from etagent.tools.executor import ToolsConfig


@group
class EvaluationJudge:
    """The LLM judge of math answers: a text model on its own (served) engine."""

    enabled: bool = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: PositiveInt = MISSING
    attempts: Annotated[PositiveInt, FREE] = MISSING
    kinds: list[Annotated[str, OneOf("math", "qa")]] = MISSING
    batch_questions: Annotated[PositiveInt, FREE] = MISSING


@group
class WebSearch:
    backend: Annotated[str, OneOf("serper", "brightdata", "bing")] | None = MISSING


@group
class EvaluationConfig:
    model: ModelPath = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    judge: EvaluationJudge = field(default_factory=EvaluationJudge)
    datasets: Annotated[list[str], FREE] = MISSING
    data_dir: Annotated[str, FREE] = MISSING
    # per dataset name: its questions file, instead of data_dir/{name}/test.jsonl (a run records
    # the file of each dataset it evaluates here: evaluation/run.py)
    files: Annotated[dict[str, InputData], FREE] = MISSING
    # per dataset of the user's (a name that is not a benchmark): how its answers are scored
    kinds: dict[str, Annotated[str, OneOf("math", "qa")]] = MISSING
    # per dataset: the split to read of a source that holds several
    splits: dict[str, str] = MISSING
    question_format: QuestionFormat = field(default_factory=QuestionFormat)
    limit: Annotated[PositiveInt | None, FREE] = MISSING
    partial_input_ok: Annotated[bool, FREE] = MISSING
    out_dir: OutputFolder = MISSING
    run_name: Annotated[str | None, FREE] = MISSING
    n: PositiveInt = MISSING
    qa_pass_mark: Fraction = MISSING
    batch_questions: Annotated[PositiveInt, FREE] = MISSING
    bootstrap_rounds: Annotated[PositiveInt, FREE] = MISSING
    seed: Annotated[Seed, FREE] = MISSING
    web_search: Annotated[WebSearch, FREE] = field(default_factory=WebSearch)

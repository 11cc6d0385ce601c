"""The schema of configs/rl/ (rl/run.py): one dataclass per group, each setting declared once with
its type, its constraints and whether a resumed run may change it (``FREE``: the step budget and
cadences, memory-only sizes, the loggers; everything else changes what the next steps compute).
The values, and what each means, are in configs/rl/_base.yaml and the presets; registered with
Hydra in rl/__init__.py, so a key that is not a field fails at load (etagent/settings.py)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.config import LoraSettings, TensorBoardConfig, WandbConfig
from etagent.gateway.harness import GatewaySettings
from etagent.llm import EngineConfig
from etagent.question_formats import QuestionFormat
from etagent.settings import (
    FREE,
    Fraction,
    Ge,
    Gt,
    InputData,
    Le,
    Len,
    Lt,
    ModelPath,
    NonNegativeFloat,
    NonNegativeInt,
    OneOf,
    OutputFolder,
    PositiveFloat,
    PositiveInt,
    Seed,
    group,
)
from etagent.tools.executor import ToolsConfig


@group
class RLData:
    train: InputData = MISSING
    validation: InputData | None = MISSING
    validation_split: str | None = MISSING
    prompts_per_step: PositiveInt = MISSING
    epochs: PositiveInt = MISSING
    max_prompt_tokens: PositiveInt | None = MISSING
    question_format: QuestionFormat = field(default_factory=QuestionFormat)
    rerender_prompts: bool = MISSING


@group
class RolloutSettings:
    """Plain GRPO (``kind: group``), ARPO's tree (``kind: tree``) and its numbers, or an outside
    harness through the gateway (``kind: gateway``)."""

    n: PositiveInt = MISSING
    kind: Annotated[str, OneOf("group", "tree", "gateway")] = MISSING
    initial_rollouts: PositiveInt = MISSING
    beam_size: PositiveInt = MISSING
    branch_probability: Fraction = MISSING
    entropy_weight: NonNegativeFloat = MISSING
    delta_h: Annotated[str, OneOf("after_result", "lagged")] = MISSING
    entropy: Annotated[str, OneOf("topk", "exact")] = MISSING
    top_logprobs: NonNegativeInt = MISSING
    entropy_window: PositiveInt = MISSING
    dynamic_roots: bool = MISSING
    branch_penalty: bool = MISSING
    partial: bool = MISSING
    partial_extra: NonNegativeInt = MISSING
    max_staleness: PositiveInt = MISSING
    on_stale: Annotated[str, OneOf("drop", "wait")] = MISSING
    stale_tokens: Annotated[str, OneOf("tis", "mask")] = MISSING
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


@group
class RewardSettings:
    mode: Annotated[str, OneOf("default", "paper")] = MISSING
    sigma_tool: NonNegativeFloat = MISSING
    sigma_length: NonNegativeFloat = MISSING
    decay: bool = MISSING


@group
class AlgorithmSettings:
    clip_low: Annotated[float, Ge(0), Le(1)] = MISSING
    clip_high: NonNegativeFloat = MISSING
    # the dual clip's constant bounds the ratio of negative-advantage tokens from above: > 1
    clip_c: Annotated[float, Ge(1)] = MISSING
    eps: PositiveFloat = MISSING
    kl_coef: NonNegativeFloat = MISSING
    kl_estimator: Annotated[str, OneOf("k1", "k2", "k3", "low_var_kl")] = MISSING
    entropy_balanced_clipping: bool = MISSING
    entropy_aware_advantage: bool = MISSING
    tis_cap: Annotated[float, Ge(1)] | None = MISSING
    log_ratio_clamp: PositiveFloat | None = MISSING
    truncated: Annotated[str, OneOf("train", "mask", "wrong")] = MISSING


@group
class OptimSettings:
    # AdamW's first step is lr / (1 - beta1) in float32: above 1e37 it cannot be taken at all
    lr: Annotated[float, Gt(0), Le(1e37)] = MISSING
    betas: Annotated[list[Annotated[float, Ge(0), Lt(1)]], Len(2, 2)] = MISSING
    eps: PositiveFloat = MISSING
    weight_decay: NonNegativeFloat = MISSING
    grad_clip: PositiveFloat = MISSING


@group
class RLTrainSettings:
    device: Annotated[str, OneOf("cpu", "cuda")] = MISSING
    compute_dtype: Annotated[str, OneOf("float32", "bfloat16", "float16")] = MISSING
    gradient_checkpointing: Annotated[bool, FREE] = MISSING
    attn_implementation: Annotated[str, OneOf("sdpa", "eager", "flash_attention_2")] = MISSING
    mini_batch_prompts: PositiveInt = MISSING
    micro_batch_tokens: Annotated[PositiveInt, FREE] = MISSING
    share_prefixes: Annotated[bool, FREE] = MISSING
    logprob_chunk_tokens: Annotated[PositiveInt, FREE] = MISSING
    weight_bucket_mb: Annotated[PositiveInt, FREE] = MISSING
    max_steps: Annotated[PositiveInt | None, FREE] = MISSING
    save_every: Annotated[PositiveInt, FREE] = MISSING
    keep_checkpoints: Annotated[PositiveInt, FREE] = MISSING
    export_every: Annotated[PositiveInt | None, FREE] = MISSING
    export_dtype: Annotated[str, OneOf("float32", "bfloat16", "float16")] = MISSING
    validate_every: Annotated[PositiveInt, FREE] = MISSING
    seed: Seed = MISSING


@group
class RLLoraSettings(LoraSettings):
    """LoRA on the policy (rl/adapters.py), and what the exported models hold."""

    export: Annotated[str, OneOf("merged", "adapter"), FREE] = MISSING


@group
class RLConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    rl_stage: PositiveInt = MISSING
    model: ModelPath = MISSING
    out_dir: OutputFolder = MISSING
    data: RLData = field(default_factory=RLData)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    train: RLTrainSettings = field(default_factory=RLTrainSettings)
    lora: RLLoraSettings = field(default_factory=RLLoraSettings)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

"""The schema of configs/rl/ (rl/run.py): one dataclass per group, field names and types only.
The values, and what each means, are in configs/rl/_base.yaml and the presets; registered with
Hydra in rl/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.agent import AgentConfig
from etagent.config import TensorBoardConfig, WandbConfig
from etagent.llm import EngineConfig
from etagent.tools.executor import ToolsConfig


@dataclass
class RLData:
    train: str = MISSING
    validation: str | None = MISSING
    prompts_per_step: int = MISSING
    epochs: int = MISSING
    max_prompt_tokens: int | None = MISSING


@dataclass
class RolloutSettings:
    """Plain GRPO (``kind: group``) or ARPO's tree (``kind: tree``) and its numbers."""

    n: int = MISSING
    kind: str = MISSING
    initial_rollouts: int = MISSING
    beam_size: int = MISSING
    branch_probability: float = MISSING
    entropy_weight: float = MISSING
    delta_h: str = MISSING
    entropy: str = MISSING
    top_logprobs: int = MISSING
    entropy_window: int = MISSING
    dynamic_roots: bool = MISSING
    branch_penalty: bool = MISSING


@dataclass
class RewardSettings:
    mode: str = MISSING
    sigma_tool: float = MISSING
    sigma_length: float = MISSING
    decay: bool = MISSING


@dataclass
class AlgorithmSettings:
    clip_low: float = MISSING
    clip_high: float = MISSING
    clip_c: float = MISSING
    eps: float = MISSING
    kl_coef: float = MISSING
    kl_estimator: str = MISSING
    entropy_balanced_clipping: bool = MISSING
    entropy_aware_advantage: bool = MISSING
    tis_cap: float | None = MISSING


@dataclass
class OptimSettings:
    lr: float = MISSING
    betas: list[float] = MISSING
    eps: float = MISSING
    weight_decay: float = MISSING
    grad_clip: float = MISSING


@dataclass
class RLTrainSettings:
    device: str = MISSING
    compute_dtype: str = MISSING
    gradient_checkpointing: bool = MISSING
    attn_implementation: str | None = MISSING
    mini_batch_prompts: int = MISSING
    micro_batch_tokens: int = MISSING
    logprob_chunk_tokens: int = MISSING
    weight_bucket_mb: int = MISSING
    max_steps: int | None = MISSING
    save_every: int = MISSING
    keep_checkpoints: int = MISSING
    export_every: int | None = MISSING
    export_dtype: str = MISSING
    validate_every: int = MISSING
    seed: int = MISSING


@dataclass
class RLConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    rl_stage: int = MISSING
    model: str = MISSING
    out_dir: str = MISSING
    data: RLData = field(default_factory=RLData)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    train: RLTrainSettings = field(default_factory=RLTrainSettings)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

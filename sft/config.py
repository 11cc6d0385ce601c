"""The schema of configs/sft/ (sft/run.py): one dataclass per group, field names and types only.
The values, and what each means, are in configs/sft/_base.yaml and the presets; registered with
Hydra in sft/__init__.py, so a key that is not a field fails at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from etagent.config import TensorBoardConfig, WandbConfig


@dataclass
class SFTData:
    path: str = MISSING
    format: str = MISSING


@dataclass
class SFTTrainSettings:
    batch_size: int = MISSING
    gradient_accumulation_steps: int = MISSING
    learning_rate: float = MISSING
    epochs: float = MISSING
    max_steps: int = MISSING
    lr_scheduler: str = MISSING
    warmup_ratio: float = MISSING
    weight_decay: float = MISSING
    max_grad_norm: float = MISSING
    logging_steps: int = MISSING
    save_steps: int = MISSING
    save_total_limit: int | None = MISSING
    sampling: str = MISSING
    packing: bool = MISSING
    bf16: bool = MISSING
    gradient_checkpointing: bool = MISSING
    deepspeed: str | None = MISSING
    fsdp: str = MISSING
    progress_bar: bool = MISSING


@dataclass
class LoraSettings:
    enabled: bool = MISSING
    rank: int = MISSING
    alpha: int = MISSING
    dropout: float = MISSING
    target_modules: list[str] = MISSING


@dataclass
class SFTConfig:
    model: str = MISSING
    out_dir: str = MISSING
    seed: int = MISSING
    threads: int = MISSING
    cutoff_len: int = MISSING
    model_dtype: str = MISSING
    attn_implementation: str | None = MISSING
    data: SFTData = field(default_factory=SFTData)
    train: SFTTrainSettings = field(default_factory=SFTTrainSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

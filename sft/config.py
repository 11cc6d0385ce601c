"""The schema of configs/sft/ (sft/run.py): one dataclass per group, each setting declared once with
its type, its constraints and whether a resumed run may change it (``FREE``: logging, checkpoint
cadence, threads, the loggers). The values, and what each means, are in configs/sft/_base.yaml and
the presets; registered with Hydra in sft/__init__.py, so a key that is not a field fails at load
(etagent/settings.py)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from omegaconf import MISSING

from etagent.config import LoraSettings, TensorBoardConfig, WandbConfig
from etagent.settings import (
    FREE,
    Fraction,
    Ge,
    Gt,
    InputData,
    InputFile,
    Le,
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


@group
class SFTData:
    path: InputData = MISSING
    format: Annotated[str, OneOf("etagent", "alpaca", "sharegpt")] = MISSING


@group
class SFTTrainSettings:
    batch_size: PositiveInt = MISSING
    gradient_accumulation_steps: PositiveInt = MISSING
    # AdamW's first step is lr / (1 - beta1) in float32: above 1e37 it cannot be taken at all
    learning_rate: Annotated[float, Gt(0), Le(1e37)] = MISSING
    epochs: PositiveFloat = MISSING
    # -1: train for ``epochs`` (0 is refused by check_settings)
    max_steps: Annotated[int, Ge(-1)] = MISSING
    lr_scheduler: Annotated[
        str, OneOf("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt")
    ] = MISSING
    warmup_ratio: Fraction = MISSING
    weight_decay: NonNegativeFloat = MISSING
    max_grad_norm: PositiveFloat = MISSING
    logging_steps: Annotated[PositiveInt, FREE] = MISSING
    save_steps: Annotated[PositiveInt, FREE] = MISSING
    save_total_limit: Annotated[PositiveInt | None, FREE] = MISSING
    sampling: Annotated[str, OneOf("random", "group_by_length", "sequential")] = MISSING
    packing: bool = MISSING
    bf16: bool = MISSING
    gradient_checkpointing: bool = MISSING
    deepspeed: InputFile | None = MISSING
    fsdp: str = MISSING
    progress_bar: Annotated[bool, FREE] = MISSING


@group
class SFTConfig:
    model: ModelPath = MISSING
    out_dir: OutputFolder = MISSING
    seed: Seed = MISSING
    threads: Annotated[NonNegativeInt, FREE] = MISSING
    cutoff_len: PositiveInt = MISSING
    model_dtype: Annotated[str, OneOf("float32", "bfloat16", "float16")] = MISSING
    attn_implementation: Annotated[str, OneOf("sdpa", "eager", "flash_attention_2")] | None = MISSING
    data: SFTData = field(default_factory=SFTData)
    train: SFTTrainSettings = field(default_factory=SFTTrainSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

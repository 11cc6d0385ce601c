"""SFT: fine-tune the policy on tool-integrated trajectories, training only on what it writes.

    python -m etagent.sft.run [--preset tiny|paper] [overrides]             # or: etagent sft ...
    torchrun --nproc_per_node=4 -m etagent.sft.run --preset paper            # multi-GPU (ZeRO-3)
    bash scripts/sft.sh ...                                          # the same, with launchers

Reads SFT data (``data.path``: our JSONL from ``flywheel export`` or the toy builder, or
LLaMA-Factory alpaca/sharegpt JSON) and a model; writes ``out_dir/model`` (a plain
``save_pretrained`` folder with the tokenizer and chat template, loadable by transformers and
vLLM as is), checkpoints in ``out_dir/checkpoints`` and ``out_dir/manifest.json``.

The recipe: plan (:func:`plan`, before the output folder is claimed, so that a refused run writes
nothing: the settings, the model's files, the optional packages, LoRA's target modules, the data
tokenized with the rollout's prompt rendering and tool results masked, sequences over
``cutoff_len`` dropped and counted, and the Trainer's arguments) -> setup (load the model,
optionally with LoRA) ->
train (the transformers Trainer: full fine-tuning by default, DeepSpeed ZeRO-3 or FSDP across
GPUs, bf16, gradient checkpointing, length-grouped batches, or packed batches with correct
attention boundaries under flash-attention) -> save. A run resumes from its last checkpoint.

Deliberate differences from the paper's SFT (LLaMA-Factory, docs/paper-code.md §A3): tool
results are masked out of the loss (the paper trained on them), and the protocol prompt is in the
system turn as at rollout time (the paper's alpaca layout put it in the user turn).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etagent.config import LoraSettings, WandbConfig
from etagent.errors import SettingError, TrainingDiverged, UserError, exit_on_user_error
from etagent.progress import Progress
from etagent.records import write_manifest
from etagent.rundir import claim_output, completed, restore_manifest
from etagent.settings import check_attention, check_installed, check_model_weights, check_paths
from etagent.sft.config import SFTConfig, SFTTrainSettings
from etagent.sft.data import IGNORE, build_dataset, load_examples

# torch and transformers are imported in the functions that use them: a refused setting or input
# is reported in about a second, not after their import (two to three seconds).
log = logging.getLogger("sft")


class Collator:
    """Right-pads a batch; labels pad with -100. With ``flatten`` the batch becomes one packed row
    with position ids restarting per example (flash-attention keeps examples apart)."""

    def __init__(self, pad_id: int, flatten: bool):
        self.pad_id, self.flatten = pad_id, flatten

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        if self.flatten:
            ids = [t for r in rows for t in r["input_ids"]]
            labels = [label for r in rows for label in ([IGNORE] + r["labels"][1:])]  # no loss across a boundary
            positions = [p for r in rows for p in range(len(r["input_ids"]))]
            return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]), "position_ids": torch.tensor([positions])}
        longest = max(len(r["input_ids"]) for r in rows)
        pad = lambda seq, value: seq + [value] * (longest - len(seq))  # noqa: E731
        return {
            "input_ids": torch.tensor([pad(r["input_ids"], self.pad_id) for r in rows]),
            "labels": torch.tensor([pad(r["labels"], IGNORE) for r in rows]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
        }


def training_arguments(t: SFTTrainSettings, wandb: WandbConfig, seed: int, out: Path):
    """The transformers Trainer's arguments for the ``train`` group, checkpoints in ``out``."""
    import torch
    from transformers import TrainingArguments

    report_to = ["wandb"] if wandb.enabled else []
    if wandb.enabled:
        os.environ.setdefault("WANDB_MODE", wandb.mode)
        os.environ.setdefault("WANDB_PROJECT", wandb.project)
    return TrainingArguments(
        output_dir=str(out / "checkpoints"),
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=seed,
        data_seed=seed,
        bf16=t.bf16,
        gradient_checkpointing=t.gradient_checkpointing,
        deepspeed=t.deepspeed,
        fsdp=t.fsdp,
        train_sampling_strategy="sequential" if t.packing else t.sampling,
        length_column_name="length",
        report_to=report_to,
        run_name=wandb.run_name,
        disable_tqdm=True,  # StepProgress shows the steps, in etagent's progress style
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        remove_unused_columns=False,
    )


def step_progress(bar: bool):
    """A Trainer callback that shows the steps as every stage shows progress (etagent.progress:
    a bar on a terminal unless ``bar`` is false, else a line every 15 s), with the last loss."""
    from transformers import TrainerCallback

    class StepProgress(TrainerCallback):
        progress: Progress | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.progress = Progress("sft", state.max_steps, "step", initial=state.global_step, bar=None if bar else False)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.progress is not None and logs and "loss" in logs:
                self.progress.update(0, loss=f"{logs['loss']:.4g}")

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.close()

    return StepProgress()


def free_core_threads():
    """A Trainer callback that sets torch's threads, before each step, to the cores other
    processes leave free (etagent/threads.py)."""
    from transformers import TrainerCallback

    from etagent.threads import FreeCoreThreads

    threads = FreeCoreThreads()

    class FreeCores(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            threads.adjust()

    return FreeCores()


def finite_weights_check(out: Path):
    """A Trainer callback that counts the weights that are not finite, or far past their range at
    the start, after every optimizer step
    (etagent/divergence.py) and stops the run before the step's checkpoint or the final model is
    saved (the Trainer saves after ``on_step_end``): the last checkpoint on disk is the last good
    one, and no model of NaN weights is written."""
    from transformers import TrainerCallback

    from etagent.divergence import WeightCheck, largest_magnitude

    check = WeightCheck()

    class FiniteWeights(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if check.limit is None:  # from the weights the run (or its resume) starts with
                check.start(largest_magnitude(model))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            broken = check.broken(model)
            if broken:
                last = last_complete_checkpoint(out / "checkpoints")
                raise TrainingDiverged(
                    f"SFT step {state.global_step}: the optimizer step left {broken} weight values {check.describe()}. Nothing of "
                    f"this step was saved; the last checkpoint is {last or 'none (the run starts from model)'}. Lower "
                    "train.learning_rate (or train.max_grad_norm) and rerun with --restart or into a new out_dir"
                )

    return FiniteWeights()


def tensorboard_callback(log_dir: Path, resumed_from: str | None):
    """The Trainer's own TensorBoard callback, writing event files into ``log_dir`` through
    tensorboardX; a resumed run drops what its killed predecessor logged after the checkpoint."""
    from tensorboardX import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    purge_step = int(Path(resumed_from).name.split("-")[-1]) + 1 if resumed_from else None
    return TensorBoardCallback(SummaryWriter(str(log_dir), purge_step=purge_step))


def last_complete_checkpoint(folder: Path) -> str | None:
    """The newest ``checkpoint-N`` in ``folder`` that a kill did not cut short, removing newer
    ones that it did. The Trainer writes a checkpoint's ``trainer_state.json`` last, after the
    weights, optimizer, scheduler and random states, and only then removes older checkpoints, so a
    checkpoint whose ``trainer_state.json`` reads as JSON is whole, and there is always one to
    resume from after a kill during a save (the save itself is redone)."""
    if not folder.is_dir():
        return None
    numbered = sorted((p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name[11:].isdigit()), key=lambda p: int(p.name[11:]))
    for checkpoint in reversed(numbered):
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())
            return str(checkpoint)
        except (OSError, ValueError):
            log.warning("%s: a save that did not finish (no readable trainer_state.json); resuming before it", checkpoint)
            if int(os.environ.get("RANK", "0")) == 0:  # the Trainer saves it again when it gets there
                shutil.rmtree(checkpoint)
    return None


def load_model(name: str, dtype: str, attn_implementation: str | None, lora: LoraSettings):
    """The model to train: ``name`` in ``dtype``, wrapped with LoRA adapters when ``lora.enabled``."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if lora.enabled:
        from peft import get_peft_model

        model = get_peft_model(model, lora.peft_config())
    return model


def check_settings(cfg: SFTConfig) -> None:
    """What the declarations (sft/config.py, checked at load) cannot say alone, and the model and
    the data present and of their kind (etagent.settings.check_paths: files and headers only)."""
    # transformers reads max_steps -1 as "train for train.epochs"
    if cfg.train.max_steps == 0:
        raise SettingError("train.max_steps", "must be at least 1, or -1 to train for train.epochs; got 0")
    if cfg.train.packing and cfg.attn_implementation != "flash_attention_2":
        raise SettingError(
            "train.packing",
            "needs attn_implementation=flash_attention_2 (only it keeps packed examples apart); on CPU use train.sampling=group_by_length",
        )
    if cfg.train.fsdp and cfg.train.deepspeed:
        raise SettingError(
            "train.fsdp", f"is {cfg.train.fsdp!r}, and train.deepspeed is set too: the Trainer shards one way, set one of them"
        )
    if cfg.train.fsdp and "LOCAL_RANK" not in os.environ:  # the Trainer's own condition (its parallel mode)
        raise SettingError("train.fsdp", f"is {cfg.train.fsdp!r}, which shards across processes: launch with torchrun (scripts/sft.sh)")
    check_paths(SFTConfig, dataclasses.asdict(cfg))


@dataclass
class SFTPlan:
    """What :func:`plan` checked and made, which the training uses as it is."""

    config: dict  # the resolved config, as the manifest records it
    tokenizer: Any
    dataset: list[dict]  # the tokenized examples: input_ids, labels, length
    data_report: dict
    args: Any  # the Trainer's TrainingArguments


def plan(cfg: SFTConfig) -> SFTPlan:
    """Everything SFT can refuse, before the output folder is claimed, the cheap first: the
    settings and the inputs present (:func:`check_settings`), every example read; then the
    optional packages the settings ask for, the model's weights against its config, LoRA's target
    modules in the model, every example tokenized (none left is refused), and the
    Trainer's arguments built (with a ZeRO-3 config they register DeepSpeed with transformers, so
    that from_pretrained builds the model partitioned across the ranks)."""
    check_settings(cfg)
    examples = load_examples(cfg.data.path, cfg.data.format)  # a malformed row is refused in about a second
    check_attention("attn_implementation", cfg.attn_implementation)
    if cfg.train.deepspeed:
        check_installed("train.deepspeed", "deepspeed", "DeepSpeed (train.deepspeed)")
    if cfg.wandb.enabled:
        check_installed("wandb.enabled", "wandb", "wandb.enabled=true")
    check_model_weights(SFTConfig, dataclasses.asdict(cfg))
    if cfg.lora.enabled:
        cfg.lora.check_targets(cfg.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    rows, data_report = build_dataset(examples, tokenizer, cfg.cutoff_len)
    if not rows:
        raise UserError(f"{cfg.data.path}: no example left to train on ({data_report})")
    args = training_arguments(cfg.train, cfg.wandb, cfg.seed, Path(cfg.out_dir))
    return SFTPlan(
        config=dataclasses.asdict(cfg),
        tokenizer=tokenizer,
        dataset=[{"input_ids": r.input_ids, "labels": r.labels, "length": len(r)} for r in rows],
        data_report=data_report,
        args=args,
    )


def run(cfg: SFTConfig) -> dict:
    # a finished run is left as it is: nothing of it is read again or trained, so only its
    # settings are checked (the claim compares them with the manifest's)
    previous = completed(cfg.out_dir) if (Path(cfg.out_dir) / "model").is_dir() else None
    if previous is None:
        planned = plan(cfg)
    else:
        check_settings(cfg)
    config = dataclasses.asdict(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 holds the output directory
        return previous["metrics"] if previous is not None else train(cfg, Path(cfg.out_dir), planned)
    with claim_output(cfg.out_dir, stage="sft", schema=SFTConfig, config=config) as out:
        if previous is not None:
            # the Trainer, resumed from a checkpoint at max_steps, takes one step more and saves the
            # model again: a finished run is left as it is, so that what was made from it stays valid
            restore_manifest(out, previous)
            print(f"SFT already complete in {out} ({previous['counts']['steps']} steps); nothing to do (--restart to train again)")
            return previous["metrics"]
        return train(cfg, out, planned)


def train(cfg: SFTConfig, out: Path, planned: SFTPlan) -> dict:
    started = time.time()
    # -- setup ------------------------------------------------------------------------------
    import torch
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    out.mkdir(parents=True, exist_ok=True)
    callbacks = [step_progress(cfg.train.progress_bar), finite_weights_check(out)]
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    elif not torch.cuda.is_available():  # on the CPU: the cores other processes leave free (etagent/threads.py)
        callbacks.append(free_core_threads())
    tokenizer, dataset, data_report, args, config = planned.tokenizer, planned.dataset, planned.data_report, planned.args, planned.config
    log.info("data: %s", data_report)
    model = load_model(cfg.model, cfg.model_dtype, cfg.attn_implementation, cfg.lora)

    # -- train ------------------------------------------------------------------------------
    last = last_complete_checkpoint(Path(args.output_dir))
    logs_here = cfg.tensorboard.enabled and int(os.environ.get("RANK", "0")) == 0
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=Collator(tokenizer.pad_token_id, cfg.train.packing),
        processing_class=tokenizer,
        callbacks=callbacks + ([tensorboard_callback(out / "tensorboard", last)] if logs_here else []),
    )
    trainer.remove_callback(PrinterCallback)  # its dict per logging step: StepProgress's lines say it
    if last:
        log.info("resuming from %s", last)
    result = trainer.train(resume_from_checkpoint=last)

    # -- save -------------------------------------------------------------------------------
    model_dir = out / "model"
    if cfg.lora.enabled:  # a plain model directory, usable by vLLM without peft
        merged = trainer.model.merge_and_unload()
        if trainer.is_world_process_zero():
            merged.save_pretrained(model_dir)
    else:
        trainer.save_model(str(model_dir))  # gathers ZeRO-3 / FSDP shards
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics = {
        "data": data_report,
        "steps": trainer.state.global_step,
        "train_loss": round(result.training_loss, 5),
        "final_logged_loss": losses[-1] if losses else None,
        "resumed_from": last,
    }
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(model_dir)
        (out / "loss_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        write_manifest(
            out,
            stage="sft",
            config=config,
            counts={"examples": data_report["kept"], "steps": trainer.state.global_step},
            seed=cfg.seed,
            started_at=started,
            metrics=metrics,
        )
        print(f"SFT done: {trainer.state.global_step} steps, final logged loss {metrics['final_logged_loss']}, model in {model_dir}")
    return metrics


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for cfg in stage_configs("sft", argv, prog="python -m etagent.sft.run", doc=__doc__, plan=plan):
        run(cfg)


if __name__ == "__main__":
    main()

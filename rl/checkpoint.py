"""What an RL run leaves on disk, and how it resumes.

- ``checkpoints/step_{k}/``: the training state to resume from, sharded: every rank writes its
  own shards of the policy (with LoRA, of its adapters alone) and of AdamW's state with
  ``torch.distributed.checkpoint`` (no rank gathers the model or the optimizer: at 7B that was
  92 GB on rank 0 per save), plus ``state.json`` (the step and its metrics), and with partial
  rollouts each rank's groups in flight (``in_flight_rank{r}.pkl``: a resumed run carries over
  what the uninterrupted one did). Written into ``step_{k}.tmp`` and renamed when every
  rank has finished, so a kill during a save leaves the previous checkpoint as the last complete
  one; only the last ``keep`` are kept.
- ``models/step_{k}/`` every ``export_every`` steps and ``model/`` at the end: the policy as a
  plain ``save_pretrained`` folder in the export dtype (bf16 for the paper: 15 GB at 7B, not
  the float32 training copy), which the next curriculum stage, the evaluation and vLLM load as it
  is; with LoRA, the merged weights, or the adapters alone as peft's adapter folder
  (``lora.export``). Gathered to rank 0 bucket by bucket (rl/weights.py) and written from there.

A shared filesystem is assumed across nodes (every rank writes into the same folder).

What it does not do: decide when to save (rl/trainer.py).
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from etagent.config import LoraSettings
from etagent.rl.adapters import save_adapter
from etagent.rl.weights import adapter_weights, stream_weights


def trained_state(policy, optimizer) -> tuple[dict, dict]:
    """The sharded state dicts of what is trained and of its optimizer state: with LoRA the
    adapters alone (the frozen base is read from the stage's model again on resume), without it
    every weight. A frozen weight tied to another (the output embedding) is left out under each of
    its names, which torch's ``ignore_frozen_params`` does for the first name only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(policy, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    frozen = {name for name, p in policy.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optimizer_state


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (one whose ``state.json`` was written and which was renamed
    from its ``.tmp`` folder), or None."""
    steps = []
    for folder in (out / "checkpoints").glob("step_*"):
        number = folder.name.removeprefix("step_")
        if number.isdigit() and (folder / "state.json").exists():
            if not (folder / "state").is_dir():
                raise ValueError(
                    f"{folder} is a checkpoint of an earlier version of the toolkit (a save_pretrained folder and optimizer.pt, "
                    "no sharded state/): it cannot be resumed; start again in a new out_dir, or with the model it holds as `model`"
                )
            steps.append((int(number), folder))
    return max(steps)[1] if steps else None


def save_checkpoint(out: Path, step: int, policy, optimizer, metrics: dict, keep: int, in_flight: list | None = None) -> Path:
    """Every rank writes its shards of the policy and the optimizer into ``checkpoints/step_{k}``,
    and with partial rollouts its groups in flight (``in_flight_rank{r}.pkl``); the older
    checkpoints beyond ``keep`` go."""
    import torch.distributed.checkpoint as dcp

    folder = out / "checkpoints" / f"step_{step}"
    tmp = folder.with_name(folder.name + ".tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # what a killed save left
    dist.barrier()
    if in_flight is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / f"in_flight_rank{dist.get_rank()}.pkl").write_bytes(pickle.dumps(in_flight))
    model_state, optimizer_state = trained_state(policy, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / "state")
    if dist.get_rank() == 0:
        (tmp / "state.json").write_text(json.dumps({"step": step, "metrics": metrics}) + "\n")
        commit(tmp, folder)
        for old in sorted(
            (p for p in (out / "checkpoints").glob("step_*") if p.name.removeprefix("step_").isdigit()),
            key=lambda p: int(p.name.removeprefix("step_")),
        )[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return folder


def commit(tmp: Path, folder: Path) -> None:
    """The checkpoint becomes complete: its folder takes its final name."""
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


def load_in_flight(folder: Path) -> list:
    """This rank's groups in flight at the checkpoint (partial rollouts). The file is this run's
    own, written by :func:`save_checkpoint`: pickle is read from nowhere else."""
    path = folder / f"in_flight_rank{dist.get_rank()}.pkl"
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: the checkpoint holds no groups in flight for this rank (rollout.partial was off when it was saved)"
        )
    return pickle.loads(path.read_bytes())


def load_checkpoint(folder: Path, policy, optimizer) -> dict:
    """Every rank reads its shards back into the policy and the optimizer; returns state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state, optimizer_state = trained_state(policy, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder / "state")  # every tensor asked for must be in the checkpoint
    # strict=False: the frozen weights are not in it (they were read from the stage's model)
    set_state_dict(
        policy,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=False, ignore_frozen_params=True),
    )
    return json.loads((folder / "state.json").read_text())


@dataclass(frozen=True)
class AdapterExport:
    """Export LoRA's adapters alone, as peft's adapter folder over the model at ``base``."""

    settings: LoraSettings
    base: str


def export_model(
    target: Path,
    lm,
    tokenizer,
    dtype: torch.dtype,
    bucket_bytes: int,
    adapter: AdapterExport | None = None,
    dropout: dict[str, float] | None = None,
) -> None:
    """``lm`` (the transformers model inside the sharded policy) as a save_pretrained folder in
    ``dtype`` at ``target`` (with LoRA: merged), or its adapters alone as peft's adapter folder
    (``adapter``), whole or not at all: gathered bucket by bucket, kept on rank 0's host memory
    only, written to ``target.tmp`` and renamed. ``dropout``: the model's own dropout
    probabilities, which training ran without (rl/policy.py's switch_off_dropout), written back
    into the config."""
    rank = dist.get_rank()
    weights = {}
    for name, tensor in adapter_weights(lm, dtype) if adapter else stream_weights(lm, dtype, bucket_bytes):
        if rank == 0:
            weights[name] = tensor.cpu()
        del tensor
    if rank == 0:
        tmp = target.with_name(target.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        if adapter:
            save_adapter(tmp, weights, adapter.settings, adapter.base)
        else:
            lm.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            # the config says what the weights are: the export dtype, not the training copy's float32
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            config.update(dropout or {})
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    dist.barrier()

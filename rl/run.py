"""RL: GRPO with the efficiency reward on a Pareto-selected parquet, one readable step.

    python -m etagent.rl.run [--preset tiny|paper] [overrides]           # or: etagent rl ...
    torchrun --nproc_per_node=2 -m etagent.rl.run ...                    # FSDP2 across processes
    bash scripts/rl.sh ...                                       # the same, with launchers

Reads the RL parquet of a curriculum stage (``data.train``, as ``pareto/`` writes it) and a
policy (``model``: a ``save_pretrained`` folder); writes into ``out_dir``: ``metrics.jsonl`` (one
line per step), ``rollouts/step_{k}.jsonl`` (every rollout with its reward terms and its text by token origin),
``checkpoints/step_{k}/`` (the sharded training state, the last ``train.keep_checkpoints``),
``models/step_{k}/`` (every ``train.export_every`` steps) and ``model/`` (the final policy),
plain ``save_pretrained`` folders the next stage and the evaluation load as they are, and
``manifest.json``. A rerun resumes from the last complete checkpoint.

The recipe: setup (process group, the sharded policy, the optimizer, the rollout engine, the
data, all settings checked before any work) -> ``train_step`` per step (rl/trainer.py) -> the final model.
One step, as named and timed phases (``timing_s/<phase>`` in the metrics):

1. generate: n rollouts per prompt through the agent loop with the real tools (``rollout.kind``:
   ARPO's entropy-branching tree, or n independent samples; rl/rollout.py), sampled by the
   colocated engine (``engine.kind``): ``hf``, the policy module itself (it shares the weights:
   nothing to copy), or ``vllm``, one vLLM engine per rank in the trainer's process (torchrun),
   asleep outside this phase and the validation; with ``rollout.partial``, more groups than the
   step trains on, the unfinished ones carried into the next step (rl/rollout.py's
   PartialRollout, its groups in flight kept in each checkpoint);
2. reward: the efficiency reward per prompt's group (rl/reward.py), sigmas decayed linearly over
   the run as in the paper;
3. advantage: GRPO, the group's mean and unbiased std;
4. balance (more than one rank): each mini-batch's sequences re-dealt over the ranks so that each
   holds as many as the plan says and about as many tokens (rl/batch.py's balanced_partition);
5. old_logprobs (vllm, or partial rollouts with stale_tokens=tis; rl/actor.py): the policy's log-probabilities of the sampled tokens before the
   update, and their mismatch with vLLM's own; the update corrects for it by truncated importance
   sampling (``algorithm.tis_cap``, rl/algorithm.py). The hf engine samples with the
   policy module and its current weights, so its log-probabilities are the old ones already
   (their mismatch with the trainer's forward is measured in the update's first mini-batch).
   Every log-probability is of the distribution sampled from, softmax(logits / T), as verl's
   actor computes them;
6. ref_logprobs (only with ``algorithm.kl_coef`` > 0): the same under a frozen copy of the
   run's starting policy;
7. update (rl/actor.py): for each mini-batch (``mini_batch_prompts`` x n sequences over all ranks; rl/batch.py's
   plan), the dual-clip PPO loss (plus the KL term, when on; AEPO's entropy-balanced clipping
   and entropy-aware advantage, when on) as an exact token mean over the mini-batch
   (micro-batches: rows of similar length within a token budget, packed without padding under
   flash-attention), one AdamW step with gradient clipping, none when the gradient is not finite
   (the run stops there);
8. sync: the engine brought to the updated weights (vllm: streamed from their shards,
   rl/weights.py; hf: nothing, it is the policy). What differs between the engines is in one
   object, rl/engine.py, which the trainer calls without asking which kind it is;
9. validate: every ``validate_every`` steps;
10. save: the rollouts, then the sharded checkpoint every ``save_every`` steps (rl/checkpoint.py),
   then the exported model when one is due.

The policy is sharded with FSDP2 (rl/policy.py: ``fully_shard`` per decoder layer, then the
root; gloo on CPU, NCCL on GPUs), also in one process. Each rank rolls out its share of the
step's prompts; during generation with the hf engine every layer stays gathered, so ranks that
decode different lengths never wait on each other.

This module is the command line and the run's plan (:func:`plan`): everything RL can refuse is
checked here, before the output folder is claimed, so that a refused run writes nothing and a
corrected rerun needs no ``--restart``: how the settings go together first (about a second), then
the inputs and the model's files (its weights against its config), the engine, what the settings
ask of this machine (the device, the optional packages, the batch plan over the processes, the
tools, LoRA's target modules) and the data under the model's tokenizer. The trainer
(rl/trainer.py: setup, the step's phases, the loop over steps) refuses nothing.

What it does not do: choose a stage's data (pareto/) or chain the stages
(scripts/rl_curriculum.sh runs data, RL and evaluation per stage).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from etagent.errors import SettingError, exit_on_user_error
from etagent.gateway.harness import check_gateway
from etagent.rl.config import RLConfig
from etagent.rundir import claim_output
from etagent.settings import check_attention, check_device, check_installed, check_model_weights, check_paths

log = logging.getLogger("rl")


def check_gateway_rollout(cfg: RLConfig) -> None:
    """``rollout.kind=gateway``: a harness command that can start, the gateway's packages, and no
    partial rollouts (a session is driven by the harness to its end: nothing can stop it at a
    step's boundary and carry it over)."""
    if not cfg.rollout.gateway.harness:
        raise SettingError(
            "rollout.gateway.harness", "is null, and rollout.kind=gateway runs it: give the harness command (examples/openai_harness.py)"
        )
    check_gateway("rollout.gateway", cfg.rollout.gateway)
    if cfg.rollout.partial:
        raise SettingError("rollout.partial", "is true, and a gateway session runs to its end in the harness: set rollout.partial=false")


def check_settings(cfg: RLConfig) -> None:
    """What the declarations (rl/config.py, checked at load) cannot say alone, how settings go
    together; then the model and data present and of their kind (etagent.settings.check_paths:
    files and headers only). (RL trains ``model``; the engine group's ``model`` is not read.)"""
    if cfg.train.share_prefixes and cfg.train.attn_implementation == "flash_attention_2":
        raise SettingError(
            "train.share_prefixes",
            "is true, and flash_attention_2's packed sequences cannot express a prefix tree (each token attending to its "
            "ancestors): set train.share_prefixes=false, or train.attn_implementation=sdpa",
        )
    if cfg.rollout.kind == "tree" and cfg.rollout.initial_rollouts > cfg.rollout.n:
        raise SettingError(
            "rollout.initial_rollouts",
            f"is {cfg.rollout.initial_rollouts}, more than rollout.n={cfg.rollout.n}: the tree starts that many of the n "
            "rollouts of each prompt; set it <= rollout.n (ARPO: 8 of 16)",
        )
    if cfg.rollout.partial and cfg.rollout.stale_tokens == "tis" and cfg.algorithm.tis_cap is None:
        raise SettingError(
            "algorithm.tis_cap",
            "is null, and partial rollouts with stale_tokens=tis weigh each token against the weights that sampled it, "
            "truncated at tis_cap: set it (verl: 2) or rollout.stale_tokens=mask",
        )
    if cfg.rollout.partial and cfg.rollout.on_stale == "wait":
        # waiting for its oldest groups, a step trains on groups at most ceil(extra / share) steps old
        share = max(1, cfg.data.prompts_per_step // int(os.environ.get("WORLD_SIZE", "1")))
        oldest = -(-cfg.rollout.partial_extra // share)
        if oldest > cfg.rollout.max_staleness:
            raise SettingError(
                "rollout.max_staleness",
                f"is {cfg.rollout.max_staleness}, and with on_stale=wait a step's groups can be up to ceil(partial_extra / "
                f"prompts per process) = {oldest} versions old: raise it to {oldest}, lower rollout.partial_extra, or set on_stale=drop",
            )
    if cfg.lora.enabled and cfg.lora.dropout != 0:
        # dropout makes the trainer's forward a different function from the one that sampled
        raise SettingError(
            "lora.dropout",
            f"is {cfg.lora.dropout}: RL's ratio compares the trainer's log-probabilities with the sampler's, "
            "which dropout would make differ; set lora.dropout=0",
        )
    if cfg.rollout.kind == "gateway":
        check_gateway_rollout(cfg)
    if cfg.rollout.kind == "tree" and cfg.rollout.top_logprobs == 0:  # the engines measure entropy only where asked for them
        raise SettingError("rollout.top_logprobs", "is 0, and the tree branches on entropies measured with them: set it >= 1 (ARPO: 10)")
    # the policy gradient is of the distribution the rollouts were drawn from: softmax(logits / T).
    # The trainer's log-probabilities are over the whole vocabulary, so a truncated or reshaped
    # sampling distribution (top-p, top-k, min-p, a repetition penalty) would bias the ratio and
    # TIS (TRL measured a mean ratio of 0.965 at top-k 20): refused rather than replayed.
    s = cfg.agent.sampling
    for key, value, neutral in (
        ("top_p", s.top_p, 1.0),
        ("top_k", s.top_k, 0),
        ("min_p", s.min_p, 0.0),
        ("repetition_penalty", s.repetition_penalty, 1.0),
    ):
        if value != neutral:
            raise SettingError(
                f"agent.sampling.{key}",
                f"is {value}: RL samples from the policy's whole distribution (its log-probabilities are the trainer's, "
                f"over the whole vocabulary); set agent.sampling.{key}={neutral}",
            )
    if cfg.agent.sampling.temperature <= 0:
        raise SettingError(
            "agent.sampling.temperature",
            f"must be a number > 0, got {cfg.agent.sampling.temperature}: RL's policy gradient needs a distribution (0 is greedy)",
        )
    check_paths(RLConfig, dataclasses.asdict(cfg))


def check_rows(cfg: RLConfig) -> None:
    """Every row of the training and validation data readable as a prompt, without loading a
    tokenizer or torch: a malformed row is refused in about a second."""
    from etagent.rl.rollout import read_prompts

    question_format = cfg.data.question_format
    read_prompts(cfg.data.train, question_format=question_format, rerender_prompts=cfg.data.rerender_prompts)
    if cfg.data.validation:
        own_split = dataclasses.replace(question_format, split=cfg.data.validation_split)
        read_prompts(
            cfg.data.validation, question_format=own_split, rerender_prompts=cfg.data.rerender_prompts, split_key="data.validation_split"
        )


def check_data(cfg: RLConfig) -> None:
    """Each prompt within ``data.max_prompt_tokens`` under the model's tokenizer, and at least a
    step's prompts (``data.prompts_per_step``), before the output folder is claimed. The trainer's
    setup reads them again (rl/trainer.py's read_data)."""
    from transformers import AutoTokenizer

    from etagent.rl.trainer import read_data

    prompts, _, _ = read_data(cfg, AutoTokenizer.from_pretrained(cfg.model))
    if len(prompts) < cfg.data.prompts_per_step:
        raise SettingError(
            "data.prompts_per_step", f"is {cfg.data.prompts_per_step}, more than the {len(prompts)} prompts of {cfg.data.train}"
        )


def check_machine(cfg: RLConfig) -> None:
    """What the settings ask of this machine and this launch: the device, the optional packages,
    the batch plan over the processes torchrun started (WORLD_SIZE), the tools, and LoRA's target
    modules in the model."""
    from etagent.rl.batch import batch_plan
    from etagent.tools.executor import check_tools

    check_device("train.device", cfg.train.device)
    check_attention("train.attn_implementation", cfg.train.attn_implementation)
    if cfg.wandb.enabled:
        check_installed("wandb.enabled", "wandb", "wandb.enabled=true")
    batch_plan(cfg.data.prompts_per_step, cfg.rollout.n, cfg.train.mini_batch_prompts, int(os.environ.get("WORLD_SIZE", "1")))
    check_tools(cfg.tools)
    check_model_weights(RLConfig, dataclasses.asdict(cfg))
    if cfg.lora.enabled:
        cfg.lora.check_targets(cfg.model)


def plan(cfg: RLConfig) -> None:
    """Everything RL can refuse, before the output folder is claimed (the module docstring says
    in which order), the cheap first: the settings, the inputs present and the data's rows; then
    the engine, the machine and the model's weights, the data under the tokenizer."""
    check_settings(cfg)
    check_rows(cfg)
    # rl/engine.py and the trainer import torch, transformers and the engines: only once the
    # settings and the rows passed, so that those refusals answer in about a second
    from etagent.rl.engine import check_engine_settings

    check_engine_settings(cfg)
    check_machine(cfg)
    check_data(cfg)


def run(cfg: RLConfig) -> list[dict]:
    """Train from the last checkpoint in cfg.out_dir (or cfg.model); return the metrics of the steps run."""
    plan(cfg)
    from etagent.rl.trainer import train

    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 holds the output directory
        return train(cfg)
    config = dataclasses.asdict(cfg)
    with claim_output(cfg.out_dir, stage=f"rl/stage{cfg.rl_stage}", schema=RLConfig, config=config):
        return train(cfg)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for cfg in stage_configs("rl", argv, prog="python -m etagent.rl.run", doc=__doc__, plan=plan):
        run(cfg)


if __name__ == "__main__":
    main()

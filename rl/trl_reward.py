"""Our efficiency reward inside TRL's ``GRPOTrainer`` (trl 1.16): a reward function with TRL's
signature, and our questions as a TRL prompt dataset in the tag protocol.

    from trl import GRPOConfig, GRPOTrainer
    from etagent.rl.trl_reward import EfficiencyReward, prompt_dataset

    dataset = prompt_dataset(questions)  # prompt: our system prompt + the question; answer, kind, id
    reward = EfficiencyReward(num_generations=8, sigma_tool=0.2, sigma_length=0.5)  # mode="paper" for the paper's
    trainer = GRPOTrainer(model=..., reward_funcs=reward, train_dataset=dataset, args=GRPOConfig(num_generations=8, ...))

How TRL calls a reward function: once per generation batch on each process, with keyword
arguments ``prompts``, ``completions`` (the decoded text, or one assistant message each when the
prompts are chat messages), ``completion_ids`` (the sampled ids, cut after EOS), every dataset
column (one value per completion), ``trainer_state``, ``log_metric`` and ``log_extra``. Its
sampler puts the ``num_generations`` completions of a prompt next to each other, so each run of
``num_generations`` is one prompt's group, and :func:`etagent.rl.reward.efficiency_reward` runs on it:
T from the paired tags in the completion's text, the lengths from ``completion_ids``, the gold
answers from the ``answer`` column (a list of strings, as our questions have, or one string) or
the dataset's own ``solution`` or ``ground_truth``, the kind (math or qa) from ``kind=`` for every
row, else the ``kind`` column, else inferred from the gold answers. The group is why
``num_generations`` is given: a run of equal prompts cannot tell one group from two neighbouring
groups of a question the dataset holds twice, nor show a group cut in two. TRL cuts one between
processes when a process's share of the generation batch (``per_device_train_batch_size x
steps_per_generation``) is not a multiple of ``num_generations``; the reward then refuses it, as
it refuses evaluation with a different ``num_generations_eval``.

Both modes read the whole completion: there is no tool result in it (below), and every token of
it was sampled. The sigmas stay constant through the run (our trainer decays them linearly
within a stage, ``reward.decay``).

What TRL does not do, and what still needs our trainer (``rl/run.py``):
- tool execution in our protocol: TRL samples each completion in one go, to EOS or
  ``max_completion_length``. A ``<python>`` or ``<search>`` call the model writes is never run
  and no ``<result>`` is inserted (TRL's own ``tools`` are function calls in the chat template's
  format, not our tags), so f_tool counts the calls the model wrote, and an answer after one
  rests on no result;
- the tools' token masks: with no tool output inserted there is nothing to mask; in our trainer
  the loss skips every inserted token;
- ARPO's entropy-branching tree: TRL samples ``num_generations`` independent completions (plain
  GRPO groups).

What this module does not do: import TRL (the function is plain Python over TRL's arguments) or
configure the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from etagent import protocol
from etagent.question_formats import inferred_kind
from etagent.records import Question
from etagent.rl.reward import DATA_SOURCES, efficiency_reward

DATA_SOURCE_OF_KIND = {kind: source for source, kind in DATA_SOURCES.items()}
# The columns that may hold a row's gold answers, in order: ours (prompt_dataset), TRL's math
# datasets' (DeepMath-103K, NuminaMath-TIR: ``solution``, which TRL's own accuracy_reward reads),
# and verl's name for it.
GOLD_COLUMNS = ("answer", "solution", "ground_truth")


def prompt_dataset(questions: Sequence[Question]):
    """A ``datasets.Dataset`` TRL's GRPOTrainer trains on: ``prompt`` (the chat messages every
    stage renders, :func:`etagent.protocol.prompt_messages`: our system prompt, then the
    question), and ``answer``, ``kind`` and ``id`` for the reward."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": protocol.prompt_messages(q.question), "answer": list(q.answer), "kind": q.kind, "id": q.id} for q in questions]
    )


def completion_text(completion) -> str:
    """A completion as TRL passes it: the text, or a list holding one assistant message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


@dataclass(frozen=True)
class EfficiencyReward:
    """TRL reward function: rl/reward.py's efficiency reward of each completion, within its
    prompt's group of ``num_generations`` (GRPOConfig's value). The gold answers from the
    dataset's ``answer``, ``solution`` or ``ground_truth`` column (:data:`GOLD_COLUMNS`, the first
    it has). ``kind``: math or qa for every row; None reads each row's ``kind`` column, or where
    the dataset has none infers it from the gold answers (a number or LaTeX, ``$72$``, is math)."""

    num_generations: int
    sigma_tool: float
    sigma_length: float
    mode: str = "default"
    kind: str | None = None

    def __call__(self, prompts, completions, completion_ids, log_metric=None, **columns) -> list[float]:
        n = self.num_generations
        if len(completions) % n:
            raise ValueError(
                f"{len(completions)} completions are not whole groups of {n}: give EfficiencyReward GRPOConfig's num_generations, "
                "and make each process's generation batch (per_device_train_batch_size x steps_per_generation) a multiple of it"
            )
        column = next((c for c in GOLD_COLUMNS if c in columns), None)
        if column is None:
            raise ValueError(f"the dataset has no gold-answer column: name it one of {', '.join(GOLD_COLUMNS)}")
        answer = columns[column]
        rewards, raw, calls = [], [], []
        for start in range(0, len(completions), n):
            group = range(start, start + n)
            if any(prompts[i] != prompts[start] for i in group):
                raise ValueError(
                    f"completions {start} to {start + n - 1} answer different prompts: TRL's groups are runs of num_generations={n}"
                )
            golds = answer[start]
            golds = [golds] if isinstance(golds, str) else [str(g) for g in golds]
            kind = self.kind or (columns["kind"][start] if "kind" in columns else inferred_kind(golds))
            if kind not in DATA_SOURCE_OF_KIND:
                raise ValueError(f"kind must be one of {', '.join(DATA_SOURCE_OF_KIND)}, got {kind!r}")
            terms = efficiency_reward(
                DATA_SOURCE_OF_KIND[kind],
                golds,
                [completion_text(completions[i]) for i in group],
                [len(completion_ids[i]) for i in group],
                self.sigma_tool,
                self.sigma_length,
                self.mode,
            )
            rewards += terms.rewards
            raw += terms.raw
            calls += terms.tool_calls
        if log_metric is not None:  # TRL averages these per logging step, beside the reward
            log_metric("efficiency/raw", float(np.mean(raw)))
            log_metric("efficiency/tool_calls", float(np.mean(calls)))
        return rewards

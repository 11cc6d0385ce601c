"""The prompts of an RL run and the rollouts of one step.

:func:`read_prompts` turns the RL parquet (verl's schema, as ``pareto/`` writes it or as the
paper's files are) into questions for the agent loop; :class:`GroupRollout` is plain GRPO
sampling: n rollouts per prompt through the agent loop, each step with its own seed. The ARPO
tree rollout (entropy branching) implements the same ``generate`` and replaces it by config.

What this module does not do: score the rollouts (rl/reward.py) or turn them into tensors
(rl/batch.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from etagent import protocol
from etagent.agent import AgentLoop, TrajectoryState
from etagent.records import Question, RecordError, RLRow, read_records


@dataclass(frozen=True)
class Prompt:
    """One row of the RL parquet: the question the agent loop answers, and what the reward reads
    (``index`` groups its rollouts, ``data_source`` picks the scoring)."""

    question: Question
    index: int
    data_source: str


def read_prompts(path: str | Path, tokenizer=None, max_prompt_tokens: int | None = None) -> list[Prompt]:
    """The rows of an RL parquet as prompts. The system turn must be the protocol's prompt: the
    agent loop renders that one, so a different one would train on prompts the data never had.
    With ``max_prompt_tokens``, a longer prompt is an error naming its row, as verl's
    ``truncation=error`` (a cut question would be scored against its full answer)."""
    prompts, seen = [], set()
    for row_number, row in enumerate(read_records(path, RLRow), start=1):
        roles = [m.role for m in row.prompt]
        if roles != ["system", "user"]:
            raise RecordError(path, row_number, "prompt", f"expected a system and a user turn, got {roles}")
        if row.prompt[0].content != protocol.SYSTEM_PROMPT:
            raise RecordError(
                path, row_number, "prompt.0.content", "the system prompt is not the protocol's (etagent.protocol.SYSTEM_PROMPT)"
            )
        index = row.extra_info.index
        if index in seen:
            raise RecordError(path, row_number, "extra_info.index", f"{index} is not unique: the reward groups rollouts by it")
        seen.add(index)
        question = Question(
            id=row.extra_info.question_id or f"{row.data_source}-{index}",
            question=row.prompt[1].content,
            answer=row.reward_model.ground_truth,
            source=row.data_source,
            kind=row.ability,
        )
        if max_prompt_tokens is not None:
            length = len(protocol.encode_prompt(tokenizer, question.question))
            if length > max_prompt_tokens:
                raise RecordError(path, row_number, "prompt", f"{length} tokens, over data.max_prompt_tokens ({max_prompt_tokens})")
        prompts.append(Prompt(question=question, index=index, data_source=row.data_source))
    return prompts


class GroupRollout:
    """Plain GRPO rollouts: ``n`` independent samples per prompt."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n

    def generate(self, loop: AgentLoop, prompts: list[Prompt], step: int, seed: int) -> list[list[TrajectoryState]]:
        """One group of ``n`` finished trajectories per prompt, in prompt order. Trajectory ids
        name the step, the prompt and the sample; the seed is the run's plus the step, so a
        resumed step draws what the uninterrupted one did."""
        states = [
            loop.new(p.question, f"step{step}/{p.index}/{k}", seed=seed + step, stage="rl", round=step)
            for p in prompts
            for k in range(self.n)
        ]
        asyncio.run(loop.run(states))
        return [states[i * self.n : (i + 1) * self.n] for i in range(len(prompts))]

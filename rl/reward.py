"""The efficiency reward of the paper's RL stage, as small pure functions over one question's group.

For rollout i of a group (the n rollouts of one prompt):

    R_i = raw_i * f_tool_i * f_length_i + f_format_i
    f_tool_i   = 2 / (1 + exp(sigma_tool * (T_i - mean T)))        T: tool calls in the text
    f_length_i = 2 / (1 + exp(sigma_length * (z_i - mean z)))      z: z-scored lengths (population
                                                                   std; all 0 when it is 0)
    f_format_i = -1 when the format check fails, else 0

Both factors are 1 at the group mean and above 1 below it (fewer calls, shorter), in (0, 2).
The sigmas decay linearly within a curriculum stage (:func:`sigma_factor`). T counts the tool
calls as the paper does (:func:`etagent.protocol.count_tool_calls`: paired tags anywhere).

Two modes, named as such (docs/paper-code.md §C4.3):

- ``paper``: the released code, behaviour for behaviour (:mod:`etagent.rl.paper_reward` reads the answer
  as it did). It scores the whole decoded response, tool results included (an answer block a
  tool printed counts as the policy's: the released code's loophole, kept in this mode). Math:
  0 without an ``<answer>...</answer>``, else the last box of the *whole* response against the
  *first* gold answer by the MATH string rules. QA: the last box of the *first* answer block,
  F1 after SQuAD normalisation and then ``strip_string(deepsearch=True)``, max over the gold
  answers; that strip deletes every space, so each side is one token and the "F1" is exact
  match without spaces ("river Kess" scores 0 against "Kess river bank", and "Kess River" 1
  against "the Kess river"). ``\\fbox{x}`` and ``\\boxed x`` score 0 there. The lengths the
  paper used count every response token, tool results included (the caller passes them).
- ``default``, the corrected one: it scores only what the policy wrote, which the caller passes
  (RL: the text with every tool result emptied, ``etagent.records.policy_text``, and the calls
  that ran as ``tool_calls``); the answer is read from the last answer block (its last box, or
  its text), math is right when it equals *any* gold answer (MATH rules or math-verify), QA is
  the token F1 with SQuAD normalisation, max over the gold answers; lengths count generated
  tokens only (again, the caller passes them).

:func:`etagent.rl.paper_reward.validation_score` is the paper's validation score, which differs from the
training reward.

What this module does not do: group rollouts (the caller passes one group), put the reward on a
token, or compute advantages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO

import numpy as np

from etagent import protocol, scoring
from etagent.errors import MissingInput, exit_on_user_error
from etagent.rl import paper_reward

MODES = ("paper", "default")
DATA_SOURCES = {"math_effi_rl": "math", "qa_effi_rl": "qa"}
SOURCE_OF_KIND = {kind: source for source, kind in DATA_SOURCES.items()}


def rl_data_source(data_source, ground_truth: Sequence[str]) -> str:
    """The RL data source a row's reward is computed as: ours as it is; another project's
    (``openai/gsm8k``, Search-R1's ``nq``, ``searchR1_hotpotqa``, ...) by the scoring it calls
    for (etagent.question_formats.kind_of_data_source), else by its gold answers (a number or
    LaTeX is math)."""
    from etagent.question_formats import inferred_kind, kind_of_data_source

    if data_source in DATA_SOURCES:
        return data_source
    kind = kind_of_data_source(data_source) or inferred_kind([str(g) for g in ground_truth])
    return SOURCE_OF_KIND[kind]


def kind_of(data_source: str) -> str:
    """ "math" or "qa" for the RL parquet's data sources; anything else is an error, as in the paper."""
    if data_source not in DATA_SOURCES:
        raise ValueError(f"data_source must be one of {', '.join(DATA_SOURCES)}, got {data_source!r}")
    return DATA_SOURCES[data_source]


def answer_block(response: str) -> str | None:
    """The text between the last ``<answer>`` and the ``</answer>`` after it (None without one)."""
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else response[start + len("<answer>") : end]


def raw_correctness(response: str, ground_truth: Sequence[str], data_source: str, mode: str = "default") -> float:
    """raw_i: math 0 or 1, QA an F1 in [0, 1]; 0 without an answer block, in both modes."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    kind = kind_of(data_source)
    if mode == "paper":
        return paper_reward.raw_score(kind, response, ground_truth)
    block = answer_block(response)
    if block is None or not ground_truth:
        return 0.0
    boxed = protocol.last_boxed(block)
    prediction = block.strip() if boxed is None else protocol.unwrap_text(boxed)
    if kind == "math":
        return float(scoring.math_equal(prediction, ground_truth))
    return scoring.best_over_golds(scoring.f1, prediction, ground_truth)


def relative_factor(values: Sequence[float], sigma: float) -> np.ndarray:
    """2 / (1 + exp(sigma * (v - mean v))) per member of the group."""
    values = np.asarray(values, dtype=float)
    if len(values) == 0:
        return values
    return 2.0 / (1.0 + np.exp(sigma * (values - values.mean())))


def length_zscores(lengths: Sequence[int]) -> np.ndarray:
    """Lengths z-scored within the group with the population std; all 0 when the std is 0."""
    lengths = np.asarray(lengths, dtype=float)
    std = lengths.std() if len(lengths) else 0.0
    return np.zeros_like(lengths) if std == 0 else (lengths - lengths.mean()) / std


def format_penalty(response: str) -> float:
    """-1 when :func:`etagent.protocol.validate_format` fails, else 0."""
    return 0.0 if protocol.validate_format(response) else -1.0


def sigma_factor(step: int, total_steps: int) -> float:
    """The paper's linear decay of both sigmas within a stage: 1 at step 1, 0 at the last step
    (steps count from 1); 0 for a stage of one step."""
    if total_steps <= 1:
        return 0.0
    return max(0.0, (total_steps - step) / (total_steps - 1))


@dataclass(frozen=True)
class GroupReward:
    """Per rollout of one group: the reward and every term of it."""

    rewards: list[float]
    raw: list[float]
    tool_calls: list[int]
    f_tool: list[float]
    f_length: list[float]
    f_format: list[float]

    def to_json(self) -> dict:
        return asdict(self)


def efficiency_reward(
    data_source: str,
    ground_truth: Sequence[str],
    responses: Sequence[str],
    lengths: Sequence[int],
    sigma_tool: float,
    sigma_length: float,
    mode: str = "default",
    tool_calls: Sequence[int] | None = None,
) -> GroupReward:
    """The training reward of every rollout of one question's group. ``lengths`` per response:
    all response tokens for ``paper``, generated tokens for ``default``. The sigmas are the
    effective ones (already multiplied by :func:`sigma_factor`). ``tool_calls``: the calls each
    response made, when the caller knows which ran (RL's default mode); else the paired tags in
    the text, as the paper counts them."""
    if len(lengths) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(lengths)} lengths")
    raw = [raw_correctness(r, ground_truth, data_source, mode) for r in responses]
    if tool_calls is not None and len(tool_calls) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(tool_calls)} tool-call counts")
    tool_calls = list(tool_calls) if tool_calls is not None else [protocol.count_tool_calls(r) for r in responses]
    f_tool = relative_factor(tool_calls, sigma_tool)
    z = length_zscores(lengths)
    f_length = relative_factor(z, sigma_length)
    f_format = [format_penalty(r) for r in responses]
    rewards = [c * t * n + f for c, t, n, f in zip(raw, f_tool, f_length, f_format)]
    return GroupReward(
        rewards=[float(x) for x in rewards],
        raw=[float(x) for x in raw],
        tool_calls=tool_calls,
        f_tool=[float(x) for x in f_tool],
        f_length=[float(x) for x in f_length],
        f_format=f_format,
    )


# ---------------------------------------------------------------------------------------------
# `etagent reward`: check a reward by hand

# Each field of a group and the JSON types it may have.
FIELDS = {
    "data_source": ((str,), "a string"),
    "ground_truth": ((list,), "a list of strings"),
    "responses": ((list,), "a list of strings"),
    "lengths": ((list,), "a list of integers"),
    "sigma_tool": ((int, float), "a number"),
    "sigma_length": ((int, float), "a number"),
}


def group_problems(group: dict) -> dict[str, str]:
    """What is wrong with one group's fields, by field (empty when nothing is). The mode and the
    sigmas are RL's reward settings and are checked by their declaration (rl/config.py
    RewardSettings: the sigmas finite and >= 0, 0 being the end of a stage's decay; a negative
    sigma rewards the longer answer with more tool calls, the opposite of the reward's purpose)."""
    from etagent.errors import SettingError
    from etagent.rl.config import RewardSettings
    from etagent.settings import validate

    lengths, responses = group["lengths"], group["responses"]
    problems = {
        "data_source": group["data_source"] not in DATA_SOURCES and f"must be one of {', '.join(DATA_SOURCES)}",
        "responses": not responses and "empty: a group has at least one response",
        "ground_truth": not any(str(g).strip() for g in group["ground_truth"]) and "no gold answer",
        "lengths": (len(lengths) != len(responses) and f"{len(lengths)} lengths for {len(responses)} responses")
        or (any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths) and "must be integers >= 0"),
    }
    settings = {
        "mode": group.get("mode", "default"),
        "sigma_tool": group["sigma_tool"],
        "sigma_length": group["sigma_length"],
        "decay": False,
    }
    try:
        validate(RewardSettings, settings)
    except SettingError as error:
        problems[error.key] = error.reason
    return {field: problem for field, problem in problems.items() if problem}


def reward_lines(source: IO[bytes], name: str, out: IO[str]) -> None:
    """One group per JSON line in, one line of rewards and terms out, written as each is done."""
    from etagent.records import RecordError, iter_json_objects

    for number, group in iter_json_objects(source, name):
        for field, (types, expected) in FIELDS.items():
            if field not in group:
                raise RecordError(name, number, field, "missing")
            if not isinstance(group[field], types) or isinstance(group[field], bool):
                raise RecordError(name, number, field, f"expected {expected}")
        for field, problem in group_problems(group).items():
            raise RecordError(name, number, field, problem)
        result = efficiency_reward(
            group["data_source"],
            [str(g) for g in group["ground_truth"]],
            [str(r) for r in group["responses"]],
            [int(n) for n in group["lengths"]],
            float(group["sigma_tool"]),
            float(group["sigma_length"]),
            group.get("mode", "default"),
        )
        out.write(json.dumps(result.to_json()) + "\n")
        out.flush()


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="etagent reward",
        description="The RL efficiency reward of each group, by hand. Reads JSON lines {data_source: math_effi_rl|qa_effi_rl, "
        "ground_truth: [str], responses: [str], lengths: [int], sigma_tool, sigma_length, mode: paper|default} and writes one "
        "line per group: {rewards, raw, tool_calls, f_tool, f_length, f_format}. See rl/reward.py.",
    )
    parser.add_argument("file", nargs="?", help="JSONL input (default: stdin)")
    args = parser.parse_args(argv)
    if args.file:
        if not os.path.isfile(args.file):
            raise MissingInput(f"{args.file}: no such file")
        with open(args.file, "rb") as f:
            reward_lines(f, args.file, sys.stdout)
    else:
        reward_lines(sys.stdin.buffer, "<stdin>", sys.stdout)

"""Our reward for verl users: ``compute_score`` (one response) and ``compute_score_batch`` (the
group-relative efficiency reward), with verl's custom-reward signatures.

Per response, in any verl, on our RL parquet (``data_source`` ``math_effi_rl`` / ``qa_effi_rl``) or
another project's (verl's GSM8K and MATH, Search-R1's ``{target: [...]}`` ground truth; any
``data_source``, scored as math or qa by etagent.rl.reward.rl_data_source)::

    custom_reward_function.path=/path/to/etagent/rl/verl_reward.py
    custom_reward_function.name=compute_score
    +custom_reward_function.reward_kwargs.mode=paper      # optional; default: the corrected mode

verl's per-response reward managers call it with keyword arguments (``data_source``,
``solution_str``, ``ground_truth``, ``extra_info``, plus the ``reward_kwargs``). It returns
verl's dict form: ``score`` (the reward), and ``raw``, ``format_penalty`` and ``tool_calls``,
which verl logs beside it. One response is its own group there, so f_tool = f_length = 1: this
is the reward the paper's released scripts trained with (both sigmas 0).

The whole efficiency reward, in verl 0.4 to 0.7.0, whose ``batch`` reward manager
(``verl/workers/reward_manager/batch.py``) hands the reward function the whole batch::

    reward_model.reward_manager=batch
    reward_model.use_reward_loop=false                          # verl 0.7.0 only (its default is true)
    custom_reward_function.path=/path/to/etagent/rl/verl_reward.py
    custom_reward_function.name=compute_score_batch
    +custom_reward_function.reward_kwargs.tokenizer_path=/path/to/the/policy
    +custom_reward_function.reward_kwargs.sigma_tool=0.2
    +custom_reward_function.reward_kwargs.sigma_length=0.5
    +custom_reward_function.reward_kwargs.mode=default          # or paper

That manager calls ``compute_score_batch(data_sources=, solution_strs=, ground_truths=,
extra_infos=, **reward_kwargs)`` once per batch (every rollout of every prompt, in the order
``trainer.balance_batch`` left them) and takes one dict per response, ``score`` and the terms.
Responses are grouped by ``data_source`` and ``extra_info["index"]``, which our RL parquet makes unique per question
(the paper's own manager grouped the same way; verl's GRPO ``uid`` is not passed to the reward),
and :func:`etagent.rl.reward.efficiency_reward` runs on each group. From verl 0.7.1 on (0.9.1 included)
rewards are computed one response at a time in verl's reward loop, the batch manager is no longer
reachable from the config, and only ``compute_score`` applies there; the manager class itself is
still verl's (``tests/test_trl_reward.py`` runs 0.9.1's ``BatchRewardManager`` with this function,
in a venv with verl).

What the batch function reads, and why:
- lengths: the batch manager does not pass them (it knows each response's token count, the
  attention mask's sum, and keeps it). So they are counted again by encoding each decoded
  response with the policy's tokenizer (``tokenizer_path``, loaded once per process). The
  response was decoded without special tokens, so the count leaves out EOS and can differ from
  the sampled ids by a token or so where re-encoding merges differently; z-scores do not move
  with a count shifted alike for the whole group. The count covers tool results too, as the
  paper's lengths did;
- text and tool calls: verl passes the decoded text only, which cannot tell a tool's result from
  what the policy wrote, so both modes read the whole response and count the paired tags in it,
  as ``compute_score`` does (the default mode in our trainer reads the policy's own tokens only);
- sigmas: constant through the run. verl tells a reward function nothing of the step, so the
  linear decay within a stage (our trainer's ``reward.decay``; the paper's fork passed its factor
  through its own manager) is not applied.

What still needs our trainer (``rl/run.py``): ARPO's entropy-branching tree, the tools' token
masks (train only on the policy's tokens) and tool execution in our tag protocol: verl's
tool-calling agent loop speaks its chat templates' function calls, not our ``<search>`` and
``<python>`` tags.

Importing this file needs our package in verl's environment: ``pip install /path/to/etagent``
(the core installs beside verl 0.9.1: transformers 5.10.4 there).
"""

from __future__ import annotations

from functools import lru_cache

from etagent.rl.reward import efficiency_reward, rl_data_source


def gold_answers(ground_truth) -> list[str]:
    """A row's ``reward_model.ground_truth`` as a list of gold answers: any sequence (a numpy
    array, as verl loads our parquet's list column), a single string or number (verl's GSM8K and
    MATH), or Search-R1's ``{"target": [...]}``."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(f"ground_truth is an object without 'target' (Search-R1's gold answers): {sorted(ground_truth)}")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, (str, int, float)):
        return [str(ground_truth)]
    return [str(g) for g in ground_truth]


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, mode: str = "default") -> dict:
    """The reward of one response to an RL-parquet prompt. ``ground_truth`` is the row's
    ``reward_model.ground_truth``: a list of gold answers (any sequence, a numpy array as verl
    loads it, a single string, or Search-R1's ``{target: [...]}``). ``data_source`` is ours, or
    any other project's, scored as the kind it calls for (etagent.rl.reward.rl_data_source)."""
    golds = gold_answers(ground_truth)
    # one response is its own group: f_tool = f_length = 1 whatever the sigmas, so pass 0
    terms = efficiency_reward(rl_data_source(data_source, golds), golds, [solution_str], [0], 0.0, 0.0, mode)
    return {
        "score": float(terms.rewards[0]),
        "raw": float(terms.raw[0]),
        "format_penalty": float(terms.f_format[0]),
        "tool_calls": int(terms.tool_calls[0]),
    }


@lru_cache(maxsize=4)
def policy_tokenizer(path: str):
    """The policy's tokenizer, loaded once per process (verl calls the reward every step)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def compute_score_batch(
    data_sources,
    solution_strs,
    ground_truths,
    extra_infos,
    *,
    tokenizer_path: str,
    sigma_tool: float,
    sigma_length: float,
    mode: str = "default",
) -> list[dict]:
    """The efficiency reward of every response of a batch, grouped by ``data_source`` and
    ``extra_info["index"]`` (a file that merges sources, Search-R1's NQ and HotpotQA, numbers each
    source's rows from 0): one dict per response, in the batch's order (``score`` and the terms
    verl logs beside it).

    Raises ValueError when a response has no index, or when one index holds responses to two
    questions (a data source or gold answers that differ): the groups would be wrong."""
    members: dict[object, list[int]] = {}
    for i, extra in enumerate(extra_infos):
        if "index" not in (extra or {}):
            raise ValueError(
                f"response {i}: extra_info has no 'index'; the group reward groups a prompt's responses by it (our RL parquet sets it)"
            )
        members.setdefault((str(data_sources[i]), extra["index"]), []).append(i)
    # one call for the batch: the fast tokenizer encodes a list in parallel
    lengths = [len(ids) for ids in policy_tokenizer(tokenizer_path)(list(solution_strs), add_special_tokens=False)["input_ids"]]
    scores: list[dict] = [{} for _ in solution_strs]
    for (data_source, index), group in members.items():
        golds = gold_answers(ground_truths[group[0]])
        for i in group[1:]:
            if gold_answers(ground_truths[i]) != golds:
                raise ValueError(
                    f"extra_info.index {index!r} of {data_source!r} holds responses to two questions: the index must be unique per question"
                )
        terms = efficiency_reward(
            rl_data_source(data_source, golds),
            golds,
            [solution_strs[i] for i in group],
            [lengths[i] for i in group],
            sigma_tool,
            sigma_length,
            mode,
        )
        for k, i in enumerate(group):
            scores[i] = {
                "score": terms.rewards[k],
                "raw": terms.raw[k],
                "format_penalty": terms.f_format[k],
                "tool_calls": terms.tool_calls[k],
                "f_tool": terms.f_tool[k],
                "f_length": terms.f_length[k],
                "length": lengths[i],
            }
    return scores

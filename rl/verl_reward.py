"""Our reward for verl users: ``compute_score`` with verl's custom-reward signature.

In a verl run on our RL parquet (``data_source`` ``math_effi_rl`` / ``qa_effi_rl``)::

    custom_reward_function.path=/path/to/etagent/rl/verl_reward.py
    custom_reward_function.name=compute_score
    +custom_reward_function.reward_kwargs.mode=paper      # optional; default: the corrected mode

verl's reward managers call it once per response, with keyword arguments (``data_source``,
``solution_str``, ``ground_truth``, ``extra_info``, plus the ``reward_kwargs``). It returns
verl's dict form: ``score`` (the reward), and ``raw``, ``format_penalty`` and ``tool_calls``,
which verl logs beside it.

What it computes: rl/reward.py's reward of one response, raw correctness plus the format
penalty, in either mode. The efficiency factors f_tool and f_length are relative to the other
rollouts of the same prompt and need their token lengths, which verl's per-response interface
does not pass; with them at 1 this is the reward the paper's released scripts trained with (both
sigmas 0). The group-relative reward runs in our trainer (``rl/run.py``) and by hand through
``etagent reward``.

Importing this file needs our package in verl's environment without its pinned dependencies
(verl pins an older transformers): ``pip install --no-deps -e /path/to/etagent`` and
``pip install math-verify pydantic numpy``.
"""

from __future__ import annotations

from rl.reward import efficiency_reward


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, mode: str = "default") -> dict:
    """The reward of one response to an RL-parquet prompt. ``ground_truth`` is the row's
    ``reward_model.ground_truth``: a list of gold answers (any sequence, a numpy array as verl
    loads it, or a single string)."""
    golds = [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]
    # one response is its own group: f_tool = f_length = 1 whatever the sigmas, so pass 0
    terms = efficiency_reward(data_source, golds, [solution_str], [0], 0.0, 0.0, mode)
    return {
        "score": float(terms.rewards[0]),
        "raw": float(terms.raw[0]),
        "format_penalty": float(terms.f_format[0]),
        "tool_calls": int(terms.tool_calls[0]),
    }

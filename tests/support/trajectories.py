"""Test helpers for trajectories and records: a response split into runs of equal mask value, and
direct rollout's trajectory lines as Pareto reads them."""

from __future__ import annotations


def mask_runs(mask: list[int], ids: list[int]) -> list[tuple[int, list[int]]]:
    """[(mask value, token ids)] for each maximal run of tokens with the same mask value."""
    runs, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        runs.append((mask[i], ids[i:j]))
        i = j
    return runs


def rollout_line(qid: str, kind: str, chains: list[tuple[float, int]], **extra) -> dict:
    """One line of direct_rollout's trajectories.jsonl with the fields Pareto reads."""
    return {
        "id": qid,
        "question": f"question {qid}?",
        "answer": ["7"],
        "source": "toy_python" if kind == "math" else "toy_search",
        "kind": kind,
        "trajectories": [
            {
                "id": f"{qid}/{k}",
                "text": "...",
                "judgement": {"metric": "f1", "score": c, "verdict": c >= 0.75},
                "tool_calls_executed": t,
                "tool_calls_written": t,
                "n_generated": 50 + t,
                "finish_reason": "answer",
            }
            for k, (c, t) in enumerate(chains)
        ],
        **extra,
    }

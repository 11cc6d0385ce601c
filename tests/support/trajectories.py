"""Test helper: a trajectory's response split into runs of equal mask value."""

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

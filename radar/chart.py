"""Draw the radar chart: one polygon per run on five axes, PNG and SVG, with its normalisation
written in the caption.

Correctness, Efficiency, Conciseness and Successful Execution are percentages: drawn on a fixed
0-100 scale. Reasoning Length (correctness per 1000 reasoning tokens) has no natural maximum: it
is drawn relative to the largest value among the runs in the chart (that run touches the rim).
Raw values are printed in the legend, with the redundant- and insufficient-call rates where the
evaluated questions say which calls they need.
"""

from __future__ import annotations

import math
from pathlib import Path

AXES = ("Correctness", "Efficiency", "Conciseness", "Successful Execution", "Reasoning Length")
PERCENT_AXES = AXES[:4]


def normalise(runs: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """Each run's five values on a 0-1 scale (see the module docstring)."""
    longest = max((r["Reasoning Length"] for r in runs.values()), default=0.0) or 1.0
    return {label: [r[a] / 100 for a in PERCENT_AXES] + [r["Reasoning Length"] / longest] for label, r in runs.items()}


def caption(rule: str) -> str:
    return (
        "Correctness, Efficiency, Conciseness and Successful Execution: percent, 0-100 scale. "
        "Reasoning Length: correctness per 1000 reasoning tokens, relative to the largest plotted value. "
        f"Successful Execution uses the {rule} rule. Axes are averages over the evaluated datasets."
    )


def draw(
    runs: dict[str, dict[str, float]],
    out: Path,
    rule: str = "corrected",
    behaviour: dict[str, tuple[float, float] | None] | None = None,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = normalise(runs)
    angles = [2 * math.pi * i / len(AXES) for i in range(len(AXES))]
    fig = plt.figure(figsize=(7.5, 8))
    ax = fig.add_axes([0.12, 0.2, 0.76, 0.7], polar=True)
    ax.set_theta_offset(math.pi / 2)
    ax.set_theta_direction(-1)
    ax.set_xticks(angles)
    ax.set_xticklabels(AXES, fontsize=10)
    ax.set_ylim(0, 1)
    ax.set_yticks([0.25, 0.5, 0.75, 1.0])
    ax.set_yticklabels(["25", "50", "75", "100"], fontsize=7, color="grey")
    for label, points in values.items():
        raw = runs[label]
        legend = (
            f"{label}: correctness {raw['Correctness']:.1f}, efficiency {raw['Efficiency']:.1f}, conciseness {raw['Conciseness']:.1f}, "
            f"execution {raw['Successful Execution']:.1f}, reasoning length {raw['Reasoning Length']:.2f}"
        )
        rates = (behaviour or {}).get(label)
        if rates is not None:
            legend += f"\n    tool calls: {rates[0]:.1f}% redundant, {rates[1]:.1f}% insufficient"
        ax.plot(angles + angles[:1], points + points[:1], linewidth=2, label=legend)
        ax.fill(angles + angles[:1], points + points[:1], alpha=0.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=8, frameon=False)
    text = caption(rule)
    fig.text(0.5, 0.02, text, ha="center", va="bottom", fontsize=7.5, wrap=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=150)
    fig.savefig(out.with_suffix(".svg"))
    plt.close(fig)
    return text

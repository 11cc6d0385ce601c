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
import textwrap
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


def legend_text(label: str, raw: dict[str, float], rates: tuple[float, float] | None) -> str:
    lines = [
        f"{label}: correctness {raw['Correctness']:.1f}, efficiency {raw['Efficiency']:.1f}, conciseness {raw['Conciseness']:.1f}",
        f"    execution {raw['Successful Execution']:.1f}, reasoning length {raw['Reasoning Length']:.2f}",
    ]
    if rates is not None:
        lines.append(f"    tool calls: {rates[0]:.1f}% redundant, {rates[1]:.1f}% insufficient")
    return "\n".join(lines)


# The figure's layout, in inches: the polar plot in a fixed square at the top (with room around
# it for the axis names), then the legend, then the caption, each as tall as its text. The
# legend and caption heights are measured after rendering their text, so no run count makes
# them overlap or run off the canvas.
WIDTH = 7.5
POLAR_SIDE = 4.6
POLAR_TOP, POLAR_BOTTOM = 0.55, 0.4  # room for the axis names above and below the circle
GAP = 0.15


def figure(
    runs: dict[str, dict[str, float]],
    rule: str = "corrected",
    behaviour: dict[str, tuple[float, float] | None] | None = None,
):
    """The chart as a matplotlib Figure (not saved): :func:`draw` saves it, the tests measure it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = normalise(runs)
    angles = [2 * math.pi * i / len(AXES) for i in range(len(AXES))]
    fig = plt.figure(figsize=(WIDTH, 10))
    ax = fig.add_axes([0, 0, 1, 1], polar=True)
    ax.set_theta_offset(math.pi / 2)
    ax.set_theta_direction(-1)
    ax.set_xticks(angles)
    ax.set_xticklabels(AXES, fontsize=10)
    ax.tick_params(axis="x", pad=8)
    for name, angle in zip(ax.get_xticklabels(), angles):  # names at the sides start at the rim, not across it
        side = math.sin(angle)
        name.set_horizontalalignment("left" if side > 0.1 else "right" if side < -0.1 else "center")
    ax.set_ylim(0, 1)
    ax.set_yticks([0.25, 0.5, 0.75, 1.0])
    ax.set_yticklabels(["25", "50", "75", "100"], fontsize=7, color="grey")
    for label, points in values.items():
        text = legend_text(label, runs[label], (behaviour or {}).get(label))
        ax.plot(angles + angles[:1], points + points[:1], linewidth=2, label=text)
        ax.fill(angles + angles[:1], points + points[:1], alpha=0.12)
    legend = fig.legend(loc="upper center", fontsize=8, frameon=False)
    note = fig.text(0.5, 0, textwrap.fill(caption(rule), 120), ha="center", va="bottom", fontsize=7.5)

    renderer = fig.canvas.get_renderer()
    legend_height = legend.get_window_extent(renderer).height / fig.dpi
    note_height = note.get_window_extent(renderer).height / fig.dpi
    polar_height = POLAR_TOP + POLAR_SIDE + POLAR_BOTTOM
    height = polar_height + legend_height + GAP + note_height + 2 * GAP
    fig.set_size_inches(WIDTH, height)
    ax.set_position([(WIDTH - POLAR_SIDE) / 2 / WIDTH, (height - POLAR_TOP - POLAR_SIDE) / height, POLAR_SIDE / WIDTH, POLAR_SIDE / height])
    legend.set_bbox_to_anchor((0.5, 1 - polar_height / height), transform=fig.transFigure)
    note.set_y(GAP / height)
    return fig


def draw(
    runs: dict[str, dict[str, float]],
    out: Path,
    rule: str = "corrected",
    behaviour: dict[str, tuple[float, float] | None] | None = None,
) -> str:
    """Save the chart as ``out``.png and .svg; return its caption."""
    import matplotlib.pyplot as plt

    fig = figure(runs, rule, behaviour)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=150)
    fig.savefig(out.with_suffix(".svg"))
    plt.close(fig)
    return caption(rule)

"""The report page of one run: a single self-contained HTML file (styles, scripts, charts and data
inside it; no server, no network), from what ``report/collect.py`` read.

The page reads from the results down: the evaluation tables first, then the curves, the charts,
the trajectory browser, and last the pipeline's table (one row per stage folder, folded: at the
paper's scale it is dozens of rows). A metric that never changes within a stage folder is one
line of text (name = value), not a panel; the others are drawn in the reader's browser by
``static/curves.js`` from the points this module writes into the page (smoothing, log scale,
values under the pointer). The radar and Pareto charts are embedded as the PNGs their stages
drew. The trajectory browser's data sits in the page in chunks of ``CHUNK`` trajectories, each a
JSON script element the browser parses only when a page of the list needs it: the list is
filtered over a small index, and a page of thousands of trajectories renders 50 at a time.

It draws nothing itself and reads no file but the page's own static parts and the run's charts.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from html import escape
from pathlib import Path

from etagent.report.collect import Run

CHUNK = 200
STATIC = Path(__file__).parent / "static"
# The curves in the order a reader looks at them; any other metric follows, alphabetically.
CURVE_ORDER = (
    "sft/loss",
    "sft/grad_norm",
    "sft/learning_rate",
    "rl/reward/mean",
    "rl/reward/raw",
    "rl/reward terms/f_tool",
    "rl/reward terms/f_length",
    "rl/reward terms/f_format",
    "rl/val/score",
    "rl/rollout/tool_calls",
    "rl/rollout/length",
    "rl/actor/entropy",
    "rl/actor/kl",
    "rl/actor/grad_norm",
)
# Evaluation columns, per dataset, when the run has them.
TABLE_COLUMNS = ("correctness", "efficiency", "llm_judge", "f1", "em", "pass@1", "pass@2", "pass@4", "pass@8", "tool_calls", "mean_tokens")
BEHAVIOUR_COLUMNS = ("questions", "correctness", "tool_calls", "redundant_rate", "insufficient_rate", "redundant_when_solved")


def render(run: Run, max_trajectories: int) -> str:
    """The page; ``max_trajectories`` is the cap the browser's sample was drawn under, which the
    page names when the run had more."""
    sections = [
        ("evaluation", "Evaluation", evaluation_section(run)),
        ("curves", "Curves", curves_section(run)),
        ("charts", "Charts", charts_section(run)),
        ("trajectories", "Trajectories", browser_section(run, max_trajectories)),
        ("pipeline", "Pipeline", pipeline_section(run)),
    ]
    nav = " ".join(f'<a href="#{key}">{title}</a>' for key, title, _ in sections)
    body = "\n".join(f'<section id="{key}"><h2>{title}</h2>\n{html}\n</section>' for key, title, html in sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<link rel="icon" href="data:,">
<title>etagent report: {escape(run.root.name)}</title>
<style>{(STATIC / "report.css").read_text()}</style>
</head><body>
<header><h1>Run <code>{escape(str(run.root))}</code></h1><nav>{nav}</nav></header>
{problems_box(run)}
{body}
{trajectory_data(run)}
<script>{(STATIC / "curves.js").read_text()}</script>
<script>{(STATIC / "browser.js").read_text()}</script>
</body></html>
"""


def problems_box(run: Run) -> str:
    if not run.problems:
        return '<div id="problems" class="ok">Every stage found is complete and every file it names is present.</div>'
    items = "".join(f"<li>{escape(p)}</li>" for p in run.problems)
    return f'<div id="problems" class="warn"><b>What is missing or incomplete ({len(run.problems)})</b><ul>{items}</ul></div>'


def table(header: list[str], rows: list[list[str]], css: str = "") -> str:
    """A table in a box that scrolls sideways when the table is wider than the page."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<div class="wide"><table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def number(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if 1e-3 <= abs(value) < 1000 or value == 0 else f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.0f}"
    return escape(str(value))


def pipeline_section(run: Run) -> str:
    if not run.stages:
        return "<p>No stage has written anything here yet.</p>"
    rows = []
    for s in run.stages:
        counts = ", ".join(f"{escape(str(k))}: {number(v)}" for k, v in s.counts.items() if not isinstance(v, dict | list))
        inputs = listed([f"<code>{breakable(short(i, run.root))}</code>" for i in s.inputs])
        outputs = listed([escape(o) for o in s.outputs], separator=" · ", most=12)
        status = f'<span class="status-{escape(s.status.replace(" ", "-"))}">{escape(s.status)}</span>'
        rows.append(
            [
                escape(s.stage),
                f"<code>{breakable(s.folder)}</code>",
                status,
                escape(s.started_at.replace("T", " ")[:19]),
                duration(s.seconds),
                counts,
                number(s.seed),
                revision(s.commit, s.dirty),
                inputs,
                outputs,
            ]
        )
    statuses = Counter(s.status for s in run.stages)
    summary = f"{len(run.stages)} stage folders: " + ", ".join(f"{n} {status}" for status, n in statuses.most_common())
    header = ["stage", "output folder", "status", "started", "took", "counts", "seed", "git", "inputs", "outputs"]
    return f"<details><summary>{escape(summary)} (the table)</summary>{table(header, rows, 'pipeline')}</details>"


def breakable(path: str) -> str:
    """A path, escaped, that may wrap after each slash (a browser does not break it there
    itself, and a long path would widen its column past the page)."""
    return "/<wbr>".join(escape(part) for part in path.split("/"))


def revision(commit: str, dirty: bool | None) -> str:
    """The toolkit's commit a stage ran, as git shortens it, marked when its checkout had
    uncommitted changes; the whole commit on hover."""
    if not commit:
        return "–"
    # under the commit, so the mark does not widen a table that already fills the page
    mark = '<br><span class="dirty" title="the checkout had uncommitted changes">dirty</span>' if dirty else ""
    return f'<code title="{escape(commit)}">{escape(commit[:7])}</code>{mark}'


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{seconds:.1f} s"


def listed(items: list[str], separator: str = "<br>", most: int = 8) -> str:
    shown = separator.join(items[:most])
    return shown + (f"{separator}and {len(items) - most} more" if len(items) > most else "")


def short(path: str, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def curves_section(run: Run) -> str:
    """The controls, the constant metrics in one line, and a panel per other metric, grouped by
    the metric's prefix (``rl/actor``, ``sft``); ``static/curves.js`` draws the panels from the
    points in the ``curve-data`` script element."""
    if not run.curves:
        return "<p>No curves: no SFT loss history and no RL metrics.jsonl in this run.</p>"
    order = {name: k for k, name in enumerate(CURVE_ORDER)}
    names = sorted(run.curves, key=lambda n: (order.get(n, len(order)), n))
    constant = {name: value for name in names if (value := constant_value(run.curves[name])) is not None}
    groups: dict[str, list[str]] = {}
    for name in names:
        if name not in constant:
            groups.setdefault(name.rsplit("/", 1)[0] if "/" in name else name, []).append(name)
    parts = [
        '<p id="curve-controls"><label>smoothing <input id="smoothing" type="range" min="0" max="0.99" step="0.01" value="0.6"> '
        '<output id="smoothing-value">0.6</output></label> <span class="hint">an exponential moving average, as TensorBoard\'s; '
        "the raw values are drawn faintly behind it. Each panel has its own log scale; hover a panel for its values.</span></p>"
    ]
    if constant:
        items = " · ".join(f"<code>{escape(name)}</code> = {value}" for name, value in constant.items())
        parts.append(f'<p id="constant-curves">Constant at every step, not drawn: {items}</p>')
    for group, members in groups.items():
        panels = "".join(f'<figure class="chart" data-curve="{escape(name)}"></figure>' for name in members)
        parts.append(
            f'<details class="curve-group" open><summary>{escape(group)} ({len(members)})</summary><div class="charts">{panels}</div></details>'
        )
    data = {name: [[series, sorted(points)] for series, points in run.curves[name].items()] for name in names if name not in constant}
    parts.append(f'<script type="application/json" id="curve-data">{script_json(data)}</script>')
    return "\n".join(parts)


def constant_value(series: dict[str, list[tuple[float, float]]]) -> str | None:
    """A metric's value as the page writes it when it never changes within any stage folder
    (``0``, or ``32 (rl/stage1), 16 (rl/stage2)`` where the folders differ); None when it does."""
    values = {name: {value for _, value in points} for name, points in series.items()}
    if any(len(v) != 1 for v in values.values()):
        return None
    if len({v for vs in values.values() for v in vs}) == 1:
        return number(next(iter(next(iter(values.values())))))
    return ", ".join(f"{number(next(iter(v)))} ({escape(name)})" for name, v in values.items())


def evaluation_section(run: Run) -> str:
    if not run.evaluations:
        return "<p>No evaluation in this run.</p>"
    datasets = sorted({d for e in run.evaluations for d in e["datasets"]})
    parts = []
    for dataset in datasets:
        present = [e for e in run.evaluations if dataset in e["datasets"]]
        columns = [c for c in TABLE_COLUMNS if any(c in e["datasets"][dataset] for e in present)]
        rows = []
        for e in present:
            metrics = e["datasets"][dataset]
            rows.append([escape(str(e["run"])), f"<code>{escape(e['folder'])}</code>"] + [number(metrics.get(c)) for c in columns])
        parts.append(f"<h3>{escape(dataset)}</h3>" + table(["run", "folder", *columns], rows, "numbers"))
        behaviour_rows = []
        for e in present:
            for kind, b in (e["datasets"][dataset].get("behaviour") or {}).items():
                behaviour_rows.append([escape(str(e["run"])), escape(kind)] + [number(b.get(c)) for c in BEHAVIOUR_COLUMNS])
        if behaviour_rows:
            parts.append(
                "<p>Tool-use behaviour per kind of question (calls per sample; rates in % of samples, the last in % of the solved ones):</p>"
                + table(["run", "kind", *BEHAVIOUR_COLUMNS], behaviour_rows, "numbers behaviour")
            )
    return "\n".join(parts)


def charts_section(run: Run) -> str:
    if not run.images:
        return "<p>No radar chart or Pareto scatter in this run.</p>"
    figures = []
    for image in run.images:
        data = base64.b64encode(Path(image["path"]).read_bytes()).decode()
        figures.append(
            f'<figure class="image"><img alt="{escape(image["title"])}" src="data:image/png;base64,{data}"><figcaption>{escape(image["title"])}</figcaption></figure>'
        )
    return f'<div class="images">{"".join(figures)}</div>'


def browser_section(run: Run, max_trajectories: int) -> str:
    if not run.trajectories:
        return "<p>No trajectories: no evaluation samples and no RL rollouts in this run.</p>"
    sample = ""
    if run.trajectories_found > len(run.trajectories):
        sample = (
            f'<p id="sample">The browser holds {len(run.trajectories):,} of the run\'s {run.trajectories_found:,} trajectories: '
            f"the same share of each of its {len(run.buckets):,} RL steps and evaluation datasets (chosen at random, the same "
            f"each time the report is written), at most {max_trajectories:,} in all (<code>--max-trajectories</code>).</p>\n"
        )
    return (
        sample
        + """<div id="filters">
<label>stage <select id="f-stage"><option value="">all</option></select></label>
<label>kind <select id="f-kind"><option value="">all</option></select></label>
<label>answer <select id="f-correct"><option value="">all</option><option value="1">correct</option><option value="0">wrong</option></select></label>
<label>tool use <select id="f-behaviour"><option value="">all</option><option value="redundant">redundant calls</option>
<option value="insufficient">insufficient calls</option></select></label>
<label>reward from <input id="f-reward-min" type="number" step="any" size="6"> to <input id="f-reward-max" type="number" step="any" size="6"></label>
<label>text <input id="f-text" type="search" placeholder="in the question"></label>
</div>
<p id="count"></p>
<div id="browser"><ol id="list"></ol><div id="detail"><p>Choose a trajectory on the left.</p></div></div>
<p id="pager"><button id="prev">previous</button> <span id="page"></span> <button id="next">next</button></p>
<p class="legend">Token origin: <span class="origin-sampled">sampled by the policy</span> <span class="origin-given">given (a prefix, a hint, an edit)</span>
<span class="origin-tool">inserted tool output</span> <span class="origin-unknown">not recorded</span></p>"""
    )


def trajectory_data(run: Run) -> str:
    """The browser's index (what the filters read) and the trajectories' full records in chunks;
    nothing when there are none (the script then leaves the page as it is)."""
    if not run.trajectories:
        return ""
    index = [
        {
            "stage": t["stage"],
            "kind": f"{t['source']} ({t['kind']})",
            "correct": t["correct"],
            "redundant": t["redundant"],
            "insufficient": t["insufficient"],
            "reward": t["reward"],
            "calls": t["tool_calls"],
            "q": t["question"][:160],
        }
        for t in run.trajectories
    ]
    scripts = [f'<script type="application/json" id="index">{script_json(index)}</script>']
    for start in range(0, len(run.trajectories), CHUNK):
        scripts.append(
            f'<script type="application/json" id="chunk-{start // CHUNK}">{script_json(run.trajectories[start : start + CHUNK])}</script>'
        )
    scripts.append(f'<script type="application/json" id="chunk-size">{CHUNK}</script>')
    return "\n".join(scripts)


def script_json(value) -> str:
    """JSON that is safe inside a <script> element (no '</' can close it early) and that a browser
    parses: a NaN or infinity, which JSON has no words for, is written as text."""
    return json.dumps(finite(value), ensure_ascii=False, default=str, allow_nan=False).replace("</", "<\\/").replace("<!--", "\\u003c!--")


def finite(value):
    """``value`` with every non-finite float replaced by its text ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value

"""The radar: five axes per evaluation run, and the chart with several runs overlaid.

    python -m etagent.radar.run runs=[runs/eval-sft,runs/eval-rl] [--preset tiny|paper] [overrides]

Reads evaluation runs (evaluation/run.py output: per dataset its trajectories, scored samples
and metrics) and computes, per run and dataset, the metrics of radar/metrics.py; then averages
each axis over the datasets, as the paper's figure does:

- Correctness: the table's correctness (x100);
- Efficiency: the table's efficiency (x100);
- Conciseness: the share of trajectories with no redundant or ineffective tool call (x100);
- Successful Execution: mean over trajectories of correctness / max(failed tool calls, 1) (x100),
  by the corrected rule unless ``execution_rule: paper`` (both are in radar.json);
- Reasoning Length: correctness per 1000 tokens of reasoning (text outside tool results).

The paper released no plotting code; our chart's normalisation: the four percentage axes are
drawn on a fixed 0-100 scale, Reasoning Length relative to the largest value among the plotted
runs (its raw values are in the legend and in radar.json). The caption under the chart says so.

Writes ``{out_dir}/radar.json``, ``radar.md``, ``radar.png`` and ``radar.svg``. Judgements are
cached in ``{out_dir}/{label}/{dataset}/conciseness.jsonl``, so a killed run resumes. Each run's
label (``labels``, or the name it was evaluated under) is unique, or the radar is refused naming
the label: results are keyed by it. A label is a name, never a path: its folder is the label
percent-encoded (:func:`label_folder`: ``sft/rl`` is ``sft%2Frl``), one folder inside
``out_dir`` whatever the label holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from etagent.errors import MissingInput, SettingError, UserError, exit_on_user_error
from etagent.llm import check_engine_settings
from etagent.llm.text import TextModel, load_text_model
from etagent.progress import Progress
from etagent.radar.chart import AXES, draw
from etagent.radar.config import RadarConfig, RadarJudge
from etagent.radar.metrics import REDUNDANCY_PROMPT, execution, majority_redundant, parse_redundancy, reasoning_tokens, toy_redundant
from etagent.records import JsonlAppender, RecordError, TrajectoryGroup, iter_jsonl, read_json_file, read_jsonl, write_manifest
from etagent.rundir import claim_output
from etagent.scoring import correctness
from etagent.settings import check_paths

log = logging.getLogger("radar")


async def _votes(judge: TextModel, settings: RadarJudge, group: TrajectoryGroup, text: str, key: str) -> list[bool | None]:
    """``settings.rounds`` verdicts on one trajectory (None where the judge failed or was unreadable);
    ``settings``: the ``judge`` group."""
    prompt = REDUNDANCY_PROMPT.format(
        question=group.question, answer=" | ".join(group.answer), trajectory=text[: settings.max_trajectory_chars]
    )

    async def one(round_: int):
        try:
            reply = await judge.chat([{"role": "user", "content": prompt}], stop=["</answer>"], session=f"{key}/{round_}")
        except Exception as exc:  # a failed judgement is recorded as no vote ("NA"), never fatal
            log.warning("judge call failed for %s: %s", key, exc)
            return None
        return parse_redundancy(reply)

    return list(await asyncio.gather(*(one(r) for r in range(settings.rounds))))


def conciseness(judge: RadarJudge, groups: list[TrajectoryGroup], out: Path) -> dict[str, bool]:
    """Redundancy verdict per trajectory id, judged once and cached in conciseness.jsonl."""
    path = out / "conciseness.jsonl"
    with JsonlAppender(path) as writer:
        todo = [(g, t) for g in groups for t in g.trajectories if t.id not in writer.done]
        if judge.mode == "toy_oracle":
            for g, t in todo:
                writer.write({"id": t.id, "redundant": toy_redundant(g.needed_calls, t.tool_calls), "votes": None})
        elif todo:
            model = load_text_model(judge, "judge")
            progress = Progress(f"judging conciseness in {out}", len(todo), "trajectory")

            async def judge_all():
                for start in range(0, len(todo), judge.batch):
                    batch = todo[start : start + judge.batch]
                    votes = await asyncio.gather(*(_votes(model, judge, g, t.text, t.id) for g, t in batch))
                    for (_, t), v in zip(batch, votes):
                        writer.write(
                            {
                                "id": t.id,
                                "redundant": majority_redundant(v),
                                "votes": ["NA" if x is None else ("yes" if x else "no") for x in v],
                            }
                        )
                    progress.update(len(batch))

            asyncio.run(judge_all())
            progress.close()
    return {row["id"]: row["redundant"] for _, row in iter_jsonl(path)}


@dataclass
class Evaluated:
    """One evaluated dataset of a run, as the radar reads it: its metrics.json, its trajectories
    and each question's scored samples (by id)."""

    table: dict
    groups: list[TrajectoryGroup]
    scored: dict[str, dict]


def read_evaluated(run_dir: Path, dataset: str) -> Evaluated:
    """What the radar reads of one evaluated dataset, refused where it cannot be measured: no
    metrics.json, none of its samples, a malformed line, or a question without its scores."""
    metrics_path = run_dir / dataset / "metrics.json"
    if not metrics_path.is_file():
        raise MissingInput(f"{metrics_path}: no such file (was {dataset} evaluated in {run_dir}?)")
    table = read_json_file(metrics_path)
    if not isinstance(table, dict):
        raise RecordError(metrics_path, None, "(file)", "expected a JSON object of metrics")
    if not table.get("samples"):
        raise UserError(
            f"{metrics_path}: no samples (the evaluation ran on no questions): nothing to measure; leave {dataset} out with datasets=[...]"
        )
    groups = read_jsonl(run_dir / dataset / "trajectories.jsonl", TrajectoryGroup)
    scored_path = run_dir / dataset / "scored.jsonl"
    scored = {}
    for line, row in iter_jsonl(scored_path):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("samples"), list):
            raise RecordError(scored_path, line, "(record)", "expected an object with an id and its samples' scores")
        scored[row["id"]] = row
    for g in groups:
        if len(scored.get(g.id, {}).get("samples", [])) != len(g.trajectories):
            raise RecordError(scored_path, None, "samples", f"question {g.id!r} has no scores for its {len(g.trajectories)} samples")
    return Evaluated(table, groups, scored)


def dataset_metrics(judge: RadarJudge, evaluated: Evaluated, out: Path, tokenizer) -> dict:
    """The radar's measures of one evaluated dataset of a run (``judge`` asks the redundancy question)."""
    table, groups, scored = evaluated.table, evaluated.groups, evaluated.scored
    out.mkdir(parents=True, exist_ok=True)
    redundant = conciseness(judge, groups, out)
    rows = []
    for g in groups:
        for t, m in zip(g.trajectories, scored[g.id]["samples"]):
            c = correctness(m, g.kind)
            ex = execution(t.text, t.tool_calls)
            length = reasoning_tokens(t.text, tokenizer)
            rows.append((c, ex, length, redundant[t.id]))
    n = len(rows)
    sums = {key: sum(ex[key] for _, ex, _, _ in rows) for key in ("paper_total", "paper_failed", "corrected_total", "corrected_failed")}
    return {
        "trajectories": n,
        "correctness": table["correctness"],
        "efficiency": table["efficiency"],
        "conciseness": round(100 * sum(not r for *_, r in rows) / n, 2),
        "execution_paper": round(100 * sum(c / max(ex["paper_failed"], 1) for c, ex, _, _ in rows) / n, 2),
        "execution_corrected": round(100 * sum(c / max(ex["corrected_failed"], 1) for c, ex, _, _ in rows) / n, 2),
        "successful_calls_paper": round(100 * (1 - sums["paper_failed"] / sums["paper_total"]), 2) if sums["paper_total"] else None,
        "successful_calls_corrected": round(100 * (1 - sums["corrected_failed"] / sums["corrected_total"]), 2)
        if sums["corrected_total"]
        else None,
        "behaviour": table.get("behaviour", {}).get("all"),
        "reasoning_tokens": round(sum(length for _, _, length, _ in rows) / n, 1),
        "correctness_per_1k_reasoning_tokens": round(1000 * sum(c / max(length, 1) for c, _, length, _ in rows) / n, 3),
    }


def axes(per_dataset: dict[str, dict], rule: str) -> dict[str, float]:
    mean = lambda key: round(sum(d[key] for d in per_dataset.values()) / len(per_dataset), 3)  # noqa: E731
    return {
        "Correctness": mean("correctness"),
        "Efficiency": mean("efficiency"),
        "Conciseness": mean("conciseness"),
        "Successful Execution": mean(f"execution_{rule}"),
        "Reasoning Length": mean("correctness_per_1k_reasoning_tokens"),
    }


def tool_use_rates(per_dataset: dict[str, dict]) -> tuple[float, float] | None:
    """(redundant, insufficient) call rates in %, averaged over the datasets whose questions say
    which calls they need (the toy world's); None when none do."""
    known = [d["behaviour"] for d in per_dataset.values() if d.get("behaviour")]
    if not known:
        return None
    mean = lambda key: sum(b[key] for b in known) / len(known)  # noqa: E731
    return mean("redundant_rate"), mean("insufficient_rate")


def run_name(run_dir: Path) -> str:
    """The name an evaluation ran under (its summary's ``run``)."""
    summary = read_json_file(run_dir / "summary.json")
    if not isinstance(summary, dict) or not isinstance(summary.get("run"), str):
        raise RecordError(run_dir / "summary.json", None, "run", "missing, or not a string: not an evaluation's summary")
    return summary["run"]


# Characters a label keeps as they are in its folder's name; every other one is percent-encoded
# (a path separator, "%" itself, control characters, any non-ASCII character), so the name is one
# path component, and decodes back to the label (distinct labels, distinct folders).
LABEL_SAFE = " !#$&'()+,;=@[]^_`{}~-."
# The longest file name the usual file systems allow, in bytes.
MAX_NAME_BYTES = 255


def label_folder(label: str) -> str:
    """The folder of a run's cached judgements under ``out_dir``: the label percent-encoded
    (``sft/rl`` -> ``sft%2Frl``, ``..`` -> ``%2E%2E``), so that it is one path component inside
    ``out_dir`` and ``urllib.parse.unquote`` gives the label back (distinct labels, distinct
    folders)."""
    name = quote(label, safe=LABEL_SAFE, errors="surrogatepass")  # a command line's undecodable bytes too
    return name.replace(".", "%2E") if set(name) <= {"."} else name


def run_labels(cfg: RadarConfig) -> list[str]:
    """Each run's label: ``labels``, or the name it was evaluated under (its summary's ``run``).
    Refused, naming the labels: two runs with one label (one would replace the other in the
    chart and share its cached judgements; two that differ only in case would share a folder on
    a case-insensitive file system), an empty label, and one too long for a folder name."""
    given = bool(cfg.labels)
    labels = list(cfg.labels) if given else [run_name(Path(r)) for r in cfg.runs]
    key = "labels" if given else "runs"
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        where = f"{key}[{i}]"
        if not label:
            raise SettingError(where, f"{'is' if given else 'was evaluated under'} an empty label: give each run a name in labels=[...]")
        if len(label_folder(label).encode()) > MAX_NAME_BYTES:
            raise SettingError(where, f"the label {label[:40]!r}... is too long for a folder name: give a shorter one in labels=[...]")
        first = seen.setdefault(label.casefold(), i)
        if first != i:
            same = "is" if labels[first] == label else f"differs only in case from {labels[first]!r}, which is"
            how = "" if given else f" (the name each was evaluated under: {cfg.runs[first]} and {cfg.runs[i]})"
            raise SettingError(
                where, f"the label {label!r} {same} the label of {key}[{first}]{how}: give each run its own label in labels=[...]"
            )
    return labels


def check_settings(cfg: RadarConfig) -> dict:
    """The runs and the tokenizer present, and what the declarations (radar/config.py) cannot say
    alone, before any work. Returns the config as run (with the toy oracle, no judge model)."""
    if not cfg.runs:
        raise SettingError("runs", "is empty: give the evaluation output directories to compare")
    config = dataclasses.asdict(cfg)
    if cfg.judge.mode != "llm":  # the oracle reads the toy world's answers: no judge model
        config["judge"]["engine"]["model"] = None
    check_paths(RadarConfig, config)
    for i, run_dir in enumerate(cfg.runs):
        if not (Path(run_dir) / "summary.json").is_file():
            raise SettingError(
                f"runs[{i}]",
                f"{run_dir} has no summary.json: not a finished evaluation (python -m etagent.evaluation.run out_dir={run_dir})",
            )
    if cfg.labels and len(cfg.labels) != len(cfg.runs):
        raise SettingError("labels", f"{len(cfg.labels)} labels for {len(cfg.runs)} runs")
    run_labels(cfg)
    for i, dataset in enumerate(cfg.datasets or []):
        if dataset in ("", ".", "..") or "/" in dataset or "\\" in dataset:
            raise SettingError(f"datasets[{i}]", f"{dataset!r} is not the name of a dataset's folder in a run (a name, not a path)")
    if cfg.judge.mode == "llm":
        check_engine_settings(cfg.judge.engine, "judge.engine")
    return config


def plan(cfg: RadarConfig) -> tuple[dict, list[dict[str, Evaluated]]]:
    """Everything the radar can refuse, before it claims its output folder: the settings
    (:func:`check_settings`), matplotlib for the chart, and every dataset of every run read
    (:func:`read_evaluated`; a run with none is refused). Returns the config as run and each
    run's datasets."""
    config = check_settings(cfg)
    import matplotlib  # noqa: F401 -- the chart needs it: missing, it is one line naming the extra (etagent/errors.py)

    runs = []
    for i, run_dir in enumerate(map(Path, cfg.runs)):
        datasets = list(cfg.datasets) if cfg.datasets else sorted(p.name for p in run_dir.iterdir() if (p / "metrics.json").exists())
        if not datasets:
            raise SettingError(f"runs[{i}]", f"{run_dir} holds no evaluated dataset (no <dataset>/metrics.json): nothing to measure")
        runs.append({d: read_evaluated(run_dir, d) for d in datasets})
        if cfg.judge.mode == "toy_oracle":  # the oracle knows what each question needs from the question itself
            for d, evaluated in runs[-1].items():
                unknown = next((g.id for g in evaluated.groups if g.needed_calls is None), None)
                if unknown is not None:
                    raise SettingError(
                        "judge.mode",
                        f"toy_oracle reads each question's needed_calls, and question {unknown!r} of {run_dir / d} has none (a toy world's questions have them): use llm",
                    )
    return config, runs


def run(cfg: RadarConfig) -> dict:
    config, runs = plan(cfg)
    with claim_output(cfg.out_dir, stage="radar", schema=RadarConfig, config=config) as out:
        return measure(cfg, out, config, runs)


def measure(cfg: RadarConfig, out: Path, config: dict, runs: list[dict[str, Evaluated]]) -> dict:
    from transformers import AutoTokenizer

    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    # A run is labelled with the name it was evaluated under (evaluation's run_name).
    labels = run_labels(cfg)
    judge = cfg.judge
    result = {}
    for label, run_dir, datasets in zip(labels, cfg.runs, runs):
        per_dataset = {d: dataset_metrics(judge, evaluated, out / label_folder(label) / d, tokenizer) for d, evaluated in datasets.items()}
        result[label] = {"run": str(run_dir), "datasets": per_dataset, "axes": axes(per_dataset, cfg.execution_rule)}
    (out / "radar.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| run | " + " | ".join(AXES) + " |", "|---" * (len(AXES) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(f"{r['axes'][a]:.2f}" for a in AXES) + " |" for label, r in result.items()]
    (out / "radar.md").write_text("\n".join(lines) + "\n")
    caption = draw(
        {label: r["axes"] for label, r in result.items()},
        out / "radar",
        rule=cfg.execution_rule,
        behaviour={label: tool_use_rates(r["datasets"]) for label, r in result.items()},
    )
    write_manifest(
        out,
        stage="radar",
        config=config,
        counts={label: sum(d["trajectories"] for d in r["datasets"].values()) for label, r in result.items()},
        seed=None,
        started_at=started,
        metrics={label: r["axes"] for label, r in result.items()},
    )
    print((out / "radar.md").read_text())
    print(caption)
    print(f"chart: {out / 'radar.png'} and {out / 'radar.svg'}")
    return result


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for cfg in stage_configs("radar", argv, prog="python -m etagent.radar.run", doc=__doc__, plan=plan):
        run(cfg)


if __name__ == "__main__":
    main()

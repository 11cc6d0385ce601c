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
cached in ``{out_dir}/{run}/{dataset}/conciseness.jsonl``, so a killed run resumes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from etagent.config import build
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
                writer.write({"id": t.id, "redundant": toy_redundant(g.source, t.tool_calls), "votes": None})
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


def dataset_metrics(judge: RadarJudge, run_dir: Path, dataset: str, out: Path, tokenizer) -> dict:
    """The radar's measures of one evaluated dataset of a run (``judge`` asks the redundancy question)."""
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
    scored = {row["id"]: row for _, row in iter_jsonl(run_dir / dataset / "scored.jsonl")}
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


def check_settings(cfg: DictConfig) -> dict:
    """The runs and the tokenizer present, and what the declarations (radar/config.py) cannot say
    alone, before any work. Returns the config as run (with the toy oracle, no judge model)."""
    if not cfg.runs:
        raise SettingError("runs", "is empty: give the evaluation output directories to compare")
    config = OmegaConf.to_container(cfg, resolve=True)
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
    if cfg.judge.mode == "llm":
        check_engine_settings(cfg.judge.engine, "judge.engine")
    return config


def run(cfg: DictConfig) -> dict:
    config = check_settings(cfg)
    with claim_output(cfg.out_dir, stage="radar", schema=RadarConfig, config=config) as out:
        return measure(cfg, out, config)


def measure(cfg: DictConfig, out: Path, config: dict) -> dict:
    from transformers import AutoTokenizer

    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    # A run is labelled with the name it was evaluated under (evaluation's run_name).
    labels = list(cfg.labels) if cfg.labels else [run_name(Path(r)) for r in cfg.runs]
    judge = build(RadarJudge, cfg.judge)
    result = {}
    for label, run_dir in zip(labels, cfg.runs):
        run_dir = Path(run_dir)
        datasets = list(cfg.datasets) if cfg.datasets else sorted(p.name for p in run_dir.iterdir() if (p / "metrics.json").exists())
        per_dataset = {d: dataset_metrics(judge, run_dir, d, out / label / d, tokenizer) for d in datasets}
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
    for cfg in stage_configs("radar", argv, prog="python -m etagent.radar.run", doc=__doc__):
        run(cfg)


if __name__ == "__main__":
    main()

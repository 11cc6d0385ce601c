"""Group-wise Pareto sampling: choose the RL questions of a curriculum stage from its rollouts.

    python -m etagent.pareto.run [--preset tiny|paper] [overrides]      # or: etagent pareto ...
    bash scripts/prepare_rl_stage.sh MODEL STAGE                # direct rollout, then this

Reads the direct rollout of stage k (``rollouts``: trajectories.jsonl, one line per question with
its K judged chains) and writes into ``out_dir``:

    rl.parquet      the selected questions in verl's schema, as the paper's file: data_source
                    math_effi_rl / qa_effi_rl, the chat prompt with the system prompt, ability,
                    reward_model {ground_truth: [str], style}, extra_info {index (unique per row),
                    need_tools_kwargs (false: no per-row tool arguments), question, split,
                    question_id}, metadata (null); rows in a seeded random order
    scores.jsonl    every question: its objectives, eligibility (and why not), front, crowding
                    distance where computed, selected or not
    report.json     counts (read, eligible, selected, dropped and why), front sizes, objective
                    distributions, per source
    scatter.png     the first two objectives, every question, the selected ones marked
    manifest.json

The method (docs/paper-code.md §A5): per question, the population variance of its chains'
correctness and of their executed tool calls (``objectives``, both maximised; more in
pareto/selection.py), NSGA-II fronts, the first front that does not fit cut by crowding distance.
The paper's mixed-outcome filter (math: a right and a wrong chain; QA: a chain at or above F1
0.75 and one below) runs before the selection, not after it as in the reference, so exactly
``count`` questions come out whenever that many qualify. Chains that failed in the engine
(``finish_reason: error``) are left out of their question's group, and counted.

``method: random`` is the ablation without Pareto sampling: ``count`` questions drawn at random
(under ``seed``) from every question of the rollouts, eligible or not; the files are the same.

The stage is quick and deterministic under ``seed`` (questions are taken in id order, so the
order of the rollouts file does not matter): a rerun recomputes everything and writes the same
files. The whole selection is computed before the output folder is claimed (:func:`plan`), so a
run refused for its rollouts (unfinished, degraded, malformed, no question eligible) writes
nothing. What it does not do: roll out (``direct_rollout/``) or stratify by source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from etagent.errors import MissingInput, SettingError, UserError, exit_on_user_error
from etagent.pareto.config import ParetoConfig
from etagent.pareto.selection import Chains, mixed_outcome, objectives, select
from etagent.records import (
    Question,
    RecordError,
    RLRow,
    iter_jsonl,
    parse_record,
    read_manifest,
    write_jsonl,
    write_manifest,
    write_rl_parquet,
)
from etagent.rundir import claim_output
from etagent.settings import check_paths

log = logging.getLogger("pareto")

# Per chain, the fields the objectives read, as direct_rollout writes them.
CHAIN_FIELDS = ("judgement", "tool_calls_executed", "tool_calls_written", "n_generated", "finish_reason")


def read_rollouts(path: Path) -> tuple[list[Question], dict[str, np.ndarray], Counter]:
    """Questions (in id order) and their usable chains as flat arrays, plus the count of chains
    left out and why. Only the fields the selection needs are read from each chain."""
    rows: dict[str, tuple[Question, list[tuple[float, int, int, int]]]] = {}
    left_out: Counter = Counter()
    for line, data in iter_jsonl(path):
        if not isinstance(data, dict):
            raise RecordError(path, line, "(record)", "expected a JSON object")
        chains = data.get("trajectories")
        if not isinstance(chains, list):
            raise RecordError(path, line, "trajectories", "missing" if chains is None else "expected a list")
        question = parse_record(Question, {k: v for k, v in data.items() if k != "trajectories"}, path, line)
        if question.id in rows:
            raise RecordError(path, line, "id", f"question {question.id!r} appears twice")
        usable = []
        for k, chain in enumerate(chains):
            where = f"trajectories.{k}"
            missing = [f for f in CHAIN_FIELDS if not isinstance(chain, dict) or f not in chain]
            if missing:
                raise RecordError(path, line, f"{where}.{missing[0]}", "missing (direct_rollout writes it)")
            if chain["finish_reason"] == "error":
                left_out["engine_error"] += 1
                continue
            score = (chain["judgement"] or {}).get("score")
            if score is None:
                left_out["not_judged"] += 1
                continue
            try:
                usable.append(
                    (float(score), int(chain["tool_calls_executed"]), int(chain["tool_calls_written"]), int(chain["n_generated"]))
                )
            except (TypeError, ValueError) as exc:
                raise RecordError(path, line, where, f"not a number: {exc}") from None
        rows[question.id] = (question, usable)
    questions, table = [], []
    for row, qid in enumerate(sorted(rows)):
        question, usable = rows[qid]
        questions.append(question)
        table += [(row, *chain) for chain in usable]
    columns = np.array(table, dtype=float).reshape(-1, 5)
    arrays = {
        "question": columns[:, 0].astype(np.int64),
        "correctness": columns[:, 1],
        "tool_calls": columns[:, 2],
        "written_tool_calls": columns[:, 3],
        "generated_tokens": columns[:, 4],
    }
    return questions, arrays, left_out


def ineligibility(chains: Chains, threshold: np.ndarray, mixed: np.ndarray) -> list[str | None]:
    """Why each question cannot be selected (None: it can): ``no_usable_chain``, ``one_chain``,
    ``all_correct`` (every chain at or above its kind's bar), ``all_wrong`` (none)."""
    count = chains.per_question_count()
    above = np.bincount(chains.question, weights=chains.correctness >= threshold[chains.question], minlength=chains.n_questions)
    reasons: list[str | None] = []
    for n, n_above, ok in zip(count, above, mixed):
        if ok:
            reasons.append(None)
        elif n == 0:
            reasons.append("no_usable_chain")
        elif n == 1:
            reasons.append("one_chain")
        else:
            reasons.append("all_correct" if n_above == n else "all_wrong")
    return reasons


def distribution(values: np.ndarray) -> dict:
    """Summary of one objective over a set of questions."""
    if len(values) == 0:
        return {"n": 0}
    q = np.quantile(values, [0.0, 0.25, 0.5, 0.75, 1.0])
    distinct, counts = np.unique(values, return_counts=True)
    summary = {"n": int(len(values)), "mean": round(float(values.mean()), 6)}
    summary.update({name: round(float(v), 6) for name, v in zip(("min", "p25", "median", "p75", "max"), q)})
    summary["distinct_values"] = int(len(distinct))
    if len(distinct) <= 12:  # discrete objectives (binary correctness): the whole histogram
        summary["histogram"] = {f"{v:.6g}": int(c) for v, c in zip(distinct, counts)}
    return summary


def draw_scatter(path: Path, points: np.ndarray, status: list[str], names: list[str], title: str) -> None:
    """The first two objectives; each distinct point once per status, its area by how many
    questions share it (with 8 chains the objectives take few values, so points pile up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "ineligible": dict(color="#b0b0b0", label="not eligible (no mixed outcome)", zorder=1),
        "eligible": dict(color="#6fa8dc", label="eligible, not selected", zorder=2),
        "selected": dict(color="#cc0000", label="selected", zorder=3),
    }
    x = points[:, 0]
    y = points[:, 1] if points.shape[1] > 1 else np.zeros(len(points))
    fig, ax = plt.subplots(figsize=(7, 5.5), dpi=120)
    status_array = np.array(status)
    for name, style in styles.items():
        mask = status_array == name
        if not mask.any():
            continue
        distinct, counts = np.unique(np.stack([x[mask], y[mask]], axis=1), axis=0, return_counts=True)
        ax.scatter(distinct[:, 0], distinct[:, 1], s=12 + 18 * np.sqrt(counts), alpha=0.7, edgecolors="none", **style)
    ax.set_xlabel(names[0].replace("_", " "))
    ax.set_ylabel(names[1].replace("_", " ") if len(names) > 1 else "")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="best", fontsize=8, markerscale=0.7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def check_settings(cfg: ParetoConfig) -> None:
    """The rollouts present, and what the declarations (pareto/config.py) cannot say alone."""
    check_paths(ParetoConfig, dataclasses.asdict(cfg))
    if not cfg.objectives:
        raise SettingError("objectives", "is empty: name at least one objective")
    import matplotlib  # noqa: F401 -- scatter.png needs it: missing, it is one line naming the extra (etagent/errors.py), before any write


@dataclass
class Selection:
    """What a run writes, computed before it claims its folder."""

    rows: list[RLRow]  # rl.parquet's rows, in their order
    scores: list[dict]  # scores.jsonl
    report: dict  # report.json
    scatter: tuple  # draw_scatter's points, status, names and title
    counts: dict  # the manifest's
    metrics: dict


def plan(cfg: ParetoConfig) -> Selection:
    """Everything the stage can refuse, before it claims its output folder: the settings, the
    rollouts (finished, readable, some question eligible) and the whole selection."""
    check_settings(cfg)
    return select_questions(cfg)


def run(cfg: ParetoConfig) -> dict:
    started = time.time()
    selection = plan(cfg)
    config = dataclasses.asdict(cfg)
    # every run recomputes the selection from the rollouts, so nothing is resumed
    with claim_output(cfg.out_dir, stage=f"pareto/stage{cfg.rl_stage}", schema=ParetoConfig, config=config, resumes=False) as out:
        write_rl_parquet(selection.rows, out / "rl.parquet")
        write_jsonl(out / "scores.jsonl", selection.scores)
        (out / "report.json").write_text(json.dumps(selection.report, indent=2) + "\n")
        draw_scatter(out / "scatter.png", *selection.scatter)
        write_manifest(
            out,
            stage=f"pareto/stage{cfg.rl_stage}",
            config=config,
            counts=selection.counts,
            seed=cfg.seed,
            started_at=started,
            metrics=selection.metrics,
        )
    return selection.report


def finished_rollouts(cfg: ParetoConfig) -> Path:
    """The direct rollout's trajectories.jsonl, refused unless that run finished and was not degraded."""
    rollouts = Path(cfg.rollouts)
    if rollouts.is_dir():
        rollouts = rollouts / "trajectories.jsonl"
    if not rollouts.exists():
        raise MissingInput(f"rollouts: no {rollouts} (run direct_rollout first)")
    manifest = rollouts.parent / "manifest.json"
    status = read_manifest(manifest).get("status") if manifest.exists() else None
    if status == "running":
        raise UserError(f"{manifest}: the direct rollout has not finished (status running); rerun it to complete, then select")
    if status == "degraded":
        raise UserError(f"{manifest}: the direct rollout is degraded (its tools failed too often); redo it before selecting")
    return rollouts


def select_questions(cfg: ParetoConfig) -> Selection:
    """Select the stage's questions: the RL parquet's rows, each question's scores, the report and
    the scatter plot's points, for :func:`run` to write."""
    names = list(cfg.objectives)
    rollouts = finished_rollouts(cfg)
    questions, arrays, left_out = read_rollouts(rollouts)
    chains = Chains(**arrays, n_questions=len(questions))
    kinds = np.array([q.kind for q in questions])
    threshold = np.where(kinds == "math", cfg.mixed_outcome.math_threshold, cfg.mixed_outcome.qa_pass_mark).astype(float)
    points = objectives(chains, names)
    mixed = mixed_outcome(chains, threshold)
    reasons = ineligibility(chains, threshold, mixed)
    eligible = np.flatnonzero(mixed)
    if cfg.method == "pareto" and not len(eligible):
        reasons_count = ", ".join(f"{n} {r}" for r, n in Counter(r for r in reasons if r is not None).most_common())
        raise UserError(
            f"{rollouts}: none of the {len(questions)} questions is eligible ({reasons_count}): an RL stage on them would have no "
            "question whose rollouts disagree, so no advantage to learn from; roll out more chains per question (n) or more questions"
        )
    front = np.full(len(questions), -1)
    distance = np.full(len(questions), np.nan)
    if cfg.method == "pareto":
        selection = select(points[eligible], cfg.count, cfg.seed)
        chosen = eligible[selection.selected]
        front[eligible] = selection.ranks
        distance[eligible] = selection.distance
        fronts = {
            "sizes": selection.front_sizes(),
            "whole_fronts_taken": selection.whole_fronts,
            "cut_front": selection.cut_front,
            "taken_from_cut_front": selection.taken_from_cut,
        }
    else:  # the ablation without Pareto: as many questions, drawn at random from the whole pool
        draw = np.random.default_rng([cfg.seed, 1]).choice(len(questions), size=min(cfg.count, len(questions)), replace=False)
        chosen, fronts = np.sort(draw), {}

    if not len(chosen):
        raise UserError(
            f"{rollouts}: no question selected of {len(questions)} (count={cfg.count}, method={cfg.method}); nothing for RL to train on"
        )
    # the parquet: extra_info.index is the position in the selection, the rows are shuffled
    rows = [RLRow.for_question(questions[i], index=k, split=cfg.split) for k, i in enumerate(chosen)]
    order = np.random.default_rng(cfg.seed).permutation(len(rows))

    selected = np.zeros(len(questions), dtype=bool)
    selected[chosen] = True

    status = ["selected" if selected[i] else "eligible" if reasons[i] is None else "ineligible" for i in range(len(questions))]
    dropped = Counter(r for r in reasons if r is not None)
    dropped["not_selected"] = int(len(eligible) - len(set(chosen) & set(eligible)))
    sources = sorted({q.source for q in questions})
    report = {
        "rl_stage": cfg.rl_stage,
        "rollouts": str(rollouts),
        "objectives": names,
        "method": cfg.method,
        "requested": cfg.count,
        "counts": {
            "questions": len(questions),
            "chains": int(len(chains.question)),
            "chains_left_out": dict(left_out),
            "eligible": int(len(eligible)),
            "selected": int(len(chosen)),
            "fewer_eligible_than_requested": bool(len(eligible) < cfg.count),
        },
        "dropped": dict(dropped),
        "fronts": fronts,
        "objective_distributions": {
            group: {name: distribution(points[rows_, j]) for j, name in enumerate(names)}
            for group, rows_ in (("all", np.arange(len(questions))), ("eligible", eligible), ("selected", chosen))
        },
        "per_source": {
            source: {
                "questions": sum(q.source == source for q in questions),
                "eligible": sum(q.source == source and r is None for q, r in zip(questions, reasons)),
                "selected": int(sum(questions[i].source == source for i in chosen)),
            }
            for source in sources
        },
    }
    if cfg.method == "pareto":
        title = f"RL stage {cfg.rl_stage}: {len(chosen)} selected of {len(eligible)} eligible ({len(questions)} questions)"
    else:
        title = f"RL stage {cfg.rl_stage}: {len(chosen)} drawn at random of {len(questions)} questions ({len(eligible)} eligible)"
    return Selection(
        rows=[rows[k] for k in order],
        scores=question_scores(questions, chains, points, names, reasons, front, distance, selected),
        report=report,
        scatter=(points, status, names, title),
        counts={"questions": len(questions), "eligible": int(len(eligible)), "selected": int(len(chosen))},
        metrics={"dropped": dict(dropped), "front_sizes": fronts.get("sizes", [])},
    )


def question_scores(questions, chains: Chains, points, names, reasons, front, distance, selected) -> list[dict]:
    """scores.jsonl: per question its chains, objectives, eligibility (or why not), front,
    crowding distance and whether it was selected."""
    count = chains.per_question_count()
    mean_correctness = chains.mean(chains.correctness)
    return [
        {
            "id": q.id,
            "source": q.source,
            "kind": q.kind,
            "chains": int(count[i]),
            "mean_correctness": round(float(mean_correctness[i]), 6),
            "objectives": {name: float(points[i, j]) for j, name in enumerate(names)},
            "eligible": reasons[i] is None,
            "ineligible_because": reasons[i],
            "front": int(front[i]) if front[i] >= 0 else None,
            "crowding_distance": None if np.isnan(distance[i]) else float(distance[i]),
            "selected": bool(selected[i]),
        }
        for i, q in enumerate(questions)
    ]


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for cfg in stage_configs("pareto", argv, prog="python -m etagent.pareto.run", doc=__doc__, plan=plan):
        report = run(cfg)
        c, f = report["counts"], report["fronts"]
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(report["dropped"].items()))
        if cfg.method == "pareto":
            how = (
                f"{c['selected']} of {c['eligible']} eligible questions selected ({c['questions']} read, {c['chains']} chains); "
                f"requested {report['requested']}\n  dropped: {dropped}\n"
                f"  fronts: {f['sizes'][:12]}{' ...' if len(f['sizes']) > 12 else ''}; whole fronts taken {f['whole_fronts_taken']}, "
                f"{f['taken_from_cut_front']} from front {f['cut_front']} by crowding distance"
            )
        else:
            how = f"{c['selected']} of {c['questions']} questions drawn at random ({c['eligible']} of them eligible; method random)"
        print(
            f"pareto for RL stage {cfg.rl_stage}: {how}\n  wrote {Path(cfg.out_dir) / 'rl.parquet'}, report.json, scores.jsonl, scatter.png"
        )


if __name__ == "__main__":
    main()

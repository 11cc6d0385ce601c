"""Evaluate a policy on benchmarks: rollouts with the tools, metrics, and the paper's table.

    python -m etagent.evaluation.run [--preset tiny|paper] [overrides]         # or: etagent evaluate ...
    python -m etagent.evaluation.run --preset paper engine.kind=openai engine.openai.urls=[http://127.0.0.1:8011/v1] ...

For each dataset in ``datasets`` (files under ``data_dir``, formats in evaluation/benchmarks.py):

1. rollouts: ``n`` samples per question with the agent loop and the paper's sampling and budget
   settings, through etagent.sampling (any engine; a served policy through the openai engine is
   the common case; Ray fan-out with ``ray.workers``). Knowledge-QA datasets search the local
   retriever; the others use web search when ``web_search.backend`` is set, else the local one;
2. scoring: per-sample metrics (evaluation/metrics.py) and, for the kinds in ``judge.kinds``, the
   LLM judge (``judge``: a model behind an engine, usually a served one); judge failures are
   recorded, counted and fall back to math equivalence;
3. aggregates: ``{out_dir}/{dataset}/metrics.json`` (correctness, efficiency, tool productivity,
   pass@k, bootstrap 95% intervals, ...).

Then ``{out_dir}/summary.{json,md,csv}``: one row shaped like the paper's main table (cells are
correctness/efficiency x100). Put several runs side by side with ``python -m etagent.evaluation.table``.

Every step resumes: rollouts skip questions already sampled, scoring skips questions already
scored (so no sample is judged twice), and a rerun of a finished evaluation recomputes only the
aggregates.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from functools import partial
from pathlib import Path

from etagent.errors import DegradedRun, SettingError, exit_on_user_error
from etagent.evaluation.benchmarks import BENCHMARKS, benchmark_file, load_benchmark
from etagent.evaluation.config import EvaluationConfig, EvaluationJudge
from etagent.evaluation.metrics import aggregate, behaviour
from etagent.evaluation.table import summary_rows, write_table
from etagent.progress import Progress
from etagent.question_formats import DEFAULT_FORMAT, read_question_rows
from etagent.records import JsonlAppender, TrajectoryGroup, iter_jsonl, read_jsonl, write_jsonl, write_manifest
from etagent.rundir import claim_output
from etagent.sampling import (
    SamplingConfig,
    check_harness,
    degraded_reasons,
    describe_context_overflow,
    describe_engine_failures,
    sample_planned,
)
from etagent.scoring import rule_judgement, sample_metrics
from etagent.settings import check_installed, check_model_weights, check_paths
from etagent.tools.executor import check_tools, describe_failures

log = logging.getLogger("evaluation")

# A dataset's name: it names its folder in out_dir and its questions' file, so it is one plain
# path component (a benchmark's name, or one of the user's files).
DATASET_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def dataset_sampling(cfg: EvaluationConfig, name: str, questions_path: Path, out: Path) -> SamplingConfig:
    """The rollouts of one dataset (etagent.sampling.SamplingConfig): this evaluation's engine,
    agent, tools and Ray settings on the dataset's questions (already read, cut to ``limit`` and
    written in our own schema), with its search routing."""
    tools = cfg.tools
    if name in BENCHMARKS and BENCHMARKS[name].search == "web" and cfg.web_search.backend:
        tools = dataclasses.replace(tools, search=dataclasses.replace(tools.search, backend=cfg.web_search.backend))
    return SamplingConfig(
        questions=str(questions_path),
        question_format=DEFAULT_FORMAT,
        out_dir=str(out),
        n=cfg.n,
        batch_questions=cfg.batch_questions,
        limit=None,
        partial_input_ok=cfg.partial_input_ok,
        engine=cfg.engine,
        agent=cfg.agent,
        tools=tools,
        ray=cfg.ray,
        gateway=cfg.gateway,
    )


def make_judge(judge: EvaluationJudge):
    """The LLM judge of the ``judge`` group, or None where it is off (rules only)."""
    if not judge.enabled:
        return None
    from etagent.llm.text import load_text_model
    from etagent.scoring import LLMJudge

    return LLMJudge(load_text_model(judge, "judge"), attempts=judge.attempts)


def score(out: Path, settings: EvaluationJudge, judge) -> None:
    """Score every sampled question not yet in scored.jsonl; ``judge`` (the LLM judge, or None)
    asked about the kinds ``settings.kinds``, ``settings.batch_questions`` questions at a time."""
    groups = read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)
    with JsonlAppender(out / "scored.jsonl") as writer:
        todo = [g for g in groups if g.id not in writer.done]
        progress = Progress(f"scoring {out.name}", len(todo), "question")
        for start in range(0, len(todo), settings.batch_questions):
            batch = todo[start : start + settings.batch_questions]
            rows = []
            for group in batch:
                question = group.as_question()
                rows.append((group, [sample_metrics(t, question) for t in group.trajectories]))
            if judge is not None:
                judge.judge_into(
                    [
                        (m, g.question, g.answer, t.prediction)
                        for g, ms in rows
                        if g.kind in settings.kinds
                        for m, t in zip(ms, g.trajectories)
                    ]
                )
            for group, metrics in rows:
                writer.write({"id": group.id, "kind": group.kind, "source": group.source, "samples": metrics})
            progress.update(len(batch))
        progress.close()


def behaviour_table(results: dict[str, dict]) -> list[str]:
    """Markdown lines of the per-kind behaviour table, for datasets whose questions say which tool
    calls they need (empty when none do)."""
    lines = []
    for name, r in results.items():
        if not r.get("behaviour"):
            continue
        lines += [
            f"Tool-use behaviour on {name} (calls per sample; rates in % of samples, the last one in % of the solved ones):",
            "",
            "| kind | questions | correctness | tool calls | redundant | insufficient | redundant when solved |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, b in r["behaviour"].items():
            lines.append(
                f"| {kind} | {b['questions']} | {b['correctness']:.1f} | {b['tool_calls']:.2f} | {b['redundant_rate']:.1f} | "
                f"{b['insufficient_rate']:.1f} | {b['redundant_when_solved']:.1f} |"
            )
        lines.append("")
    return lines


def check_settings(cfg: EvaluationConfig) -> dict:
    """What the evaluation reads, present and of its kind, before any output is written (ranges
    were checked at load). Returns the config as run: ``files`` holds the file of each dataset
    evaluated, and only those, so the manifest records the questions each result came from."""
    if not cfg.datasets:
        raise SettingError("datasets", "is empty: name at least one benchmark")
    if len(set(cfg.datasets)) < len(cfg.datasets):
        raise SettingError("datasets", f"names a dataset twice: {[n for n in cfg.datasets if list(cfg.datasets).count(n) > 1][0]!r}")
    for name in cfg.datasets:
        # a dataset's name is its folder in out_dir and its questions' file name: never a path
        if not DATASET_NAME.fullmatch(name) or name in (".", ".."):
            raise SettingError(
                "datasets", f"{name!r} is not a dataset name: letters, digits and . _ - only (it names a folder inside out_dir)"
            )
        if name not in BENCHMARKS and name not in cfg.files:
            raise SettingError(
                "datasets",
                f"{name!r} is not a known benchmark ({', '.join(BENCHMARKS)}); for a dataset of your own give its file: "
                f"+files.{name}=PATH (any format etagent.question_formats reads), and +kinds.{name}=math|qa where its rows do not say",
            )
    for name in cfg.splits:
        if name not in cfg.datasets:
            raise SettingError(f"splits.{name}", f"{name!r} is not one of this run's datasets ({', '.join(cfg.datasets)})")
    for name in cfg.kinds:
        if name in BENCHMARKS:
            raise SettingError(
                f"kinds.{name}", f"{name} is a known benchmark, scored as {BENCHMARKS[name].kind}; kinds is for datasets of your own"
            )
    config = dataclasses.asdict(cfg)
    config["files"] = {name: str(benchmark_path(cfg, name)) for name in cfg.datasets}
    check_paths(EvaluationConfig, config)
    return config


def check_machine(cfg: EvaluationConfig, config: dict) -> None:
    """What the engines, Ray and each dataset's tools ask of this machine, and the models' weights
    against their configs (seconds: after the settings and the questions)."""
    from etagent.llm import check_engine_settings

    if cfg.judge.enabled:
        check_engine_settings(cfg.judge.engine, "judge.engine")
    check_engine_settings(cfg.engine)
    if cfg.ray.workers > 0:
        check_installed("ray.workers", "ray", f"ray.workers={cfg.ray.workers}")
    check_harness(cfg)
    # each dataset's tools as its rollouts will build them (a web dataset may search the web)
    tools = [
        dataset_sampling(cfg, name, Path(cfg.out_dir) / "questions" / f"{name}.jsonl", Path(cfg.out_dir) / name).tools
        for name in cfg.datasets
    ]
    for backend in sorted({t.search.backend for t in tools}):
        check_tools(next(t for t in tools if t.search.backend == backend))
    check_model_weights(EvaluationConfig, config)


def plan(cfg: EvaluationConfig) -> tuple[dict, dict[str, tuple[list, str]]]:
    """Everything the evaluation can refuse, before it claims its output folder, the cheap first:
    the settings (:func:`check_settings`), every dataset's questions read, then what the run asks
    of this machine (:func:`check_machine`). Returns the config as run and the questions of each
    dataset, with how its file was read."""
    config = check_settings(cfg)
    questions = {name: dataset_questions(cfg, name) for name in cfg.datasets}
    check_machine(cfg, config)
    return config, questions


def benchmark_path(cfg: EvaluationConfig, name: str) -> Path:
    return Path(cfg.files[name]) if name in cfg.files else benchmark_file(cfg.data_dir, name)


def dataset_questions(cfg: EvaluationConfig, name: str) -> tuple[list, str]:
    """The questions of one dataset: a known benchmark in its own format (evaluation/benchmarks.py),
    or a dataset of the user's in any format etagent.question_formats reads, with its kind from
    ``kinds`` where given (first ``limit`` only); and how its file was read (for the manifest)."""
    path = benchmark_path(cfg, name)
    if name in BENCHMARKS:
        split = cfg.splits.get(name, cfg.question_format.split)
        return load_benchmark(name, path, cfg.limit, cfg.partial_input_ok, split), f"the {name} benchmark's own format"
    settings = cfg.question_format
    if name in cfg.kinds:
        settings = dataclasses.replace(settings, kind=cfg.kinds[name])
    if settings.source is None:
        settings = dataclasses.replace(settings, source=name)
    if name in cfg.splits:
        settings = dataclasses.replace(settings, split=cfg.splits[name])
    rows, mapping = read_question_rows(path, settings, cfg.partial_input_ok, split_key=f"splits.{name}")
    return [row.question for row in rows][: cfg.limit], mapping.describe()


def evaluate_dataset(cfg: EvaluationConfig, name: str, questions: tuple[list, str], judge_settings: EvaluationJudge, judge) -> dict:
    """One dataset's rollouts, scores and metrics. Its sampling was planned with the evaluation's
    (:func:`plan`: the engines, the tools and the questions checked once for every dataset)."""
    out = Path(cfg.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    path = benchmark_path(cfg, name)
    # the questions as read (cut to ``limit``), beside the dataset's folder: an input of its
    # rollouts, which never lies inside their output folder
    questions, read_as = questions
    questions_path = write_jsonl(Path(cfg.out_dir) / "questions" / f"{name}.jsonl", questions)
    rollouts = sample_planned(
        dataset_sampling(cfg, name, questions_path, out),
        f"evaluation/{name}",
        partial(rule_judgement, qa_pass_mark=cfg.qa_pass_mark),
        questions,
        f"written by the evaluation from {path}, read as {read_as}",
        token_arrays=True,
        started=time.time(),
    )
    score(out, judge_settings, judge)
    wanted = {q.id for q in questions}
    scored = [row for _, row in iter_jsonl(out / "scored.jsonl") if row["id"] in wanted]
    metrics = {"dataset": name, "file": str(path), "kinds": sorted({row["kind"] for row in scored})}
    metrics.update(aggregate([(row["kind"], row["samples"]) for row in scored], cfg.qa_pass_mark, cfg.bootstrap_rounds, cfg.seed))
    metrics["behaviour"] = behaviour(scored, cfg.qa_pass_mark)
    metrics["tool_failures"] = rollouts["tool_failures"]
    # trajectories the engine's context cut (a question longer than it among them) or the engine
    # failed: scored wrong above, so counted here, and over tools.max_failure_share the run is degraded
    metrics["context_overflow"] = rollouts["context_overflow"]
    metrics["engine_failures"] = rollouts["engine_failures"]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def run(cfg: EvaluationConfig) -> dict:
    started = time.time()
    config, questions = plan(cfg)  # every benchmark read (and so checked) before anything is written
    with claim_output(cfg.out_dir, stage="evaluation", schema=EvaluationConfig, config=config) as out:
        return _evaluate(cfg, out, config, questions, started)


def _evaluate(cfg: EvaluationConfig, out: Path, config: dict, questions: dict[str, tuple[list, str]], started: float) -> dict:
    judge_settings = cfg.judge
    judge = make_judge(judge_settings)
    results = {}
    for name in cfg.datasets:
        log.info("evaluating %s", name)
        results[name] = evaluate_dataset(cfg, name, questions[name], judge_settings, judge)
        results[name]["questions_read"] = questions[name][1]
    failures = {name: r["tool_failures"] for name, r in results.items()}
    reasons = {name: degraded_reasons(r, cfg.tools.max_failure_share) for name, r in results.items()}
    degraded_datasets = [name for name, why in reasons.items() if why]
    summary = {
        "run": cfg.run_name or out.name,
        "datasets": results,
        "degraded": degraded_datasets,
        "degraded_reasons": {name: reasons[name] for name in degraded_datasets},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md_path, _ = write_table(summary_rows([out]), out / "summary")
    behaviour_lines = behaviour_table(results)
    failure_lines = [f"Tool failures on {name}: {describe_failures(counts)}" for name, counts in failures.items() if counts["failed"]]
    failure_lines += [
        f"Context overflow on {name}: {describe_context_overflow(r['context_overflow'])}"
        for name, r in results.items()
        if r["context_overflow"]["overflowed"]
    ]
    failure_lines += [
        f"Engine failures on {name}: {describe_engine_failures(r['engine_failures'])}"
        for name, r in results.items()
        if r["engine_failures"]["failed"]
    ]
    failure_lines += [
        f"DEGRADED: on {name}, {'; '.join(reasons[name])}, over tools.max_failure_share={cfg.tools.max_failure_share}; "
        "these scores measure that, not the policy."
        for name in degraded_datasets
    ]
    extra = behaviour_lines + ([""] if behaviour_lines and failure_lines else []) + failure_lines
    if extra:
        md_path.write_text(md_path.read_text() + "\n" + "\n".join(extra) + "\n")
    write_manifest(
        out,
        stage="evaluation",
        config=config,
        counts={name: r["samples"] for name, r in results.items()},
        seed=cfg.seed,
        started_at=started,
        metrics={
            name: {
                k: r.get(k)
                for k in (
                    "correctness",
                    "efficiency",
                    "judge_failures",
                    "behaviour",
                    "tool_failures",
                    "questions_read",
                    "context_overflow",
                    "engine_failures",
                )
            }
            for name, r in results.items()
        },
        status="degraded" if degraded_datasets else "complete",
    )
    for name, r in results.items():
        if not r["samples"]:
            print(f"{name}: no questions (partial_input_ok=true on an empty file)")
            continue
        judged = f", {r['judge_failures']} judge failures" if r.get("judge_failures") else ""
        print(
            f"{name}: correctness {r['correctness']:.1f}, efficiency {r['efficiency']:.1f}, {r['tool_calls']:.2f} tool calls, "
            f"{r['samples']} samples{judged}; tool failures: {describe_failures(r['tool_failures'])}"
            + (f"; {describe_context_overflow(r['context_overflow'])}" if r["context_overflow"]["overflowed"] else "")
            + (f"; {describe_engine_failures(r['engine_failures'])}" if r["engine_failures"]["failed"] else "")
        )
    if behaviour_lines:
        print("\n".join(behaviour_lines))
    print(f"table: {out / 'summary.md'}")
    if degraded_datasets:
        raise DegradedRun(
            "; ".join(f"{name}: {'; '.join(reasons[name])}" for name in degraded_datasets)
            + f", over tools.max_failure_share={cfg.tools.max_failure_share} (summary.md says so): rerun into a new out_dir once fixed"
        )
    return summary


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for cfg in stage_configs("evaluation", argv, prog="python -m etagent.evaluation.run", doc=__doc__, plan=plan):
        run(cfg)


if __name__ == "__main__":
    main()

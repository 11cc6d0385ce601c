"""The self-evolving data flywheel: evolve seed questions into many judged trajectories each.

    python -m etagent.flywheel.run [--preset tiny|paper] [overrides]     # or: etagent flywheel ...
    python -m etagent.flywheel.export [--preset tiny|paper] [overrides]  # or: etagent flywheel export ...
    bash scripts/flywheel.sh SFT_MODEL [RUN_DIR]                  # the toy world, retriever included

For every question of ``questions`` not yet in ``out_dir``: an initial rollout by the policy, then
up to ``flywheel.rounds`` rounds of evolution (:mod:`etagent.flywheel.evolve`: re-rollout, redundancy
fix and rewrite of correct trajectories; flaw location, new step, step hint and trajectory hint
for wrong ones), every trajectory judged and kept with its operation, parent and round.
``flywheel.concurrency`` questions are evolved at once (an in-process policy batches their
requests together), each within ``flywheel.question_timeout_s`` (a question that runs out keeps
what it made, marked ``timed_out``).

Roles (``configs/flywheel``): the policy (``engine``), the self-reflector (the policy's engine,
its own sampling), the editor (``editor.engine``, off in the tiny preset: the operations that
need it are skipped and the log and manifest say so; the paper serves Qwen2.5-72B-Instruct), the
LLM judge of math answers (the editor's model, ``judge.llm``) and the search summariser
(``summariser.enabled``: each search result is replaced by the editor model's summary of it, as
in the paper's flywheel).

Writes ``out_dir/trajectories.jsonl`` (one line per question: its trajectories with provenance
and judgement, and a ``flywheel`` field with the operations' log and counts) and
``manifest.json`` (per-operation counts: attempted, parsed, succeeded, judged correct). A killed
run resumes: questions already written are skipped, a question in progress is done again from
its start, none is written twice.

What this stage does not do: choose SFT data (``flywheel/export.py``), or fan out over a Ray
cluster (scale the policy and the editor as pools of servers instead: ``engine.kind=openai``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from pathlib import Path

from etagent import scoring
from etagent.agent import AgentLoop
from etagent.errors import DegradedRun, SettingError, exit_on_user_error
from etagent.flywheel import prompts
from etagent.flywheel.config import FlywheelConfig
from etagent.flywheel.evolve import OPERATIONS, STAT_FIELDS, Flywheel, FlywheelSettings, QuestionRun, derived_seed
from etagent.llm import check_engine_settings
from etagent.llm.text import TextModel, load_text_model, shared_engine
from etagent.progress import Progress
from etagent.question_formats import read_question_rows
from etagent.records import JsonlAppender, Question, TrajectoryGroup, read_jsonl, write_manifest
from etagent.rundir import claim_output
from etagent.sampling import context_overflow, degraded_reasons, describe_context_overflow, describe_engine_failures, engine_failures
from etagent.settings import check_model_weights, check_paths
from etagent.tools import ToolOutput
from etagent.tools.executor import build_executor, check_tools, describe_failures, failure_counts

log = logging.getLogger("flywheel")


class SummarisedSearch:
    """The search tool with its result replaced by a text model's summary of it (the paper's
    flywheel summarises every search with its 72B model). The summary sees the query and the
    documents, not the trajectory's earlier steps; a failed summary keeps the documents."""

    name = "search"

    def __init__(self, search, summariser: TextModel):
        self.search, self.summariser = search, summariser

    async def __call__(self, query: str) -> ToolOutput:
        found = await self.search(query)
        if not found.ok:
            return found
        ask = prompts.SUMMARY_PROMPT.format(query=query, documents=found.text)
        try:
            summary = await self.summariser.complete([{"role": "user", "content": ask}], seed=derived_seed("summary", query))
        except Exception as error:  # noqa: BLE001 - the documents are still a good result
            log.warning("summariser failed (%s); the search result keeps the documents", error)
            return found
        return ToolOutput(summary.strip() or found.text, ok=True, cached=found.cached, details={**found.details, "summarised": True})


def question_record(run: QuestionRun, timed_out: bool, seconds: float, editor: bool) -> TrajectoryGroup:
    group = TrajectoryGroup.for_question(run.question, run.trajectories)
    group.flywheel = {
        "rounds": run.rounds,
        "evolved": run.evolved,
        "timed_out": timed_out,
        "seconds": round(seconds, 2),
        "editor": editor,
        "operations": run.stats_json(),
        "log": run.events,
    }
    return group


async def evolve_all(settings: FlywheelSettings, flywheel: Flywheel, todo: list[Question], writer: JsonlAppender, editor: bool) -> None:
    """Evolve ``todo``, ``settings.concurrency`` questions at a time, writing each as it ends."""
    limit = asyncio.Semaphore(settings.concurrency)
    progress = Progress("flywheel", len(todo), "question")
    made = 0

    async def one(q: Question) -> None:
        nonlocal made
        async with limit:
            run, begun, timed_out = QuestionRun(q), time.time(), False
            try:
                await asyncio.wait_for(flywheel.evolve(run), settings.question_timeout_s)
            except TimeoutError:
                timed_out = True
                run.event(run.rounds, "question", f"time limit of {settings.question_timeout_s} s reached; kept what was made")
            writer.write(question_record(run, timed_out, time.time() - begun, editor))
        made += len(run.trajectories)
        progress.update(1, trajectories=made)

    await asyncio.gather(*(one(q) for q in todo))
    progress.close()


def check_settings(cfg: FlywheelConfig) -> None:
    """How the roles go together, and the models and questions present and of their kind, before
    any model loads (ranges were checked at load: flywheel/config.py)."""
    if cfg.editor.enabled and not cfg.editor.engine.model:
        raise SettingError("editor.engine.model", "editor.enabled=true needs it (a model folder, hub id or .gguf file)")
    if not cfg.editor.enabled and (cfg.judge.llm or cfg.summariser.enabled):
        raise SettingError(
            "editor.enabled", "judge.llm and summariser.enabled use the editor's model: set editor.enabled=true and editor.engine.model"
        )
    check_paths(FlywheelConfig, dataclasses.asdict(cfg))


def plan(cfg: FlywheelConfig) -> tuple[list[Question], str]:
    """Everything the flywheel can refuse, before it claims its output folder, the cheap first:
    the settings (:func:`check_settings`) and every question read (first ``limit``); then what the
    engines and the tools ask of this machine and the models' weights against their configs.
    Returns the questions and how they were read (etagent.question_formats' Mapping, for the
    manifest)."""
    check_settings(cfg)
    rows, mapping = read_question_rows(cfg.questions, cfg.question_format, cfg.partial_input_ok)
    check_engine_settings(cfg.engine)
    if cfg.editor.enabled:
        check_engine_settings(cfg.editor.engine, "editor.engine")
    check_tools(cfg.tools)
    check_model_weights(FlywheelConfig, dataclasses.asdict(cfg))
    questions = [row.question for row in rows][: cfg.limit]
    return questions, mapping.describe()


def run(cfg: FlywheelConfig) -> dict:
    started = time.time()
    questions, read_as = plan(cfg)  # before any model is loaded or output written
    config = dataclasses.asdict(cfg)
    with claim_output(cfg.out_dir, stage="flywheel", schema=FlywheelConfig, config=config) as out:
        metrics = evolve(cfg, out, questions)
        metrics["questions_read"] = read_as  # which column fed each field, and any kind inferred
        write_manifest(
            out,
            stage="flywheel",
            config=config,
            counts={"questions": metrics["questions"], "trajectories": metrics["trajectories"]},
            seed=cfg.flywheel.seed,
            started_at=started,
            metrics=metrics,
            status="degraded" if metrics["degraded"] else "complete",
        )
    return metrics


def evolve(cfg: FlywheelConfig, out: Path, questions: list[Question]) -> dict:
    """Evolve every question not yet in out/trajectories.jsonl; the summary of the whole file."""
    policy = shared_engine(cfg.engine)
    editor = judge = None
    if cfg.editor.enabled:
        editor = load_text_model(cfg.editor, "editor")
        if cfg.judge.llm:  # the editor's model, asked with the judge's own settings
            judge_model = TextModel(editor.engine, cfg.judge.sampling, cfg.judge.max_new_tokens, "judge")
            judge = scoring.LLMJudge(judge_model, attempts=cfg.judge.attempts)
    else:
        log.warning("no editor configured (editor.enabled=false): A2, A3, B0, B1 and B2 are skipped; A1 and B3 run")
    reflector = TextModel(policy, cfg.reflector.sampling, cfg.reflector.max_new_tokens, "reflector")
    settings = cfg.flywheel
    with build_executor(cfg.tools) as executor, JsonlAppender(out / "trajectories.jsonl") as writer:
        if cfg.summariser.enabled:
            executor.tools["search"] = SummarisedSearch(executor.tools["search"], editor)
        loop = AgentLoop(policy, executor, cfg.agent)
        flywheel = Flywheel(loop, reflector, editor, settings, judge)
        todo = [q for q in questions if q.id not in writer.done]
        log.info("%d questions, %d already done, %d to evolve", len(questions), len(questions) - len(todo), len(todo))
        asyncio.run(evolve_all(settings, flywheel, todo, writer, editor is not None))
    metrics = summarise(out / "trajectories.jsonl")
    metrics["degraded"] = bool(degraded_reasons(metrics, cfg.tools.max_failure_share))
    return metrics


def summarise(path: Path) -> dict:
    """Counts over a flywheel output: per operation, per question, tool use and correctness."""
    groups = read_jsonl(path, TrajectoryGroup)
    operations: dict[str, Counter] = {op: Counter() for op in OPERATIONS}
    for g in groups:
        for op, counts in g.flywheel["operations"].items():
            operations[op].update(counts)
    trajectories = [t for g in groups for t in g.trajectories]
    n_questions = max(len(groups), 1)
    correct = [t for t in trajectories if t.correct]
    return {
        "questions": len(groups),
        "trajectories": len(trajectories),
        "editor": all(g.flywheel["editor"] for g in groups) if groups else None,
        "timed_out": sum(g.flywheel["timed_out"] for g in groups),
        "initial_correct": round(sum(bool(g.trajectories and g.trajectories[0].correct) for g in groups) / n_questions, 4),
        "any_correct": round(sum(any(t.correct for t in g.trajectories) for g in groups) / n_questions, 4),
        "correct_per_question": round(len(correct) / n_questions, 3),
        "trajectories_per_question": round(len(trajectories) / n_questions, 3),
        "tool_calls_of_correct": dict(sorted(Counter(t.tool_calls_written or 0 for t in correct).items())),
        "operations": {op: {**dict.fromkeys(STAT_FIELDS, 0), **counts} for op, counts in operations.items()},
        "tool_failures": failure_counts(call for t in trajectories for call in t.tool_calls),
        "context_overflow": context_overflow(trajectories),
        "engine_failures": engine_failures(trajectories),
    }


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for cfg in stage_configs("flywheel", argv, prog="python -m etagent.flywheel.run", doc=__doc__, plan=plan):
        m = run(cfg)
        print(
            f"flywheel: {m['trajectories']} trajectories of {m['questions']} questions in {cfg.out_dir}\n"
            f"  correct: initial rollout {m['initial_correct']:.3f} of questions, any trajectory {m['any_correct']:.3f}; "
            f"{m['correct_per_question']:.2f} correct trajectories per question; tool calls of correct ones {m['tool_calls_of_correct']}"
        )
        print(f"  {'operation':<20}" + "".join(f"{f:>11}" for f in STAT_FIELDS) + "   other")
        for op, counts in m["operations"].items():
            other = ", ".join(f"{k} {v}" for k, v in counts.items() if k not in STAT_FIELDS)
            print(f"  {op:<20}" + "".join(f"{counts[f]:>11}" for f in STAT_FIELDS) + f"   {other}")
        print(f"  tool failures: {describe_failures(m['tool_failures'])}")
        print(f"  {describe_context_overflow(m['context_overflow'])}; {describe_engine_failures(m['engine_failures'])}")
        if m["degraded"]:
            raise DegradedRun(
                f"{'; '.join(degraded_reasons(m, cfg.tools.max_failure_share))}, over tools.max_failure_share={cfg.tools.max_failure_share}: "
                f"the trajectories in {cfg.out_dir} are written but not to be trusted; rerun into a new out_dir once fixed"
            )


if __name__ == "__main__":
    main()

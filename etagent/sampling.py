"""Sample n rollouts per question with the agent loop, in one process or across a Ray cluster.

:func:`run_sampling` writes ``out_dir/trajectories.jsonl`` (one :class:`TrajectoryGroup` per
question, each rollout judged by the stage's judge) and ``manifest.json``. Questions already in
the output are skipped, so a killed run resumes where it stopped and never duplicates a question.

With ``ray.workers: 0`` everything runs here: each trajectory advances on its own, at most
``batch_questions`` x n are unfinished at a time (a new question starts as soon as n have
finished), and each question is written as soon as it and those before it are done (the file's
order is the questions' order); with ``agent.lockstep``, ``batch_questions`` questions at a time
in rounds. With ``ray.workers > 0`` the questions are split into batches of
``batch_questions`` and fanned out to a pool of Ray actors, each holding its own engine (one per
GPU with ``ray.num_gpus_per_worker: 1``) and tools; the driver writes the results as they come
back.

This is the sampling machinery every rollout stage shares (direct rollout, evaluation, the
flywheel's initial rollouts); each stage owns its entry point and config (``direct_rollout/``,
``evaluation/``) and decides what it does with the rollouts. Nothing here is a command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import field
from pathlib import Path
from typing import Annotated

from omegaconf import MISSING

from etagent.agent import AgentConfig, AgentLoop
from etagent.errors import SettingError
from etagent.gateway.harness import GatewaySettings, check_gateway
from etagent.llm import EngineConfig, check_engine_settings
from etagent.progress import Progress
from etagent.question_formats import QuestionFormat, read_question_rows
from etagent.records import JsonlAppender, Judgement, Question, Trajectory, TrajectoryGroup, write_manifest
from etagent.rundir import claim_output
from etagent.settings import (
    FREE,
    InputData,
    NonNegativeFloat,
    NonNegativeInt,
    OutputFolder,
    PositiveInt,
    check_installed,
    check_model_weights,
    check_paths,
    group,
)
from etagent.tools.executor import ToolsConfig, check_tools, degraded, describe_failures, failure_counts

log = logging.getLogger(__name__)

# A judge: (prediction, gold answers, kind) -> Judgement. A module-level function (or a
# functools.partial of one), so that Ray can send it to its workers by name.
Judge = Callable[[str, Sequence[str], str], Judgement]

# The per-token fields of a trajectory. A stage that only reads answers and counts (direct
# rollout) leaves them out: at the paper's scale they would make its file tens of gigabytes.
TOKEN_ARRAYS = frozenset({"prompt_ids", "response_ids", "response_mask", "response_origin", "logprobs", "tempered_logprobs"})


@group
class RayConfig:
    """``ray``: Ray actors for the rollouts, each with its own engine and tools (configs of the
    stages that sample document each field). Where the work runs, not what it computes: a
    resumed run may change all of it."""

    workers: Annotated[NonNegativeInt, FREE] = MISSING
    address: Annotated[str | None, FREE] = MISSING
    num_cpus_per_worker: Annotated[PositiveInt, FREE] = MISSING
    num_gpus_per_worker: Annotated[NonNegativeFloat, FREE] = MISSING


@group
class SamplingConfig:
    """What :func:`run_sampling` reads. A stage's config holds these keys at its top level (direct
    rollout's, beside its own), or the stage makes one per run (evaluation, one per dataset).

    Each record is one question's, complete in itself, so a resumed run may sample more of the
    same file (``limit``), from wherever the file now lies (``questions``; its content must be
    the same: etagent/rundir.py)."""

    questions: Annotated[InputData, FREE] = MISSING
    question_format: QuestionFormat = field(default_factory=QuestionFormat)
    out_dir: OutputFolder = MISSING
    n: PositiveInt = MISSING
    batch_questions: Annotated[PositiveInt, FREE] = MISSING
    limit: Annotated[PositiveInt | None, FREE] = MISSING
    partial_input_ok: Annotated[bool, FREE] = MISSING
    engine: EngineConfig = MISSING
    agent: AgentConfig = MISSING
    tools: ToolsConfig = MISSING
    ray: RayConfig = field(default_factory=RayConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


class Sampler:
    """An engine, the tools and the agent loop: turns questions into scored trajectory groups."""

    def __init__(self, engine, executor, config: AgentConfig, n: int, stage: str, judge: Judge, token_arrays: bool = True):
        self.loop = AgentLoop(engine, executor, config)
        self.n, self.stage, self.judge, self.token_arrays = n, stage, judge, token_arrays

    def sample(self, questions: Sequence[Question]) -> list[TrajectoryGroup]:
        """Every question's group, all of them in flight at once."""
        return list(self.stream(questions, window=len(questions)))

    def stream(self, questions: Sequence[Question], window: int) -> Iterator[TrajectoryGroup]:
        """Each question's group, in question order, as soon as it and every question before it
        are done. Each trajectory runs on its own (:meth:`AgentLoop.run_one`), and at most
        ``window`` x n of them are unfinished at any time: the next question starts as soon as n
        trajectories have finished, whichever questions they belong to, so the engine never waits
        for the slowest trajectory of a batch. With the agent's ``lockstep``, ``window`` questions
        at a time, in rounds."""
        if not questions:
            return
        if self.loop.config.lockstep:  # rounds over a batch of questions at a time
            for start in range(0, len(questions), window):
                batch = questions[start : start + window]
                states = [self.loop.new(q, f"{q.id}/{k}", stage=self.stage) for q in batch for k in range(self.n)]
                asyncio.run(self.loop.run(states))
                yield from (self._group(q, states[i * self.n : (i + 1) * self.n]) for i, q in enumerate(batch))
            return
        with asyncio.Runner() as runner:
            futures = [runner.get_loop().create_future() for _ in questions]
            tasks: set[asyncio.Task] = set()

            async def one(i: int, slots: asyncio.Semaphore) -> None:
                async def trajectory(state):
                    try:
                        await self.loop.run_one(state)
                    finally:
                        slots.release()

                q = questions[i]
                try:
                    states = [self.loop.new(q, f"{q.id}/{k}", stage=self.stage) for k in range(self.n)]
                    await asyncio.gather(*(trajectory(s) for s in states))
                    futures[i].set_result(self._group(q, states))
                except Exception as error:  # to the reader, in order
                    futures[i].set_exception(error)

            async def start_all() -> None:
                slots = asyncio.Semaphore(window * self.n)
                for i in range(len(questions)):
                    for _ in range(self.n):  # one place per trajectory
                        await slots.acquire()
                    tasks.add(task := asyncio.create_task(one(i, slots)))
                    task.add_done_callback(tasks.discard)

            starter = runner.get_loop().create_task(start_all())
            try:
                for future in futures:
                    yield runner.get_loop().run_until_complete(future)
            finally:
                starter.cancel()
                for task in list(tasks):
                    task.cancel()

    def _group(self, q: Question, states: list) -> TrajectoryGroup:
        records = [self.loop.to_record(s) for s in states]
        for record in records:
            record.judgement = self.judge(record.prediction, q.answer, q.kind)
            if not self.token_arrays:
                for name in TOKEN_ARRAYS:
                    setattr(record, name, None)
        if len(records) != self.n:  # never write a question as done with fewer chains than asked
            raise RuntimeError(f"question {q.id}: {len(records)} rollouts made, {self.n} asked")
        return TrajectoryGroup.for_question(q, records)


class HarnessSampler(Sampler):
    """The same groups, judged and written alike, from rollouts an outside harness drives through
    the gateway (``gateway.harness``; etagent/gateway/harness.py): ``window`` questions' n
    sessions per run of the harness. The gateway samples with ``agent.sampling``, whatever the
    harness asks, so that both paths draw from one distribution."""

    def __init__(self, engine, settings: GatewaySettings, config: AgentConfig, n: int, stage: str, judge: Judge, token_arrays: bool = True):
        from etagent.gateway.harness import HarnessRunner

        super().__init__(engine, None, config, n, stage, judge, token_arrays)
        self.runner = HarnessRunner(engine, settings, config.max_segment_tokens, config.sampling)

    def stream(self, questions: Sequence[Question], window: int) -> Iterator[TrajectoryGroup]:
        from etagent.gateway.harness import session_trajectory

        base = self.loop.config.seed
        for start in range(0, len(questions), window):
            batch = questions[start : start + window]
            tasks = [
                (q.question, q.id, {"id": q.id}, None if base is None else zlib.crc32(f"{base}/{q.id}/{k}".encode()))
                for q in batch
                for k in range(self.n)
            ]
            sessions, failure = self.runner.run(tasks, self.loop.config.max_response_tokens)
            for i, q in enumerate(batch):
                states = [
                    session_trajectory(self.loop, sessions[i * self.n + k], q, f"{q.id}/{k}", failure, stage=self.stage)
                    for k in range(self.n)
                ]
                yield self._group(q, states)


def _batches(items: Sequence, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def _local(cfg: SamplingConfig, stage: str, todo: list[Question], judge: Judge, token_arrays: bool) -> Iterator[list[TrajectoryGroup]]:
    from etagent.llm import make_engine
    from etagent.tools.executor import build_executor

    engine = make_engine(cfg.engine)
    if cfg.gateway.harness:  # the harness runs its own tools
        sampler = HarnessSampler(engine, cfg.gateway, cfg.agent, cfg.n, stage, judge, token_arrays)
        for group in sampler.stream(todo, window=cfg.batch_questions):
            yield [group]
        return
    with build_executor(cfg.tools) as executor:
        sampler = Sampler(engine, executor, cfg.agent, cfg.n, stage, judge, token_arrays)
        for group in sampler.stream(todo, window=cfg.batch_questions):
            yield [group]


def _ray(cfg: SamplingConfig, stage: str, todo: list[Question], judge: Judge, token_arrays: bool) -> Iterator[list[TrajectoryGroup]]:
    import ray
    from ray.util import ActorPool

    if not ray.is_initialized():
        if cfg.ray.address:
            ray.init(address=cfg.ray.address)
        else:
            ray.init(num_cpus=cfg.ray.workers * cfg.ray.num_cpus_per_worker, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class SamplingWorker:
        def __init__(self, config: SamplingConfig, stage: str, judge: Judge, token_arrays: bool):
            import torch

            from etagent.llm import make_engine
            from etagent.tools.executor import build_executor

            torch.set_num_threads(max(1, config.ray.num_cpus_per_worker))
            self.executor = build_executor(config.tools)
            engine = make_engine(config.engine)
            self.sampler = Sampler(engine, self.executor, config.agent, config.n, stage, judge, token_arrays)

        def sample(self, questions: list[dict]) -> list[dict]:
            groups = self.sampler.sample([Question.model_validate(q) for q in questions])
            return [g.to_json() for g in groups]

    options = {"num_cpus": cfg.ray.num_cpus_per_worker, "num_gpus": cfg.ray.num_gpus_per_worker}
    workers = [SamplingWorker.options(**options).remote(cfg, stage, judge, token_arrays) for _ in range(cfg.ray.workers)]
    pool = ActorPool(workers)
    batches = [[q.to_json() for q in batch] for batch in _batches(todo, cfg.batch_questions)]
    for result in pool.map_unordered(lambda worker, batch: worker.sample.remote(batch), batches):
        yield [TrajectoryGroup.model_validate(g) for g in result]


def check_harness(cfg: SamplingConfig) -> None:
    """``gateway.harness``: a command that can start and the gateway's packages; one engine, here
    (the harness is pointed at this process's gateway, not at Ray's actors)."""
    check_gateway("gateway", cfg.gateway)
    if cfg.gateway.harness and cfg.ray.workers > 0:
        raise SettingError("ray.workers", f"is {cfg.ray.workers}, and gateway.harness drives the engine of this process: set ray.workers=0")


def plan_sampling(cfg: SamplingConfig, schema: type = SamplingConfig) -> tuple[list[Question], str]:
    """Everything a sampling run can refuse, before it claims its output folder, the cheap first
    (a refused setting or question answers in about a second; the ranges were checked at load):
    what the run reads, present and of its kind; every question read (first ``limit``); then what
    the engine, the tools and Ray ask of this machine, and the model's weights against its
    config. Returns the questions and how they were read (etagent.question_formats' Mapping, for
    the manifest). ``schema``: the stage's, where it adds settings to these (direct rollout's
    ``model``, which the engine's follows: a refusal names the key the user set)."""
    values = dataclasses.asdict(cfg)
    check_paths(schema, values)
    rows, mapping = read_question_rows(cfg.questions, cfg.question_format, cfg.partial_input_ok)
    check_engine_settings(cfg.engine)
    if cfg.ray.workers > 0:
        check_installed("ray.workers", "ray", f"ray.workers={cfg.ray.workers}")
    check_tools(cfg.tools)
    check_harness(cfg)
    check_model_weights(schema, values)
    questions = [row.question for row in rows]
    return (questions[: cfg.limit] if cfg.limit is not None else questions), mapping.describe()


def run_sampling(cfg: SamplingConfig, stage: str, judge: Judge, token_arrays: bool = True, schema: type = SamplingConfig) -> dict:
    """Sample every question of cfg.questions (``cfg`` holds :class:`SamplingConfig`'s keys, and
    the manifest records all of it) not yet in the output for ``stage`` (the name in
    each trajectory's provenance and the manifest), judging each rollout with ``judge``; return
    summary metrics (``degraded`` when the tools failed on more than
    ``tools.max_failure_share`` of the calls, or the engine's context cut or the engine failed
    more than that share of the trajectories: :func:`degraded_reasons`). ``token_arrays=False``
    leaves the per-token fields out."""
    started = time.time()
    questions, read_as = plan_sampling(cfg, schema)
    return sample_planned(cfg, stage, judge, questions, read_as, token_arrays, started)


def sample_planned(
    cfg: SamplingConfig, stage: str, judge: Judge, questions: list[Question], read_as: str, token_arrays: bool, started: float
) -> dict:
    """:func:`run_sampling` once its plan has passed: for a stage that planned it itself
    (evaluation checks its engine and tools once for all its datasets, and read their questions)."""
    config = dataclasses.asdict(cfg)
    with claim_output(cfg.out_dir, stage=stage, schema=SamplingConfig, config=config) as out:
        metrics = _sample(cfg, stage, out, questions, judge, token_arrays, started)
        metrics["questions_read"] = read_as  # which column fed each field, and any kind inferred
        write_manifest(
            out,
            stage=stage,
            config=config,
            counts={"questions": metrics["questions"], "trajectories": metrics["trajectories"]},
            seed=cfg.agent.seed,
            started_at=started,
            metrics=metrics,
            status="degraded" if metrics["degraded"] else "complete",
        )
    for counted in engine_and_tool_problems(metrics):
        (log.error if metrics["degraded"] else log.info)("%s: %s", out, counted)
    return metrics


def _sample(
    cfg: SamplingConfig, stage: str, out: Path, questions: list[Question], judge: Judge, token_arrays: bool, started: float
) -> dict:
    with JsonlAppender(out / "trajectories.jsonl") as writer:
        todo = [q for q in questions if q.id not in writer.done]
        log.info("%d questions, %d already done, %d to sample x %d", len(questions), len(questions) - len(todo), len(todo), cfg.n)
        progress = Progress("sampling", len(todo), "question")
        runner = _ray if cfg.ray.workers > 0 else _local
        trajectories = 0
        for groups in runner(cfg, stage, todo, judge, token_arrays):
            for group in groups:
                writer.write(group)
            trajectories += sum(len(g.trajectories) for g in groups)
            rate = trajectories / max(time.time() - started, 1e-9)
            progress.update(len(groups), trajectories=trajectories, trajectories_per_s=f"{rate:.2f}")
        progress.close()
    metrics = summarise(out / "trajectories.jsonl")
    metrics["degraded"] = bool(degraded_reasons(metrics, cfg.tools.max_failure_share))
    return metrics


def summarise(path: Path) -> dict:
    """Score, tool use, length, finish reasons, tool failures, context overflow and engine
    failures over a trajectories file, overall and per kind."""
    from etagent.records import read_jsonl

    groups = read_jsonl(path, TrajectoryGroup)

    def stats(trajectories: list) -> dict:
        n = max(len(trajectories), 1)
        return {
            "trajectories": len(trajectories),
            "mean_score": round(sum(t.judgement.score or 0.0 for t in trajectories if t.judgement) / n, 4),
            "mean_tool_calls_executed": round(sum(t.tool_calls_executed or 0 for t in trajectories) / n, 4),
            "mean_tool_calls_written": round(sum(t.tool_calls_written or 0 for t in trajectories) / n, 4),
            "mean_generated_tokens": round(sum(t.n_generated or 0 for t in trajectories) / n, 1),
            "mean_tokens": round(sum(t.n_tokens for t in trajectories) / n, 1),
        }

    trajectories = [t for g in groups for t in g.trajectories]
    kinds = sorted({g.kind for g in groups})
    return {
        "questions": len(groups),
        **stats(trajectories),
        "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
        "tool_failures": failure_counts(call for t in trajectories for call in t.tool_calls),
        "context_overflow": context_overflow(trajectories),
        "engine_failures": engine_failures(trajectories),
        "per_kind": {kind: stats([t for g in groups if g.kind == kind for t in g.trajectories]) for kind in kinds},
    }


# -- what the engine, not the policy, ended ---------------------------------------------------
# A trajectory cut by the engine's context or failed by the engine has no answer, and is scored
# wrong like any other: a score that measures engine.max_model_len or a broken server, not the
# policy. They are counted beside the tools' failures, and over the same share
# (tools.max_failure_share) a stage ends degraded (exit 3), as it does for the tools.


def context_overflow(trajectories: Iterable[Trajectory]) -> dict:
    """The trajectories the engine's context cut before their own response budget was spent
    (finish reason ``context``: etagent/agent.py), of all; ``prompt_too_long`` counts those whose
    prompt alone filled the context (not one token generated: a question longer than the
    context): ``{"trajectories": 40, "overflowed": 3, "prompt_too_long": 2, "share": 0.075}``."""
    total = overflowed = prompt_too_long = 0
    for t in trajectories:
        total += 1
        if t.finish_reason == "context":
            overflowed += 1
            prompt_too_long += t.n_generated == 0
    return {
        "trajectories": total,
        "overflowed": overflowed,
        "prompt_too_long": prompt_too_long,
        "share": round(overflowed / total, 4) if total else 0.0,
    }


def engine_failures(trajectories: Iterable[Trajectory]) -> dict:
    """The trajectories the engine failed (finish reason ``error``: a request it refused, a
    prompt past a served model's own context, a server down), of all, by cause (the error's text
    up to its first colon): ``{"trajectories": 40, "failed": 1, "share": 0.025, "by_cause":
    {"every server failed": 1}}``."""
    total = 0
    causes: Counter = Counter()
    for t in trajectories:
        total += 1
        if t.finish_reason == "error":
            causes[(t.error or "no reason given").split(":")[0][:80]] += 1
    failed = sum(causes.values())
    return {
        "trajectories": total,
        "failed": failed,
        "share": round(failed / total, 4) if total else 0.0,
        "by_cause": dict(causes.most_common()),
    }


def describe_context_overflow(counts: dict) -> str:
    """``3 of 40 trajectories cut by the engine's context (7.5%), 2 of them prompts longer than
    the context``."""
    too_long = f", {counts['prompt_too_long']} of them prompts longer than the context" if counts["prompt_too_long"] else ""
    return f"{counts['overflowed']} of {counts['trajectories']} trajectories cut by the engine's context ({100 * counts['share']:.1f}%){too_long}"


def describe_engine_failures(counts: dict) -> str:
    """``1 of 40 trajectories failed by the engine (2.5%): every server failed 1``."""
    causes = ", ".join(f"{cause} {n}" for cause, n in counts["by_cause"].items())
    return f"{counts['failed']} of {counts['trajectories']} trajectories failed by the engine ({100 * counts['share']:.1f}%)" + (
        f": {causes}" if causes else ""
    )


def engine_and_tool_problems(metrics: dict) -> list[str]:
    """Each of the tools' failures, the context's cuts and the engine's failures that happened in
    a run's metrics (:func:`summarise`), described in one line, whatever their share."""
    lines = []
    if metrics["tool_failures"]["failed"]:
        lines.append(describe_failures(metrics["tool_failures"]))
    if metrics["context_overflow"]["overflowed"]:
        lines.append(describe_context_overflow(metrics["context_overflow"]))
    if metrics["engine_failures"]["failed"]:
        lines.append(describe_engine_failures(metrics["engine_failures"]))
    return lines


def degraded_reasons(metrics: dict, max_share: float) -> list[str]:
    """Why a run's scores are not to be trusted (empty when they are): the tools failed on more
    than ``max_share`` of the calls, or the engine's context cut or the engine failed more than
    ``max_share`` of the trajectories (``tools.max_failure_share``), each in one line with what
    to change."""
    reasons = []
    if degraded(metrics["tool_failures"], max_share):
        reasons.append(describe_failures(metrics["tool_failures"]) + " (fix the tools)")
    if metrics["context_overflow"]["share"] > max_share:
        reasons.append(
            describe_context_overflow(metrics["context_overflow"])
            + " (a longer context where the model has one: engine.vllm.max_model_len, or engine.openai.max_model_len and the"
            " server's; or shorter questions)"
        )
    if metrics["engine_failures"]["share"] > max_share:
        reasons.append(describe_engine_failures(metrics["engine_failures"]) + " (fix the engine; each trajectory's error says why)")
    return reasons

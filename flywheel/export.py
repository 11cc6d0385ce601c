"""The flywheel's trajectories as SFT data, with a report of what was kept and why the rest was not.

    python -m etagent.flywheel.export [--preset tiny|paper] [overrides]     # or: etagent flywheel export ...

Reads ``out_dir/trajectories.jsonl`` (``flywheel/run.py``), or each file of
``export.trajectories`` (several runs exported together: one per world version on the toy
world), and writes into ``export.out_dir``, which never holds what it reads:

- ``sft.jsonl``: one chat example per kept trajectory (the protocol prompt in the system turn,
  the question, the trajectory as the assistant turn with its tool results as masked segments,
  and the trajectory's own token ids and mask), which ``sft/`` reads unchanged
  (``data.path=.../sft.jsonl``);
- ``llamafactory/<format>/``: the same examples as LLaMA-Factory alpaca or sharegpt JSON, each
  with its ``dataset_info.json``;
- ``report.json``: kept and dropped counts with the reason of each drop, per question and per
  operation, the tool-call counts of what was kept, and, with ``export.seed_data``, the same
  figures for the seed SFT data of the same questions, whose examples go to ``seed_sft.jsonl``
  (for an SFT on the seed data of exactly these questions: ``scripts/flywheel_effect.sh``).

A trajectory is kept when it is judged correct, passes the strict template check
(:func:`etagent.protocol.template_problems`: starts with ``<think>``, ends with one boxed answer,
no tags inside the answer), has no failed tool call (``export.require_tool_success``: a timeout,
an error or the budget message), and is not a copy of one already kept for its question; then at
most ``export.max_per_question`` per question, fewer tool calls first
(``export.prefer_fewer_calls``; the flywheel's order otherwise). The reference shipped no such
step (docs/paper-code.md §A2.7); these are the rules its unused helpers imply, with tool results
masked and the prompt in the system turn, where every other stage puts it.

The export is a function of its input: rerunning it rewrites the same files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from collections import Counter
from pathlib import Path

from etagent import protocol
from etagent.errors import UserError, exit_on_user_error
from etagent.flywheel.config import ExportSettings, FlywheelConfig
from etagent.records import SFTExample, Trajectory, TrajectoryGroup, export_llamafactory, read_jsonl, read_records, write_jsonl
from etagent.settings import check_paths

log = logging.getLogger("etagent.flywheel.export")


def drop_reason(t: Trajectory, require_tool_success: bool) -> str | None:
    """Why a trajectory is not SFT data (None: it is)."""
    if not t.correct:
        return "not judged correct"
    problems = protocol.template_problems(t.text)
    if problems:
        return f"template: {problems[0]}"
    if not t.prediction.strip():
        return "no answer"
    if require_tool_success and any(not c.ok or c.budget_exhausted for c in t.tool_calls):
        return "a failed tool call"
    return None


def choose(group: TrajectoryGroup, cfg: FlywheelConfig, dropped: Counter) -> list[Trajectory]:
    """The trajectories of one question kept as SFT data; counts each drop by its reason."""
    candidates, seen = [], set()
    for t in group.trajectories:
        reason = drop_reason(t, cfg.require_tool_success)
        if reason is None and t.text.strip() in seen:
            reason = "a copy of a kept trajectory"
        if reason is not None:
            dropped[reason] += 1
            continue
        seen.add(t.text.strip())
        candidates.append(t)
    if cfg.prefer_fewer_calls:
        candidates.sort(key=lambda t: t.tool_calls_written or 0)  # stable: the flywheel's order on ties
    dropped["over max_per_question"] += max(0, len(candidates) - cfg.max_per_question)
    return candidates[: cfg.max_per_question]


def spread(calls_per_question: dict[str, list[int]]) -> dict:
    """How many examples each question has, and how varied their tool-call counts are."""
    counts = [len(calls) for calls in calls_per_question.values()]
    every = [c for calls in calls_per_question.values() for c in calls]
    return {
        "questions": len(counts),
        "examples": sum(counts),
        "examples_per_question": round(sum(counts) / max(len(counts), 1), 3),
        "distinct_tool_call_counts_per_question": round(sum(len(set(c)) for c in calls_per_question.values()) / max(len(counts), 1), 3),
        "tool_call_count_stdev": round(statistics.pstdev(every), 3) if every else 0.0,
        "tool_calls": dict(sorted(Counter(every).items())),
    }


def export(cfg: FlywheelConfig) -> dict:
    """Write the SFT data and the report; return the report."""
    e = cfg.export
    files = [str(path) for path in e.trajectories] if e.trajectories else [str(Path(cfg.out_dir) / "trajectories.jsonl")]
    # the export's own reading of the settings: the trajectories are read, export.out_dir written
    check_paths(ExportSettings, {**dataclasses.asdict(e), "trajectories": files})
    out = Path(e.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # questions are written as they finish, an order that depends on timing: the data's order must not
    groups, seen = [], {}
    for source in files:
        for group in read_jsonl(source, TrajectoryGroup):
            if group.id in seen:
                raise UserError(f"{source}: question {group.id!r} is also in {seen[group.id]}: export each question from one run")
            seen[group.id] = source
            groups.append(group)
    groups.sort(key=lambda g: g.id)
    source = ", ".join(files)
    examples, dropped, kept_ops = [], Counter(), Counter()
    kept_calls: dict[str, list[int]] = {}
    for group in groups:
        kept = choose(group, e, dropped)
        kept_calls[group.id] = [t.tool_calls_written or 0 for t in kept]
        for t in kept:
            kept_ops[t.provenance.operation] += 1
            examples.append(
                SFTExample.from_rollout(
                    t,
                    group.question,
                    question_id=group.id,
                    operation=t.provenance.operation,
                    round=t.provenance.round,
                    parent=t.provenance.parent,
                    tool_calls=t.tool_calls_written,
                )
            )
    if not examples:  # an SFT on this would train on nothing: say why, and write nothing
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.most_common()) or "no trajectories"
        raise UserError(
            f"{source}: none of the {sum(len(g.trajectories) for g in groups)} trajectories of {len(groups)} questions is kept as SFT data ({reasons})"
        )
    write_jsonl(out / "sft.jsonl", examples)
    for fmt in e.llamafactory:
        export_llamafactory(examples, out / "llamafactory" / fmt, name=f"flywheel_{fmt}", fmt=fmt)
    total = sum(len(g.trajectories) for g in groups)
    report = {
        "source": str(source),
        "trajectories": total,
        "kept": len(examples),
        "dropped": dict(dropped.most_common()),
        "kept_by_operation": dict(kept_ops.most_common()),
        "questions_with_data": sum(1 for calls in kept_calls.values() if calls),
        "export": spread(kept_calls),
        "rules": {k: getattr(e, k) for k in ("max_per_question", "prefer_fewer_calls", "require_tool_success")},
    }
    if e.seed_data:
        seed = seed_examples(Path(e.seed_data), set(kept_calls))
        write_jsonl(out / "seed_sft.jsonl", seed)
        calls = {q: [protocol.count_tool_calls(x.response) for x in seed if x.id.rsplit("/", 1)[0] == q] for q in kept_calls}
        report["seed_data"] = {"path": str(e.seed_data), "written": str(out / "seed_sft.jsonl"), **spread(calls)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def seed_examples(path: Path, questions: set[str]) -> list[SFTExample]:
    """The seed SFT examples of ``questions`` (example ids "<question id>/...")."""
    return [x for x in read_records(path, SFTExample) if x.id.rsplit("/", 1)[0] in questions]


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    from etagent.stage_cli import stage_configs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for cfg in stage_configs("flywheel", argv, prog="python -m etagent.flywheel.export", doc=__doc__, resumes=False):
        r = export(cfg)
        x = r["export"]
        print(
            f"flywheel export: {r['kept']} of {r['trajectories']} trajectories kept as SFT data for {r['questions_with_data']} of "
            f"{x['questions']} questions -> {cfg.export.out_dir}/sft.jsonl\n"
            f"  dropped: {r['dropped']}\n  kept by operation: {r['kept_by_operation']}\n"
            f"  per question: {x['examples_per_question']:.2f} examples, {x['distinct_tool_call_counts_per_question']:.2f} distinct "
            f"tool-call counts; tool calls {x['tool_calls']}"
        )
        if "seed_data" in r:
            s = r["seed_data"]
            print(
                f"  seed data of the same questions: {s['examples_per_question']:.2f} examples, "
                f"{s['distinct_tool_call_counts_per_question']:.2f} distinct tool-call counts per question; tool calls {s['tool_calls']}"
            )


if __name__ == "__main__":
    main()

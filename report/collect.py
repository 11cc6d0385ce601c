"""Read a run directory into the plain data the report page shows.

A run directory is what the demo, curriculum and ablation scripts fill: one output folder per
stage (each with its ``manifest.json``), nested at any depth. This module finds them and reads
what each stage leaves: manifests (the pipeline), SFT loss histories and RL ``metrics.jsonl``
(the curves), evaluation summaries (the tables), radar and Pareto charts, and the trajectories
of evaluations and RL rollouts (the browser).

It never raises on what a run lacks or holds wrong: a stage still running, a killed one, a
missing, truncated or malformed file (a line that is not an object, a reward that is not a
number, a manifest that is a list) all become a line in :attr:`Run.problems` naming the file, and
the rest is read. Every value the page shows is normalised to the type it is shown as
(:func:`trajectory_entry`); a number that is not finite is shown as text.

A run at the paper's scale holds far more trajectories than a page can: the browser holds at most
``max_trajectories`` of them, an even sample over the run's buckets (each RL step of each stage,
each dataset of each evaluation; :func:`even_shares`, :func:`sample_positions`). A first pass
counts every bucket's trajectories while it reads the curves; only the chosen ones are then read
again and kept, so memory holds the sample, not the run.

It reads only the run: a file or folder whose real path lies outside the run folder (a symbolic
link out of it, an input a manifest names elsewhere) is listed as a problem and not read, so a
page made to be shared carries nothing from outside the run. It does not draw anything (see
``report/page.py`` and ``report/static/curves.js``).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etagent.records import RecordError, decode_json, origin_segments, read_json_file

# Files that show a stage wrote here.
OUTPUT_FILES = {"metrics.jsonl", "summary.json", "trajectories.jsonl"}
# What a manifest's status says is wrong (etagent.rundir writes "running" when a stage starts;
# etagent.sampling finishes with "degraded" when the tools, the engine's context or the engine
# failed too often).
STATUS_PROBLEMS = {
    "running": "still running, or stopped before its end",
    "degraded": "finished, but its tools failed, or the engine's context cut or the engine failed its trajectories, "
    "more often than tools.max_failure_share allows",
}
# Folders no stage's outputs sit in: model weights and checkpoints, ray's temporary files.
SKIPPED_FOLDERS = {"model", "models", "checkpoints", "__pycache__", ".git"}


@dataclass
class Stage:
    """One output folder with a manifest."""

    folder: str  # relative to the run directory
    stage: str
    status: str
    started_at: str = ""
    seconds: float | None = None
    counts: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # the folder's files and folders, with sizes
    seed: int | None = None
    commit: str = ""  # the toolkit's git commit the stage ran, "" where the manifest has none
    dirty: bool | None = None  # whether that checkout had uncommitted changes


@dataclass
class Bucket:
    """The trajectories of one RL step of a stage, or of one dataset of an evaluation: where each
    lies in its files (``positions``, counted on the first read), and ``read``, which reads the
    ones at the positions given, in order, as browser entries."""

    label: str  # the browser's stage: "rl/stage1 step 3", "eval (toy-sft) toy"
    positions: list
    read: Callable[[list], list[dict]]


@dataclass
class Run:
    root: Path
    stages: list[Stage] = field(default_factory=list)
    # curve name -> series name -> [(step, value)]
    curves: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    evaluations: list[dict] = field(default_factory=list)  # {"folder", "run", "datasets": {name: metrics}}
    images: list[dict] = field(default_factory=list)  # {"title", "path"}
    trajectories: list[dict] = field(default_factory=list)  # the sample the browser holds
    trajectories_found: int = 0  # in the whole run
    buckets: list[Bucket] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def inside(root: Path, path: Path) -> bool:
    """Whether ``path``, links resolved, lies in the run folder ``root``."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def stage_folders(root: Path, problems: list[str] | None = None) -> list[tuple[Path, bool]]:
    """(folder, has a manifest) for every folder under ``root`` (symbolic links followed while
    they stay in ``root``, each real folder once) that holds a manifest, or stage outputs with no
    manifest in it or above it (a stage stopped before it wrote one)."""
    found, seen, with_manifest = [], set(), []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if not inside(root, Path(folder)):
            if problems is not None:
                problems.append(f"{folder}: a link out of the run folder (to {real}); not read")
            subfolders[:] = []
            continue
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS and not d.startswith("."))
        path = Path(folder)
        if "manifest.json" in files:
            with_manifest.append(path)
            found.append((path, True))
        elif OUTPUT_FILES & set(files) and not any(path.is_relative_to(m) for m in with_manifest):
            found.append((path, False))
    return found


def readable(run: Run, path: Path, problems: list[str]) -> bool:
    """Whether ``path`` may be read: it exists and lies in the run folder."""
    if not inside(run.root, path):
        problems.append(f"{path}: outside the run folder (at {os.path.realpath(path)}); not read")
        return False
    if not path.is_file():
        problems.append(f"{path}: missing" if not path.exists() else f"{path}: not a file")
        return False
    return True


def read_json(run: Run, path: Path, kind: type = dict, quiet: bool = False) -> Any:
    """A JSON file of the run holding a ``kind`` (an object, or a list), or None with the problem
    listed (unless ``quiet``: a second read of a file already reported)."""
    problems = [] if quiet else run.problems
    if not readable(run, path, problems):
        return None
    try:
        value = read_json_file(path)  # the toolkit's one JSON reader: a file it refuses is listed, not a crash
    except RecordError as error:
        problems.append(f"{path}: not valid JSON ({why(error)})")
        return None
    if not isinstance(value, kind):
        problems.append(f"{path}: holds a JSON {type(value).__name__}, not the {kind.__name__} expected; not read")
        return None
    return value


def read_lines(run: Run, path: Path) -> list[dict]:
    """The JSON objects of a JSONL file of the run; a line that does not decode, or is not an
    object, is reported and skipped (a writer killed mid-line leaves one at the end)."""
    return [row for _, row in numbered_lines(run, path)]


def numbered_lines(run: Run, path: Path, wanted: set[int] | None = None, quiet: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each JSON object of a JSONL file, as :func:`read_lines`; only the
    lines numbered in ``wanted`` (the others are not decoded) when it is given, and no problem
    listed when ``quiet`` (a second read of a file already reported)."""
    problems = [] if quiet else run.problems
    if not readable(run, path, problems):
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if (wanted is not None and number not in wanted) or not line.strip():
                continue
            try:
                row = decode_json(line, path, number)
            except RecordError as error:
                ending = " (the last line: its writer was stopped while writing it)" if not line.endswith(b"\n") else ""
                problems.append(f"{path}:{number}: not a JSON line{ending}: {why(error)}; skipped")
                continue
            if not isinstance(row, dict):
                problems.append(f"{path}:{number}: a JSON {type(row).__name__}, not an object; skipped")
                continue
            yield number, row


def why(error: RecordError) -> str:
    """What a reader refused in a file, without the file and line a problem's line names already."""
    return error.message if error.field.startswith("(") else f"field '{error.field}' {error.message}"


def number(value) -> float | None:
    """A finite number, or None (a missing, non-numeric or non-finite value)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return value


def shown(value):
    """A number as the page shows it: finite ones as they are, NaN and infinities as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def text(value) -> str:
    return "" if value is None else str(value)


def trajectory_entry(**fields) -> dict:
    """One trajectory for the browser, every field of the type the page reads it as: texts are
    strings, the reward and the call count finite numbers or null, the terms numbers or text, the
    segments [origin, text] pairs; whatever a file held."""
    segments = fields.get("segments")
    if not isinstance(segments, list) or not all(isinstance(s, list) and len(s) == 2 for s in segments):
        segments = [[None, text(fields.get("text"))]]
    answer = fields.get("answer")
    terms = fields.get("terms") if isinstance(fields.get("terms"), dict) else {}
    judgement = fields.get("judgement")
    return {
        "stage": text(fields.get("stage")),
        "id": text(fields.get("id")),
        "source": text(fields.get("source", "?")),
        "kind": text(fields.get("kind", "?")),
        "question": text(fields.get("question")),
        "answer": [text(a) for a in answer] if isinstance(answer, list) else [text(answer)] if answer is not None else [],
        "correct": fields.get("correct") if isinstance(fields.get("correct"), bool) else None,
        "reward": number(fields.get("reward")),
        "tool_calls": number(fields.get("tool_calls")),
        "redundant": flag(fields.get("redundant")),
        "insufficient": flag(fields.get("insufficient")),
        "terms": {text(k): shown(v) for k, v in terms.items() if isinstance(v, int | float | str) and not isinstance(v, bool)},
        "finish": text(fields.get("finish")),
        "segments": [[None if o is None else text(o), text(t)] for o, t in segments],
        "judgement": {k: shown(v) for k, v in judgement.items()} if isinstance(judgement, dict) else None,
    }


def collect(root: str | os.PathLike, max_trajectories: int, tokenizer_for=None) -> Run:
    """Everything the report shows of the run in ``root``, with at most ``max_trajectories``
    trajectories for the browser (an even sample when the run has more). ``tokenizer_for(model_path)``
    returns a tokenizer to split evaluation responses by token origin (None: by tags only)."""
    run = Run(Path(root))
    if not run.root.is_dir():
        run.problems.append(f"{run.root}: no such directory")
        return run
    for folder, has_manifest in stage_folders(run.root, run.problems):
        try:
            collect_folder(run, folder, has_manifest, tokenizer_for)
        except Exception as exc:  # a file of a shape no reader foresaw: listed, and the rest read
            run.problems.append(f"{folder}: could not be read ({type(exc).__name__}: {exc}); left out")
    run.stages.sort(key=lambda s: (s.started_at or "~", s.folder))
    run.trajectories_found = sum(len(b.positions) for b in run.buckets)
    shares = even_shares([len(b.positions) for b in run.buckets], max_trajectories)
    for bucket, share in zip(run.buckets, shares, strict=True):
        chosen = [bucket.positions[k] for k in sample_positions(bucket.label, len(bucket.positions), share)]
        try:
            run.trajectories += bucket.read(chosen)
        except Exception as exc:  # as for a folder: listed, and the rest read
            run.problems.append(f"{bucket.label}: its trajectories could not be read ({type(exc).__name__}: {exc}); left out")
    if not run.stages:
        run.problems.append(f"{run.root}: no stage output found (no manifest.json below it)")
    return run


def even_shares(sizes: list[int], keep: int) -> list[int]:
    """How many trajectories to keep of each bucket, given each bucket's size: ``keep`` in all
    (every one when the buckets hold no more), the same share of each, where a bucket smaller than
    its share keeps all it has and leaves the rest to the others. What does not divide evenly goes
    one each to the first buckets; with fewer to keep than buckets, the last buckets keep none."""
    shares = [0] * len(sizes)
    left = min(keep, sum(sizes))
    open_buckets = sorted(range(len(sizes)), key=lambda i: sizes[i])
    while open_buckets and left:
        share = left // len(open_buckets)
        smallest = open_buckets[0]
        if sizes[smallest] <= share:
            shares[smallest] = sizes[smallest]
            left -= sizes[smallest]
            open_buckets.pop(0)
            continue
        remainder = left - share * len(open_buckets)
        for rank, i in enumerate(sorted(open_buckets)):
            shares[i] = share + (rank < remainder)
        break
    return shares


def sample_positions(label: str, size: int, count: int) -> list[int]:
    """``count`` of the indices ``0..size-1``, in order: all of them when ``count`` covers them,
    else a random choice seeded by the bucket's label, so the same run gives the same page."""
    if count >= size:
        return list(range(size))
    return sorted(random.Random(label).sample(range(size), count))


def manifest_revision(value) -> tuple[str, bool | None]:
    """(commit, dirty) from a manifest's ``git`` (etagent.records.git_revision: ``{"commit",
    "dirty"}``; a text from another writer is taken as the commit)."""
    if isinstance(value, dict):
        dirty = value.get("dirty")
        return text(value.get("commit")), dirty if isinstance(dirty, bool) else None
    return text(value), None


def collect_folder(run: Run, folder: Path, has_manifest: bool, tokenizer_for) -> None:
    """One stage folder: its manifest's line in the pipeline, and what it shows."""
    relative = str(folder.relative_to(run.root)) if folder != run.root else "."
    manifest = read_json(run, folder / "manifest.json") if has_manifest else None
    if manifest is None:
        if not has_manifest:  # an unreadable one is reported by read_json
            run.problems.append(f"{folder}: stage outputs but no manifest.json (the stage was stopped before it wrote one)")
        stage = Stage(relative, guess_stage(folder), "unreadable manifest" if has_manifest else "no manifest")
    else:
        stage = read_stage(relative, manifest)
        if stage.status in STATUS_PROBLEMS:
            run.problems.append(f"{folder}: {stage.stage} is {stage.status} (started {stage.started_at}): {STATUS_PROBLEMS[stage.status]}")
        for path in stage.inputs:
            if not Path(path).exists():
                run.problems.append(f"{folder}: its input {path} is missing")
    stage.outputs = listing(folder)
    run.stages.append(stage)
    read_outputs(run, folder, stage, tokenizer_for)


def listing(folder: Path) -> list[str]:
    """What a stage folder holds: its files with their sizes, its folders with a slash."""
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name == "manifest.json":
            continue
        entries.append(f"{path.name}/" if path.is_dir() else f"{path.name} ({size(path.stat().st_size)})")
    return entries


def size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def guess_stage(folder: Path) -> str:
    if (folder / "metrics.jsonl").exists():
        return "rl"
    if (folder / "summary.json").exists():
        return "evaluation"
    return "unknown"


def read_stage(folder: str, manifest: dict) -> Stage:
    commit, dirty = manifest_revision(manifest.get("git"))
    return Stage(
        folder=folder,
        stage=str(manifest.get("stage", "unknown")),
        status=str(manifest.get("status", "complete")),
        started_at=str(manifest.get("started_at", "")),
        seconds=manifest.get("seconds") if manifest.get("status", "complete") != "running" else None,
        counts=manifest.get("counts") or {},
        inputs=[i["path"] for i in manifest.get("inputs", []) if isinstance(i, dict) and "path" in i],
        seed=manifest.get("seed"),
        commit=commit,
        dirty=dirty,
    )


def read_outputs(run: Run, folder: Path, stage: Stage, tokenizer_for) -> None:
    """What the report shows of one stage's folder."""
    name = stage.folder
    if stage.stage == "sft":
        history = folder / "loss_history.json"
        if history.exists():
            entries = read_json(run, history, kind=list) or []
            for key in ("loss", "grad_norm", "learning_rate"):
                points = [
                    (e["step"], e[key])
                    for e in entries
                    if isinstance(e, dict) and number(e.get(key)) is not None and number(e.get("step")) is not None
                ]
                if points:
                    run.curves.setdefault(f"sft/{key}", {})[name] = points
        elif stage.status == "complete":
            run.problems.append(f"{history}: missing (the SFT curves need it)")
    if stage.stage.startswith("rl/") or stage.stage == "rl":
        read_rl(run, folder, stage)
    if stage.stage == "evaluation":
        read_evaluation(run, folder, stage, tokenizer_for)
    for png, title in (("radar.png", "Radar chart"), ("scatter.png", "Pareto selection")):
        if (folder / png).exists() and readable(run, folder / png, run.problems):
            run.images.append({"title": f"{title}: {name}", "path": folder / png})


def read_rl(run: Run, folder: Path, stage: Stage) -> None:
    name = stage.folder
    path = folder / "metrics.jsonl"
    if not path.exists():
        run.problems.append(f"{path}: missing (no RL step finished yet)")
        return
    for row in read_lines(run, path):
        step = row.get("step")
        if not isinstance(step, int | float):
            continue
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                run.curves.setdefault(f"rl/{key}", {}).setdefault(name, []).append((step, value))
    rollouts = sorted((folder / "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    questions = rl_questions(run, folder) if rollouts else {}
    for rollout_file in rollouts:
        step = int(rollout_file.stem.split("_")[1])
        # the reward's terms, averaged over the step's rollouts (metrics.jsonl has their sum)
        sums = {"f_tool": [0.0, 0], "f_length": [0.0, 0], "f_format": [0.0, 0]}
        lines = []
        for line, row in numbered_lines(run, rollout_file):
            lines.append(line)
            for term, total in sums.items():
                if number(row.get(term)) is not None:
                    total[0] += row[term]
                    total[1] += 1
        for term, (total, count) in sums.items():
            if count:
                run.curves.setdefault(f"rl/reward terms/{term}", {}).setdefault(name, []).append((step, total / count))
        label = f"{name} step {step}"

        def read(chosen: list[int], path: Path = rollout_file, label: str = label) -> list[dict]:
            return [rollout_entry(row, label, questions) for _, row in numbered_lines(run, path, set(chosen), quiet=True)]

        run.buckets.append(Bucket(label, lines, read))


def rollout_entry(row: dict, label: str, questions: dict[int, dict]) -> dict:
    """One RL rollout (a line of ``rollouts/step_k.jsonl``) with its question, for the browser."""
    question = questions.get(row.get("index"), {}) if isinstance(row.get("index"), int) else {}
    raw = number(row.get("raw"))
    return trajectory_entry(
        stage=label,
        id=row.get("id", ""),
        source=question.get("source", "?"),
        kind=question.get("kind", "?"),
        question=question.get("question", f"(prompt {row.get('index')})"),
        answer=question.get("answer", []),
        correct=None if raw is None else raw >= 1.0,
        reward=row.get("reward"),
        tool_calls=row.get("tool_calls"),
        terms={k: row[k] for k in ("reward", "raw", "f_tool", "f_length", "f_format", "length") if k in row},
        finish=row.get("finish_reason", ""),
        segments=row.get("segments"),
        text=row.get("text", ""),
    )


def rl_questions(run: Run, folder: Path) -> dict[int, dict]:
    """The RL data's questions by prompt index, to show beside their rollouts."""
    manifest = read_json(run, folder / "manifest.json", quiet=True) or {}
    data = ((manifest.get("config") or {}).get("data") or {}).get("train")
    if not data or not Path(data).exists():
        run.problems.append(f"{folder}: its RL data {data} is missing; rollouts are shown without their questions")
        return {}
    if not inside(run.root, Path(data)):
        run.problems.append(f"{folder}: its RL data {data} lies outside the run folder; rollouts are shown without their questions")
        return {}
    from etagent.question_formats import QuestionFormat, read_question_rows

    # read as RL read it: any questions format, with the run's own question_format (none in a
    # manifest from before it existed)
    settings = QuestionFormat.given(**(manifest["config"]["data"].get("question_format") or {}))
    try:
        rows, _ = read_question_rows(data, settings)
    except Exception as exc:  # a report shows what it can: the data's own error names the row
        run.problems.append(f"{data}: {exc}")
        return {}
    return {
        row.index: {
            "question": row.question.question,
            "answer": row.question.answer,
            "source": row.question.source,
            "kind": row.question.kind,
        }
        for row in rows
    }


def read_evaluation(run: Run, folder: Path, stage: Stage, tokenizer_for) -> None:
    summary_path = folder / "summary.json"
    summary = read_json(run, summary_path) if summary_path.exists() else None
    if summary is None and stage.status == "complete" and not summary_path.exists():  # one that does not read is listed by read_json
        run.problems.append(f"{summary_path}: missing")
    name = text((summary or {}).get("run") or stage.folder)
    datasets = (summary or {}).get("datasets") or {}
    if not isinstance(datasets, dict) or not all(isinstance(d, dict) for d in datasets.values()):
        run.problems.append(f"{summary_path}: its datasets are not objects of metrics; not shown")
        datasets = {}
    run.evaluations.append({"folder": stage.folder, "run": name, "datasets": datasets})
    manifest = read_json(run, folder / "manifest.json", quiet=True) or {}
    config = manifest.get("config") or {}
    model = (config.get("engine") or {}).get("model")
    pass_mark = number(config.get("qa_pass_mark")) or 0.8
    tokenizer = tokenizer_for(model) if tokenizer_for and model else None
    for dataset in sorted(p for p in folder.iterdir() if (p / "trajectories.jsonl").exists()):
        path = dataset / "trajectories.jsonl"
        # a trajectory's position: its group's line, and its place among the group's trajectories
        positions = [(line, k) for line, group in numbered_lines(run, path) for k in range(len(group_trajectories(group)))]
        label = f"{stage.folder} ({name}) {dataset.name}"

        def read(chosen: list[tuple[int, int]], dataset: Path = dataset, label: str = label) -> list[dict]:
            scored = (
                {row.get("id"): row for row in read_lines(run, dataset / "scored.jsonl")} if (dataset / "scored.jsonl").exists() else {}
            )
            wanted = {line: set() for line, _ in chosen}
            for line, k in chosen:
                wanted[line].add(k)
            entries = []
            for line, group in numbered_lines(run, dataset / "trajectories.jsonl", set(wanted), quiet=True):
                row = scored.get(group.get("id"), {})
                samples = row.get("samples") if isinstance(row.get("samples"), list) else []
                for k, trajectory in enumerate(group_trajectories(group)):
                    if k in wanted[line]:
                        metrics = samples[k] if k < len(samples) and isinstance(samples[k], dict) else {}
                        entries.append(evaluation_entry(group, trajectory, metrics, label, pass_mark, tokenizer))
            return entries

        run.buckets.append(Bucket(label, positions, read))


def group_trajectories(group: dict) -> list[dict]:
    """The trajectories of an evaluation's question group (a line of ``trajectories.jsonl``)."""
    trajectories = group.get("trajectories")
    return [t for t in trajectories if isinstance(t, dict)] if isinstance(trajectories, list) else []


def evaluation_entry(group: dict, trajectory: dict, metrics: dict, label: str, pass_mark: float, tokenizer) -> dict:
    """One evaluation sample with its question and its scores, for the browser."""
    return trajectory_entry(
        stage=label,
        id=trajectory.get("id", ""),
        source=group.get("source", "?"),
        kind=group.get("kind", "?"),
        question=group.get("question", ""),
        answer=group.get("answer", []),
        correct=sample_correct(metrics, group.get("kind"), pass_mark),
        tool_calls=metrics.get("tool_calls", trajectory.get("tool_calls_executed")),
        redundant=metrics.get("redundant_calls"),
        insufficient=metrics.get("insufficient_calls"),
        terms=metrics,
        finish=trajectory.get("finish_reason", ""),
        segments=response_segments(trajectory, tokenizer),
        judgement=trajectory.get("judgement"),
    )


def sample_correct(metrics: dict, kind: str | None, pass_mark: float) -> bool | None:
    """Solved as the evaluation's behaviour table counts it: c_i (etagent.scoring.correctness) at
    least the run's qa_pass_mark."""
    from etagent.scoring import correctness

    if not metrics or kind not in ("math", "qa"):
        return None
    try:
        return correctness(metrics, kind) >= pass_mark
    except (KeyError, TypeError, ValueError):  # an older toolkit's scores, or malformed ones: unscored here
        return None


def flag(value) -> bool | None:
    return None if value is None else bool(value)


def response_segments(trajectory: dict, tokenizer) -> list[list]:
    """The response by token origin when the trajectory kept its token ids and origins and a
    tokenizer is at hand; else the whole text, origin not recorded."""
    ids, origins = trajectory.get("response_ids"), trajectory.get("response_origin")
    if tokenizer is None or not ids or not origins or len(ids) != len(origins):
        return [[None, str(trajectory.get("text", ""))]]
    return origin_segments(ids, origins, tokenizer)

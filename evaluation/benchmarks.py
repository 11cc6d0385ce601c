"""Benchmark files in the formats the paper's evaluation reads, mapped to questions.

Each benchmark lives in ``{data_dir}/{name}/test.jsonl`` (mmlu-pro: a parquet file) with the
fields the paper's files have (docs/paper-code.md §B1.3, §B5). :func:`load_benchmark`
turns one into :class:`etagent.records.Question` records: the question text (with lettered
choices appended for multiple-choice formats), the acceptable answers, ``kind`` (``math`` is
scored by math equivalence or the LLM judge, ``qa`` by F1) and ``source`` (the benchmark).

:data:`BENCHMARKS` also says which search each benchmark uses: the local Wikipedia retriever for
the knowledge-QA sets (as the paper routes them), web search for the rest, where configured.

What this module does not do: download (``evaluation/prepare.py``) or score.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from etagent.errors import MissingInput, SettingError
from etagent.question_formats import Mapping, QuestionFormat, detect_format, iter_rows, to_question_row, with_choices
from etagent.records import Question, RecordError


@dataclass(frozen=True)
class Benchmark:
    kind: str  # math or qa
    search: str  # local (Wikipedia retriever) or web
    group: str  # for tables: math, knowledge, deep search, multiple choice, toy


BENCHMARKS = {
    "aime24": Benchmark("math", "web", "math"),
    "aime25": Benchmark("math", "web", "math"),
    "amc23": Benchmark("math", "web", "math"),
    "math500": Benchmark("math", "web", "math"),
    "gsm8k": Benchmark("math", "web", "math"),
    "olympiadbench": Benchmark("math", "web", "math"),
    "math": Benchmark("math", "web", "math"),
    "2wiki": Benchmark("qa", "local", "knowledge"),
    "hotpotqa": Benchmark("qa", "local", "knowledge"),
    "musique": Benchmark("qa", "local", "knowledge"),
    "bamboogle": Benchmark("qa", "local", "knowledge"),
    "gaia": Benchmark("qa", "web", "deep search"),
    "hle": Benchmark("qa", "web", "deep search"),
    "webwalker": Benchmark("qa", "web", "deep search"),
    "xbench": Benchmark("qa", "web", "deep search"),
    "simpleqa": Benchmark("qa", "web", "deep search"),
    "gpqa": Benchmark("qa", "web", "multiple choice"),
    "csbench": Benchmark("qa", "local", "multiple choice"),
    "mmlu-pro": Benchmark("qa", "web", "multiple choice"),
    "toy": Benchmark("qa", "local", "toy"),  # our questions artifact: kind per question
}
# The six datasets of the paper's main table, in its column order.
PAPER_TABLE = ("aime24", "amc23", "math500", "2wiki", "bamboogle", "musique")


def _first(row: dict, *names: str):
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    return None


def _record(name: str, number: int, row: dict, path: Path) -> Question:
    spec = BENCHMARKS[name]
    if detect_format(row) != "etagent":
        # the benchmark as another project's preprocessing left it (verl's GSM8K parquet,
        # Search-R1's, FlashRAG's): read as etagent.question_formats reads that format
        question = to_question_row(
            row, number, str(path), detect_format(row), QuestionFormat.given(kind=spec.kind, source=name), Mapping("")
        ).question
        return question.model_copy(update={"id": f"{name}-{question.id}"})
    if name == "gsm8k":
        question, raw = row.get("question"), row.get("answer")
        if not isinstance(raw, str) or "####" not in raw:
            raise RecordError(
                path,
                number,
                "answer",
                "expected a rationale ending with '#### <number>' (openai/gsm8k's); for a file of another layout, evaluate it as "
                "a dataset of your own: datasets=[mygsm] +files.mygsm=PATH +kinds.mygsm=math",
            )
        answer = raw.split("####")[-1].strip().replace(",", "")
    elif name == "olympiadbench":
        question, final = row.get("question"), row.get("final_answer")
        if not isinstance(final, list) or not final:
            raise RecordError(path, number, "final_answer", "expected a non-empty list")
        answer = final[0]
    elif name in ("math", "aime25"):
        question, answer = _first(row, "problem", "question"), row.get("answer")
    elif name == "gaia":
        question, answer = _first(row, "Question", "question"), _first(row, "answer", "Final answer")
    elif name == "csbench":
        question, answer = _first(row, "Question"), row.get("Answer")
        if row.get("Format") == "Multiple-choice":
            question = with_choices(question, [row.get(letter, "") for letter in "ABCD"])
    elif name == "mmlu-pro":
        question, answer = row.get("question"), row.get("answer")
        question = with_choices(question, list(row.get("options") or []))
    else:
        question, answer = _first(row, "question", "problem"), row.get("answer", row.get("golden_answers"))
    if not isinstance(question, str) or not question.strip():
        raise RecordError(path, number, "question", "missing or empty")
    if answer is None or answer == []:
        raise RecordError(path, number, "answer", "missing")
    qid = _first(row, "id", "ID", "idx", "question_id", "task_id")
    qid = f"{name}-{qid if qid is not None else number}"
    if name == "toy":  # our own questions artifact: its kind, source and needed calls per question
        kind, source, needed = row.get("kind", spec.kind), row.get("source", name), row.get("needed_calls")
        return Question(id=qid, question=question, answer=answer, source=source, kind=kind, needed_calls=needed)
    return Question(id=qid, question=question, answer=answer, source=name, kind=spec.kind)


def benchmark_file(data_dir: str | Path, name: str) -> Path:
    directory = Path(data_dir) / name
    if name == "mmlu-pro":
        parquet = sorted(directory.glob("*.parquet"))
        if parquet:
            return parquet[0]
    return directory / "test.jsonl"


def load_benchmark(
    name: str, path: str | Path, limit: int | None = None, partial_ok: bool = False, split: str | None = None
) -> list[Question]:
    """The questions of one benchmark file (first ``limit`` only, as the paper's --counts), read as
    etagent.question_formats reads any source (JSONL, JSON, parquet, a folder of parquet files or
    of splits, a ``datasets`` folder; ``split`` where it holds several): rows in the paper's
    layout by the benchmark's own rules, rows of another project's preprocessing by that
    format's. An empty file or a cut-off last line is refused unless ``partial_ok``."""
    if name not in BENCHMARKS:
        raise SettingError("datasets", f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    path = Path(path)
    if not path.exists():
        raise MissingInput(f"{path}: no file for benchmark {name} (see evaluation/prepare.py)")
    rows = iter_rows(path, split, partial_ok, split_key=f"splits.{name}")
    questions, seen = [], set()
    for number, row in rows:
        if not isinstance(row, dict):
            raise RecordError(path, number, "(record)", "expected a JSON object")
        question = _record(name, number, row, path)
        if question.id in seen:  # ids reused in a file: fall back to line numbers
            question.id = f"{name}-{number}"
        seen.add(question.id)
        questions.append(question)
        if limit is not None and len(questions) >= limit:
            break
    if not questions and not partial_ok:
        raise RecordError(
            path, None, "(file)", f"no questions for benchmark {name}; give a file with questions, or set partial_input_ok=true"
        )
    return questions

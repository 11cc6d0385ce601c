"""Questions from the files researchers already have, read into the one question schema.

Every stage that takes questions or RL prompts reads them through :func:`read_question_rows`
(``etagent.records.read_questions`` and ``rl/rollout.py``'s ``read_prompts`` build on it). It
accepts, with nothing converted by hand:

- **ours** (:class:`etagent.records.Question`): ``{id, question, answer, source, kind}``, as the
  toy world and ``etagent convert`` write it; ``source`` and ``kind`` may be left out;
- **FlashRAG** JSONL: ``{id, question, golden_answers, metadata}``, and its multiple-choice sets,
  whose ``golden_answers`` index a ``choices`` column;
- **Search-R1** parquet or JSONL: verl's columns with ``ability: fact-reasoning`` and
  ``reward_model.ground_truth: {target: [...]}``, usually beside the FlashRAG columns it was made
  from; without them the question is read after ``Question:`` in Search-R1's prompt template;
- **verl** parquet (our RL parquet, verl's GSM8K, any ``data_source/prompt/ability/reward_model/
  extra_info`` file): the question from ``extra_info.question`` (verl's examples keep the raw
  question there), else the last user turn;
- **TRL** prompt datasets: ``prompt`` as a string or as chat messages, the answer in ``solution``,
  ``ground_truth`` or ``answer``;
- a **Hugging Face datasets** folder written by ``save_to_disk`` (one dataset, or a dataset dict),
  a folder of parquet files (parts of one dataset, or one per split), or ``hf:<hub id>`` on a
  machine with the network; its rows are any of the above. A source of several splits is read
  only where ``split`` names one.

Each file's format is recognised from its first row; :class:`QuestionFormat` (the
``question_format`` settings of the stages) fills what a format lacks and maps columns by name.
Gold answers are read as meant (:func:`_gold`: GSM8K's number after ``####``, a worked solution's
last box, a multiple-choice index as its option's text), and known producers' instructions are
taken off the question (:data:`INSTRUCTION_SUFFIXES`). ``kind`` (how answers are scored: ``math``
or ``qa``) comes from the setting when it is not ``auto``, else from the row's ``kind`` or
``ability`` (any ability naming math is ``math``; every other ability, Search-R1's
``fact-reasoning`` among them, is ``qa``), else a known ``data_source``
(:data:`DATA_SOURCE_KINDS`), else ``qa`` for FlashRAG and Search-R1 files, else inferred from the
gold answers (:func:`inferred_kind`: numbers and LaTeX are math); ``source`` from the setting, the
row's ``source`` or ``data_source``, else the file's name; ``id`` from ``id``,
``extra_info.question_id``, ``extra_info.index``, else the row number, unique per source.
:class:`Mapping` says which column each field came from; every reading logs it and ``etagent
convert`` prints it.

What this module does not do: check what a stage needs beyond the questions (RL's prompt rules
are in ``rl/rollout.py``), or download anything unless asked with ``hf:``.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from omegaconf import MISSING
from pydantic import ValidationError

from etagent import protocol
from etagent.config import register_schema
from etagent.errors import MissingInput, SettingError
from etagent.records import Question, RecordError, iter_jsonl, read_datasets_folder, read_json_file, read_parquet_rows
from etagent.settings import DATASETS_FOLDER_FILES, OneOf, group

log = logging.getLogger("etagent.questions")

HUB_PREFIX = "hf:"
FORMATS = ("etagent", "flashrag", "search_r1", "verl", "trl")
MAPPABLE = ("id", "question", "answer", "kind", "source")
# Search-R1's templates end with "Question: {question}\n" (scripts/data_process/*.py there)
SEARCH_R1_QUESTION = re.compile(r"Question:\s*(.*?)\s*$", re.S)


@group
class QuestionFormat:
    """How rows in another project's format become questions (see the module docstring)."""

    kind: Annotated[str, OneOf("auto", "math", "qa")] = MISSING
    source: str | None = MISSING
    split: str | None = MISSING
    fields: dict[str, str] = MISSING

    @classmethod
    def given(cls, **hints) -> QuestionFormat:
        """The ``hints`` given (``split="test"``) and no other: the kind read from each row, no
        source name, no split chosen, no field renamed. How code without a config reads questions
        (``etagent score``, evaluation's benchmarks, tests); a config's group sets all four."""
        return cls(**{"kind": "auto", "source": None, "split": None, "fields": {}, **hints})


register_schema("question_format", QuestionFormat)

# evaluation hands the questions it read to etagent.sampling in our own schema, read with no hints
DEFAULT_FORMAT = QuestionFormat.given()


@dataclass
class QuestionRow:
    """One row read as a question, with what RL needs of its original row: its ``index`` (the
    row's ``extra_info.index`` where it has one, else its position) and its chat ``prompt`` (None
    for formats without one)."""

    question: Question
    index: int
    prompt: list[dict] | None
    number: int


@dataclass
class Mapping:
    """What each question field was read from, for one file."""

    format: str
    rows: int = 0
    fields: dict[str, Counter] = field(default_factory=lambda: {name: Counter() for name in MAPPABLE})
    notes: list[str] = field(default_factory=list)  # what was done to the whole file (ids qualified, ...)

    def describe_field(self, name: str) -> str:
        return "read from " + " | ".join(self.fields[name]) if self.fields[name] else "not read"

    def describe(self) -> str:
        parts = []
        for name, sources in self.fields.items():
            if sources:
                parts.append(f"{name} <- " + " | ".join(f"{source} ({n})" if len(sources) > 1 else source for source, n in sources.items()))
        return f"{self.format} format, {self.rows} rows: " + "; ".join(parts + self.notes)


# ---------------------------------------------------------------------------------------------
# Rows


def is_hub_dataset(value: str) -> bool:
    return str(value).startswith(HUB_PREFIX)


def is_datasets_folder(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk``: one dataset, or a dict of splits."""
    return path.is_dir() and any((path / name).is_file() for name in DATASETS_FOLDER_FILES)


def _datasets_rows(where: str, split: str | None, split_key: str) -> list[dict]:
    import datasets  # the data extra; missing, it is one line naming the extra (etagent/errors.py)

    if is_hub_dataset(where):
        name = where[len(HUB_PREFIX) :]
        try:
            loaded = datasets.load_dataset(name, split=split or "train")
        except Exception as exc:  # the hub's errors are many (offline, no such dataset, no split)
            raise SettingError("questions", f"{where}: could not load it from the hub: {str(exc).splitlines()[0]}") from None
        return loaded.to_list()
    loaded = read_datasets_folder(where)  # checked whole: a folder that does not read is one line naming the file
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[_chosen_split(where, list(loaded), split, split_key)]
    return loaded.to_list()


# The names a folder of parquet files may give its splits (verl's preprocessing writes train.parquet
# and test.parquet into one folder; Hugging Face's exports name shards train-00000-of-00002.parquet).
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev")


def _chosen_split(where: str, splits: list[str], split: str | None, split_key: str) -> str:
    """The split to read of a source that holds ``splits``: the one named, or the only one. Never a
    silent default: an evaluation that read a dict's ``train`` would score the training split."""
    if split is None and len(splits) == 1:
        return splits[0]
    if split not in splits:
        named = f"has no split {split!r}" if split is not None else "holds several splits"
        raise SettingError(split_key, f"{where} {named}: {', '.join(splits)}; name the one to read ({split_key}=...)")
    return split


def split_files(folder: Path) -> dict[str, list[Path]]:
    """A folder's parquet files by split, where every file is named after one (``train.parquet``,
    ``test-00000-of-00001.parquet``); empty when the files are parts of one dataset."""
    files = sorted(folder.glob("*.parquet"))
    by_split: dict[str, list[Path]] = {}
    for file in files:
        name = file.stem.split("-")[0].split(".")[0]
        if name not in SPLIT_NAMES:
            return {}
        by_split.setdefault(name, []).append(file)
    return by_split


def iter_rows(
    where: str | os.PathLike, split: str | None = None, partial_ok: bool = False, split_key: str = "question_format.split"
) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a JSONL, JSON-array or parquet file, a folder of parquet files (one
    dataset in parts, or one file per split), a ``datasets`` folder, or ``hf:<id>``. A source of
    several splits is read only where ``split`` names one (``split_key``: the setting that does)."""
    if is_hub_dataset(str(where)):
        yield from enumerate(_datasets_rows(str(where), split, split_key), start=1)
        return
    path = Path(where)
    if not path.exists():
        raise MissingInput(f"{path}: no such file")
    if is_datasets_folder(path):
        yield from enumerate(_datasets_rows(str(path), split, split_key), start=1)
    elif path.is_dir() and split_files(path):
        by_split = split_files(path)
        chosen = _chosen_split(str(path), list(by_split), split, split_key)
        number = 0
        for file in by_split[chosen]:
            for row in read_parquet_rows(file):
                number += 1
                yield number, row
    elif path.suffix == ".parquet" or path.is_dir():
        yield from enumerate(read_parquet_rows(path), start=1)
    elif path.suffix == ".json":
        array = read_json_file(path)
        if not isinstance(array, list):
            raise RecordError(path, None, "(file)", "expected a JSON array of records")
        yield from enumerate(array, start=1)
    else:
        yield from iter_jsonl(path, partial_ok)


# ---------------------------------------------------------------------------------------------
# Formats


def _lookup(row: dict, dotted: str) -> tuple[bool, Any]:
    """(whether the row has the column, its value): a dotted name reads a nested column."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _get(row: dict, dotted: str) -> Any:
    return _lookup(row, dotted)[1]


def _present(value: Any) -> bool:
    """A column is there when it holds anything but null; a blank value is read, and refused by
    the question's own checks (an empty question, an empty gold answer), not passed over."""
    return value is not None


def detect_format(row: dict) -> str:
    """The format a row is in, from its columns."""
    if isinstance(row.get("prompt"), (list, tuple)) and isinstance(row.get("reward_model"), dict):
        ground_truth = row["reward_model"].get("ground_truth")
        return "search_r1" if isinstance(ground_truth, dict) and "target" in ground_truth else "verl"
    if "golden_answers" in row:
        return "flashrag"
    if "prompt" in row and "question" not in row:
        return "trl"
    return "etagent"


def _messages(prompt: Any) -> list[dict] | None:
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return None


def _last_user_turn(prompt: Any) -> str | None:
    messages = _messages(prompt)
    if messages is None:
        return prompt if isinstance(prompt, str) else None
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else None


# our field -> the columns that may hold it, per format, in order of preference
CANDIDATES = {
    "question": {
        "etagent": ("question", "problem"),
        "flashrag": ("question",),
        "search_r1": ("question", "prompt (after 'Question:')"),
        "verl": ("extra_info.question", "question", "prompt (the last user turn)"),
        "trl": ("question", "problem", "prompt (the last user turn)", "prompt"),
    },
    "answer": {
        "etagent": ("answer", "golden_answers", "solution", "ground_truth"),
        "flashrag": ("golden_answers",),
        "search_r1": ("reward_model.ground_truth.target", "golden_answers"),
        "verl": ("reward_model.ground_truth",),
        "trl": ("solution", "ground_truth", "answer"),
    },
    "id": ("id", "extra_info.question_id", "extra_info.index", "question_id", "idx"),
    "kind": ("kind", "ability"),
    "source": ("source", "data_source"),
}


def _read_column(row: dict, column: str) -> Any:
    if column == "prompt (after 'Question:')":
        text = _last_user_turn(row.get("prompt"))
        found = SEARCH_R1_QUESTION.search(text) if isinstance(text, str) else None
        return found.group(1) if found else None
    if column == "prompt (the last user turn)":
        return _last_user_turn(row.get("prompt")) if _messages(row.get("prompt")) is not None else None
    if column == "prompt":
        return row.get("prompt") if isinstance(row.get("prompt"), str) else None
    return _get(row, column)


def _first_present(row: dict, columns: tuple[str, ...]) -> tuple[Any, str | None]:
    for column in columns:
        value = _read_column(row, column)
        if _present(value):
            return value, column
    return None, None


def _kind_of(value: Any) -> str:
    """An ability or kind as the scoring it calls for: math when it names math, else qa."""
    return "math" if "math" in str(value).lower() else "qa"


# The ``data_source`` names other projects give their rows, and the scoring each calls for: verl's
# default_compute_score (verl/utils/reward_score/__init__.py: GSM8K, MATH, DAPO, Numina, geometry3k,
# Search-R1), Search-R1's own (verl/trainer/main_ppo.py there), verl's hellaswag example, ours.
DATA_SOURCE_KINDS = {
    "openai/gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "math_dapo": "math",
    "math_dapo_reasoning": "math",
    "hiyouga/geometry3k": "math",
    "math_effi_rl": "math",
    "nq": "qa",
    "triviaqa": "qa",
    "popqa": "qa",
    "hotpotqa": "qa",
    "2wikimultihopqa": "qa",
    "musique": "qa",
    "bamboogle": "qa",
    "strategyqa": "qa",
    "Rowan/hellaswag": "qa",
    "qa_effi_rl": "qa",
}
DATA_SOURCE_PREFIX_KINDS = {"aime": "math", "numina_": "math", "searchR1_": "qa"}


def kind_of_data_source(name: Any) -> str | None:
    """math or qa for a ``data_source`` another project names (:data:`DATA_SOURCE_KINDS`, or a
    prefix of :data:`DATA_SOURCE_PREFIX_KINDS`); None for one it does not know."""
    name = str(name)
    if name in DATA_SOURCE_KINDS:
        return DATA_SOURCE_KINDS[name]
    return next((kind for prefix, kind in DATA_SOURCE_PREFIX_KINDS.items() if name.startswith(prefix)), None)


# A gold answer that is a number (72, -3.5, 1,000, 3/4, 50%) or LaTeX ($72$, \frac{1}{3}, x^2) is
# scored by math equivalence; any other text by token F1.
NUMBER = re.compile(r"^\s*[-+]?(\d[\d,]*(\.\d*)?|\.\d+)(\s*/\s*\d+)?\s*%?\s*$")
LATEX = re.compile(r"\$|\\[a-zA-Z]+|\^|_\{")


def looks_like_math(answer: str) -> bool:
    return bool(NUMBER.match(answer) or LATEX.search(answer))


def inferred_kind(answers: list[str]) -> str:
    """math when every gold answer is a number or LaTeX (:func:`looks_like_math`), else qa."""
    return "math" if answers and all(looks_like_math(a) for a in answers) else "qa"


# Instructions other projects' preprocessing appends to the question (after one space), removed
# wherever a question is read: the agent loop renders the protocol's own prompt, and a question
# that kept one would be trained and scored with another protocol's answer format. docs/data.md
# lists them.
INSTRUCTION_SUFFIXES = {
    "verl's gsm8k.py": 'Let\'s think step by step and output the final answer after "####".',
    "verl's gsm8k tool and interaction examples": "Let's think step by step and output the final answer after `####`.",
    "verl's math_dataset.py": "Let's think step by step and output the final answer within \\boxed{}.",
    "verl's geo3k.py": (
        "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. The reasoning "
        "process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
    ),
}


def strip_instruction(question: str) -> tuple[str, str | None]:
    """The question without a known producer's instruction at its end, and which producer's."""
    text = question.rstrip()
    for producer, suffix in INSTRUCTION_SUFFIXES.items():
        if text.endswith(suffix) and text[: -len(suffix)].strip():
            return text[: -len(suffix)].rstrip(), producer
    return question, None


# GSM8K's answers are a rationale whose last line is "#### <number>" (openai/gsm8k)
GSM8K_RATIONALE = re.compile(r"####\s*(-?[0-9][0-9.,]*)\s*$")


def with_choices(question: str, choices: list[str]) -> str:
    """The multiple-choice layout (the paper's): the question, a blank line, ``A. option`` lines."""
    lines = [f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(choices)]
    return question + "\n\n" + "\n".join(lines)


def _choices(row: dict) -> tuple[list[str] | None, str | None]:
    """A multiple-choice row's options (FlashRAG's ``choices``, verl's ``reward_model.choices``)."""
    for column in ("choices", "reward_model.choices"):
        value = _get(row, column)
        if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value):
            return list(value), column
    return None, None


def _gold(value: Any, column: str, row: dict, path: str, number: int) -> tuple[Any, str | None]:
    """The gold answers of a row as they are meant, and how they were read when not as they stand:
    a GSM8K rationale's number after ``####``; a worked solution's last ``\\boxed{}``; indices
    into a multiple-choice row's options as the options' text (FlashRAG's golden_answers, verl's
    hellaswag ground truth)."""
    choices, choices_column = _choices(row)
    answers = value if isinstance(value, (list, tuple)) else [value]
    if choices is not None and answers and all(isinstance(a, int) and not isinstance(a, bool) for a in answers):
        for a in answers:
            if not 0 <= a < len(choices):
                raise RecordError(path, number, column, f"choice {a} is not an index into the {len(choices)} options of {choices_column}")
        return [choices[a] for a in answers], f"the options of {choices_column} it indexes"
    if isinstance(value, str):
        found = GSM8K_RATIONALE.search(value)
        if found:
            return found.group(1).replace(",", "").rstrip("."), "the number after '####'"
        boxed = protocol.last_boxed(value) if "\\boxed" in value else None
        if boxed and boxed.strip() != value.strip():
            return protocol.unwrap_text(boxed), "its last \\boxed{}"
    return value, None


def to_question_row(row: Any, number: int, path: str, fmt: str, settings: QuestionFormat, mapping: Mapping) -> QuestionRow:
    """One row of a file in format ``fmt`` as a question; a row that cannot be one raises
    :class:`RecordError` naming the file, the row and the field."""
    if not isinstance(row, dict):
        raise RecordError(path, number, "(record)", f"expected an object, got {type(row).__name__}")
    mapped = dict(settings.fields or {})
    values: dict[str, Any] = {}
    read_from: dict[str, str] = {}  # field -> the column it came from, for the errors
    for name in ("question", "answer"):
        columns = (mapped[name],) if name in mapped else CANDIDATES[name][fmt]
        value, column = _first_present(row, columns)
        if value is None:  # a column given as null is refused by the question's own check, saying so
            column = next((c for c in columns if _lookup(row, c)[0]), None)
        if column is None:
            raise RecordError(
                path, number, name, "missing" if fmt == "etagent" else f"missing (looked for {', '.join(columns)} in this {fmt} row)"
            )
        values[name], read_from[name] = value, column
    if fmt == "search_r1" and isinstance(values["answer"], dict):  # golden answers given as {target: [...]}
        values["answer"] = values["answer"].get("target")
    described = dict(read_from)
    if isinstance(values["question"], str):
        values["question"], producer = strip_instruction(values["question"])
        if producer:
            described["question"] += f" ({producer} instruction removed)"
    values["answer"], how = _gold(values["answer"], read_from["answer"], row, path, number)
    if how:
        described["answer"] += f" ({how})"
    choices, _ = _choices(row)
    if choices is not None and isinstance(values["question"], str):
        values["question"] = with_choices(values["question"], choices)
        described["question"] += " (with its options)"
    for name in ("question", "answer"):
        mapping.fields[name][described[name]] += 1

    qid, column = _first_present(row, (mapped["id"],) if "id" in mapped else CANDIDATES["id"])
    if qid is None:
        qid, column = f"{file_name(path)}-{number}", "the row number"
    values["id"] = qid
    mapping.fields["id"][column] += 1

    if settings.source is not None:
        values["source"], column = settings.source, "question_format.source"
    else:
        source, column = _first_present(row, (mapped["source"],) if "source" in mapped else CANDIDATES["source"])
        if source is None:
            source, column = file_name(path), "the file's name"
        values["source"] = str(source)
    mapping.fields["source"][column] += 1

    values["kind"], column = _row_kind(row, fmt, settings, mapped, values)
    mapping.fields["kind"][column] += 1

    if fmt == "etagent":  # our own schema keeps the fields it does not know (a Record keeps extras)
        values.update({key: value for key, value in row.items() if key not in values and key not in mapped.values()})
    elif isinstance(row.get("needed_calls"), dict):
        values["needed_calls"] = row["needed_calls"]
    try:
        question = Question(**values)
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "(record)"
        where = read_from.get(name, name).split(" (")[0]  # the row's column, as the user's file names it
        raise RecordError(path, number, where, "missing" if first["type"] == "missing" else first["msg"]) from None
    index = _get(row, "extra_info.index")
    index = index if isinstance(index, int) and not isinstance(index, bool) else number - 1
    return QuestionRow(question=question, index=index, prompt=_messages(row.get("prompt")), number=number)


def file_name(path: str) -> str:
    """A file's name without its suffix, as text any writer can write: a byte of a name that is not
    UTF-8 (which Python reads as a lone surrogate) as its escape."""
    name = Path(str(path)).stem or str(path)
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _row_kind(row: dict, fmt: str, settings: QuestionFormat, mapped: dict, values: dict) -> tuple[Any, str]:
    """The row's kind and where it came from: the setting; the row's own ``kind`` (ours: math or qa,
    a typo refused by the question's check) or its producer's ``ability``; its ``data_source``
    where another project's is known (:data:`DATA_SOURCE_KINDS`); qa for FlashRAG and Search-R1
    files (question-answering sets by construction); else inferred from the gold answers."""
    if settings.kind != "auto":
        return settings.kind, "question_format.kind"
    kind, column = _first_present(row, (mapped["kind"],) if "kind" in mapped else CANDIDATES["kind"])
    if kind is not None:
        if column == "kind" or kind in ("math", "qa"):
            return kind, column
        return _kind_of(kind), f"{column} ({kind!r} read as {_kind_of(kind)})"
    by_source = kind_of_data_source(row.get("data_source"))
    if by_source is not None:
        return by_source, f"data_source ({row['data_source']!r}: {by_source})"
    if fmt in ("flashrag", "search_r1"):
        return "qa", f"the {fmt} format (question answering)"
    answers = values["answer"] if isinstance(values["answer"], (list, tuple)) else [values["answer"]]
    kind = inferred_kind([str(a) for a in answers if a is not None])
    return kind, f"inferred from the answer ({kind}: {'a number or LaTeX' if kind == 'math' else 'text'})"


def read_question_rows(
    where: str | os.PathLike, settings: QuestionFormat = DEFAULT_FORMAT, partial_ok: bool = False, split_key: str = "question_format.split"
) -> tuple[list[QuestionRow], Mapping]:
    """Every row of a questions source as a question, with what was read from where (also logged,
    so every stage's log says it on its first lines). Ids are unique within each source (a
    duplicate is an error naming both rows); a file whose sources number their rows each from the
    start (Search-R1's merged NQ and HotpotQA) gets its ids, and its RL indices, qualified by source
    (``nq/train_0``). An empty source is refused unless ``partial_ok``: a run on it would end with
    status 0 having done nothing."""
    unknown = sorted(set(settings.fields or {}) - set(MAPPABLE))
    if unknown:
        raise SettingError(f"question_format.fields.{unknown[0]}", f"not a question field; map any of {', '.join(MAPPABLE)}")
    path = str(where)
    rows: list[QuestionRow] = []
    mapping: Mapping | None = None
    seen: dict[tuple[str, str], int] = {}
    for number, row in iter_rows(where, settings.split, partial_ok, split_key):
        if mapping is None:
            mapping = Mapping(format=detect_format(row) if isinstance(row, dict) else "etagent")
        item = to_question_row(row, number, path, mapping.format, settings, mapping)
        key = (item.question.source, item.question.id)
        if key in seen:
            raise RecordError(path, number, "id", f"duplicate id {item.question.id!r} in source {key[0]!r} (first at record {seen[key]})")
        seen[key] = number
        rows.append(item)
    mapping = mapping or Mapping(format="etagent")
    mapping.rows = len(rows)
    _qualify_by_source(rows, mapping)
    if not rows and not partial_ok:
        raise RecordError(
            path, None, "(file)", "no questions in the file; give a questions file, or set partial_input_ok=true to run on none"
        )
    log.info("read %s: %s", path, mapping.describe())
    return rows, mapping


def _qualify_by_source(rows: list[QuestionRow], mapping: Mapping) -> None:
    """Where two sources of one file share an id (each numbered its rows from the start), every id
    becomes ``source/id``; where they share an RL index (``extra_info.index``), every index becomes
    the row's position. Stages key their outputs by id and RL groups rollouts by index."""
    sources_of_id: dict[str, set] = {}
    sources_of_index: dict[int, set] = {}
    for row in rows:
        sources_of_id.setdefault(row.question.id, set()).add(row.question.source)
        sources_of_index.setdefault(row.index, set()).add(row.question.source)
    if any(len(sources) > 1 for sources in sources_of_id.values()):
        for row in rows:
            row.question.id = f"{row.question.source}/{row.question.id}"
        mapping.notes.append("ids qualified by source (each source numbers its rows from the start)")
    if any(len(sources) > 1 for sources in sources_of_index.values()):
        for position, row in enumerate(rows):
            row.index = position
        mapping.notes.append("RL indices are the row positions (extra_info.index restarts per source)")


def read_questions(
    where: str | os.PathLike, partial_ok: bool = False, settings: QuestionFormat = DEFAULT_FORMAT, split_key: str = "question_format.split"
) -> list[Question]:
    """The questions of a source in any format above (see :func:`read_question_rows`)."""
    rows, _ = read_question_rows(where, settings, partial_ok, split_key)
    return [row.question for row in rows]

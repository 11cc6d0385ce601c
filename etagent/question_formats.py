"""Questions from the files researchers already have, read into the one question schema.

Every stage that takes questions or RL prompts reads them through :func:`read_question_rows`
(``etagent.records.read_questions`` and ``rl/rollout.py``'s ``read_prompts`` build on it). It
accepts, with nothing converted by hand:

- **ours** (:class:`etagent.records.Question`): ``{id, question, answer, source, kind}``, as the
  toy world and ``etagent convert`` write it; ``source`` and ``kind`` may be left out;
- **FlashRAG** QA JSONL: ``{id, question, golden_answers, metadata}``;
- **Search-R1** parquet or JSONL: verl's columns with ``ability: fact-reasoning`` and
  ``reward_model.ground_truth: {target: [...]}``, usually beside the FlashRAG columns it was made
  from; without them the question is read after ``Question:`` in Search-R1's prompt template;
- **verl** parquet (our RL parquet, verl's GSM8K, any ``data_source/prompt/ability/reward_model/
  extra_info`` file): the question from ``extra_info.question`` (verl's examples keep the raw
  question there), else the last user turn;
- **TRL** prompt datasets: ``prompt`` as a string or as chat messages, the answer in ``solution``,
  ``ground_truth`` or ``answer``;
- a **Hugging Face datasets** folder written by ``save_to_disk`` (one dataset, or a dataset dict
  of which ``split`` is read), or ``hf:<hub id>`` on a machine with the network; its rows are any
  of the above.

Each file's format is recognised from its first row; :class:`QuestionFormat` (the
``question_format`` settings of the stages) fills what a format lacks and maps columns by name.
``kind`` (how answers are scored: ``math`` or ``qa``) comes from the setting when it is not
``auto``, else from the row's ``kind`` or ``ability`` (any ability naming math is ``math``; every
other ability, Search-R1's ``fact-reasoning`` among them, is ``qa``), else ``qa``; ``source`` from
the setting, the row's ``source`` or ``data_source``, else the file's name; ``id`` from ``id``,
``extra_info.question_id``, ``extra_info.index``, else the row number. :class:`Mapping` says which
column each field came from; ``etagent convert`` prints it.

What this module does not do: check what a stage needs beyond the questions (RL's prompt rules
are in ``rl/rollout.py``), or download anything unless asked with ``hf:``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import ValidationError

from etagent.config import register_schema
from etagent.errors import MissingInput, SettingError
from etagent.records import Question, RecordError, iter_jsonl, read_json_file, read_parquet_rows
from etagent.settings import DATASETS_FOLDER_FILES, OneOf, group

HUB_PREFIX = "hf:"
FORMATS = ("etagent", "flashrag", "search_r1", "verl", "trl")
MAPPABLE = ("id", "question", "answer", "kind", "source")
# Search-R1's templates end with "Question: {question}\n" (scripts/data_process/*.py there)
SEARCH_R1_QUESTION = re.compile(r"Question:\s*(.*?)\s*$", re.S)


@group
class QuestionFormat:
    """How rows in another project's format become questions (see the module docstring)."""

    # defaults here, as they are in every stage's _base.yaml: evaluation hands the questions it
    # read to etagent.sampling in our own schema, with this group as it is by default
    kind: Annotated[str, OneOf("auto", "math", "qa")] = "auto"
    source: str | None = None
    split: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


register_schema("question_format", QuestionFormat)

DEFAULT_FORMAT = QuestionFormat()


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

    def describe_field(self, name: str) -> str:
        return "read from " + " | ".join(self.fields[name]) if self.fields[name] else "not read"

    def describe(self) -> str:
        parts = []
        for name, sources in self.fields.items():
            if sources:
                parts.append(f"{name} <- " + " | ".join(f"{source} ({n})" if len(sources) > 1 else source for source, n in sources.items()))
        return f"{self.format} format, {self.rows} rows: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Rows


def is_hub_dataset(value: str) -> bool:
    return str(value).startswith(HUB_PREFIX)


def is_datasets_folder(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk``: one dataset, or a dict of splits."""
    return path.is_dir() and any((path / name).is_file() for name in DATASETS_FOLDER_FILES)


def _datasets_rows(where: str, split: str | None) -> list[dict]:
    import datasets  # the data extra; missing, it is one line naming the extra (etagent/errors.py)

    if is_hub_dataset(where):
        name = where[len(HUB_PREFIX) :]
        try:
            loaded = datasets.load_dataset(name, split=split or "train")
        except Exception as exc:  # the hub's errors are many (offline, no such dataset, no split)
            raise SettingError("questions", f"{where}: could not load it from the hub: {str(exc).splitlines()[0]}") from None
        return loaded.to_list()
    loaded = datasets.load_from_disk(where)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        chosen = split or ("train" if "train" in loaded else splits[0] if len(splits) == 1 else None)
        if chosen not in loaded:
            raise SettingError("question_format.split", f"{where} holds the splits {splits}; name one (question_format.split=...)")
        loaded = loaded[chosen]
    return loaded.to_list()


def iter_rows(where: str | os.PathLike, split: str | None = None, partial_ok: bool = False) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a JSONL, JSON-array or parquet file, a folder of parquet files, a
    ``datasets`` folder, or ``hf:<id>``."""
    if is_hub_dataset(str(where)):
        yield from enumerate(_datasets_rows(str(where), split), start=1)
        return
    path = Path(where)
    if not path.exists():
        raise MissingInput(f"{path}: no such file")
    if is_datasets_folder(path):
        yield from enumerate(_datasets_rows(str(path), split), start=1)
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
        mapping.fields[name][column] += 1
    if fmt == "search_r1" and isinstance(values["answer"], dict):  # golden answers given as {target: [...]}
        values["answer"] = values["answer"].get("target")

    qid, column = _first_present(row, (mapped["id"],) if "id" in mapped else CANDIDATES["id"])
    if qid is None:
        qid, column = f"{Path(path).stem}-{number}", "the row number"
    values["id"] = qid
    mapping.fields["id"][column] += 1

    if settings.kind != "auto":
        values["kind"], column = settings.kind, "question_format.kind"
    else:
        kind, column = _first_present(row, (mapped["kind"],) if "kind" in mapped else CANDIDATES["kind"])
        if kind is None:
            kind, column = "qa", "the default (qa; set question_format.kind=math for math questions)"
        # our own `kind` must say math or qa (a typo is refused); another project's ability is
        # read as the scoring it calls for
        values["kind"] = kind if column == "kind" or kind in ("math", "qa") else _kind_of(kind)
        if values["kind"] != kind:
            column = f"{column} ({kind!r} read as {values['kind']})"
    mapping.fields["kind"][column] += 1

    if settings.source is not None:
        values["source"], column = settings.source, "question_format.source"
    else:
        source, column = _first_present(row, (mapped["source"],) if "source" in mapped else CANDIDATES["source"])
        if source is None:
            source, column = Path(str(path)).stem or str(path), "the file's name"
        values["source"] = str(source)
    mapping.fields["source"][column] += 1

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


def read_question_rows(
    where: str | os.PathLike, settings: QuestionFormat = DEFAULT_FORMAT, partial_ok: bool = False
) -> tuple[list[QuestionRow], Mapping]:
    """Every row of a questions source as a question, with what was read from where. Ids are
    unique (a duplicate is an error naming both rows). An empty source is refused unless
    ``partial_ok``: a run on it would end with status 0 having done nothing."""
    unknown = sorted(set(settings.fields or {}) - set(MAPPABLE))
    if unknown:
        raise SettingError(f"question_format.fields.{unknown[0]}", f"not a question field; map any of {', '.join(MAPPABLE)}")
    path = str(where)
    rows: list[QuestionRow] = []
    mapping: Mapping | None = None
    seen: dict[str, int] = {}
    for number, row in iter_rows(where, settings.split, partial_ok):
        if mapping is None:
            mapping = Mapping(format=detect_format(row) if isinstance(row, dict) else "etagent")
        item = to_question_row(row, number, path, mapping.format, settings, mapping)
        if item.question.id in seen:
            raise RecordError(path, number, "id", f"duplicate id {item.question.id!r} (first at record {seen[item.question.id]})")
        seen[item.question.id] = number
        rows.append(item)
    mapping = mapping or Mapping(format="etagent")
    mapping.rows = len(rows)
    if not rows and not partial_ok:
        raise RecordError(
            path, None, "(file)", "no questions in the file; give a questions file, or set partial_input_ok=true to run on none"
        )
    return rows, mapping


def read_questions(where: str | os.PathLike, partial_ok: bool = False, settings: QuestionFormat = DEFAULT_FORMAT) -> list[Question]:
    """The questions of a source in any format above (see :func:`read_question_rows`)."""
    rows, _ = read_question_rows(where, settings, partial_ok)
    return [row.question for row in rows]

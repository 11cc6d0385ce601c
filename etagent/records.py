"""The artifacts passed between stages, as typed records, with their readers and writers.

Every stage reads files and writes files (docs/design.md §3):

- questions (:class:`Question`): JSONL, JSON array or parquet;
- trajectories (:class:`TrajectoryGroup`, one line per question holding its
  :class:`Trajectory` list, each with its :class:`ToolCallRecord` list): JSONL;
- SFT data (:class:`SFTExample`: chat messages plus the assistant turn split into trained
  segments and masked tool-result segments): JSONL, exportable to LLaMA-Factory alpaca/sharegpt;
- RL data (:class:`RLRow`): parquet in verl's schema;
- ``manifest.json`` beside each output (:func:`write_manifest`).

Long-running stages append records with :class:`JsonlAppender`, keyed by question id: a run
killed at any point (``kill -9`` included) leaves every completed line readable, and the next run
skips the ids already written and never duplicates one.

Unknown fields are kept when a record is read and written back. A record that is missing a
required field, or has one of the wrong type, raises :class:`RecordError`, whose message names
the file, the line (the row for parquet) and the field.

The readers here are the toolkit's one reading path (every stage, command and the report reads
through them): any bytes become values, or a :class:`RecordError` naming the file and line. JSON
is read by :func:`decode_json`, which also refuses what would crash a writer later (nesting deeper
than :data:`MAX_NESTING`, a lone surrogate); parquet by :func:`read_parquet_rows`, ``datasets``
folders by :func:`read_datasets_folder`, both checking the Arrow data whole. Writes are whole or
nothing (:func:`write_atomically`). tests/test_readers_fuzz.py fuzzes every reader.

What this module does not do: decide what goes into a record (the stages do) or score anything.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from enum import IntEnum
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator, model_validator

from etagent import protocol
from etagent.errors import MissingInput, RecordError
from etagent.json_text import decode_json, first_line, parse_json, printable, read_json_file, unparsable

log = logging.getLogger(__name__)


class Record(BaseModel):
    """Base of every artifact record: unknown fields are kept, assignments are validated."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def _as_str(value: Any) -> Any:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _gold_answers(value: Any) -> Any:
    """Gold answers as a non-empty list of non-empty strings. Benchmarks store a string, a list, an
    int (aime25) or a bool (csbench assertions). A null, a nested list, an object or an empty
    string is refused: a question scored against it could never be right (or always be)."""
    if value is None:
        raise ValueError("no gold answer (null)")
    if isinstance(value, (str, int, float, bool)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a string or a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError("empty list of gold answers")
    answers = []
    for i, v in enumerate(value):
        if v is None or not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"gold answer {i} is {'null' if v is None else 'a ' + type(v).__name__}, not a string")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"gold answer {i} is {v}, not a number")
        if not str(v).strip():
            raise ValueError(f"empty gold answer (answer {i} is an empty string)")
        answers.append(str(v))
    return answers


# ---------------------------------------------------------------------------------------------
# Questions


class Question(Record):
    """One question: gold answers as a list of acceptable strings, and how to score it.

    ``needed_calls`` is how many calls of each tool an efficient solver makes, where that is known
    (the toy world knows it; benchmarks do not): evaluation reports redundant and insufficient
    tool use against it."""

    id: str
    question: str
    answer: list[str]
    source: str
    kind: Literal["math", "qa"]
    needed_calls: dict[str, int] | None = None

    _id_as_str = field_validator("id", mode="before")(_as_str)
    _answers_as_strings = field_validator("answer", mode="before")(_gold_answers)

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty question")
        return value


# ---------------------------------------------------------------------------------------------
# Trajectories


class ToolCallRecord(Record):
    """One tool call of a trajectory, as the tools executor reports it. ``rebuilt`` marks a record
    read back from trajectory text (a prefix given as text only): its ``ok`` and ``seconds`` are
    not known and are left at True and 0. ``failure`` is the cause when the tool itself failed
    (``ConnectError``, ``timeout``, ``sandbox failure``...), None when it did its job, even if the
    call's code raised."""

    tool: str
    input: str
    output: str
    ok: bool
    seconds: float = 0.0
    cached: bool = False
    budget_exhausted: bool = False
    rebuilt: bool = False
    failure: str | None = None


class TokenOrigin(IntEnum):
    """Where a response token came from. SFT trains on every token but ``TOOL`` ones; RL's policy
    gradient covers ``SAMPLED`` tokens only (the others have no log-probability under the policy
    that generated this rollout)."""

    TOOL = 0  # inserted tool output (a result, or the budget message)
    SAMPLED = 1  # sampled by the policy in this rollout
    GIVEN = 2  # policy text not sampled in this rollout: a prefix, an editor's corrected step, a hint


def origin_segments(ids: Sequence[int], origins: Sequence[int], tokenizer) -> list[list[str]]:
    """A response as runs of one token origin, ``[[origin name, text], ...]`` (names: ``tool``,
    ``sampled``, ``given``), for the report's trajectory browser. Each run is decoded on its own,
    so the runs' texts join to the response as a person reads it."""
    if len(ids) != len(origins):
        raise ValueError(f"{len(ids)} token ids but {len(origins)} origins")
    segments, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or origins[end] != origins[start]:
            segments.append([TokenOrigin(origins[start]).name.lower(), tokenizer.decode(list(ids[start:end]), skip_special_tokens=False)])
            start = end
    return segments


def policy_text(ids: Sequence[int], origins: Sequence[int], tokenizer) -> str:
    """A response as the policy wrote it: its text with every inserted tool result (its TOOL
    tokens) replaced by an empty result, ``<result>\n\n</result>``. What the reward reads in its
    default mode: an answer, a tag or a tool call that a tool printed is not the policy's."""
    empty = protocol.format_result("")
    return "".join(empty if name == "tool" else text for name, text in origin_segments(ids, origins, tokenizer))


class Provenance(Record):
    """Which stage or operation made a trajectory, and from what. ``operation`` is e.g. ``rollout``,
    ``fork``, ``prefix``, a flywheel operation, or ``seed`` (toy seeds); ``edited_step`` is the step
    an edit replaced; ``branch_segment``/``branch_token`` where a fork left its parent (the
    generated segment it resampled from, and that segment's first response token). Other keys
    (the toy's ``behaviour``) are kept."""

    stage: str | None = None
    operation: str | None = None
    round: int | None = None
    parent: str | None = None
    edited_step: int | None = None
    branch_segment: int | None = None
    branch_token: int | None = None


class Judgement(Record):
    """How a trajectory's answer was judged. ``score`` is the metric's value (``metric`` names it:
    ``math_equivalence``, ``f1``, ``exact_match``, ``llm_judge``, ...), ``verdict`` whether it
    counts as correct (``score >= threshold`` for graded metrics), both None when the judge gave
    no usable answer; ``reply`` is an LLM judge's raw reply and ``attempts`` how many requests it
    took, ``error`` why there is no verdict."""

    metric: str
    score: float | None
    verdict: bool | None
    threshold: float | None = None
    reply: str | None = None
    attempts: int = 1
    error: str | None = None


class Trajectory(Record):
    """One rollout of a question.

    ``text`` is exactly what ``response_ids`` decode to (special tokens included) when the agent
    loop made it; data made from text alone (seed trajectories, imported files) has no ids.
    ``response_origin`` says, per response token, where it came from (:class:`TokenOrigin`);
    ``response_mask`` is 1 where SFT trains (every origin but ``TOOL``). ``logprobs`` has one entry
    per response token (the raw distribution's; 0.0 at tokens not sampled in this rollout) and
    ``tempered_logprobs`` the same under the sampling temperature, where the engine gave them.
    ``sampling`` holds the settings and seed the rollout was sampled with, ``policy_version`` the
    weights it was sampled from.
    ``entropies`` holds, per generated segment (the first, then one after each tool result), the
    entropy of its first tokens as ARPO computes it from top-k log-probabilities;
    ``entropies_exact`` the same from full distributions, where the engine had them.
    ``tool_calls_executed`` counts calls that ran (the budget message excluded);
    ``tool_calls_written`` the calls in the text as the paper counts them
    (:func:`etagent.protocol.count_tool_calls`); ``n_generated`` the sampled tokens.
    ``error`` says why an engine failed the rollout (``finish_reason == "error"``).
    """

    id: str
    text: str
    tool_calls: list[ToolCallRecord] = []
    prediction: str = ""
    judgement: Judgement | None = None
    n_tokens: int = 0
    n_generated: int | None = None
    tool_calls_executed: int | None = None
    tool_calls_written: int | None = None
    finish_reason: str = ""
    error: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    response_mask: list[int] | None = None
    response_origin: list[int] | None = None
    logprobs: list[float] | None = None
    tempered_logprobs: list[float] | None = None
    entropies: list[float] = []
    entropies_exact: list[float] | None = None
    sampling: dict[str, Any] | None = None
    policy_version: str | None = None
    provenance: Provenance = Field(default_factory=Provenance)

    @model_validator(mode="after")
    def _token_fields_align(self) -> Trajectory:
        if self.response_ids is not None:
            n = len(self.response_ids)
            for name in ("response_mask", "response_origin", "logprobs", "tempered_logprobs"):
                value = getattr(self, name)
                if value is not None and len(value) != n:
                    raise ValueError(f"{name} has {len(value)} entries but response_ids has {n}")
        if self.response_origin is not None and self.response_mask is not None:
            if any((o != TokenOrigin.TOOL) != bool(m) for o, m in zip(self.response_origin, self.response_mask)):
                raise ValueError("response_mask must be 1 exactly where response_origin is not TOOL (0)")
        return self

    @property
    def correct(self) -> bool | None:
        """The judgement's verdict (None when not judged, or the judge failed)."""
        return None if self.judgement is None else self.judgement.verdict


class TrajectoryGroup(Record):
    """All rollouts of one question: one line of a trajectories file."""

    id: str
    question: str
    answer: list[str]
    source: str
    kind: Literal["math", "qa"]
    needed_calls: dict[str, int] | None = None
    trajectories: list[Trajectory]

    _id_as_str = field_validator("id", mode="before")(_as_str)
    _answers_as_strings = field_validator("answer", mode="before")(_gold_answers)

    @classmethod
    def for_question(cls, question: Question, trajectories: Sequence[Trajectory]) -> TrajectoryGroup:
        fields = question.model_dump()
        return cls(**fields, trajectories=list(trajectories))

    def as_question(self) -> Question:
        """The question this group answers, with every field it was asked with."""
        return Question(**self.model_dump(exclude={"trajectories"}))


# ---------------------------------------------------------------------------------------------
# SFT data


class Message(Record):
    role: Literal["system", "user", "assistant"]
    content: str


class Segment(Record):
    """A piece of the assistant turn: ``train`` is False for inserted text (tool results)."""

    text: str
    train: bool


class SFTExample(Record):
    """One SFT conversation: system and user messages, the assistant turn, and its segments.

    The segments concatenate to the assistant message's content. SFT computes the loss only on
    segments with ``train=True``, so tool results written by tools are never learned as if the
    model had produced them.
    """

    id: str
    messages: list[Message]
    segments: list[Segment]
    # The token ids and mask (1: trained) of the rollout this example came from, when it came
    # from the agent loop: SFT then trains on exactly those ids (if they decode to the text).
    response_ids: list[NonNegativeInt] | None = None
    response_mask: list[Literal[0, 1]] | None = None

    @model_validator(mode="after")
    def _segments_match_assistant(self) -> SFTExample:
        if (self.response_ids is None) != (self.response_mask is None):
            raise ValueError("response_ids and response_mask go together")
        if self.response_ids is not None and len(self.response_ids) != len(self.response_mask):
            raise ValueError(f"response_mask has {len(self.response_mask)} entries but response_ids has {len(self.response_ids)}")
        roles = [m.role for m in self.messages]
        if roles not in (["system", "user", "assistant"], ["user", "assistant"]):
            raise ValueError(f"messages must be [system,] user, assistant; got {roles}")
        joined = "".join(s.text for s in self.segments)
        if joined != self.messages[-1].content:
            raise ValueError("segments do not concatenate to the assistant message")
        return self

    @classmethod
    def from_trajectory(cls, id: str, question: str, text: str, system_prompt: str = protocol.SYSTEM_PROMPT, **extra: Any) -> SFTExample:
        """Build an example from trajectory text, masking every ``<result>...</result>`` span."""
        segments = [Segment(text=piece, train=not is_result) for piece, is_result in protocol.split_result_segments(text)]
        messages = [Message(role="system", content=system_prompt), Message(role="user", content=question)]
        return cls(id=id, messages=messages + [Message(role="assistant", content=text)], segments=segments, **extra)

    @classmethod
    def from_rollout(cls, trajectory: Trajectory, question: str, system_prompt: str = protocol.SYSTEM_PROMPT, **extra: Any) -> SFTExample:
        """An example from an agent-loop trajectory, carrying its token ids and mask: SFT then
        trains on exactly those ids, policy text (sampled or given: prefixes, edits, hints) in
        the loss and tool output out of it, the same split the text alone gives."""
        ids = {}
        if trajectory.response_ids is not None and trajectory.response_mask is not None:
            ids = {"response_ids": trajectory.response_ids, "response_mask": trajectory.response_mask}
        return cls.from_trajectory(trajectory.id, question, trajectory.text, system_prompt, **ids, **extra)

    @property
    def system(self) -> str:
        return self.messages[0].content if self.messages[0].role == "system" else ""

    @property
    def question(self) -> str:
        return self.messages[-2].content

    @property
    def response(self) -> str:
        return self.messages[-1].content


def _observation_turns(example: SFTExample) -> list[dict[str, str]] | None:
    """The assistant turn as alternating gpt and observation turns (None when it does not end with
    policy text, which LLaMA-Factory requires). An observation holds the tool output: the text
    :func:`protocol.format_result` wrapped, or the whole span where it was wrapped otherwise."""
    turns = []
    for piece, is_result in protocol.split_result_segments(example.response):
        if not is_result:
            turns.append({"from": "gpt", "value": piece})
            continue
        inner = protocol.unwrap_result(piece)
        turns.append({"from": "observation", "value": piece if inner is None else inner})
    if not turns or turns[0]["from"] != "gpt" or turns[-1]["from"] != "gpt":
        return None
    return turns


def export_llamafactory(
    examples: Iterable[SFTExample], out_dir: str | os.PathLike, name: str = "etagent_sft", fmt: str = "sharegpt"
) -> Path:
    """Write SFT data for LLaMA-Factory: ``{name}.json`` and a ``dataset_info.json`` entry.

    The protocol prompt goes in the system column (the reference put it in the user turn).

    - ``alpaca`` and ``sharegpt``: the assistant turn is one message, as our rollouts have it;
      LLaMA-Factory then trains on the tool results too (it has no per-span masking). Our own
      importer (``sft/``) masks them again.
    - ``sharegpt_observation``: tool results as observation turns, which LLaMA-Factory masks; its
      chat template then renders each result as a turn of its own (role tokens around it), which
      is not how our agent loop inserts results (inline in one assistant turn). An example that
      does not end with policy text is left out (LLaMA-Factory needs an assistant turn last).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    examples = list(examples)
    if fmt == "alpaca":
        rows = [{"instruction": e.question, "input": "", "output": e.response, "system": e.system} for e in examples]
        info = {
            "file_name": f"{name}.json",
            "columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system"},
        }
    elif fmt in ("sharegpt", "sharegpt_observation"):
        rows = []
        for e in examples:
            turns = [{"from": "gpt", "value": e.response}] if fmt == "sharegpt" else _observation_turns(e)
            if turns is None:
                log.warning("%s: the assistant turn does not end with policy text; left out of the %s export", e.id, fmt)
                continue
            rows.append({"conversations": [{"from": "human", "value": e.question}] + turns, "system": e.system})
        info = {"file_name": f"{name}.json", "formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}}
    else:
        raise ValueError(f"unknown LLaMA-Factory format {fmt!r} (alpaca, sharegpt or sharegpt_observation)")
    write_atomically(out / f"{name}.json", json.dumps(rows, ensure_ascii=False, indent=1))
    write_atomically(out / "dataset_info.json", json.dumps({name: info}, indent=2))
    return out / f"{name}.json"


# ---------------------------------------------------------------------------------------------
# RL data: parquet in verl's schema


class RewardModel(Record):
    ground_truth: list[str]
    style: str = "rule"

    _answers_as_strings = field_validator("ground_truth", mode="before")(_gold_answers)


class ExtraInfo(Record):
    """``question_id`` is ours (the question's id in its questions file); the paper's files lack it.
    ``need_tools_kwargs`` is false in ours: our tools take nothing per row, and verl warns on every
    row that claims it without a ``tools_kwargs`` (the paper's files claim it)."""

    index: int
    need_tools_kwargs: bool = False
    question: str
    split: str
    question_id: str | None = None


class RLRow(Record):
    """One RL prompt in verl's schema. ``extra_info.index`` is unique per question: the
    efficiency reward groups a question's rollouts by it. ``metadata`` is the column the paper's
    parquet has (always null there)."""

    data_source: str
    prompt: list[Message]
    ability: Literal["math", "qa"]
    reward_model: RewardModel
    extra_info: ExtraInfo
    metadata: str | None = None

    @classmethod
    def for_question(cls, question: Question, index: int, split: str, system_prompt: str = protocol.SYSTEM_PROMPT) -> RLRow:
        return cls(
            data_source="math_effi_rl" if question.kind == "math" else "qa_effi_rl",
            prompt=[Message(**m) for m in protocol.prompt_messages(question.question, system_prompt)],
            ability=question.kind,
            reward_model=RewardModel(ground_truth=question.answer),
            extra_info=ExtraInfo(index=index, question=question.question, split=split, question_id=question.id),
        )


def _rl_schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.list_(pa.string())), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("index", pa.int64()),
                        ("need_tools_kwargs", pa.bool_()),
                        ("question", pa.string()),
                        ("split", pa.string()),
                        ("question_id", pa.string()),
                    ]
                ),
            ),
            ("metadata", pa.string()),
        ]
    )


def write_rl_parquet(rows: Iterable[RLRow], path: str | os.PathLike) -> Path:
    """Write RL rows as parquet with verl's column layout (atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _rl_schema()
    data = [row.model_dump(mode="json", include={name: True for name in schema.names}) for row in rows]
    table = pa.Table.from_pylist(data, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:  # as write_atomically: a failed write leaves nothing behind
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Reading

R = TypeVar("R", bound=Record)


def _validation_error(path, line: int | None, error: ValidationError) -> RecordError:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(record)"
    message = first["msg"]
    if first["type"] == "missing":
        message = "missing"
    return RecordError(path, line, field, message)


def parse_record(model: type[R], data: Any, path: str | os.PathLike = "<memory>", line: int | None = None) -> R:
    """Validate one decoded record, raising RecordError with file, line and field."""
    if not isinstance(data, dict):
        raise RecordError(path, line, "(record)", f"expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _validation_error(path, line, error) from None


def iter_jsonl(path: str | os.PathLike, partial_ok: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded value) for every non-blank line of a JSONL file, streaming, each
    read as :func:`decode_json` reads it.

    A last line with no newline that does not decode is a record its writer was killed in the
    middle of: the file is incomplete, and reading on would silently drop a record, so it is an
    error naming the line unless ``partial_ok`` (then it is skipped with a warning). Any other
    undecodable line is an error.
    """
    path = Path(path)
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            try:
                value = parse_json(raw, path, number)
            except RecordError:
                raise
            except ValueError as error:
                if not raw.endswith(b"\n"):  # the unterminated tail of an interrupted write
                    if partial_ok:
                        log.warning("%s:%d: skipping an incomplete last line (%d bytes)", path, number, len(raw))
                        return
                    raise RecordError(
                        path,
                        number,
                        "(line)",
                        f"cut off: the last line ({len(raw)} bytes) is not valid JSON and has no newline, as when its writer "
                        "is killed; finish or remove the line (stages that read questions skip it with partial_input_ok=true)",
                    ) from None
                raise unparsable(error, raw, path, number) from None
            yield number, value


def iter_json_objects(source: IO[bytes], name: str) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for every non-blank line of an open binary stream (a file, or
    ``sys.stdin.buffer``) of JSON objects, for the commands that read one request per line; a line
    that :func:`decode_json` refuses, or that is not a JSON object, raises :class:`RecordError`
    naming ``name`` and the line. (Bytes, so that a bad byte is reported with its line rather than
    by the text decoder.)"""
    for number, raw in enumerate(source, start=1):
        if not raw.strip():
            continue
        item = decode_json(raw, name, number)
        if not isinstance(item, dict):
            raise RecordError(name, number, "(line)", "expected a JSON object")
        yield number, item


def _arrow_problem(table, path) -> RecordError | None:
    """A RecordError naming the first column of an Arrow ``table`` (read from ``path``) whose data
    is not valid (strings that are not UTF-8, offsets past the data), or None: checked whole
    before its rows are converted, where a bad string would raise without naming its column."""
    import pyarrow as pa

    for name, column in zip(table.column_names, table.columns, strict=True):
        try:
            column.validate(full=True)
        except pa.ArrowException as error:
            return RecordError(path, None, printable(name), f"holds data that is not valid ({first_line(error)})")
    return None


def _clashing_column(schema, other) -> str | None:
    """The first column of schema ``other`` whose type cannot be unified with its type in ``schema``."""
    import pyarrow as pa

    for field in other:
        index = schema.get_field_index(field.name)
        if index >= 0:
            try:
                pa.unify_schemas([pa.schema([schema.field(index)]), pa.schema([field])])
            except pa.ArrowException:
                return field.name
    return None


def read_parquet_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a parquet file, or of the files ending in ``.parquet`` directly in a folder (in
    name order), as dicts. A folder's files are one table with the union of their columns
    (``pyarrow.unify_schemas`` over each file's schema): a column a file lacks is null in its rows,
    and a file whose column's type clashes with an earlier file's is a :class:`RecordError` naming
    the file and the column. So is a file that is not parquet, or holds data that is not valid
    (strings that are not UTF-8)."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.name.endswith(".parquet") and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise RecordError(path, None, "(folder)", "holds no file ending in .parquet")
    schema, origin = None, {}
    for file in files:
        try:
            own = pq.read_schema(file)
        except (pa.ArrowException, OSError, ValueError) as error:  # ValueError: column names that are not UTF-8
            raise RecordError(file, None, "(file)", f"not a readable parquet file: {first_line(error)}") from None
        try:
            schema = own if schema is None else pa.unify_schemas([schema, own])
        except pa.ArrowException as error:
            column = _clashing_column(schema, own)
            if column is None:
                raise RecordError(file, None, "(file)", f"its columns cannot join the folder's other files': {first_line(error)}") from None
            raise RecordError(
                file,
                None,
                printable(column),
                f"is {own.field(column).type} here but {schema.field(column).type} in {origin[column].name}: the files of one "
                "folder are one table; convert one of them, or give the files apart",
            ) from None
        for name in own.names:
            origin.setdefault(name, file)
    rows = []
    for file in files:
        try:
            table = ds.dataset(file, schema=schema, format="parquet").to_table()
            problem = _arrow_problem(table, file)
            if problem is None:
                rows += table.to_pylist()
        except (pa.ArrowException, OSError, ValueError, OverflowError) as error:  # what reading or converting this file's data met
            raise RecordError(file, None, "(file)", f"not a readable parquet file: {first_line(error)}") from None
        if problem is not None:
            raise problem
    return rows


def read_datasets_folder(path: str | os.PathLike):
    """A folder ``datasets``' ``save_to_disk`` wrote (one ``Dataset``, or a ``DatasetDict`` of
    splits), loaded by ``datasets.load_from_disk`` and checked whole, so that its rows
    (``to_list()``) read: a JSON file of it that does not read is a :class:`RecordError` naming the
    file and line (as :func:`read_json_file`), a column whose data is not valid one naming the
    column, and anything else ``datasets`` cannot load one naming the folder."""
    import datasets  # the data extra; missing, it is one line naming the extra (etagent/errors.py)

    path = Path(path)
    for meta in sorted(path.rglob("*.json")):  # state.json, dataset_info.json, dataset_dict.json
        read_json_file(meta)
    try:
        loaded = datasets.load_from_disk(str(path))
        parts = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
        problem = next(filter(None, (_arrow_problem(part.data.table, path) for part in parts)), None)
    except Exception as error:  # load_from_disk raises what its parsing of the folder meets: KeyError, TypeError, ArrowInvalid, OSError...
        raise RecordError(path, None, "(folder)", f"not a readable datasets folder: {type(error).__name__}: {first_line(error)}") from None
    if problem is not None:
        raise problem
    return loaded


def read_jsonl(path: str | os.PathLike, model: type[R], partial_ok: bool = False) -> list[R]:
    """Read and validate every record of a JSONL file (see :func:`iter_jsonl` for ``partial_ok``)."""
    return [parse_record(model, data, path, number) for number, data in iter_jsonl(path, partial_ok)]


def read_records(path: str | os.PathLike, model: type[R], partial_ok: bool = False) -> list[R]:
    """Read records from ``.jsonl``, ``.json`` (an array) or ``.parquet``, validated."""
    path = Path(path)
    if not path.exists():
        raise MissingInput(f"{path}: no such file")
    if path.suffix == ".parquet" or path.is_dir():
        rows = read_parquet_rows(path)
        return [parse_record(model, row, path, i) for i, row in enumerate(rows, start=1)]
    if path.suffix == ".json":
        rows = read_json_file(path)
        if not isinstance(rows, list):
            raise RecordError(path, None, "(file)", "expected a JSON array of records")
        return [parse_record(model, row, path, i) for i, row in enumerate(rows, start=1)]
    return read_jsonl(path, model, partial_ok)


# ---------------------------------------------------------------------------------------------
# Writing


def write_atomically(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write a file whole or not at all: text is encoded (UTF-8) before anything is opened, the
    bytes go to a temporary file beside ``path`` that is renamed over it, and a write that fails
    (a full disk) removes its temporary file. Readers never see half a file, and a failed write
    leaves nothing behind."""
    path = Path(path)
    data = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _dump(record: Record | dict) -> dict:
    return record.to_json() if isinstance(record, Record) else record


def write_jsonl(path: str | os.PathLike, records: Iterable[Record | dict]) -> Path:
    """Write a whole JSONL file at once, atomically (readers never see half a file)."""
    path = Path(path)
    write_atomically(path, "".join(json.dumps(_dump(r), ensure_ascii=False) + "\n" for r in records))
    return path


class JsonlAppender:
    """Append-only JSONL output keyed by a field, resumable after any interruption.

    Opening an existing file reads the keys already written (``done``) and cuts off an
    unterminated last line, the trace of a writer killed mid-record, so the next append starts on
    a clean line. Each record is written as one line and flushed to the OS before ``write``
    returns, so a ``kill -9`` loses at most the record being written. Writing a key that is
    already done raises: resuming code must skip done keys, never rewrite them.

    Use one appender per file and process (it is thread-safe within the process).
    """

    def __init__(self, path: str | os.PathLike, key: str = "id", fsync: bool = False):
        self.path = Path(path)
        self.key = key
        self.fsync = fsync
        self.done: set[str] = set()
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._recover()
        self._file = self.path.open("ab")

    def _recover(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1  # 0 when there is no complete line
            if end < len(data):
                log.warning("%s: dropping an incomplete last record (%d bytes) left by an interrupted run", self.path, len(data) - end)
                f.truncate(end)
        for number, raw in enumerate(data[:end].split(b"\n"), start=1):
            if not raw.strip():
                continue
            record = decode_json(raw, self.path, number)
            if not isinstance(record, dict) or self.key not in record:
                raise RecordError(self.path, number, self.key, "missing")
            self.done.add(str(record[self.key]))

    def write(self, record: Record | dict) -> None:
        data = _dump(record)
        if self.key not in data:
            raise KeyError(f"record has no {self.key!r} field")
        key = str(data[self.key])
        line = (json.dumps(data, ensure_ascii=False) + "\n").encode()
        with self._lock:
            if key in self.done:
                raise ValueError(f"{self.path}: {self.key}={key!r} is already written")
            self._file.write(line)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self.done.add(key)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Manifests


# Files up to this size are hashed whole; a larger one (model weights) by its size and
# SAMPLED_CHUNKS chunks spread evenly over it, so that a resume of a 15 GB model's run does not
# read 15 GB: a changed file almost always changes its size or one of the chunks.
WHOLE_FILE_BYTES = 64 << 20
SAMPLED_CHUNKS, CHUNK_BYTES = 16, 1 << 20


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, or, over WHOLE_FILE_BYTES, of its size and sampled chunks."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            while block := f.read(chunk):
                digest.update(block)
        else:
            digest.update(f"size {size}".encode())
            for i in range(SAMPLED_CHUNKS):
                f.seek((size - CHUNK_BYTES) * i // (SAMPLED_CHUNKS - 1))
                digest.update(f.read(CHUNK_BYTES))
    return digest.hexdigest()


def sha256_path(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory's data files (names and contents, in sorted order;
    :func:`data_files`)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in data_files(path):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def data_files(folder: Path) -> list[Path]:
    """The files under ``folder`` that hold what its run made, in sorted order: not its records of
    the run, an output folder's ``.lock`` (its last writer's pid) and a stage's ``manifest.json``
    (its times and status), which a rerun of a finished stage rewrites with the data unchanged. A
    folder that a later stage read stays the same input across such a rerun."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".lock" and not _stage_manifest(p))


def _stage_manifest(path: Path) -> bool:
    if path.name != "manifest.json":
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and "stage" in manifest and "etagent_version" in manifest


def path_size(path: str | os.PathLike) -> int:
    """Bytes of a file, or of a folder's data files (:func:`data_files`)."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in data_files(path))


def input_identity(key: str, path: str | os.PathLike) -> dict[str, Any]:
    """What a manifest records of one input: the setting that names it, its path, its size and
    its content hash (see :func:`sha256_file`). A hub dataset (``hf:<id>``) is recorded by its id
    only: the hub does not promise that an id's content stays the same."""
    if str(path).startswith("hf:"):
        return {"key": key, "path": str(path), "hub": True}
    return {"key": key, "path": str(path), "bytes": path_size(path), "sha256": sha256_path(path)}


def git_revision() -> dict[str, Any]:
    """The toolkit's git commit and whether its tree has uncommitted changes (if in a checkout)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def write_manifest(
    out_dir: str | os.PathLike,
    *,
    stage: str,
    config: dict[str, Any],
    inputs: Sequence[dict[str, Any]] | None = None,
    counts: dict[str, int] | None = None,
    seed: int | None = None,
    started_at: float,
    metrics: dict[str, Any] | None = None,
    status: str = "complete",
) -> Path:
    """Write ``manifest.json`` into an output directory (atomically).

    Records the stage, the resolved config, every input (:func:`input_identity`; by default the
    ones the manifest already holds, which ``etagent.rundir.claim_output`` wrote when the run
    began), the digest of those three (:func:`manifest_digest`), row counts, the seed, the
    toolkit's git revision, start and end times and summary metrics.
    """
    from etagent import __version__

    path = Path(out_dir) / "manifest.json"
    if inputs is None:
        inputs = read_manifest(path).get("inputs", []) if path.exists() else []
    finished = time.time()
    # as the file will hold them (a value JSON cannot hold written as its text), so that the
    # digest of what is read back is the digest written
    signed = json.loads(json.dumps({"stage": stage, "config": config, "inputs": list(inputs)}, ensure_ascii=False, default=str))
    manifest = {
        "stage": signed["stage"],
        "status": status,
        "config": signed["config"],
        "inputs": signed["inputs"],
        "digest": manifest_digest(signed),
        "counts": counts or {},
        "seed": seed,
        "git": git_revision(),
        "etagent_version": __version__,
        "python": platform.python_version(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started_at)),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(finished)),
        "seconds": round(finished - started_at, 3),
        "metrics": metrics or {},
    }
    write_atomically(path, json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n")
    return path


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of what a resume is checked against, a manifest's ``stage``, ``config`` and
    ``inputs``, as canonical JSON (sorted keys, no spaces): :func:`write_manifest` records it as
    ``digest``, and etagent.rundir refuses to resume a folder whose manifest no longer matches it
    (a config edited by hand would let a rerun with other settings pass as the same run)."""
    signed = {key: manifest.get(key) for key in ("stage", "config", "inputs")}
    text = json.dumps(signed, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A ``manifest.json`` as a dict, read as :func:`read_json_file` reads it; one that does not
    read, or is not a JSON object, is a :class:`RecordError`."""
    try:
        manifest = read_json_file(path)
    except RecordError as error:
        raise RecordError(path, error.line, error.field, f"{error.message}; move the directory aside, or rerun with --restart") from None
    if not isinstance(manifest, dict):
        raise RecordError(path, None, "(file)", f"expected a JSON object, got {type(manifest).__name__}")
    return manifest

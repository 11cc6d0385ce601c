"""Every reader against bytes no producer writes: random bytes, nesting up to 100,000 deep, random
unicode (lone surrogates, NUL, byte-order marks, bytes that are not UTF-8) and files cut short,
fed to each reader of etagent/records.py (JSON, JSONL, parquet files and folders, ``datasets``
folders, manifests) and to the report's. A reader returns values every writer can write, or
raises :class:`RecordError`: one line, naming the file (and the line, for JSON lines), which
``exit_on_user_error`` turns into exit 2 (docs/design.md §4d). The report lists what it cannot
read as a problem and writes its page.

Then the same two inputs a careless user gives (a lone surrogate, a line nested 100,000 deep)
through each command as a user runs it: ``convert``, ``score`` and ``reward`` exit 2 with one line
and leave no temporary file; the report lists the file and writes its page; the evaluation
stage refuses before it makes its output folder."""

from __future__ import annotations

import inspect
import io
import json
import random
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from etagent import json_text, records
from etagent.errors import user_error_line
from etagent.records import JsonlAppender, Question, RecordError
from tests.support.commands import USER_ERROR, etagent, evaluate_args

DEEP = 100_000
VALID = {"id": "q1", "question": "What is 2 + 2?", "answer": ["4"], "source": "toy", "kind": "math"}


# --- what the fuzzer writes ----------------------------------------------------------------------


def random_text(rng: random.Random) -> str:
    """The inside of a JSON string (as JSON text): characters from every plane, escapes of lone
    surrogates, of a pair, of NUL, a byte-order mark, and now and then a quote or backslash that
    breaks the string."""
    pieces = []
    for _ in range(rng.randint(0, 8)):
        kind = rng.randrange(10)
        if kind == 0:
            pieces.append(rng.choice(["a", "Zorvak Telmin", " ", "é", "数学", "😀"]))
        elif kind == 1:
            pieces.append(chr(rng.randint(0x20, 0xD7FF)))  # below the surrogates ('"' and '\\' among them)
        elif kind == 2:
            pieces.append(chr(rng.randint(0xE000, 0x10FFFF)))  # above them, the astral planes included
        elif kind == 3:
            pieces.append(f"\\u{rng.randint(0xD800, 0xDBFF):04x}")  # a lone high surrogate
        elif kind == 4:
            pieces.append(f"\\u{rng.randint(0xDC00, 0xDFFF):04X}")  # a lone low one
        elif kind == 5:
            pieces.append("\\ud83d\\ude00")  # a pair: one character
        elif kind == 6:
            pieces.append("\\u0000")
        elif kind == 7:
            pieces.append("\ufeff")
        elif kind == 8:
            pieces.append("\\\\ud800")  # an escaped backslash, then text that looks like an escape
        else:
            pieces.append(rng.choice(['\\"', "\\n", "\\t", "\\u00e9"]))
    return "".join(pieces)


def nested(rng: random.Random, depth: int) -> str:
    """A JSON value ``depth`` arrays or objects deep, now and then left unclosed."""
    opening, closing = rng.choice([("[", "]"), ('{"k": ', "}"), ('[{"k": ', "}]")])
    close = depth if rng.random() < 0.8 else rng.randrange(depth + 1)
    return opening * depth + rng.choice(["1", '"x"', "[]", "{}"]) + closing * close


def random_depth(rng: random.Random) -> int:
    return DEEP if rng.random() < 0.2 else int(10 ** rng.uniform(0, 5))


def random_record(rng: random.Random) -> str:
    extra = f', "x": {nested(rng, random_depth(rng))}' if rng.random() < 0.3 else ""
    return (
        f'{{"id": "{random_text(rng)}", "question": "q {random_text(rng)}", "answer": ["{random_text(rng)}"], '
        f'"source": "s", "kind": "{rng.choice(["qa", "math", random_text(rng)])}"{extra}}}'
    )


# bytes that are not UTF-8 (a stray byte, an overlong NUL, an encoded surrogate, a character cut
# short), a raw NUL, and byte-order marks
BAD_BYTES = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x00", b"\xef\xbb\xbf", b"\xff\xfe", b"\n", b"\r\n"]


def mutated(rng: random.Random, data: bytes) -> bytes:
    """``data`` with a few bytes changed: bad bytes put in, random bytes changed, cut short."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        where = rng.randint(0, len(data))
        if kind == 0:
            data[where:where] = rng.choice(BAD_BYTES)
        elif kind == 1 and data:
            data[min(where, len(data) - 1)] = rng.randrange(256)
        elif kind == 2:
            del data[where:]
        else:
            data[0:0] = rng.choice([b"\xef\xbb\xbf", b"\xfe\xff", b""])
    return bytes(data)


def json_bytes(rng: random.Random) -> bytes:
    """A file a JSON reader may be given: random bytes, one value nested up to 100,000 deep, lines of
    records with random unicode (as JSON lines, or as one JSON array), and any of them mutated."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        data = (nested(rng, random_depth(rng)) + "\n").encode()
    else:
        lines = [random_record(rng) for _ in range(rng.randint(1, 3))]
        data = ("[" + ",\n".join(lines) + "]\n" if kind == 2 else "\n".join(lines) + "\n").encode()
    return mutated(rng, data) if rng.random() < 0.5 else data


# --- what a reader must do ---------------------------------------------------------------------


def writable(value) -> None:
    """What a reader returned can be written as UTF-8 JSON: no lone surrogate, no nesting that a
    writer's recursion cannot follow."""
    if isinstance(value, list) and value and isinstance(value[0], records.Record):
        value = [record.to_json() for record in value]
    json.dumps(value, ensure_ascii=False, default=repr).encode("utf-8")


def read_or_refuse(reader, target: Path, *, line_based: bool = False):
    """``reader(target)``'s result, checked writable, or None where it raised RecordError, checked to be
    one printable line naming a file at ``target`` (and its line, for a reader of JSON lines). Any
    other exception fails the test with its traceback: a crash."""
    try:
        value = reader(target)
    except RecordError as error:
        message = user_error_line(error)  # what exit_on_user_error prints after "error: ", then exit 2
        assert message == str(error) and "\n" not in message, message
        message.encode("utf-8")
        assert error.path.startswith(str(target)), (error.path, target)
        assert not line_based or error.line is not None, message
        return None
    writable(value)
    return value


def appender(path: Path) -> set:
    with JsonlAppender(path) as opened:  # opening reads the keys written, as a resumed stage does
        return opened.done


# Every reader of records.py, by the kind of file it reads, each named by its function (then how it
# is called). A reader of JSON lines names the line.
JSONL_READERS = {
    "iter_jsonl": lambda path: list(records.iter_jsonl(path)),
    "iter_jsonl partial_ok": lambda path: list(records.iter_jsonl(path, partial_ok=True)),
    "iter_json_objects": lambda path: list(records.iter_json_objects(io.BytesIO(path.read_bytes()), str(path))),
    "read_jsonl": lambda path: records.read_jsonl(path, Question),
    "read_records .jsonl": lambda path: records.read_records(path, Question),
    "JsonlAppender": appender,
}
JSON_FILE_READERS = {
    "decode_json": lambda path: records.decode_json(path.read_bytes(), path),
    "read_json_file": records.read_json_file,
    "read_manifest": records.read_manifest,
    "read_records .json": lambda path: records.read_records(path, Question),
}
PARQUET_READERS = {
    "read_parquet_rows": records.read_parquet_rows,
    "read_records .parquet": lambda path: records.read_records(path, Question),
}
DATASETS_READERS = {"read_datasets_folder": lambda path: rows_of(records.read_datasets_folder(path))}
FUZZED = {name.split()[0] for readers in (JSONL_READERS, JSON_FILE_READERS, PARQUET_READERS, DATASETS_READERS) for name in readers}


def rows_of(loaded) -> list[dict]:
    """Every row of a loaded ``datasets`` folder, as etagent.question_formats reads them."""
    import datasets

    parts = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
    return [row for part in parts for row in part.to_list()]


def test_every_reader_in_records_is_fuzzed():
    """A reader added to etagent/records.py or etagent/json_text.py (a public read_*, iter_* or
    decode_* function) fails this until it is in the fuzz tests' lists."""
    readers = {
        name
        for module in (records, json_text)
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and re.match(r"(read|iter|decode)_", name)
    }
    assert readers == FUZZED - {"JsonlAppender"}, f"fuzz these readers too: {sorted(readers - FUZZED)}"


# --- the fuzz tests ----------------------------------------------------------------------------


def test_json_readers_read_any_bytes_or_refuse_them_naming_the_file_and_line(tmp_path):
    rng = random.Random(62)
    outcomes = {"read": 0, "refused": 0}
    for case in range(400):
        data = json_bytes(rng)
        jsonl, whole = tmp_path / f"{case}.jsonl", tmp_path / f"{case}.json"
        for readers, path, line_based in ((JSONL_READERS, jsonl, True), (JSON_FILE_READERS, whole, False)):
            path.write_bytes(data)
            for name, reader in readers.items():  # the appender last: it cuts an unterminated last line
                try:
                    result = read_or_refuse(reader, path, line_based=line_based)
                except AssertionError as error:
                    raise AssertionError(f"{name} on case {case} ({data[:120]!r}...): {error}") from None
                outcomes["refused" if result is None else "read"] += 1
    assert min(outcomes.values()) > 100, outcomes  # both ends were reached, many times


def test_the_inputs_the_issue_names_are_refused_naming_file_line_and_field(tmp_path):
    """The lone surrogate is named with its field; the nesting with its line, in a whole file too;
    a surrogate pair (an emoji written with ensure_ascii) and a byte-order mark read."""
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "question": "\\ud83d\\ude00", "answer": ["4"]}\n{"id": "b", "answer": ["x\\udc00"]}\n')
    with pytest.raises(RecordError, match=r"q.jsonl:2: field 'answer\[0\]': holds a lone surrogate \\udc00"):
        list(records.iter_jsonl(path))
    assert next(records.iter_jsonl(path))[1]["question"] == "😀"
    whole = tmp_path / "q.json"
    whole.write_text('[\n {"id": "a"},\n {"id": "b", "x": ' + "[" * DEEP + "]" * DEEP + "}\n]")
    with pytest.raises(RecordError, match=rf"q.json:3: field '\(file\)': nested deeper than {json_text.MAX_NESTING} levels"):
        records.read_json_file(whole)
    whole.write_text('{"config": {"model": "m\\ud800"}}')
    with pytest.raises(RecordError, match=r"q.json:1: field 'config.model': holds a lone surrogate .*--restart"):
        records.read_manifest(whole)


def surrogate_free(rng: random.Random) -> str:
    """Random unicode as a str pyarrow can write (it refuses a lone surrogate itself)."""
    text = random_text(rng)
    try:
        value = json.loads(f'"{text}"')
        value.encode("utf-8")
        return value
    except ValueError:
        return "plain"


def test_parquet_readers_read_any_bytes_or_refuse_them_naming_the_file(tmp_path):
    rng = random.Random(26)
    outcomes = {"read": 0, "refused": 0}
    for case in range(160):
        folder = tmp_path / str(case)
        folder.mkdir()
        rows = [{**VALID, "id": f"q{i}", "question": f"MARKER01 {surrogate_free(rng)}"} for i in range(3)]
        depth = rng.choice([1, 10, 49, 50, 200])  # pyarrow reads a schema 100 levels deep (49 lists), no deeper
        value, nested_type = 1, pa.int64()
        for _ in range(depth):
            value, nested_type = [value], pa.list_(nested_type)
        table = pa.Table.from_pylist(rows).append_column("nested", pa.array([value] * 3, type=nested_type))
        path = folder / "part-0.parquet"
        pq.write_table(table, path, compression=rng.choice(["none", "snappy"]), use_dictionary=rng.random() < 0.5)
        data = path.read_bytes()
        kind = rng.randrange(4)
        if kind == 0:  # the strings' bytes, in the data pages and the statistics, made not UTF-8
            data = data.replace(b"MARKER01", b"\xff\xfe\xed\xa0\x80ABC")
        elif kind == 1:
            data = mutated(rng, data)
        elif kind == 2:
            data = rng.randbytes(rng.randint(0, 400))
        path.write_bytes(data)
        if rng.random() < 0.5:  # a second file of the folder, with other columns or a type that clashes
            other = {"id": 7} if rng.random() < 0.5 else {"id": "q9", "kind": "qa", "extra": [1.5]}
            pq.write_table(pa.Table.from_pylist([{**VALID, **other}]), folder / "part-1.parquet")
        for name, reader in PARQUET_READERS.items():
            for target in (path, folder):
                if target.is_dir() and name != "read_parquet_rows":
                    continue
                try:
                    result = read_or_refuse(reader, target)
                except AssertionError as error:
                    raise AssertionError(f"{name} on case {case} ({target}): {error}") from None
                outcomes["refused" if result is None else "read"] += 1
    assert min(outcomes.values()) > 20, outcomes


def test_a_folder_of_parquet_files_reads_the_union_of_their_columns_or_names_the_file_that_clashes(tmp_path):
    """verl-style parts written by pyarrow: a later file's extra column is kept (null in the rows
    of the files without it); a column whose type differs is refused naming the file and column;
    files not ending in .parquet are not read."""
    pq.write_table(pa.Table.from_pylist([VALID]), tmp_path / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist([{**VALID, "id": "q2", "level": 3}]), tmp_path / "train-00001-of-00002.parquet")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not data")
    rows = records.read_parquet_rows(tmp_path)
    assert [(row["id"], row["level"]) for row in rows] == [("q1", None), ("q2", 3)]
    pq.write_table(pa.Table.from_pylist([{**VALID, "id": "q3", "level": "hard"}]), tmp_path / "train-00002-of-00002.parquet")
    with pytest.raises(RecordError, match=r"train-00002-of-00002.parquet: field 'level': is string here but int64 in train-00001"):
        records.read_parquet_rows(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecordError, match="holds no file ending in .parquet"):
        records.read_parquet_rows(empty)


def test_datasets_folders_read_any_bytes_or_refuse_them_naming_the_file(tmp_path):
    """Folders ``datasets``' own ``save_to_disk`` wrote (one dataset, and a dict of splits), one of
    their files changed: the rows read, or a RecordError names the file or the folder."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rng = random.Random(7)
    single, splits = tmp_path / "single", tmp_path / "splits"
    datasets.Dataset.from_list([VALID, {**VALID, "id": "q2"}]).save_to_disk(str(single))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([VALID]), "test": datasets.Dataset.from_list([VALID])}).save_to_disk(
        str(splits)
    )
    outcomes = {"read": 0, "refused": 0}
    for case in range(70):
        base = rng.choice([single, splits])
        folder = tmp_path / f"case{case}"
        shutil.copytree(base, folder)
        victim = rng.choice(sorted(p for p in folder.rglob("*") if p.is_file()))
        kind = rng.randrange(6)
        if kind == 0:
            victim.unlink()
        elif kind == 4:  # a string in the Arrow data made not UTF-8: the column is named
            victim = next(folder.rglob("*.arrow"))
            victim.write_bytes(victim.read_bytes().replace(VALID["question"].encode(), b"\xffhat\xed\xa0\x80 2 + 2?"))
        elif kind == 5:  # as datasets wrote it
            pass
        elif kind == 1 and victim.suffix == ".json":
            victim.write_bytes(json_bytes(rng))
        elif kind == 2:
            victim.write_bytes(rng.randbytes(rng.randint(0, 300)))
        else:
            victim.write_bytes(mutated(rng, victim.read_bytes()))
        try:
            result = read_or_refuse(DATASETS_READERS["read_datasets_folder"], folder)
        except AssertionError as error:
            raise AssertionError(f"case {case}, {victim.relative_to(folder)} changed: {error}") from None
        outcomes["refused" if result is None else "read"] += 1
    assert min(outcomes.values()) > 5, outcomes


def test_the_report_lists_any_file_it_cannot_read_and_writes_its_page(tmp_path):
    """An evaluation's folder in a run, one of its files fuzzed: the report never stops, lists
    the file, and writes its page whole (no temporary file left)."""
    from etagent.report.run import ReportSettings, write_report

    rng = random.Random(3)
    listed = 0
    for case in range(40):
        run = tmp_path / f"run{case}"
        folder = run / "eval"
        (folder / "toy").mkdir(parents=True)
        manifest = {"stage": "evaluation", "status": "complete", "config": {}, "started_at": "2026-01-01T00:00:00"}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        (folder / "summary.json").write_text(json.dumps({"run": "r", "datasets": {"toy": {"correctness": 0.5}}}))
        group = {"id": "q1", "question": "q", "answer": ["4"], "trajectories": [{"id": "q1/0", "text": "<answer>4</answer>"}]}
        (folder / "toy" / "trajectories.jsonl").write_text(json.dumps(group) + "\n")
        victim = rng.choice([folder / "manifest.json", folder / "summary.json", folder / "toy" / "trajectories.jsonl"])
        victim.write_bytes(json_bytes(rng))
        page = tmp_path / f"page{case}"
        page.mkdir()
        write_report(run, ReportSettings(max_trajectories=10), page / "report.html")
        assert [p.name for p in page.iterdir()] == ["report.html"], case
        html = (page / "report.html").read_text()
        assert "<title>etagent report: " in html[:400]
        listed += str(victim) in html
    assert listed > 10, listed  # most of the fuzzed files were listed as problems


# --- the commands, as a user runs them -------------------------------------------------------------

COMMAND_LINES = {
    "convert": VALID,
    "score": {"prediction": "4", "answers": ["4"], "kind": "math"},
    "reward": {
        "data_source": "math_effi_rl",
        "ground_truth": ["4"],
        "responses": ["<answer>4</answer>"],
        "lengths": [3],
        "sigma_tool": 1.0,
        "sigma_length": 1.0,
    },
}


def bad_line(good: dict, how: str) -> bytes:
    """``good`` as one JSON line, with a lone surrogate in its first string value, or a value
    nested 100,000 deep."""
    if how == "surrogate":
        key = next(key for key, value in good.items() if isinstance(value, str))
        return json.dumps({**good, key: good[key] + "\ud800"}).encode() + b"\n"
    return json.dumps(good)[:-1].encode() + b', "x": ' + b"[" * DEEP + b"]" * DEEP + b"}\n"


@pytest.mark.parametrize("how", ["surrogate", "deep"])
@pytest.mark.parametrize("command", sorted(COMMAND_LINES))
def test_each_command_refuses_a_lone_surrogate_and_deep_nesting_in_one_line(tmp_path, command, how):
    data = tmp_path / "in.jsonl"
    data.write_bytes(json.dumps(COMMAND_LINES[command]).encode() + b"\n" + bad_line(COMMAND_LINES[command], how))
    out = tmp_path / "out"
    out.mkdir()
    result = etagent(command, str(data), *([str(out / "q.jsonl")] if command == "convert" else []))
    assert result.returncode == USER_ERROR, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data}:2: "), result.stderr[-2000:]
    assert ("lone surrogate \\ud800" if how == "surrogate" else "nested deeper than") in lines[0]
    assert list(out.iterdir()) == []  # convert wrote nothing, no .tmp either


@pytest.mark.parametrize("how", ["surrogate", "deep"])
def test_the_report_command_lists_a_lone_surrogate_and_deep_nesting(tmp_path, how):
    run = tmp_path / "run" / "eval"
    run.mkdir(parents=True)
    manifest = {"stage": "evaluation", "status": "complete", "config": {}}
    (run / "manifest.json").write_bytes(bad_line(manifest, how))
    page = tmp_path / "page"
    page.mkdir()
    result = etagent("report", str(tmp_path / "run"), "--out", str(page / "report.html"))
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    assert [p.name for p in page.iterdir()] == ["report.html"]
    text = (page / "report.html").read_text()
    assert f"{run / 'manifest.json'}: not valid JSON" in text
    assert ("lone surrogate \\ud800" if how == "surrogate" else "nested deeper than") in text


def test_a_stage_refuses_a_lone_surrogate_and_deep_nesting_before_it_makes_its_folder(toy, tmp_path, capsys):
    """The evaluation stage (its questions are read by the reader every stage uses), in process."""
    from etagent.evaluation.run import main

    for how in ("surrogate", "deep"):
        questions, out = tmp_path / f"{how}.jsonl", tmp_path / f"out-{how}"
        questions.write_bytes(json.dumps(VALID).encode() + b"\n" + bad_line({**VALID, "id": "q2"}, how))
        with pytest.raises(SystemExit) as exit:
            main(evaluate_args(toy / "model", questions, out)[1:])
        assert exit.value.code == USER_ERROR
        stderr = capsys.readouterr().err.strip().splitlines()
        assert stderr[-1].startswith(f"error: {questions}:2: "), stderr[-3:]
        assert not out.exists()

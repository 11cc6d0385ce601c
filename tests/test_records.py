"""Artifact records: round trips, clear errors naming file/line/field, the resumable appender
under kill -9 (a real subprocess), parquet in verl's schema, LLaMA-Factory export, manifests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest

from etagent import protocol
from etagent.question_formats import read_questions
from etagent.records import (
    JsonlAppender,
    Question,
    RecordError,
    RLRow,
    SFTExample,
    Trajectory,
    TrajectoryGroup,
    export_llamafactory,
    input_identity,
    iter_jsonl,
    read_jsonl,
    read_records,
    write_jsonl,
    write_manifest,
    write_rl_parquet,
)


def q(i, **kw):
    return Question(id=f"q{i}", question=f"question {i}?", answer=[str(i)], source="toy_search", kind="qa", **kw)


# --- questions ----------------------------------------------------------------------------------


def test_gold_answers_are_coerced_to_lists_of_strings():
    assert Question(id=1, question="x", answer=5, source="aime25", kind="math").answer == ["5"]
    assert Question(id="a", question="x", answer=True, source="csbench", kind="qa").answer == ["True"]
    assert Question(id="a", question="x", answer=["a", 2], source="s", kind="qa").answer == ["a", "2"]
    with pytest.raises(ValueError):
        Question(id="a", question="x", answer=[], source="s", kind="qa")


def test_questions_round_trip_in_every_format_keeping_unknown_fields(tmp_path):
    questions = [q(i, level=i % 3) for i in range(5)]
    write_jsonl(tmp_path / "q.jsonl", questions)
    (tmp_path / "q.json").write_text(json.dumps([x.to_json() for x in questions]))
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([x.to_json() for x in questions]), tmp_path / "q.parquet")
    for name in ("q.jsonl", "q.json", "q.parquet"):
        back = read_questions(tmp_path / name)
        assert [x.to_json() for x in back] == [x.to_json() for x in questions]
        assert back[2].level == 2  # unknown field kept


def test_missing_field_error_names_file_line_and_field(tmp_path):
    path = tmp_path / "questions.jsonl"
    rows = [q(0).to_json(), q(1).to_json(), {"id": "q2", "question": "x?", "source": "s", "kind": "qa"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecordError) as err:
        read_questions(path)
    assert str(err.value) == f"{path}:3: field 'answer': missing"
    assert "\n" not in str(err.value)


def test_wrong_types_and_nested_fields_are_named(tmp_path):
    path = tmp_path / "t.jsonl"
    group = TrajectoryGroup.for_question(q(0), [Trajectory(id="q0/0", text="x")]).to_json()
    group["trajectories"][0]["tool_calls"] = [{"tool": "python", "input": "1", "output": "1"}]
    path.write_text(json.dumps(group) + "\n")
    with pytest.raises(RecordError) as err:
        read_jsonl(path, TrajectoryGroup)
    assert str(err.value) == f"{path}:1: field 'trajectories.0.tool_calls.0.ok': missing"


def test_invalid_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(q(0).to_json()) + "\n{not json\n" + json.dumps(q(1).to_json()) + "\n")
    with pytest.raises(RecordError, match=r"q.jsonl:2: field '\(line\)': not valid JSON"):
        read_questions(path)
    path.write_text(json.dumps(q(0).to_json()) + "\n" + json.dumps(q(0).to_json()) + "\n")
    with pytest.raises(RecordError, match=r"q.jsonl:2: field 'id': duplicate id 'q0'"):
        read_questions(path)
    with pytest.raises(RecordError, match=r"q.json: field '\(file\)': expected a JSON array"):
        (tmp_path / "q.json").write_text("{}")
        read_questions(tmp_path / "q.json")


def test_parquet_rows_are_named_in_errors(tmp_path):
    import pyarrow as pa

    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "question": "x", "answer": ["1"], "source": "s", "kind": "maths"}]), tmp_path / "q.parquet"
    )
    with pytest.raises(RecordError, match=r"q.parquet:1: field 'kind'"):
        read_questions(tmp_path / "q.parquet")


def test_incomplete_last_line_is_refused_unless_partial_input_is_allowed(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(q(0).to_json()) + "\n" + json.dumps(q(1).to_json())[:20])
    with pytest.raises(RecordError, match=r"q.jsonl:2: field '\(line\)': cut off"):
        read_questions(path)
    assert [x.id for x in read_questions(path, partial_ok=True)] == ["q0"]


def test_an_empty_questions_file_or_question_is_refused(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n")
    with pytest.raises(RecordError, match="no questions in the file"):
        read_questions(path)
    assert read_questions(path, partial_ok=True) == []
    path.write_text(json.dumps({**q(0).to_json(), "question": "  "}) + "\n")
    with pytest.raises(RecordError, match=r"q.jsonl:1: field 'question': Value error, empty question"):
        read_questions(path)


# --- trajectories -------------------------------------------------------------------------------


def test_trajectory_token_fields_must_align():
    Trajectory(id="t", text="x", response_ids=[1, 2], response_mask=[1, 0], logprobs=[-0.1, 0.0])
    with pytest.raises(ValueError, match="response_mask has 1 entries but response_ids has 2"):
        Trajectory(id="t", text="x", response_ids=[1, 2], response_mask=[1])


def test_trajectory_groups_round_trip(tmp_path):
    t = Trajectory(
        id="q0/0",
        text="<think>a</think>",
        tool_calls=[{"tool": "search", "input": "a", "output": "b", "ok": True, "seconds": 0.1}],
        response_ids=[5, 6],
        response_mask=[1, 0],
        provenance={"stage": "direct_rollout", "parent": None},
    )
    write_jsonl(tmp_path / "t.jsonl", [TrajectoryGroup.for_question(q(0), [t])])
    [back] = read_jsonl(tmp_path / "t.jsonl", TrajectoryGroup)
    assert back.trajectories[0] == t and back.answer == ["0"]


# --- SFT data -----------------------------------------------------------------------------------


TRAJECTORY = (
    "<think>look up</think><search>Zorvak</search>"
    + protocol.format_result("Zorvak was born in 1873.")
    + "<think>so</think><answer>\\boxed{1873}</answer>"
)


def test_sft_example_masks_exactly_the_tool_results():
    example = SFTExample.from_trajectory("e0", "When was Zorvak born?", TRAJECTORY)
    assert example.response == TRAJECTORY
    assert [(s.train, s.text.startswith("<result>")) for s in example.segments] == [(True, False), (False, True), (True, False)]
    assert example.system == protocol.SYSTEM_PROMPT and example.question == "When was Zorvak born?"
    with pytest.raises(ValueError, match="segments do not concatenate"):
        SFTExample(id="x", messages=example.messages, segments=example.segments[:1])


def test_export_llamafactory_puts_the_prompt_in_the_system_column(tmp_path):
    example = SFTExample.from_trajectory("e0", "When was Zorvak born?", TRAJECTORY)
    path = export_llamafactory([example], tmp_path, name="toy", fmt="sharegpt")
    [row] = json.loads(path.read_text())
    assert row["system"] == protocol.SYSTEM_PROMPT
    assert row["conversations"] == [{"from": "human", "value": "When was Zorvak born?"}, {"from": "gpt", "value": TRAJECTORY}]
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info["toy"]["formatting"] == "sharegpt" and info["toy"]["columns"]["system"] == "system"
    export_llamafactory([example], tmp_path, name="toy", fmt="alpaca")
    [row] = json.loads((tmp_path / "toy.json").read_text())
    assert row == {"instruction": "When was Zorvak born?", "input": "", "output": TRAJECTORY, "system": protocol.SYSTEM_PROMPT}


# --- RL parquet ---------------------------------------------------------------------------------


def test_rl_parquet_has_verls_schema(tmp_path):
    questions = [q(0), Question(id="m1", question="1+1?", answer=2, source="dapo", kind="math")]
    path = write_rl_parquet([RLRow.for_question(x, i, "train") for i, x in enumerate(questions)], tmp_path / "rl.parquet")
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "metadata"]
    rows = table.to_pylist()
    assert rows[0]["metadata"] is None  # the paper's file has the column, always null
    assert rows[0]["data_source"] == "qa_effi_rl" and rows[1]["data_source"] == "math_effi_rl"
    assert rows[1]["prompt"] == protocol.prompt_messages("1+1?")
    assert rows[1]["reward_model"] == {"ground_truth": ["2"], "style": "rule"}
    assert rows[1]["extra_info"] == {"index": 1, "need_tools_kwargs": False, "question": "1+1?", "split": "train", "question_id": "m1"}
    back = read_records(path, RLRow)
    assert back[1].reward_model.ground_truth == ["2"]


# --- the resumable appender ---------------------------------------------------------------------


def test_appender_skips_done_ids_and_refuses_duplicates(tmp_path):
    path = tmp_path / "out.jsonl"
    with JsonlAppender(path) as w:
        w.write(q(0))
        w.write({"id": "q1", "x": 1})
    with JsonlAppender(path) as w:
        assert w.done == {"q0", "q1"}
        with pytest.raises(ValueError, match="already written"):
            w.write(q(0))
        w.write(q(2))
    assert [data["id"] for _, data in iter_jsonl(path)] == ["q0", "q1", "q2"]


def test_appender_cuts_an_unterminated_record(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "q0"}\n{"id": "q1", "text": "half a rec')
    with JsonlAppender(path) as w:
        assert w.done == {"q0"}
        w.write({"id": "q1", "text": "whole"})
    assert path.read_text() == '{"id": "q0"}\n{"id": "q1", "text": "whole"}\n'


def test_appender_rejects_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "q0"}\ngarbage\n{"id": "q2"}\n')
    with pytest.raises(RecordError, match="out.jsonl:2"):
        JsonlAppender(path)


WRITER = textwrap.dedent(
    """
    import sys
    from etagent.records import JsonlAppender
    path, n = sys.argv[1], int(sys.argv[2])
    with JsonlAppender(path) as w:
        for i in range(n):
            key = f"q{i:05d}"
            if key in w.done:
                continue
            # large records, so that a kill often lands in the middle of a write
            w.write({"id": key, "payload": "x" * (200_000 + i)})
            print(key, flush=True)
    """
)


@pytest.mark.parametrize("kill_after", [3, 17, 40])
def test_kill_9_mid_write_loses_no_completed_record_and_resumes_without_duplicates(tmp_path, kill_after):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "out.jsonl"
    n = 60
    child = subprocess.Popen([sys.executable, str(script), str(path), str(n)], stdout=subprocess.PIPE, text=True)
    reported = []
    for line in child.stdout:
        reported.append(line.strip())
        if len(reported) == kill_after:
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL
    # every record the writer reported as written survived; the file may end mid-record
    survived = [data["id"] for _, data in iter_jsonl(path, partial_ok=True)]
    assert set(reported) <= set(survived)
    assert len(survived) == len(set(survived))
    # resume: finishes the rest, no duplicates, nothing lost
    done = subprocess.run([sys.executable, str(script), str(path), str(n)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    final = [data for _, data in iter_jsonl(path)]
    assert [d["id"] for d in final] == [f"q{i:05d}" for i in range(n)]
    assert all(len(d["payload"]) == 200_000 + int(d["id"][1:]) for d in final)
    assert path.read_bytes().endswith(b"\n")


# --- manifests ----------------------------------------------------------------------------------


def test_a_folders_identity_is_its_data_not_its_runs_records(tmp_path):
    """A stage that reran on its finished folder rewrote its manifest (times, status) and left its
    data as it was; a later stage that read the folder must find the same input (the demo run
    twice: the radar refused the evaluation it had measured). A data file that changes, or a
    manifest.json that is the user's own data, changes it."""
    folder = tmp_path / "eval"
    write_jsonl(folder / "toy" / "scored.jsonl", [q(0)])
    write_manifest(folder / "toy", stage="evaluation/toy", config={}, started_at=1.0)
    write_manifest(folder, stage="evaluation", config={}, started_at=1.0)
    (folder / ".lock").write_text("123")
    before = input_identity("runs[0]", folder)
    write_manifest(folder, stage="evaluation", config={}, started_at=2.0, status="complete")
    write_manifest(folder / "toy", stage="evaluation/toy", config={}, started_at=2.0)
    (folder / ".lock").write_text("456")
    assert input_identity("runs[0]", folder) == before
    write_jsonl(folder / "toy" / "scored.jsonl", [q(1)])
    assert input_identity("runs[0]", folder)["sha256"] != before["sha256"]
    theirs = tmp_path / "data"
    theirs.mkdir()
    (theirs / "manifest.json").write_text('{"files": ["a"]}')
    first = input_identity("data", theirs)
    (theirs / "manifest.json").write_text('{"files": ["b"]}')
    assert input_identity("data", theirs)["sha256"] != first["sha256"]


def test_manifest_records_inputs_counts_and_revision(tmp_path):
    data = tmp_path / "in.jsonl"
    write_jsonl(data, [q(0)])
    start = time.time()
    identity = input_identity("questions", data)
    path = write_manifest(
        tmp_path / "out",
        stage="demo",
        config={"a": 1},
        inputs=[identity],
        counts={"rows": 1},
        seed=3,
        started_at=start,
        metrics={"acc": 0.5},
    )
    manifest = json.loads(path.read_text())
    import hashlib

    assert manifest["inputs"] == [
        {"key": "questions", "path": str(data), "bytes": data.stat().st_size, "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
    ]
    assert manifest["stage"] == "demo" and manifest["config"] == {"a": 1} and manifest["seed"] == 3
    assert manifest["counts"] == {"rows": 1} and manifest["metrics"] == {"acc": 0.5} and manifest["status"] == "complete"
    assert set(manifest["git"]) == {"commit", "dirty"}
    assert manifest["seconds"] >= 0
    # a final manifest keeps the inputs its run's claim recorded
    again = write_manifest(tmp_path / "out", stage="demo", config={"a": 1}, started_at=start)
    assert json.loads(again.read_text())["inputs"] == manifest["inputs"]


def test_a_large_file_is_identified_by_its_size_and_sampled_chunks(tmp_path, monkeypatch):
    """Over WHOLE_FILE_BYTES a file is hashed by its size and chunks spread over it, so a resume of
    a large model's run does not read it all; a change in any sampled chunk or the size shows."""
    import etagent.records as records

    monkeypatch.setattr(records, "WHOLE_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(records, "CHUNK_BYTES", 1 << 10)
    big = tmp_path / "weights.bin"
    data = bytearray(os.urandom(3 << 20))
    big.write_bytes(bytes(data))
    first = records.sha256_file(big)
    assert records.sha256_file(big) == first  # the same bytes, the same identity
    data[0] ^= 0xFF  # the first chunk is always sampled
    big.write_bytes(bytes(data))
    assert records.sha256_file(big) != first
    big.write_bytes(bytes(data) + b"more")
    assert records.sha256_file(big) != first

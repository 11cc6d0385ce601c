"""Questions in the formats researchers already have (etagent/question_formats.py), read by every
stage that takes questions: each file made in the test the way its project documents it
(FlashRAG's QA JSONL, Search-R1's and verl's preprocessing scripts through ``datasets.map``, a TRL
prompt dataset saved with ``save_to_disk``), then read by the reader, ``etagent convert``,
evaluation, direct rollout and RL's data loading."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from etagent import protocol
from etagent.config import load_config
from etagent.direct_rollout.run import run as run_direct_rollout
from etagent.evaluation.run import run as run_evaluation
from etagent.question_formats import QuestionFormat, read_question_rows, read_questions
from etagent.records import Question, RecordError, RLRow, read_jsonl, write_rl_parquet
from etagent.rl.rollout import read_prompts
from tests.support.commands import TOKEN

# Search-R1's prompt template (scripts/data_process/nq_search.py, template_type base), as its
# files carry it in the user turn
SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search as "
    "many times as your want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
# verl's examples/data_preprocess/gsm8k.py appends this to the question in the user turn
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def flashrag_rows(questions: list[Question]) -> list[dict]:
    return [{"id": q.id, "question": q.question, "golden_answers": q.answer, "metadata": {"kind": q.kind}} for q in questions]


def write_formats(questions: list[Question], out: Path) -> dict[str, Path]:
    """The questions in every format, each made as its project's documentation makes it."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    paths["flashrag"] = out / "flashrag.jsonl"
    paths["flashrag"].write_text("".join(json.dumps(row) + "\n" for row in flashrag_rows(questions)))

    def search_r1(example, index):  # nq_search.py's process_fn: FlashRAG's columns kept beside verl's
        return {
            "data_source": "nq",
            "prompt": [{"role": "user", "content": SEARCH_R1_TEMPLATE.format(question=example["question"].strip())}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": example["golden_answers"]}},
            "extra_info": {"split": "train", "index": index},
        }

    flashrag = datasets.Dataset.from_list(flashrag_rows(questions))
    search = flashrag.map(search_r1, with_indices=True)
    paths["search_r1"] = out / "search_r1.parquet"
    search.to_parquet(str(paths["search_r1"]))
    paths["search_r1_bare"] = out / "search_r1_bare.parquet"  # only verl's columns: the question read from the template
    search.remove_columns(["id", "question", "golden_answers", "metadata"]).to_parquet(str(paths["search_r1_bare"]))
    paths["search_r1_jsonl"] = out / "search_r1.jsonl"
    search.to_json(str(paths["search_r1_jsonl"]))

    def verl_gsm8k(example, index):  # verl's gsm8k.py process_fn: question and answer popped
        question, answer = example.pop("question"), example.pop("answer")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + VERL_GSM8K_INSTRUCTION}],
            "ability": "math" if example["kind"] == "math" else "qa",
            "reward_model": {"style": "rule", "ground_truth": answer[0]},
            "extra_info": {"split": "train", "index": index, "answer": answer[0], "question": question},
        }

    raw = datasets.Dataset.from_list([{"question": q.question, "answer": q.answer, "kind": q.kind} for q in questions])
    paths["verl"] = out / "verl.parquet"
    raw.map(verl_gsm8k, with_indices=True, remove_columns=["kind"]).to_parquet(str(paths["verl"]))

    trl = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q.question}], "solution": q.answer[0], "kind": q.kind} for q in questions]
    )
    paths["trl"] = out / "trl_dataset"
    trl.save_to_disk(str(paths["trl"]))
    paths["datasets_dict"] = out / "datasets_dict"
    datasets.DatasetDict(train=trl.select(range(1)), test=trl).save_to_disk(str(paths["datasets_dict"]))
    paths["ours"] = out / "ours.jsonl"
    paths["ours"].write_text("".join(json.dumps({"question": q.question, "answer": q.answer}) + "\n" for q in questions))
    return paths


# where a format keeps only the first gold answer, or no kind
FIRST_ANSWER_ONLY = {"verl", "trl", "datasets_dict"}
SETTINGS = {"datasets_dict": QuestionFormat(split="test")}


@pytest.fixture(scope="module")
def toy_questions(toy) -> list[Question]:
    questions = read_questions(toy / "questions" / "test.jsonl")
    by_kind = [q for q in questions if q.kind == "math"][:3] + [q for q in questions if q.kind == "qa"][:3]
    return by_kind


@pytest.fixture(scope="module")
def formats(toy_questions, tmp_path_factory) -> dict[str, Path]:
    return write_formats(toy_questions, tmp_path_factory.mktemp("formats"))


def test_every_format_reads_as_the_questions_it_was_made_from(formats, toy_questions):
    for name, path in formats.items():
        rows, mapping = read_question_rows(path, SETTINGS.get(name, QuestionFormat()))
        assert [r.question.question for r in rows] == [q.question for q in toy_questions], name
        expected = [q.answer[:1] if name in FIRST_ANSWER_ONLY else q.answer for q in toy_questions]
        assert [r.question.answer for r in rows] == expected, name
        assert len({r.question.id for r in rows}) == len(rows)
        assert mapping.rows == len(rows) and "question <- " in mapping.describe()
        kinds = [r.question.kind for r in rows]
        if name in ("verl", "trl", "datasets_dict"):  # verl's ability column, or a kind column, says it
            assert kinds == [q.kind for q in toy_questions], name
        elif name.startswith("search_r1"):  # Search-R1's ability is fact-reasoning: QA, scored by F1
            assert set(kinds) == {"qa"} and "'fact-reasoning' read as qa" in mapping.describe(), name
        else:  # no kind in the row: qa, and the mapping says it was the default
            assert set(kinds) == {"qa"} and "kind <- the default (qa" in mapping.describe(), name
    # a column of the user's own: the fields mapping reads it, dotted for a nested one
    rows, mapping = read_question_rows(formats["flashrag"], QuestionFormat(fields={"kind": "metadata.kind"}))
    assert [r.question.kind for r in rows] == [q.kind for q in toy_questions]
    assert "kind <- metadata.kind" in mapping.describe()
    rows, _ = read_question_rows(formats["flashrag"], QuestionFormat(kind="math", source="mine"))
    assert {(r.question.kind, r.question.source) for r in rows} == {("math", "mine")}


def test_missing_fields_name_the_file_the_row_and_the_field(tmp_path):
    """Every required field taken out of every row format: an error naming file, row and field,
    never a traceback or a question without an answer."""
    rng = random.Random(0)
    base = {
        "flashrag": {"id": "a", "question": "q?", "golden_answers": ["x"]},
        "ours": {"id": "a", "question": "q?", "answer": ["x"], "kind": "qa", "source": "s"},
        "trl": {"prompt": [{"role": "user", "content": "q?"}], "solution": "x"},
        "verl": {
            "data_source": "d",
            "prompt": [{"role": "user", "content": "q?"}],
            "ability": "qa",
            "reward_model": {"ground_truth": "x"},
            "extra_info": {"index": 0},
        },
    }
    removable = {
        "flashrag": ("question", "golden_answers"),
        "ours": ("question", "answer"),
        "trl": ("solution",),
        "verl": ("reward_model",),
    }
    for name, row in base.items():
        for column in removable[name]:
            good = [dict(row, id=f"r{i}") if "id" in row else dict(row) for i in range(3)]
            if name == "verl":
                good = [dict(row, extra_info={"index": i}) for i in range(3)]
            bad_at = rng.randrange(3)
            del good[bad_at][column]
            if name == "verl":  # the question read from the prompt; no answer column left
                good[bad_at]["reward_model"] = {"style": "rule"}
            path = tmp_path / f"{name}-{column}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in good))
            with pytest.raises(RecordError) as error:
                read_question_rows(path)
            assert error.value.path == str(path) and error.value.line == bad_at + 1, (name, column, str(error.value))
            assert error.value.field in ("question", "answer"), str(error.value)
    with pytest.raises(Exception, match="not a question field"):
        read_question_rows(tmp_path / "flashrag-question.jsonl", QuestionFormat(fields={"golden": "x"}))


def test_rl_reads_every_format_and_refuses_a_foreign_prompt_unless_rerendered(formats, toy_questions, tmp_path):
    ours = tmp_path / "rl.parquet"
    write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(toy_questions)], ours)
    assert [p.question.question for p in read_prompts(ours)] == [q.question for q in toy_questions]
    for name, path in formats.items():
        settings = SETTINGS.get(name, QuestionFormat())
        has_prompt = name not in ("flashrag", "ours")
        if has_prompt:
            with pytest.raises(RecordError, match="data.rerender_prompts=true"):
                read_prompts(path, question_format=settings)
        prompts = read_prompts(path, question_format=settings, rerender_prompts=True)
        assert [p.question.question for p in prompts] == [q.question for q in toy_questions], name
        assert len({p.index for p in prompts}) == len(prompts)
        assert {p.data_source for p in prompts} <= {"math_effi_rl", "qa_effi_rl"}
    verl = read_prompts(formats["verl"], rerender_prompts=True)
    assert [p.data_source for p in verl] == [f"{q.kind}_effi_rl" for q in toy_questions]  # the ability decides the scoring
    # the instruction verl's script put into the user turn is not trained on: the raw question is
    assert all(VERL_GSM8K_INSTRUCTION not in p.question.question for p in verl)
    # a system prompt of another project's, or the protocol's with other text, is refused the same way
    other = tmp_path / "other_system.parquet"
    rows = [RLRow.for_question(q, i, "train", system_prompt="You are helpful.") for i, q in enumerate(toy_questions)]
    write_rl_parquet(rows, other)
    with pytest.raises(RecordError, match="not the protocol's"):
        read_prompts(other)
    assert [p.question.question for p in read_prompts(other, rerender_prompts=True)] == [q.question for q in toy_questions]
    assert protocol.SYSTEM_PROMPT not in {p.question.question for p in read_prompts(other, rerender_prompts=True)}


def test_convert_writes_our_schema_and_says_what_it_mapped(formats, toy_questions, tmp_path):
    for name in ("search_r1", "verl", "datasets_dict"):
        out = tmp_path / f"{name}.jsonl"
        extra = ["--split", "test"] if name == "datasets_dict" else []
        done = subprocess.run(
            [sys.executable, "-m", "etagent.launcher", "convert", str(formats[name]), str(out), "--field", "kind=kind", *extra]
            if name == "datasets_dict"
            else [sys.executable, "-m", "etagent.launcher", "convert", str(formats[name]), str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        written = read_jsonl(out, Question)
        assert [q.question for q in written] == [q.question for q in toy_questions]
        assert f"wrote {len(toy_questions)} questions" in done.stdout and "question <- " in done.stdout and "answer <- " in done.stdout
        assert read_questions(out) == written  # our own schema reads back as it is
    # the output never overwrites the source
    source = formats["flashrag"]
    before = source.read_bytes()
    refused = subprocess.run(
        [sys.executable, "-m", "etagent.launcher", "convert", str(source), str(source)], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "never overwrite" in refused.stderr
    assert source.read_bytes() == before


def tiny_agent(toy: Path, server: str) -> list[str]:
    """The untrained toy model with short answers: these tests check what is read, not how well."""
    return [
        f"model={toy / 'model'}",
        f"tools.search.local.url={server}",
        "tools.search.local.token_env=RETRIEVER_TOKEN",
        "agent.max_response_tokens=48",
        "agent.max_segment_tokens=48",
    ]


def test_evaluation_and_direct_rollout_run_on_every_format(formats, toy_questions, toy, server, tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    names = ["flashrag", "search_r1", "verl", "trl", "datasets_dict"]
    overrides = [
        *tiny_agent(toy, server),
        f"datasets=[{','.join(names)}]",
        *[f"+files.{name}={formats[name]}" for name in names],
        "+kinds.verl=math",  # verl's rows say it themselves (ability); a kind given for a dataset wins
        "question_format.split=test",
        f"out_dir={tmp_path / 'eval'}",
        "n=1",
        "limit=4",
        "batch_questions=4",
        "bootstrap_rounds=10",
    ]
    summary = run_evaluation(load_config("evaluation", "tiny", overrides))
    for name in names:
        result = summary["datasets"][name]
        assert result["file"] == str(formats[name])
        scored = [json.loads(line) for line in (tmp_path / "eval" / name / "scored.jsonl").read_text().splitlines()]
        own_kinds = [q.kind for q in toy_questions[:4]]  # the rows' kind column (TRL's and the datasets folder's)
        expected = {"verl": ["math"] * 4, "trl": own_kinds, "datasets_dict": own_kinds}.get(name, ["qa"] * 4)
        assert [row["kind"] for row in scored] == expected, name
    for name in ("search_r1", "datasets_dict"):
        out = tmp_path / f"rollouts-{name}"
        run_direct_rollout(
            load_config(
                "direct_rollout",
                "tiny",
                [*tiny_agent(toy, server), f"questions={formats[name]}", f"out_dir={out}", "n=1", "limit=3", "batch_questions=3"]
                + (["question_format.split=test"] if name == "datasets_dict" else []),
            )
        )
        lines = (out / "trajectories.jsonl").read_text().splitlines()
        assert [json.loads(line)["question"] for line in lines] == [q.question for q in toy_questions[:3]]


def test_evaluation_names_the_setting_for_a_dataset_of_ones_own(toy, server, tmp_path):
    """A name that is not a benchmark and has no file: one line naming files.NAME, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.run", *tiny_agent(toy, server), "datasets=[myqa]", f"out_dir={tmp_path / 'e'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "+files.myqa=PATH" in done.stderr and done.stderr.count("\n") == 1, done.stderr

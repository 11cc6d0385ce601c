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
from etagent.cli import convert_main
from etagent.config import load_settings
from etagent.direct_rollout.run import run as run_direct_rollout
from etagent.errors import SettingError
from etagent.evaluation.run import run as run_evaluation
from etagent.question_formats import QuestionFormat, inferred_kind, read_question_rows, read_questions
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
SETTINGS = {"datasets_dict": QuestionFormat.given(split="test")}


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
        rows, mapping = read_question_rows(path, SETTINGS.get(name, QuestionFormat.given()))
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
        elif name == "flashrag":  # FlashRAG's sets are question answering
            assert set(kinds) == {"qa"} and "kind <- the flashrag format (question answering)" in mapping.describe(), name
        else:  # no kind in the row: inferred from the gold answer (a number is math: a year too), and said
            assert kinds == [inferred_kind(q.answer) for q in toy_questions] and "kind <- inferred from the answer" in mapping.describe()
    # a column of the user's own: the fields mapping reads it, dotted for a nested one
    rows, mapping = read_question_rows(formats["flashrag"], QuestionFormat.given(fields={"kind": "metadata.kind"}))
    assert [r.question.kind for r in rows] == [q.kind for q in toy_questions]
    assert "kind <- metadata.kind" in mapping.describe()
    rows, _ = read_question_rows(formats["flashrag"], QuestionFormat.given(kind="math", source="mine"))
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
        read_question_rows(tmp_path / "flashrag-question.jsonl", QuestionFormat.given(fields={"golden": "x"}))


def test_rl_reads_every_format_and_refuses_a_foreign_prompt_unless_rerendered(formats, toy_questions, tmp_path):
    ours = tmp_path / "rl.parquet"
    write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(toy_questions)], ours)
    assert [p.question.question for p in read_prompts(ours)] == [q.question for q in toy_questions]
    for name, path in formats.items():
        settings = SETTINGS.get(name, QuestionFormat.given())
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
    summary = run_evaluation(load_settings("evaluation", "tiny", overrides))
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
            load_settings(
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


@pytest.fixture(scope="module")
def producer_files(tmp_path_factory) -> dict:
    from tests.support.producers import PRODUCERS

    out = tmp_path_factory.mktemp("producers")
    return {name: build(out) for name, build in PRODUCERS.items()}


@pytest.mark.parametrize(
    "producer",
    [
        "search_r1_merged",
        "gsm8k_datasets_folder",
        "verl_gsm8k_folder",
        "verl_math_folder",
        "trl_deepmath_folder",
        "trl_numina_tir",
        "flashrag_multiple_choice",
    ],
)
def test_each_producers_own_file_reads_with_the_right_question_gold_and_kind(producer_files, producer, tmp_path):
    """A file made by its producer's own recipe (tests/support/producers.py) reads, through the
    one reader every stage uses and through ``etagent convert``, with each row's question as
    asked (no producer's instruction, a multiple-choice question with its options), its gold
    answers as meant (the number after GSM8K's ``####``, a worked solution's last box, the
    options' text for their indices) and its kind (math where the producer or the gold answer
    says so); ids unique, qualified by source where sources restart their numbering; and the
    mapping says where each field came from."""
    from tests.support.producers import SPLITS

    path, expected = producer_files[producer]
    settings = QuestionFormat.given(split=SPLITS.get(producer))
    rows, mapping = read_question_rows(path, settings)
    assert [(r.question.question, r.question.answer, r.question.kind) for r in rows] == expected, mapping.describe()
    assert len({r.question.id for r in rows}) == len(rows) == mapping.rows
    if producer == "search_r1_merged":
        assert [r.question.id for r in rows] == ["nq/train_0", "nq/train_1", "hotpotqa/train_0", "hotpotqa/train_1"]
        assert len({r.index for r in rows}) == len(rows) and "ids qualified by source" in mapping.describe()

    out = tmp_path / "converted.jsonl"
    assert convert_main([str(path), str(out), *(("--split", SPLITS[producer]) if producer in SPLITS else ())]) == 0
    converted = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(q["question"], q["answer"], q["kind"]) for q in converted] == expected


def test_a_kind_is_inferred_from_the_gold_answer_and_every_reading_says_where_it_came_from(tmp_path, caplog):
    """With no kind in the row, its producer's field or a known data_source, a gold answer that is
    a number or LaTeX is math and any other text qa (seeded random answers of both); the reader
    logs the mapping it used, so every stage says it on its first lines."""
    import logging

    from etagent.question_formats import inferred_kind, kind_of_data_source

    rng = random.Random(0)
    numbers = [str(rng.randint(-(10**6), 10**6)) for _ in range(50)] + [f"{rng.random() * 100:.3f}" for _ in range(50)]
    numbers += [f"{rng.randint(1, 999):,}" for _ in range(20)] + [f"{rng.randint(1, 9)}/{rng.randint(2, 9)}" for _ in range(20)]
    latex = ["$72$", "\\frac{63}{400}", "20\\sqrt3", "x^2 + 1", "\\dfrac{1}{3}", "$\\pi$", "a_{n+1}"]
    words = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(3, 20))).strip() or "yes" for _ in range(100)]
    assert all(inferred_kind([a]) == "math" for a in numbers + latex)
    assert all(inferred_kind([w]) == "qa" for w in words + ["Yes", "Arthur's Magazine", "Delhi", "seven", "2,718 people"])
    assert inferred_kind(["72", "seventy-two"]) == "qa"  # every gold answer must be math
    assert {kind_of_data_source(s) for s in ("openai/gsm8k", "aime24", "numina_olympiads", "lighteval/MATH")} == {"math"}
    assert {kind_of_data_source(s) for s in ("nq", "hotpotqa", "searchR1_nq", "qa_effi_rl")} == {"qa"} and kind_of_data_source("x") is None

    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question": "6 x 7?", "answer": "42"}) + "\n" + json.dumps({"question": "Who?", "answer": "Kess"}) + "\n")
    with caplog.at_level(logging.INFO, logger="etagent.questions"):
        rows, _ = read_question_rows(path)
    assert [r.question.kind for r in rows] == ["math", "qa"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "etagent.questions"]
    assert line.startswith(f"read {path}: etagent format, 2 rows") and "kind <- inferred from the answer (math" in line


def test_a_source_of_several_splits_is_read_only_where_a_split_is_named(producer_files, tmp_path):
    """A `datasets` dict folder and verl's folder of train.parquet and test.parquet hold several
    splits: read with none named, each is refused naming its splits and the setting (an
    evaluation that silently read train would score the training split); each split reads alone;
    verl's example JSON beside its parquet is not read."""
    for producer in ("gsm8k_datasets_folder", "verl_gsm8k_folder"):
        path, expected = producer_files[producer]
        with pytest.raises(SettingError, match=r"question_format.split: .* holds several splits: (train, test|test, train); name the one"):
            read_question_rows(path)
        assert len(read_question_rows(path, QuestionFormat.given(split="test"))[0]) == len(expected)
        assert len(read_question_rows(path, QuestionFormat.given(split="train"))[0]) < len(expected)
        with pytest.raises(SettingError, match=r"has no split 'dev'"):
            read_question_rows(path, QuestionFormat.given(split="dev"))


def test_rl_trains_on_the_question_alone_from_a_merged_search_r1_file_and_verls_math(producer_files):
    """RL's data loading takes Search-R1's merged NQ and HotpotQA file (its indices restart per
    source) with unique groups, and verl's MATH prompts without verl's instruction, rendered
    with the protocol's prompt."""
    path, expected = producer_files["search_r1_merged"]
    prompts = read_prompts(path, rerender_prompts=True)
    assert len({p.index for p in prompts}) == len(prompts) == len(expected)
    assert {p.data_source for p in prompts} == {"qa_effi_rl"} and [p.question.question for p in prompts] == [e[0] for e in expected]
    path, expected = producer_files["verl_math_folder"]
    prompts = read_prompts(path, rerender_prompts=True)
    assert [p.question.question for p in prompts] == [e[0] for e in expected]
    assert not any("think step by step" in p.question.question for p in prompts) and {p.data_source for p in prompts} == {"math_effi_rl"}


def test_the_gsm8k_benchmark_reads_a_datasets_folder_and_verls_parquet(producer_files, tmp_path):
    """The ``gsm8k`` benchmark name reads openai/gsm8k saved to disk and verl's preprocessed
    folder (its test split), each question with the number after ``####`` as its gold answer;
    a file of another layout is refused saying how to evaluate it as a dataset of one's own."""
    from etagent.evaluation.benchmarks import load_benchmark

    for producer in ("gsm8k_datasets_folder", "verl_gsm8k_folder"):
        path, expected = producer_files[producer]
        questions = load_benchmark("gsm8k", path, split="test")
        assert [(q.question, q.answer, q.kind) for q in questions] == expected, producer
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "6 x 7?", "answer": "42"}) + "\n")
    with pytest.raises(RecordError, match=r"datasets=\[mygsm\] \+files.mygsm=PATH \+kinds.mygsm=math"):
        load_benchmark("gsm8k", other)


def test_verls_and_trls_rewards_read_their_producers_own_columns():
    """verl's reward reads Search-R1's ``{target: [...]}`` ground truth as its gold answers and
    scores any data_source as the kind it calls for (nq: F1; openai/gsm8k: math), grouping a
    batch by data_source and index (Search-R1's merged files restart the index per source). TRL's
    reward reads TRL's own ``solution`` column, its kind inferred from it where no column says."""
    import numpy as np

    from etagent.rl.trl_reward import EfficiencyReward
    from etagent.rl.verl_reward import compute_score, gold_answers

    target = {"target": np.array(["Arthur's Magazine", "Arthurs Magazine"])}
    assert gold_answers(target) == ["Arthur's Magazine", "Arthurs Magazine"]
    right = "<think>look</think><answer>Arthur's Magazine</answer>"
    assert compute_score("nq", right, target)["raw"] == 1.0
    assert compute_score("searchR1_hotpotqa", right, target)["raw"] == 1.0
    assert compute_score("openai/gsm8k", "<think>so</think><answer>\\boxed{72}</answer>", "72")["raw"] == 1.0
    assert compute_score("my_own_source", "<think>so</think><answer>\\boxed{72}</answer>", ["72"])["raw"] == 1.0  # by its gold

    reward = EfficiencyReward(num_generations=2, sigma_tool=0.0, sigma_length=0.0)
    completions = ["<think>so</think><answer>\\boxed{72}</answer>", "<think>so</think><answer>\\boxed{71}</answer>"]
    scores = reward(prompts=["p", "p"], completions=completions, completion_ids=[[1, 2], [1, 2]], solution=["$72$", "$72$"])
    assert scores[0] > scores[1] and scores[0] == pytest.approx(1.0)


def test_evaluation_reads_each_dataset_at_its_own_split(producer_files, toy, tmp_path):
    """Two datasets of one's own in folders of several splits: ``splits.<name>`` names each one's;
    one not named is refused naming its setting; a split for a dataset the run lacks is refused."""
    from etagent.evaluation.run import check_settings, dataset_questions

    gsm, expected = producer_files["gsm8k_datasets_folder"]
    deepmath, deepmath_expected = producer_files["trl_deepmath_folder"]
    base = [f"model={toy / 'model'}", f"out_dir={tmp_path / 'eval'}", "datasets=[gsm,deep]", f"+files.gsm={gsm}", f"+files.deep={deepmath}"]
    cfg = load_settings("evaluation", "tiny", [*base, "+splits.gsm=test", "+splits.deep=train"])
    questions, read_as = dataset_questions(cfg, "gsm")
    assert [q.answer for q in questions] == [e[1] for e in expected] and "the number after '####'" in read_as
    assert len(dataset_questions(cfg, "deep")[0]) == 1
    cfg = load_settings("evaluation", "tiny", [*base, "+splits.gsm=test"])
    with pytest.raises(SettingError, match=r"splits.deep: .* holds several splits"):
        dataset_questions(cfg, "deep")
    cfg = load_settings("evaluation", "tiny", [*base, "+splits.gsm=test", "+splits.deep=test", "+splits.other=test"])
    with pytest.raises(SettingError, match=r"splits.other: 'other' is not one of this run's datasets"):
        check_settings(cfg)


def test_a_dataset_name_never_forms_a_path(toy, tmp_path):
    """An evaluation dataset's name becomes its folder in out_dir and its questions' file name: a
    name that is not one plain path component (a separator, '..', empty) or that repeats is refused
    before anything is written."""

    from etagent.evaluation.run import check_settings

    questions = toy / "questions" / "test.jsonl"
    base = [f"model={toy / 'model'}", f"out_dir={tmp_path / 'eval'}"]
    for name in ("../up", "a/b", "..", "a\\b", "x" * 200):
        cfg = load_settings("evaluation", "tiny", base)
        cfg.datasets, cfg.files[name] = [name], str(questions)  # names Hydra's override grammar would not take
        with pytest.raises(SettingError, match=r"setting datasets: .* is not a dataset name"):
            check_settings(cfg)
    cfg = load_settings("evaluation", "tiny", [*base, "datasets=[toy,toy]"])
    with pytest.raises(SettingError, match="names a dataset twice: 'toy'"):
        check_settings(cfg)
    assert not (tmp_path / "eval").exists() and not (tmp_path / "up").exists()

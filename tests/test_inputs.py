"""What a stage reads, checked before any work, and what it writes kept apart from it.

The first tests walk every stage's declared inputs and outputs (etagent/settings.py: no list of
fields here): each input refused when missing or of the wrong kind, each output folder refused
when it equals, contains or lies inside an input. The others are the issue's probes through the
real command line (exit 2, one line, the inputs unchanged), and the resume that knows its inputs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from etagent.config import SCHEMAS, load_config
from etagent.errors import SettingError
from etagent.settings import PathKind, check_paths, settings_of
from tests.support.commands import etagent, evaluate_args, refused, rollout_args

STAGES = sorted(name for name, (_, package) in SCHEMAS.items() if package == "_global_")


def fake_model(folder: Path, *, tokenizer: bool = True, weights: bool = True, config: str = '{"model_type": "qwen2"}') -> Path:
    """A folder shaped as a model: the files the path checks read (a config, a safetensors file
    whose header is whole, a tokenizer), with one tiny tensor for weights."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config)
    if weights:
        save_file({"weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def valid_path(kind: str, where: Path) -> Path:
    """A path that is an input of ``kind``."""
    if kind == "model":
        return fake_model(where)
    if kind in ("folder", "tokenizer"):
        where.mkdir(parents=True)
        if kind == "tokenizer":
            (where / "tokenizer.json").write_text("{}")
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text('{"id": "q"}\n')
    return where


def wrong_kinds(kind: str, where: Path) -> list[Path]:
    """Paths that are not inputs of ``kind``: missing, and of another kind."""
    where.mkdir(parents=True)
    a_file = where / "a-file.jsonl"
    a_file.write_text("{}\n")
    a_folder = where / "a-folder"
    a_folder.mkdir()
    (a_folder / "notes.txt").write_text("not data")
    missing = where / "missing"
    if kind in ("file",):
        return [missing, a_folder]
    if kind == "data":
        return [missing, a_folder]  # a folder without parquet files
    if kind == "folder":
        return [missing, a_file]
    if kind == "file or folder":
        return [missing]
    no_tokenizer = fake_model(where / "no-tokenizer", tokenizer=False)
    if kind == "tokenizer":
        return [missing, a_file, no_tokenizer]
    return [
        missing,
        a_file,
        a_folder,
        no_tokenizer,
        fake_model(where / "no-weights", weights=False),
        fake_model(where / "bad", config="{oops"),
    ]


def stage_values(stage: str, tmp_path: Path) -> tuple[dict, list, list]:
    """The tiny preset's values with every declared input valid (each element of a list or dict
    of inputs) and every output in tmp_path; the places of its inputs and outputs, each as
    (the key a refusal names, its kind, the dict or list holding it, the index in it)."""
    schema = SCHEMAS[stage][0]
    values = OmegaConf.to_container(load_config(stage, "tiny"), resolve=True)
    inputs, outputs = [], []
    for setting in settings_of(schema):
        kind = setting.first(PathKind)
        if kind is None:
            continue
        parent_key, _, leaf = setting.key.rpartition(".")
        parent = values
        for part in filter(None, parent_key.split(".")):
            parent = parent[part]
            if isinstance(parent, dict) and parent.get("enabled") is False:
                parent["enabled"] = True  # every group read, so every input is checked
        if parent is None or parent.get(leaf) is None and setting.container is None:
            continue
        # a single value, or each element of a list or a dict of them
        if setting.container is None:
            places = [(setting.key, parent, leaf)]
        elif setting.container is list:
            parent[leaf] = parent[leaf] or ["one"]
            places = [(f"{setting.key}[{i}]", parent[leaf], i) for i in range(len(parent[leaf]))]
        else:
            parent[leaf] = parent[leaf] or {"one": "x"}
            places = [(f"{setting.key}.{name}", parent[leaf], name) for name in parent[leaf]]
        for key, holder, index in places:
            place = tmp_path / "in" / key.replace(".", "-").replace("[", "-").replace("]", "")
            if kind.role == "input":
                holder[index] = str(valid_path(kind.kind, place))
                inputs.append((key, kind.kind, holder, index))
            else:
                holder[index] = str(tmp_path / "out" / key.replace(".", "-"))
                outputs.append((key, kind.kind, holder, index))
    return values, inputs, outputs


@pytest.mark.parametrize("stage", STAGES)
def test_every_declared_input_is_checked_for_its_kind(stage, tmp_path):
    schema = SCHEMAS[stage][0]
    values, inputs, _ = stage_values(stage, tmp_path)
    check_paths(schema, values)  # all valid: nothing refused
    for key, kind, holder, index in inputs:
        good = holder[index]
        for bad in wrong_kinds(kind, tmp_path / "bad" / key):
            holder[index] = str(bad)
            with pytest.raises(SettingError) as refusal:
                check_paths(schema, values)
            assert refusal.value.key == key, (stage, key, bad, str(refusal.value))
            assert repr(str(bad)) in str(refusal.value)
        holder[index] = good


@pytest.mark.parametrize("stage", STAGES)
def test_no_output_folder_equals_contains_or_lies_inside_an_input(stage, tmp_path):
    schema = SCHEMAS[stage][0]
    values, inputs, outputs = stage_values(stage, tmp_path)
    for out_key, _, out_holder, out_index in outputs:
        kept = out_holder[out_index]
        for _, _, holder, index in inputs:
            source = Path(holder[index])
            for overlapping in (source, source.parent, source / "inside"):
                out_holder[out_index] = str(overlapping)
                with pytest.raises(SettingError) as refusal:
                    check_paths(schema, values)
                assert refusal.value.key == out_key and "outputs never overwrite inputs" in str(refusal.value)
        out_holder[out_index] = kept


def digest(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


# --- the probes, through the real command line ------------------------------------------


def test_sft_never_writes_over_the_model_it_trains_from(toy, tmp_path):
    model = tmp_path / "D" / "model"
    shutil.copytree(toy / "model", model)
    before = digest(model)
    data = f"data.path={toy / 'sft.jsonl'}"
    for out in (model, model.parent, model / "sub"):
        result = etagent("sft", f"model={model}", f"out_dir={out}", data, "train.max_steps=1")
        refused(result, "setting out_dir:")
        assert "outputs never overwrite inputs" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert digest(model) == before


def test_an_evaluation_never_writes_over_its_questions(toy, tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    questions = out / "questions.jsonl"
    shutil.copy(toy / "questions" / "test.jsonl", questions)
    before = digest(questions)
    refused(etagent(*evaluate_args(toy / "model", questions, out, "http://127.0.0.1:9", "limit=4")), "outputs never overwrite inputs")
    assert digest(questions) == before and len(questions.read_text().splitlines()) == 200


@pytest.mark.parametrize("missing", ["tokenizer", "weights", "config", "cut weights", "broken tokenizer"])
def test_a_model_folder_missing_a_part_is_refused_before_any_work(toy, tmp_path, missing):
    model = tmp_path / "model"
    shutil.copytree(toy / "model", model)
    if missing == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
            (model / name).unlink(missing_ok=True)
    elif missing == "weights":
        for weights in model.glob("*.safetensors"):
            weights.unlink()
    elif missing == "cut weights":  # a copy or download stopped half-way
        weights = next(model.glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif missing == "broken tokenizer":
        (model / "tokenizer.json").write_text('{"version": ')
    else:
        (model / "config.json").write_text("{ not json")
    expected = {
        "tokenizer": "has no tokenizer",
        "weights": "has no weights",
        "config": "config.json that is not valid JSON",
        "cut weights": "has weights that cannot be read: model.safetensors is cut short",
        "broken tokenizer": "has a tokenizer.json that is not valid JSON",
    }[missing]
    sft_out, eval_out = tmp_path / "sft", tmp_path / "eval"
    refused(etagent("sft", f"model={model}", f"data.path={toy / 'sft.jsonl'}", f"out_dir={sft_out}"), expected)
    if missing == "tokenizer":  # the probe: evaluation sampled only "empty prompt" errors
        refused(etagent(*evaluate_args(model, toy / "questions" / "test.jsonl", eval_out)), expected)
    assert not sft_out.exists() and not eval_out.exists()


def test_a_folder_where_a_file_is_expected_and_unreadable_files_are_one_line(toy, tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    (folder / "x.txt").write_text("x")
    refused(etagent("sft", f"model={toy / 'model'}", f"data.path={folder}", f"out_dir={tmp_path / 's'}"), "setting data.path:")
    refused(etagent(*evaluate_args(toy / "model", folder, tmp_path / "e")), "setting files.toy:")
    refused(etagent(*rollout_args(toy / "model", folder, tmp_path / "r")), "setting questions:")
    refused(etagent("rl", f"model={toy / 'model'}", f"data.train={folder}", f"out_dir={tmp_path / 'rl'}"), "setting data.train:")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    refused(etagent("rl", f"model={toy / 'model'}", f"data.train={corrupt}", f"out_dir={tmp_path / 'rl2'}"), "not a readable parquet file")
    empty = tmp_path / "corpus.jsonl"
    empty.write_text("")
    refused(etagent("retriever", "build", f"corpus={empty}", f"index_dir={tmp_path / 'index'}"), "no passages (the corpus is empty)")
    refused(
        etagent(
            "retriever",
            "build",
            f"corpus={toy / 'corpus.jsonl'}",
            f"index_dir={tmp_path / 'index2'}",
            f"encoder.model={tmp_path / 'nothing'}",
        ),
        "setting encoder.model: no encoder at",
    )


@pytest.mark.parametrize(
    "answer, reason",
    [
        (None, "no gold answer (null)"),
        ([["nested"]], "gold answer 0 is a list"),
        ("", "answer 0 is an empty string"),
        (["a", ""], "answer 1 is an empty string"),
    ],
)
def test_gold_answers_that_could_never_be_scored_are_refused(toy, tmp_path, answer, reason):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "What?", "answer": answer, "source": "toy", "kind": "qa"}) + "\n")
    refused(etagent(*rollout_args(toy / "model", questions, tmp_path / "out")), reason)


def test_sft_data_whose_every_segment_is_masked_is_refused(toy, tmp_path):
    data = tmp_path / "sft.jsonl"
    example = json.loads((toy / "sft.jsonl").read_text().splitlines()[0])
    example["segments"] = [{**s, "train": False} for s in example["segments"]]
    data.write_text(json.dumps(example) + "\n")
    out = tmp_path / "out"
    result = etagent("sft", f"model={toy / 'model'}", f"data.path={data}", f"out_dir={out}")
    refused(result, "no example left to train on")
    assert "'dropped_all_masked': 1" in result.stderr


@pytest.mark.slow
def test_a_resume_whose_inputs_changed_is_refused_unless_restarted(sft_model_full, toy, server, tmp_path):
    """Evaluation resumes into the same out_dir; if its questions file has changed since (the gold
    answers edited), the rerun is refused naming the file, and --restart starts over with the
    earlier outputs moved aside (nothing deleted)."""
    questions = tmp_path / "questions.jsonl"
    shutil.copy(toy / "questions" / "test.jsonl", questions)
    out = tmp_path / "eval"
    first = etagent(*evaluate_args(sft_model_full / "model", questions, out, server, "limit=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    lines = questions.read_text().splitlines()
    edited = [json.loads(line) for line in lines]
    edited[0]["answer"] = ["a different answer"]
    questions.write_text("".join(json.dumps(q) + "\n" for q in edited))
    result = etagent(*evaluate_args(sft_model_full / "model", questions, out, server, "limit=2"))
    refused(result, f"was made from another files.toy: {questions} has changed since")
    assert len(result.stderr.strip().splitlines()) == 1
    summary = json.loads((out / "summary.json").read_text())
    restarted = etagent(*evaluate_args(sft_model_full / "model", questions, out, server, "limit=2"), "--restart")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    [aside] = [p for p in out.parent.iterdir() if p.name.startswith("eval.previous-")]
    assert json.loads((aside / "summary.json").read_text()) == summary  # the earlier run, kept whole
    manifest = json.loads((out / "manifest.json").read_text())
    [recorded] = [i for i in manifest["inputs"] if i["key"] == "files.toy"]
    assert recorded["sha256"] == hashlib.sha256(questions.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_kill_during_an_sft_save_is_resumed_from_the_last_whole_checkpoint(toy, tmp_path):
    """What kill -9 leaves in the middle of a save (a checkpoint folder without its
    trainer_state.json, written last) no longer stops every rerun: the rerun resumes from the
    last whole checkpoint and redoes the save."""
    out, data = tmp_path / "sft", tmp_path / "sft.jsonl"
    # 64 of the toy's 6000 examples: 6 steps of 4 read 24 of them, and tokenizing the rest took 3 s a run
    data.write_text("".join((toy / "sft.jsonl").read_text().splitlines(keepends=True)[:64]))
    args = ["sft", f"model={toy / 'model'}", f"data.path={data}", f"out_dir={out}", "train.progress_bar=false", "threads=1"]
    args += ["train.max_steps=6", "train.save_steps=2", "train.logging_steps=1"]
    first = etagent(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    # the kill came before the save's last file, so before the final model and the manifest's
    # "complete" (a finished run is left as it is on a rerun)
    (out / "checkpoints" / "checkpoint-6" / "trainer_state.json").unlink()
    shutil.rmtree(out / "model")
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    again = etagent(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-4'}" in again.stderr
    state = json.loads((out / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6


def test_a_selection_or_an_export_of_nothing_is_refused(tmp_path):
    """Asked for questions, Pareto finds none eligible (every chain of every question wrong, or
    all right): exit 2 naming why, and no rl.parquet that an RL stage would train on for
    nothing. A flywheel export that keeps no trajectory is refused the same way."""
    from tests.support.trajectories import rollout_line

    rollouts = tmp_path / "rollouts" / "trajectories.jsonl"
    rollouts.parent.mkdir()
    lines = [rollout_line("a", "math", [(0, 1), (0, 2)]), rollout_line("b", "math", [(1, 1), (1, 1)])]
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = digest(rollouts)
    out = tmp_path / "selection"
    refused(etagent("pareto", f"rollouts={rollouts}", f"out_dir={out}"), "none of the 2 questions is eligible (1 all_wrong, 1 all_correct)")
    assert not (out / "rl.parquet").exists() and digest(rollouts) == before

    flywheel = tmp_path / "flywheel"
    flywheel.mkdir()
    (flywheel / "trajectories.jsonl").write_text(rollouts.read_text().replace('"verdict": true', '"verdict": false'))
    refused(etagent("flywheel", "export", f"out_dir={flywheel}", "export.seed_data=null"), "is kept as SFT data")
    assert not (flywheel / "sft" / "sft.jsonl").exists()


@pytest.mark.parametrize(
    "fmt, rows, field",
    [
        ("alpaca", [["not", "an", "object"]], "(record)"),
        ("sharegpt", [{"conversations": [{"from": "human"}]}], "conversations.0"),
        ("sharegpt", [{"conversations": [{"from": "human", "value": "q"}, "a string turn"]}], "conversations.1"),
    ],
)
def test_malformed_llamafactory_rows_name_their_row_and_field(toy, tmp_path, fmt, rows, field):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(rows))
    refused(
        etagent("sft", f"model={toy / 'model'}", f"data.path={data}", f"data.format={fmt}", f"out_dir={tmp_path / 'o'}"),
        f"data.json:1: field '{field}'",
    )

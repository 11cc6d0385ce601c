"""The toy world and tiny model: determinism, token ids surviving a reload, seed trajectories
that really ran their tools and show the behaviours they claim, and the CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from etagent import protocol
from etagent.config import load_settings
from etagent.question_formats import read_questions
from etagent.records import SFTExample, TrajectoryGroup, read_jsonl, read_records
from etagent.toy.build import run
from etagent.toy.seeds import ToySearch

SMALL = [
    "world.people=40",
    "world.cities=10",
    "questions.train.search=20",
    "questions.train.python=20",
    "questions.train.both=20",
    "questions.train.none=20",
    "questions.test_per_kind=5",
    "tokenizer.vocab_size=600",
]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ARTIFACTS = [
    "corpus.jsonl",
    "questions/train.jsonl",
    "questions/test.jsonl",
    "seed_trajectories.jsonl",
    "sft.jsonl",
    "model/tokenizer.json",
    "model/model.safetensors",
    "model/config.json",
]


def without_timings(path: Path) -> list[dict]:
    groups = [json.loads(line) for line in path.read_text().splitlines()]
    for g in groups:
        for t in g["trajectories"]:
            for call in t["tool_calls"]:
                assert call.pop("seconds") >= 0
    return groups


def test_build_is_deterministic_from_the_seed(tmp_path):
    for name in ("a", "b", "c"):
        seed = 1 if name == "c" else 0
        run(load_settings("toy", "tiny", [f"out_dir={tmp_path / name}", f"seed={seed}"] + SMALL))
    for artifact in ARTIFACTS:
        if artifact == "seed_trajectories.jsonl":  # identical except the measured tool-call times
            a, b = (without_timings(tmp_path / run_dir / artifact) for run_dir in ("a", "b"))
            assert a == b
        else:
            assert sha(tmp_path / "a" / artifact) == sha(tmp_path / "b" / artifact), artifact
    assert sha(tmp_path / "a" / "corpus.jsonl") != sha(tmp_path / "c" / "corpus.jsonl")


def toy_texts(toy: Path) -> list[str]:
    texts = [protocol.SYSTEM_PROMPT]
    texts += [d["contents"] for d in map(json.loads, (toy / "corpus.jsonl").read_text().splitlines())]
    texts += [q.question for split in ("train", "test") for q in read_questions(toy / "questions" / f"{split}.jsonl")]
    groups = read_jsonl(toy / "seed_trajectories.jsonl", TrajectoryGroup)
    texts += [t.text for g in groups for t in g.trajectories]
    return texts


def test_tokenizer_reload_gives_identical_ids_for_every_toy_text(toy):
    from tokenizers import Tokenizer

    # the tokenizer exactly as trained (tokenizer.json), against what AutoTokenizer rebuilds
    trained = Tokenizer.from_file(str(toy / "model" / "tokenizer.json"))
    reloaded = AutoTokenizer.from_pretrained(toy / "model")
    texts = toy_texts(toy)
    assert len(texts) > 3000
    for text in texts:
        ids = trained.encode(text).ids
        assert reloaded.encode(text) == ids, text[:80]
        assert reloaded.decode(ids) == text
    # the chat-rendered prompt too, and it ends by opening the assistant turn
    prompt = protocol.encode_prompt(reloaded, "In which year was X born?")
    assert reloaded.decode(prompt).endswith("<|im_start|>assistant\n")
    assert reloaded.decode(prompt).startswith("<|im_start|>system\n" + protocol.SYSTEM_PROMPT)


def test_tags_are_single_tokens_and_eos_is_im_end(toy):
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    for tag in protocol.TAG_STRINGS:
        assert len(tokenizer.encode(tag)) == 1, tag
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # numbers split into chunks of up to three digits from the left
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("14157163")) == ["141", "571", "63"]


def test_every_made_up_word_and_number_has_the_same_ids_wherever_it_appears(toy):
    """The copy property: each name, profession word and number is tokenized to the same ids in
    the question, the query, the code, the results, the reasoning and the boxed answer, whatever
    character precedes it. Checked on every occurrence in every toy text."""
    import re

    from etagent.toy.world import make_world

    config = load_settings("toy", "tiny", [f"out_dir={toy}"])
    words = set(make_world(config.seed, config.world.people, config.world.cities).made_up_words())
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    own_ids: dict[str, list[int]] = {}
    contexts = Counter()
    checked = 0
    for text in toy_texts(toy):
        encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        spans = list(zip(encoding["input_ids"], encoding["offset_mapping"]))
        for match in re.finditer(r"[A-Za-z]+|[0-9]+", text):
            unit = match.group()
            if unit not in words and not unit.isdigit():
                continue
            covering = [i for i, (start, end) in spans if start < match.end() and end > match.start()]
            inside = [i for i, (start, end) in spans if start >= match.start() and end <= match.end()]
            # its tokens start and end exactly at the word: nothing glued on either side
            assert covering == inside, (unit, text[max(0, match.start() - 30) : match.end() + 10])
            expected = own_ids.setdefault(unit, tokenizer.encode(unit, add_special_tokens=False))
            assert inside == expected, (unit, text[max(0, match.start() - 30) : match.end() + 10])
            contexts[text[match.start() - 1] if match.start() else "^"] += 1
            checked += 1
    assert checked > 30000
    # the contexts that glued a character to a word before: space, quote, brace, tag, newline
    assert {" ", '"', "{", ">", "\n", "("} <= set(contexts)
    assert all(len(own_ids[w]) == 1 for w in own_ids if not w.isdigit())


def test_model_loads_with_the_tokenizers_vocab_and_a_vllm_friendly_head_size(toy):
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    model = AutoModelForCausalLM.from_pretrained(toy / "model")
    config = model.config
    assert config.model_type == "qwen2" and config.vocab_size == len(tokenizer)
    assert config.hidden_size // config.num_attention_heads in (32, 64, 80, 96, 112, 128)
    assert config.eos_token_id == tokenizer.eos_token_id and config.tie_word_embeddings
    prompt = torch.tensor([protocol.encode_prompt(tokenizer, "What is 3 times 4?")])
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > prompt.shape[1]


def test_questions_cover_four_kinds_and_test_is_held_out(toy):
    train = read_questions(toy / "questions" / "train.jsonl")
    test = read_questions(toy / "questions" / "test.jsonl")
    assert Counter(q.source for q in train) == {"toy_search": 2000, "toy_python": 1400, "toy_both": 2000, "toy_none": 600}
    assert Counter(q.source for q in test) == {"toy_search": 50, "toy_python": 50, "toy_both": 50, "toy_none": 50}
    assert not {q.question for q in train} & {q.question for q in test}
    # a text is asked at most once per version (in two versions it has two answers)
    assert len({(q.model_extra["world_version"], q.question) for q in train}) == len(train)
    assert {q.kind for q in train if q.source in ("toy_python", "toy_both")} == {"math"}
    assert {q.kind for q in train if q.source in ("toy_search", "toy_none")} == {"qa"}
    # held-out questions are asked in the served world, training questions in its 8 versions
    assert all(q.needed_calls is not None for q in train + test)
    per_version = Counter(q.model_extra["world_version"] for q in train)
    assert set(per_version) == set(range(1, 9)) and all(n == 750 for n in per_version.values())  # 6000/8
    assert all("world_version" not in q.model_extra for q in test)


NEEDED = {"toy_search": ["search"], "toy_python": ["python"], "toy_both": ["search", "python"], "toy_none": []}


def test_seed_trajectories_show_the_behaviour_they_claim(toy):
    groups = read_jsonl(toy / "seed_trajectories.jsonl", TrajectoryGroup)
    behaviours = Counter()
    for g in groups:
        for t in g.trajectories:
            behaviour = t.provenance.behaviour
            behaviours[behaviour] += 1
            tools = [c.tool for c in t.tool_calls]
            assert protocol.validate_format(t.text) and protocol.validate_template_format(t.text), t.text
            assert protocol.count_tool_calls(t.text) == len(t.tool_calls)
            assert protocol.extract_answer(t.text) == t.prediction
            # every habit is right in the data: SFT learns all three
            assert t.judgement.score == 1.0
            if behaviour == "efficient":
                assert tools == NEEDED[g.source]
            elif behaviour == "redundant":
                assert len(tools) == len(NEEDED[g.source]) + 1 and set(NEEDED[g.source]) <= set(tools)
                if g.source != "toy_none":  # announced in the first thought
                    first = t.text.split("</think>", 1)[0]
                    assert "twice" in first, t.text
            else:
                assert tools == [] and g.source != "toy_none"
                assert "without any tool" in t.text or "directly" in t.text
    total = sum(behaviours.values())
    # the configured mix (0.4/0.48/0.12), with 'none' questions' insufficient draws turned efficient
    assert abs(behaviours["redundant"] / total - 0.48) < 0.04
    assert abs(behaviours["insufficient"] / total - 0.12 * 0.9) < 0.03
    assert len(read_jsonl(toy / "sft.jsonl", SFTExample)) == total


def test_seed_tool_results_are_real_tool_outputs(toy):
    """Each seed's results are what the tools return in the world version its question was asked
    in (training_worlds/{k}.jsonl: the same names, other facts), never the served world's."""
    groups = read_jsonl(toy / "seed_trajectories.jsonl", TrajectoryGroup)
    cfg = json.loads((toy / "manifest.json").read_text())["config"]
    versions = {int(p.stem): p for p in (toy / "training_worlds").glob("*.jsonl")}
    assert sorted(versions) == list(range(1, cfg["world"]["training_versions"] + 1))

    def search_in(path: Path) -> ToySearch:
        corpus = [json.loads(line) for line in path.read_text().splitlines()]
        return ToySearch(corpus, cfg["tools"]["search"]["top_k"], cfg["tools"]["search"]["max_doc_chars"])

    searches = {k: search_in(path) for k, path in versions.items()}
    served = search_in(toy / "corpus.jsonl")
    calls = [(t.provenance.world_version, c) for g in groups for t in g.trajectories for c in t.tool_calls]
    python_calls = [c for _, c in calls if c.tool == "python"][:25]
    for call in python_calls:  # the output a fresh interpreter prints for the same code
        real = subprocess.run([sys.executable, "-c", call.input], capture_output=True, text=True, check=True).stdout.strip()
        assert call.output == real
    search_calls = [(k, c) for k, c in calls if c.tool == "search"][:200]
    for k, call in search_calls:
        assert call.output == searches[k](call.input)
    # the versions really differ from the served world: most results would read differently there
    assert sum(call.output != served(call.input) for _, call in search_calls) > 0.8 * len(search_calls)
    # and each result is inserted in the protocol's format
    t = next(t for g in groups for t in g.trajectories if t.tool_calls)
    assert protocol.tool_results(t.text) == [c.output for c in t.tool_calls]


def test_sft_data_is_the_correct_well_formed_seeds(toy):
    examples = read_records(toy / "sft.jsonl", SFTExample)
    groups = {g.id: g for g in read_jsonl(toy / "seed_trajectories.jsonl", TrajectoryGroup)}
    assert len(examples) > 1500
    for e in examples:
        assert protocol.validate_template_format(e.response)
        assert e.system == protocol.SYSTEM_PROMPT
        assert all(s.train != s.text.startswith("<result>") for s in e.segments)
        question_id = e.id.split("/")[0]
        [t] = [t for t in groups[question_id].trajectories if t.id == e.id]
        assert t.judgement.score == 1.0 and t.text == e.response


def test_cli_build_then_rerun_is_a_no_op_and_a_config_change_is_refused(tmp_path):
    out = tmp_path / "toy"
    args = [sys.executable, "-m", "etagent.launcher", "toy", "build", "--out", str(out)] + SMALL
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "toy world in" in first.stdout and "example seed trajectory" in first.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["train_questions"] == 80
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "toy world in" in again.stdout
    assert json.loads((out / "manifest.json").read_text())["finished_at"] == manifest["finished_at"]
    changed = subprocess.run(args + ["seed=5"], capture_output=True, text=True, timeout=300)
    assert changed.returncode != 0 and "different config" in changed.stderr


def test_question_counts_the_config_or_the_world_cannot_give_are_clear_errors(tmp_path):
    missing = SMALL + [f"out_dir={tmp_path / 'a'}", "~questions.train.none"]
    with pytest.raises(ValueError, match="questions.train: give a count for each of search, python, both, none"):
        run(load_settings("toy", "tiny", missing))
    # 40 people can be asked 80 distinct 'none' questions per world version
    too_many = SMALL + [f"out_dir={tmp_path / 'b'}", "questions.train.none=800"]
    with pytest.raises(ValueError, match="fewer than 100 distinct 'none' questions"):
        run(load_settings("toy", "tiny", too_many))


def test_rl_pool_is_asked_in_a_world_version_of_its_own(toy):
    """questions/rl.jsonl: fresh questions for direct rollout and RL, answered by looking up
    rl_world/corpus.jsonl (the served world's names with redrawn facts), never a held-out text."""
    rl = read_questions(toy / "questions" / "rl.jsonl")
    test = read_questions(toy / "questions" / "test.jsonl")
    assert Counter(q.source for q in rl) == {"toy_search": 100, "toy_python": 100, "toy_both": 100, "toy_none": 50}
    assert all(q.model_extra["world_version"] == "rl" for q in rl) and len({q.id for q in rl}) == len(rl)
    assert not {q.question for q in rl} & {q.question for q in test}
    served = [json.loads(line) for line in (toy / "corpus.jsonl").read_text().splitlines()]
    rl_corpus = [json.loads(line) for line in (toy / "rl_world" / "corpus.jsonl").read_text().splitlines()]
    assert [d["title"] for d in rl_corpus] == [d["title"] for d in served]
    assert sum(a["contents"] != b["contents"] for a, b in zip(rl_corpus, served)) > 0.9 * len(served)

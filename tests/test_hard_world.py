"""The hard world (etagent/toy/hops.py, docs/toy-world.md "A world with headroom") and the tests
that would fail if one of the method's components were broken on it:

- the world: every question's needed calls are its chain's non-landmark lookups (and an efficient
  seed makes exactly those), landmarks keep their facts in every version, seeds cover only their
  shapes, and a bad shape is refused naming it;
- Pareto selection, on a fixed pool, chooses questions with a larger spread of correctness and of
  tool calls than random selection does;
- the curriculum: the questions selected for stage 2 (from a stronger policy's rollouts) are
  harder, by the world's hop count, than those of stage 1;
- the flywheel's output covers question shapes that the seed data lacks.

The rollouts of the Pareto and curriculum tests, and the flywheel's policy, are scripted (test
doubles for a model's output in control-flow tests): what is tested is what the stages do with
them. Everything else is real: the hard world's build, the Pareto stage's command line, the
flywheel's operations with the Python sandbox and the retriever's BM25 over the world's corpus.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from etagent.config import load_settings
from etagent.records import Question
from etagent.toy.build import run as build_world
from etagent.toy.hops import parse_shape

SMALL = [
    "world.people=80",
    "world.cities=20",
    "world.training_versions=2",
    *[f"questions.train.{s}=40" for s in ("hops0", "hops0_python", "hops1", "hops1_python", "hops2")],
    *[f"questions.flywheel.{s}=8" for s in ("hops2_python", "hops3", "hops3_python")],
    *[
        f"questions.test.{s}=6"
        for s in (
            "hops0",
            "hops0_python",
            "hops1",
            "hops1_python",
            "hops2",
            "hops2_python",
            "hops3",
            "hops3_python",
            "hops4",
            "hops4_python",
        )
    ],
    *[
        f"questions.rl.{s}=12"
        for s in ("hops0", "hops0_python", "hops1", "hops1_python", "hops2", "hops2_python", "hops3", "hops3_python", "hops4_python")
    ],
]


@pytest.fixture(scope="module")
def hard(tmp_path_factory) -> Path:
    """A small hard world, built by the builder as `etagent toy build --world hard` builds it."""
    out = tmp_path_factory.mktemp("hard") / "toy"
    build_world(load_settings("toy_hard", "tiny", [f"out_dir={out}", *SMALL]))
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def shape_of(question: dict) -> str:
    return question["source"].removeprefix("toy_")


# --- the world --------------------------------------------------------------------------------


def test_the_preset_asks_100_held_out_questions_per_hop_count_and_seeds_only_up_to_two_hops():
    cfg = load_settings("toy_hard", "tiny", [])
    per_hops = Counter()
    for shape, n in cfg.questions.test.items():
        per_hops[parse_shape(shape)[0]] += n
    assert per_hops == {hops: 100 for hops in range(5)}
    seeded = {parse_shape(s) for s in cfg.questions.train}
    assert max(h for h, _ in seeded) == 2 and all(h <= 1 for h, python in seeded if python)
    assert not seeded & {parse_shape(s) for s in cfg.questions.flywheel}


def test_questions_seeds_and_shapes(hard):
    train, test, rl = (read(hard / "questions" / f"{split}.jsonl") for split in ("train", "test", "rl"))
    assert Counter(map(shape_of, test)) == {s: 6 for s in Counter(map(shape_of, test))} and len(test) == 60
    assert Counter(map(shape_of, rl)) == {s: 12 for s in Counter(map(shape_of, rl))} and len(rl) == 108
    groups = read(hard / "seed_trajectories.jsonl")
    seeded = {shape_of(g) for g in groups}
    assert seeded == {"hops0", "hops0_python", "hops1", "hops1_python", "hops2"}
    flywheel = {shape_of(q) for q in train} - seeded
    assert flywheel == {"hops2_python", "hops3", "hops3_python"}
    sft_questions = {example["id"].rsplit("/", 1)[0] for example in read(hard / "sft.jsonl")}
    by_id = {q["id"]: shape_of(q) for q in train}
    assert {by_id[q] for q in sft_questions} == seeded  # the flywheel's shapes are in no SFT data
    assert len({q["question"] for q in test} & {q["question"] for q in train + rl}) == 0


def test_an_efficient_seed_makes_exactly_the_needed_calls_and_quotes_what_it_found(hard):
    """needed_calls is the chain's lookups of non-landmarks (and Python where it ends in
    arithmetic): an efficient seed, which recites landmarks and searches the rest, makes
    exactly those calls; every fact it quotes after a search is in that search's result."""
    checked = Counter()
    for group in read(hard / "seed_trajectories.jsonl"):
        for t in group["trajectories"]:
            assert t["judgement"]["score"] == 1.0, t["text"]
            calls = Counter(call["tool"] for call in t["tool_calls"])
            behaviour = t["provenance"]["behaviour"]
            needed = group["needed_calls"]
            if behaviour == "efficient":
                assert calls == Counter({"search": needed["search"], "python": needed["python"]}) - Counter(), group["question"]
                checked[shape_of(group)] += 1
            elif behaviour == "redundant":
                assert sum(calls.values()) == needed["search"] + needed["python"] + 1, t["text"]
            else:
                assert sum(calls.values()) == 0 and needed["search"] + needed["python"] > 0
            for call, quoted in zip(
                (c for c in t["tool_calls"] if c["tool"] == "search"), re.findall(r"The result (?:again )?says that (.*?)\.", t["text"])
            ):
                assert quoted in call["output"], (quoted, call["output"])
    assert set(checked) == {"hops0", "hops0_python", "hops1", "hops1_python", "hops2"}


def test_landmarks_keep_their_facts_in_every_version_and_the_rest_are_redrawn(hard):
    cfg = load_settings("toy_hard", "tiny", SMALL)
    served = {d["title"]: d["contents"] for d in read(hard / "corpus.jsonl")}
    people = list(served)[: cfg.world.people]
    cities = list(served)[cfg.world.people :]
    landmarks = set(people[: cfg.world.landmark_people] + cities[: cfg.world.landmark_cities])
    for version in [*sorted((hard / "training_worlds").glob("*.jsonl")), hard / "rl_world" / "corpus.jsonl"]:
        docs = {d["title"]: d["contents"] for d in read(version)}
        assert docs.keys() == served.keys()
        assert all(docs[name] == served[name] for name in landmarks), version
        redrawn = sum(docs[name] != served[name] for name in served if name not in landmarks)
        assert redrawn == len(served) - len(landmarks), version


def test_a_shape_that_is_not_one_is_refused_naming_it(tmp_path, capsys):
    from etagent.toy.build import main

    with pytest.raises(SystemExit) as exit:
        main(["--world", "hard", "--out", str(tmp_path / "w"), "+questions.train.hops5=3"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "setting questions.train.hops5" in err and "Traceback" not in err
    assert not (tmp_path / "w" / "corpus.jsonl").exists()


# --- Pareto selection and the curriculum -------------------------------------------------------

# A scripted policy's chance to solve a question of h hops, and its tool calls per chain: a
# stronger policy solves longer chains. Weak: the seed-SFT policy; strong: after a stage of RL.
SOLVES = {"weak": [1.0, 0.97, 0.6, 0.3, 0.02], "strong": [1.0, 1.0, 0.97, 0.6, 0.3]}


def scripted_rollouts(pool: list[dict], policy: str, folder: Path, chains: int = 8, seed: int = 0) -> Path:
    """A direct rollout's folder (trajectories.jsonl, manifest) of ``chains`` scripted chains per
    question: each right with the policy's chance for the question's hop count, each making the
    question's needed calls plus a redundant one a third of the time (or none, when it guesses)."""
    from etagent.records import write_manifest
    from tests.support.trajectories import rollout_line

    rng = random.Random(seed)
    lines = []
    for q in pool:
        hops = parse_shape(shape_of(q))[0]
        needed = q["needed_calls"]["search"] + q["needed_calls"]["python"]
        outcomes = []
        for _ in range(chains):
            right = rng.random() < SOLVES[policy][hops]
            calls = needed + (rng.random() < 1 / 3) if right or rng.random() < 0.5 else 0
            outcomes.append((1.0 if right else 0.0, calls))
        line = rollout_line(q["id"], q["kind"], outcomes)
        line.update(question=q["question"], answer=q["answer"], source=q["source"])
        lines.append(line)
    folder.mkdir(parents=True)
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    write_manifest(folder, stage="direct_rollout", config={}, started_at=0)
    return folder


def select(rollouts: Path, out: Path, count: int, *extra: str) -> list[str]:
    """The Pareto stage's command line; the selected questions' ids (its rl.parquet)."""
    import pyarrow.parquet as pq

    from etagent.pareto.run import main

    main([f"rollouts={rollouts}", f"out_dir={out}", f"count={count}", *extra])
    rows = pq.read_table(out / "rl.parquet").to_pylist()
    return [row["extra_info"]["question_id"] for row in rows]


def spreads(rollouts: Path) -> dict[str, tuple[float, float]]:
    """Each question's population variance of correctness and of executed tool calls."""
    out = {}
    for line in read(rollouts / "trajectories.jsonl"):
        chains = line["trajectories"]
        out[line["id"]] = (
            float(np.var([c["judgement"]["score"] for c in chains])),
            float(np.var([c["tool_calls_executed"] for c in chains])),
        )
    return out


def test_pareto_chooses_a_larger_spread_of_correctness_and_tool_calls_than_random_selection(hard, tmp_path):
    pool = read(hard / "questions" / "rl.jsonl")
    rollouts = scripted_rollouts(pool, "weak", tmp_path / "rollouts")
    spread = spreads(rollouts)
    count = 24
    pareto = select(rollouts, tmp_path / "pareto", count)
    drawn = select(rollouts, tmp_path / "random", count, "method=random")
    assert len(pareto) == len(drawn) == count

    def mean(ids, which):
        return float(np.mean([spread[i][which] for i in ids]))

    # random selection's own spread: the stage's draw, and 2000 draws of the same size
    rng = np.random.default_rng(0)
    ids = list(spread)
    draws = [[ids[i] for i in rng.choice(len(ids), count, replace=False)] for _ in range(2000)]
    for which in (0, 1):  # correctness, tool calls
        random_means = [mean(d, which) for d in draws]
        assert mean(pareto, which) > np.quantile(random_means, 0.99) > mean(ids, which) * 0.5, which
        assert mean(pareto, which) > mean(drawn, which), which
    # and no question without a spread of correctness (always or never solved) is chosen
    assert all(spread[i][0] > 0 for i in pareto)


def test_the_curriculums_second_stage_selects_harder_questions_than_its_first(hard, tmp_path):
    """Stage k's data is selected from the rollouts of the policy stage k-1 trained: once the
    short chains are always solved, they have no spread and the selection moves to longer ones.
    The stages are ordered by the world's difficulty (hop count)."""
    pool = read(hard / "questions" / "rl.jsonl")
    hops = {q["id"]: parse_shape(shape_of(q))[0] for q in pool}
    count = 24
    stages = []
    for k, policy in ((1, "weak"), (2, "strong")):
        rollouts = scripted_rollouts(pool, policy, tmp_path / f"rollouts{k}", seed=k)
        stages.append(select(rollouts, tmp_path / f"stage{k}", count, f"rl_stage={k}"))
    first, second = (float(np.mean([hops[i] for i in stage])) for stage in stages)
    assert second > first + 0.5, (first, second)
    assert min(hops[i] for i in stages[1]) >= 2  # chains of 0-1 hops are always solved by then


# --- the flywheel -------------------------------------------------------------------------------

_PHRASE = re.compile(r"^the (mentor|home city|mayor) of (.+)$")
_FACTS = {
    "mentor": r"{} studied under (\w+ \w+)",
    "home city": r"{} was born in the city of (\w+)",
    "mayor": r"{} is governed by the mayor (\w+ \w+)",
    "born": r"{} was born in (\d+)",
    "river": r"{} is a city on the river (\w+)",
    "city": r"{} was born in the city of (\w+)",
    "founded": r"{} was founded in (\d+)",
    "population": r"{} has (\d+) inhabitants",
}
_ASKED = [
    (re.compile(r"^In which year was (.+) born\?$"), "born"),
    (re.compile(r"^On which river is (.+)\?$"), "river"),
    (re.compile(r"^In which city was (.+) born\?$"), "city"),
    (re.compile(r"^Who is the mentor of (.+)\?$"), "mentor"),
    (re.compile(r"^Who is the mayor of (.+)\?$"), "mayor"),
    (re.compile(r"^In which year was (.+) founded\?$"), "founded"),
    (re.compile(r"^How many inhabitants does (.+) have\?$"), "population"),
]
ANSWER = "<answer>The final answer is \\[ \\boxed{{{}}} \\]</answer>"


def chain_of(question: str) -> tuple[str, list[str]] | None:
    """(the named entity, the facts to follow in order) of a chain question the policy reads."""
    for pattern, last in _ASKED:
        match = pattern.match(question)
        if match:
            phrase, facts = match.group(1), [last]
            while inner := _PHRASE.match(phrase):
                facts.insert(0, inner.group(1))
                phrase = inner.group(2)
            return phrase, facts
    return None


def chain_policy(prompt: str) -> str:
    """A scripted policy (a test double for a model trained on chains of up to two lookups): it
    follows a chain one search at a time, reading each fact from the result, but after two
    lookups it answers with what it has, as if the chain were over, unless a hint after its last
    result tells it to search on; then it finishes the chain."""
    question = prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0].strip()
    response = prompt.split("<|im_start|>assistant\n")[-1]
    start, facts = chain_of(question)
    entity = start
    values = []
    for fact, result in zip(facts, re.findall(r"<result>(.*?)</result>", response, re.S)):
        entity = re.search(_FACTS[fact].format(re.escape(entity)), result).group(1)
        values.append(entity)
    hinted = "Wait," in response.rsplit("</result>", 1)[-1]
    if len(values) == len(facts) or (len(values) >= 2 and not hinted):
        return f"<think>So the answer is {values[-1]}.</think>" + ANSWER.format(values[-1])
    current = values[-1] if values else start
    thought = "</think>" if response.count("<think>") > response.count("</think>") else f"<think>I need to look up {current}.</think>"
    return f"{thought}<search>{current}</search>"


class CorpusSearch:
    """The ``<search>`` tool over one corpus with the retriever's BM25 method and result format
    (etagent.toy.seeds.ToySearch), in this process."""

    name = "search"

    def __init__(self, corpus: list[dict]):
        from etagent.toy.seeds import ToySearch

        self.search = ToySearch(corpus, top_k=1, max_doc_chars=1200)

    async def __call__(self, query: str):
        from etagent.tools import ToolOutput

        return ToolOutput(self.search(query), ok=True)


def test_the_flywheels_output_covers_shapes_the_seed_data_lacks(hard, tmp_path):
    """The flywheel, on the hard world's three-hop questions with a policy that stops a lookup
    short: its first rollouts are all wrong, its trajectory hints (B3) make right ones, and the
    export's SFT data holds three-hop chains, which no seed does."""
    from transformers import AutoTokenizer

    from etagent.agent import AgentLoop
    from etagent.flywheel.evolve import Flywheel, QuestionRun
    from etagent.flywheel.export import main as export
    from etagent.flywheel.run import question_record
    from etagent.llm import Sampling, SharedBatches
    from etagent.llm.text import TextModel
    from etagent.records import write_jsonl
    from etagent.tools.executor import ToolExecutor
    from tests.support.groups import agent_config, flywheel_settings
    from tests.support.scripted import ScriptedModel

    tokenizer = AutoTokenizer.from_pretrained(hard / "model")
    questions = [
        Question.model_validate(q) for q in read(hard / "questions" / "train.jsonl") if shape_of(q) == "hops3" and q["world_version"] == 1
    ]
    assert len(questions) == 4 and all(chain_of(q.question) is not None for q in questions)
    executor = ToolExecutor([CorpusSearch(read(hard / "training_worlds" / "1.jsonl"))])
    engine = SharedBatches(ScriptedModel(tokenizer, chain_policy))
    loop = AgentLoop(engine, executor, agent_config(timeout_s=None, max_response_tokens=600, seed=0))
    settings = flywheel_settings(rounds=2)
    flywheel = Flywheel(loop, TextModel(engine, Sampling.at(1.0), 200, "reflector"), None, settings)
    runs = []
    for q in questions:
        run = QuestionRun(q)
        asyncio.run(flywheel.evolve(run))
        runs.append(run)
    initial = [t for run in runs for t in run.trajectories if t.provenance.operation == "initial"]
    assert initial and all(t.judgement.score < 0.8 for t in initial)  # the policy alone stops short
    write_jsonl(tmp_path / "trajectories.jsonl", [question_record(run, False, 0.0, False) for run in runs])
    export([f"export.trajectories=[{tmp_path / 'trajectories.jsonl'}]", f"export.out_dir={tmp_path / 'sft'}", f"out_dir={tmp_path}"])
    examples = read(tmp_path / "sft" / "sft.jsonl")
    exported = {example["id"].split("/")[0] for example in examples}  # "<question id>/<trajectory>"
    seed_shapes = {example["id"].split("/")[0].split("-")[2] for example in read(hard / "sft.jsonl")}
    assert "hops3" not in seed_shapes
    assert exported == {q.id for q in questions}
    assert all(example["messages"][-1]["content"].count("<search>") == 3 for example in examples)  # the whole chain
    report = json.loads((tmp_path / "sft" / "report.json").read_text())
    assert (
        set(report["kept_by_operation"]) <= {"B3_trajectory_hint", "A1_rerollout"}
        and report["kept_by_operation"]["B3_trajectory_hint"] >= 4
    )

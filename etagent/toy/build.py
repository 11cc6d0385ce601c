"""Build the toy world, its seed data and the tiny model into one directory.

    etagent toy build --out runs/toy            # or: python -m etagent.toy.build --out runs/toy
    etagent toy build --world hard --out runs/hard/toy   # the world with headroom (build_hard)

Writes, deterministically from ``seed``:

    corpus.jsonl                 retrieval corpus (id, title, contents): the served world
    training_worlds/{k}.jsonl    the corpora of the world versions the training questions are
                                 asked in (same names, redrawn facts; see World.with_redrawn_facts)
    questions/train.jsonl        training questions, four kinds (see etagent.toy.world)
    questions/test.jsonl         held-out questions
    questions/rl.jsonl           the RL question pool: fresh questions in a world version of its
                                 own, never seen in SFT data (direct rollout, Pareto, RL)
    rl_world/corpus.jsonl        that version's corpus: the retriever serves it during RL
    seed_trajectories.jsonl      trajectories for the training questions (etagent.toy.seeds)
    sft.jsonl                    the correct, well-formed seed trajectories as SFT data
    model/                       tokenizer + randomly initialised Qwen2 (save_pretrained)
    manifest.json                config, counts, behaviour mix, git revision

A finished build is not redone: running again on the same directory with the same config
prints the summary and exits; a different config is an error unless ``--force``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter
from pathlib import Path

from etagent import protocol
from etagent.errors import SettingError, UserError, exit_on_user_error
from etagent.records import SFTExample, TrajectoryGroup, write_jsonl, write_manifest
from etagent.toy.config import HardWorldConfig, ToyConfig
from etagent.toy.hops import make_hop_questions, make_hop_world, parse_shape, write_hop_trajectory
from etagent.toy.model import DIGIT_CHUNKS, build_model, save_policy, train_tokenizer
from etagent.toy.seeds import BEHAVIOURS, ToySearch, write_trajectory
from etagent.toy.world import KINDS, make_questions, make_world


def check_token_ids_survive_reload(tokenizer, model_dir: Path, texts: list[str]) -> None:
    """Raise if AutoTokenizer, loading the saved folder, tokenizes any text differently."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(model_dir)
    for text in texts:
        original, again = tokenizer.encode(text), reloaded.encode(text)
        if original != again:
            raise RuntimeError(f"{model_dir}: token ids change after reload ({type(reloaded).__name__}) for {text[:80]!r}")
        if reloaded.decode(again) != text:
            raise RuntimeError(f"{model_dir}: decoding does not give the text back for {text[:80]!r}")


def build(cfg: ToyConfig, out_dir: Path) -> dict:
    """Build everything into out_dir and return the summary written to the manifest. One random
    stream draws everything, in this order: world, held-out questions, training worlds and
    questions, seed trajectories, the RL pool."""
    started = time.time()
    rng = random.Random(cfg.seed)
    world = make_world(cfg.seed, cfg.world.people, cfg.world.cities)
    corpus = world.corpus()
    write_jsonl(out_dir / "corpus.jsonl", corpus)

    for split, counts in (("train", cfg.questions.train), ("rl", cfg.questions.rl)):
        if set(counts) != set(KINDS):
            raise ValueError(f"questions.{split}: give a count for each of {', '.join(KINDS)} (got {', '.join(counts)})")
    test_texts: set[str] = set()
    test = make_questions(world, rng, {kind: cfg.questions.test_per_kind for kind in KINDS}, "test", test_texts)
    versioned, searches = training_questions(cfg, world, rng, test_texts, out_dir)
    write_jsonl(out_dir / "questions" / "train.jsonl", [q.question for _, q in versioned])
    write_jsonl(out_dir / "questions" / "test.jsonl", [q.question for q in test])
    groups = seed_groups(cfg, versioned, searches, rng)
    train = [q for _, q in versioned]

    # The RL pool is drawn last, so adding it changed nothing drawn before (world, questions,
    # seeds). Its own world version keeps RL from learning the facts of held-out questions, as
    # the training versions keep SFT from it; its own questions make RL more than a replay of SFT.
    rl_world = world.with_redrawn_facts(rng)
    write_jsonl(out_dir / "rl_world" / "corpus.jsonl", rl_world.corpus())
    rl_pool = make_questions(rl_world, rng, dict(cfg.questions.rl), "rl", set(test_texts))
    for q in rl_pool:
        q.question.world_version = "rl"
    write_jsonl(out_dir / "questions" / "rl.jsonl", [q.question for q in rl_pool])

    sft = seed_sft_examples(groups)

    texts = [protocol.SYSTEM_PROMPT] + [d["contents"] for d in corpus]
    texts += [q.question.question for q in train + test] + [t.text for g in groups for t in g.trajectories]
    tokenizer, model = write_tokenizer_and_model(cfg, out_dir, texts, world.made_up_words(), groups, sft)
    summary = build_summary(world, corpus, train, test, rl_pool, groups, sft, tokenizer, model)
    write_build_manifest(out_dir, "toy", cfg, summary, started)
    return summary


def build_hard(cfg: HardWorldConfig, out_dir: Path) -> dict:
    """The hard world (etagent/toy/hops.py) into out_dir, in the toy's layout, so every stage and
    script reads it as it reads the toy; ``questions/train.jsonl`` also holds the flywheel's
    questions (the shapes no seed teaches; in no SFT data). One random stream draws everything:
    world, held-out questions, training versions with their questions and the flywheel's, seeds,
    the RL pool."""
    started = time.time()
    for split in ("train", "flywheel", "test", "rl"):
        for shape in getattr(cfg.questions, split):
            try:
                parse_shape(shape)
            except ValueError as error:
                raise SettingError(f"questions.{split}.{shape}", str(error)) from None
    rng = random.Random(cfg.seed)
    w = cfg.world
    world = make_hop_world(cfg.seed, w.people, w.cities, w.landmark_people, w.landmark_cities)
    corpus = world.corpus()
    write_jsonl(out_dir / "corpus.jsonl", corpus)
    check_each_name_finds_its_document(cfg, corpus)
    test_texts: set[str] = set()
    test = make_hop_questions(world, rng, cfg.questions.test, "test", test_texts, w.landmark_start)
    versions = [world.with_redrawn_facts(rng) for _ in range(w.training_versions)]
    seeded, unseeded, searches = [], [], {}
    for k, version in enumerate(versions, start=1):
        version_corpus = version.corpus()
        write_jsonl(out_dir / "training_worlds" / f"{k}.jsonl", version_corpus)
        searches[k] = ToySearch(version_corpus, cfg.tools.search.top_k, cfg.tools.search.max_doc_chars)
        asked = set(test_texts)
        for counts, prefix, into in ((cfg.questions.train, "train", seeded), (cfg.questions.flywheel, "flywheel", unseeded)):
            share = {shape: n // len(versions) + (k <= n % len(versions)) for shape, n in counts.items()}
            for q in make_hop_questions(version, rng, share, f"{prefix}-w{k}", asked, w.landmark_start):
                q.question.world_version = k
                into.append((k, q))
    train = [q for _, q in seeded + unseeded]
    write_jsonl(out_dir / "questions" / "train.jsonl", [q.question for q in train])
    write_jsonl(out_dir / "questions" / "test.jsonl", [q.question for q in test])
    mix = {b: float(cfg.seeds.mix[b]) for b in BEHAVIOURS}
    groups = []
    for k, q in seeded:
        trajectories = []
        for i in range(cfg.seeds.per_question):
            trajectory = write_hop_trajectory(q, rng.choices(list(mix), weights=list(mix.values()))[0], searches[k], rng)
            trajectory.id = f"{q.question.id}/seed{i}"
            trajectory.provenance.world_version = k
            trajectories.append(trajectory)
        groups.append(TrajectoryGroup.for_question(q.question, trajectories))
    rl_world = world.with_redrawn_facts(rng)
    write_jsonl(out_dir / "rl_world" / "corpus.jsonl", rl_world.corpus())
    rl_pool = make_hop_questions(rl_world, rng, cfg.questions.rl, "rl", set(test_texts), w.landmark_start)
    for q in rl_pool:
        q.question.world_version = "rl"
    write_jsonl(out_dir / "questions" / "rl.jsonl", [q.question for q in rl_pool])

    sft = seed_sft_examples(groups)
    texts = [protocol.SYSTEM_PROMPT] + [d["contents"] for d in corpus]
    texts += [q.question.question for q in train + test] + [t.text for g in groups for t in g.trajectories]
    tokenizer, model = write_tokenizer_and_model(cfg, out_dir, texts, world.made_up_words(), groups, sft)
    summary = build_summary(world, corpus, train, test, rl_pool, groups, sft, tokenizer, model)
    summary["questions"]["per_shape_flywheel"] = dict(Counter(q.shape for _, q in unseeded))
    write_build_manifest(out_dir, "toy_hard", cfg, summary, started)
    return summary


def check_each_name_finds_its_document(cfg: HardWorldConfig, corpus: list[dict]) -> None:
    """Raise unless a search for each entity's name returns that entity's own document first (a
    name is also mentioned in the documents of those it mentors or governs)."""
    search = ToySearch(corpus, 1, cfg.tools.search.max_doc_chars)
    ids, _ = search.index.search([doc["title"] for doc in corpus], 1)
    wrong = [doc["title"] for doc, found in zip(corpus, ids) if corpus[found[0]]["title"] != doc["title"]]
    if wrong:
        raise RuntimeError(f"a search for {wrong[0]!r} (and {len(wrong) - 1} more) does not return its own document first")


def write_build_manifest(out_dir: Path, stage: str, cfg, summary: dict, started: float) -> None:
    questions = summary["questions"]
    counts = {
        "corpus": summary["corpus_documents"],
        "train_questions": questions["train"],
        "test_questions": questions["test"],
        "rl_questions": questions["rl"],
        "seed_trajectories": summary["seed_trajectories"],
        "sft_examples": summary["sft_examples"],
    }
    write_manifest(out_dir, stage=stage, config=dataclasses.asdict(cfg), counts=counts, seed=cfg.seed, started_at=started, metrics=summary)


def write_tokenizer_and_model(cfg, out_dir: Path, texts: list[str], made_up_words: list[str], groups, sft) -> tuple:
    """Train the tokenizer on the world's texts, count each seed's tokens, write the seed
    trajectories and the SFT data, and save the randomly initialised tiny model beside them."""
    tokenizer = train_tokenizer(texts, cfg.tokenizer.vocab_size, made_up_words)
    for g in groups:
        for t in g.trajectories:
            t.n_tokens = len(tokenizer.encode(t.text))
    write_jsonl(out_dir / "seed_trajectories.jsonl", groups)
    write_jsonl(out_dir / "sft.jsonl", sft)
    m = cfg.model
    model = build_model(
        tokenizer,
        hidden_size=m.hidden_size,
        layers=m.layers,
        heads=m.heads,
        kv_heads=m.kv_heads,
        intermediate_size=m.intermediate_size,
        max_positions=m.max_positions,
        seed=cfg.seed,
        token_classes=[tokenizer.convert_tokens_to_ids(made_up_words), tokenizer.convert_tokens_to_ids(DIGIT_CHUNKS)],
    )
    model_dir = save_policy(model, tokenizer, out_dir / "model")
    check_token_ids_survive_reload(tokenizer, model_dir, texts + [s.response for s in sft[:50]])
    return tokenizer, model


def seed_sft_examples(groups) -> list[SFTExample]:
    """The correct, well-formed seed trajectories as SFT data."""
    return [
        SFTExample.from_trajectory(t.id, g.question, t.text, source=g.source, provenance=t.provenance)
        for g in groups
        for t in g.trajectories
        if t.judgement.score == 1.0 and protocol.validate_template_format(t.text)
    ]


def training_questions(cfg: ToyConfig, world, rng: random.Random, test_texts: set[str], out_dir: Path) -> tuple[list, dict]:
    """The training questions as (world version, question), and each version's search.

    Training questions are asked in versions of the world with redrawn facts (World.
    with_redrawn_facts), each with its own corpus (written to training_worlds/), so the facts of
    held-out questions are never in the training data; 0 versions asks them in the served world
    itself."""
    versions = [world.with_redrawn_facts(rng) for _ in range(cfg.world.training_versions)] or [world]
    versioned, searches = [], {}
    for k, version in enumerate(versions, start=1 if cfg.world.training_versions else 0):
        share = {kind: n // len(versions) + (k <= n % len(versions)) for kind, n in cfg.questions.train.items()}
        version_corpus = version.corpus()
        if version is not world:
            write_jsonl(out_dir / "training_worlds" / f"{k}.jsonl", version_corpus)
        searches[k] = ToySearch(version_corpus, cfg.tools.search.top_k, cfg.tools.search.max_doc_chars)
        # A question text is asked at most once per version and never as a held-out question; in
        # two versions the same text has two answers, so only the lookup tells them apart.
        for q in make_questions(version, rng, share, f"train-w{k}", set(test_texts)):
            q.question.world_version = k
            versioned.append((k, q))
    return versioned, searches


def seed_groups(cfg: ToyConfig, versioned: list, searches: dict, rng: random.Random) -> list[TrajectoryGroup]:
    """``cfg.seeds.per_question`` seed trajectories per training question, each behaviour drawn
    from ``cfg.seeds.mix`` and written against its world version's search."""
    mix = {b: float(cfg.seeds.mix[b]) for b in BEHAVIOURS}
    groups = []
    for k, q in versioned:
        trajectories = []
        for i in range(cfg.seeds.per_question):
            behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
            trajectory = write_trajectory(q, behaviour, searches[k], rng)
            trajectory.id = f"{q.question.id}/seed{i}"
            trajectory.provenance.world_version = k
            trajectories.append(trajectory)
        groups.append(TrajectoryGroup.for_question(q.question, trajectories))
    return groups


def build_summary(world, corpus, train, test, rl_pool, groups, sft, tokenizer, model) -> dict:
    """What the manifest records of a build: sizes, the seed data's behaviours and accuracy."""
    all_trajectories = [t for g in groups for t in g.trajectories]
    behaviours = Counter(t.provenance.behaviour for t in all_trajectories)
    kinds = Counter(q.question.source.removeprefix("toy_") for q in train)  # the kind, or the hard world's shape
    return {
        "entities": {"people": len(world.people), "cities": len(world.cities)},
        "corpus_documents": len(corpus),
        "questions": {"train": len(train), "test": len(test), "rl": len(rl_pool), "per_kind_train": dict(kinds)},
        "seed_trajectories": len(all_trajectories),
        "behaviours": dict(behaviours),
        "seed_accuracy": round(sum(t.judgement.score for t in all_trajectories) / len(all_trajectories), 4),
        "seed_mean_tool_calls": round(sum(len(t.tool_calls) for t in all_trajectories) / len(all_trajectories), 4),
        "sft_examples": len(sft),
        "tokenizer_vocab": len(tokenizer),
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "mean_trajectory_tokens": round(sum(t.n_tokens for t in all_trajectories) / len(all_trajectories), 1),
        "prompt_tokens": len(protocol.encode_prompt(tokenizer, train[0].question.question)),
    }


def print_summary(summary: dict, out_dir: Path, example: str | None = None) -> None:
    print(f"toy world in {out_dir}")
    print(
        f"  entities        {summary['entities']['people']} people, {summary['entities']['cities']} cities ({summary['corpus_documents']} corpus documents)"
    )
    per_kind = ", ".join(f"{k} {v}" for k, v in summary["questions"]["per_kind_train"].items())
    print(
        f"  questions       {summary['questions']['train']} train ({per_kind}), {summary['questions']['test']} test, {summary['questions']['rl']} RL pool"
    )
    mix = ", ".join(f"{k} {v}" for k, v in sorted(summary["behaviours"].items()))
    print(
        f"  seed rollouts   {summary['seed_trajectories']} ({mix}); accuracy {summary['seed_accuracy']:.3f}, {summary['seed_mean_tool_calls']:.2f} tool calls each"
    )
    print(f"  SFT examples    {summary['sft_examples']} (correct and well-formed seeds)")
    print(
        f"  tokenizer       {summary['tokenizer_vocab']} tokens; prompt {summary['prompt_tokens']} tokens, trajectory {summary['mean_trajectory_tokens']} tokens on average"
    )
    print(f"  model           Qwen2, {summary['model_parameters'] / 1e6:.2f}M parameters, random init ({out_dir / 'model'})")
    if example:
        print("  example seed trajectory:")
        for line in example.splitlines():
            print(f"    {line}")


def run(cfg: ToyConfig, force: bool = False) -> dict:
    """Build unless an identical build is already in cfg.out_dir; print the summary."""
    out_dir = Path(cfg.out_dir)
    manifest_path = out_dir / "manifest.json"
    resolved = dataclasses.asdict(cfg)
    if manifest_path.exists() and not force:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("status") == "complete" and manifest.get("config") == resolved:
            print_summary(manifest["metrics"], out_dir)
            return manifest["metrics"]
        if manifest.get("config") != resolved:
            raise UserError(f"{out_dir} holds a toy world built with a different config; use another --out or --force")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_hard(cfg, out_dir) if isinstance(cfg, HardWorldConfig) else build(cfg, out_dir)
    example = None
    with open(out_dir / "seed_trajectories.jsonl") as f:
        for line in f:
            group = json.loads(line)
            if group["source"] in ("toy_both", "toy_hops2"):
                example = f"Q: {group['question']}\n" + group["trajectories"][0]["text"]
                break
    print_summary(summary, out_dir, example)
    return summary


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    import argparse

    from etagent.config import load_settings

    parser = argparse.ArgumentParser(prog="etagent toy build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world",
        choices=("toy", "hard"),
        default="toy",
        help="toy: the embedded default (configs/toy/tiny.yaml); hard: the world with headroom (configs/toy_hard/tiny.yaml)",
    )
    parser.add_argument("--out", help="output directory (default: out_dir in the world's config)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory holds another build")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. world.people=400 model.layers=6")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"out_dir={args.out}"] if args.out else [])
    run(load_settings("toy" if args.world == "toy" else "toy_hard", "tiny", overrides), force=args.force)


if __name__ == "__main__":
    main()

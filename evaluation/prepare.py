"""Download benchmarks from the Hugging Face Hub into the formats evaluation/benchmarks.py reads.

    pip install -e '.[data]'                          # the `datasets` library
    python -m etagent.evaluation.prepare --out data/benchmarks [--only aime24,math500] [--limit 500]

Run it on a machine with internet; copy ``data/benchmarks`` to where you evaluate. Each dataset
is written to ``{out}/{name}/test.jsonl`` with the fields the paper's files have. Hub ids change
over time: every source is listed in SOURCES below, with what we take from it. Gated datasets
(GAIA, GPQA, HLE) need ``huggingface-cli login`` and accepting their terms first. The paper's
own test files (its ``test/`` folder) are also read as they are: put them in the same layout.

For the knowledge-QA sets the paper evaluated on the first 200 questions of each dev set (125 for
Bamboogle); ``--limit`` keeps that many, in the file's order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from etagent.errors import exit_on_user_error

# name: (hub id, config, split, how to map a row to the paper's fields)
SOURCES = {
    "aime24": (
        "HuggingFaceH4/aime_2024",
        None,
        "train",
        lambda r: {"id": r.get("id"), "question": r["problem"], "answer": str(r["answer"])},
    ),
    "aime25": ("math-ai/aime25", None, "test", lambda r: {"id": r.get("id"), "problem": r["problem"], "answer": r["answer"]}),
    "amc23": ("math-ai/amc23", None, "test", lambda r: {"id": r.get("id"), "question": r["question"], "answer": str(r["answer"])}),
    "math500": (
        "HuggingFaceH4/MATH-500",
        None,
        "test",
        lambda r: {"id": r.get("unique_id"), "question": r["problem"], "answer": r["answer"]},
    ),
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r: {"question": r["question"], "answer": r["answer"]}),
    "olympiadbench": (
        "Hothan/OlympiadBench",
        "OE_TO_maths_en_COMP",
        "train",
        lambda r: {"id": r.get("id"), "question": r["question"], "final_answer": r["final_answer"]},
    ),
    "2wiki": (
        "RUC-NLPIR/FlashRAG_datasets",
        "2wikimultihopqa",
        "dev",
        lambda r: {"id": r["id"], "question": r["question"], "answer": r["golden_answers"]},
    ),
    "hotpotqa": (
        "RUC-NLPIR/FlashRAG_datasets",
        "hotpotqa",
        "dev",
        lambda r: {"id": r["id"], "question": r["question"], "answer": r["golden_answers"]},
    ),
    "musique": (
        "RUC-NLPIR/FlashRAG_datasets",
        "musique",
        "dev",
        lambda r: {"id": r["id"], "question": r["question"], "answer": r["golden_answers"]},
    ),
    "bamboogle": (
        "RUC-NLPIR/FlashRAG_datasets",
        "bamboogle",
        "test",
        lambda r: {"id": r["id"], "question": r["question"], "answer": r["golden_answers"]},
    ),
    "simpleqa": ("basicv8vc/SimpleQA", None, "test", lambda r: {"question": r["problem"], "answer": [r["answer"]]}),
    "gaia": (
        "gaia-benchmark/GAIA",
        "2023_all",
        "validation",
        lambda r: {"task_id": r["task_id"], "Question": r["Question"], "answer": r["Final answer"], "Level": r["Level"]},
    ),
    "hle": ("cais/hle", None, "test", lambda r: {"id": r["id"], "question": r["question"], "answer": r["answer"]}),
    "gpqa": ("Idavidrein/gpqa", "gpqa_diamond", "train", None),  # choices must be shuffled into the text: see _gpqa
    "webwalker": ("callanwu/WebWalkerQA", None, "main", lambda r: {"question": r["question"], "answer": r["answer"]}),
}
PARQUET_SOURCES = {"mmlu-pro": ("TIGER-Lab/MMLU-Pro", None, "test")}
# Not on the Hub in a usable form when this was written: bring the paper's files.
BRING_YOUR_OWN = ("math", "xbench", "csbench")


def _gpqa(row: dict, index: int) -> dict:
    """GPQA's four options, shuffled with a fixed seed per question, into the question text; the
    answer is the letter and the text (the paper's file has both)."""
    import random

    options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"], row["Incorrect Answer 3"]]
    random.Random(index).shuffle(options)
    letter = "ABCD"[options.index(row["Correct Answer"])]
    text = row["Question"] + "\n\n" + "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
    return {"id": index, "question": text, "answer": [f"({letter})", row["Correct Answer"]]}


def prepare(name: str, out: Path, limit: int | None) -> int:
    from datasets import load_dataset

    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    if name in PARQUET_SOURCES:
        hub, config, split = PARQUET_SOURCES[name]
        data = load_dataset(hub, config, split=split)
        data.to_parquet(str(target / "test-00000-of-00001.parquet"))
        return len(data)
    hub, config, split, mapping = SOURCES[name]
    data = load_dataset(hub, config, split=split)
    rows = [(_gpqa(row, i) if name == "gpqa" else mapping(row)) for i, row in enumerate(data)]
    rows = rows[:limit] if limit else rows
    with (target / "test.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False) + "\n")
    return len(rows)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m etagent.evaluation.prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="data/benchmarks")
    parser.add_argument("--only", help="comma-separated names (default: all available)")
    parser.add_argument("--limit", type=int, help="keep the first N questions of each dataset")
    args = parser.parse_args(argv)
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise SystemExit("needs the `datasets` library: pip install -e '.[data]'") from None
    names = args.only.split(",") if args.only else list(SOURCES) + list(PARQUET_SOURCES)
    for name in names:
        if name in BRING_YOUR_OWN:
            print(f"{name}: not downloadable here; put the paper's file at {Path(args.out) / name / 'test.jsonl'}")
            continue
        try:
            count = prepare(name, Path(args.out), args.limit)
        except Exception as exc:  # one unavailable dataset must not stop the others
            print(f"{name}: failed ({type(exc).__name__}: {exc})")
            continue
        print(f"{name}: {count} questions -> {Path(args.out) / name}")


if __name__ == "__main__":
    main()

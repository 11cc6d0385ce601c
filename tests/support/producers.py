"""Question files as their producers' own scripts make them, offline: each producer's row mapping,
transcribed from its preprocessing script, applied with ``datasets`` to rows shaped like its
source dataset's, and written the way the script writes (``to_parquet``, ``save_to_disk``, JSON
lines). What each script does is described beside it; the files are what a researcher has.

- Search-R1 ``scripts/data_process/qa_search_train_merge.py``: FlashRAG's NQ and HotpotQA train
  splits, each mapped with its own row index (``extra_info.index`` restarts per source; FlashRAG's
  ids ``train_N`` do too), concatenated, one parquet; FlashRAG's columns kept beside verl's.
- openai/gsm8k rows saved with ``save_to_disk`` (the dict of splits ``load_dataset`` gives).
- verl ``examples/data_preprocess/gsm8k.py``: question and answer popped, the instruction
  appended to the user turn, the number after ``####`` as ground truth, raw question and answer
  in ``extra_info``; ``train.parquet`` and ``test.parquet`` in one folder.
- verl ``examples/data_preprocess/math_dataset.py`` over MATH-lighteval: problem and solution
  popped, the instruction appended, the last ``\\boxed{}`` as ground truth, no raw question kept;
  ``train_example.json`` written beside the parquet.
- TRL ``examples/datasets/deepmath_103k.py``: ``{prompt, solution}``, the final answer wrapped in
  ``$...$`` except True/False/Yes/No; a train/test split saved to disk.
- TRL ``examples/scripts/rloo.py`` over AI-MO/NuminaMath-TIR: a system turn and the problem as
  ``prompt``; ``solution`` the whole worked solution.
- FlashRAG's multiple-choice JSONL (MMLU, ARC, OpenBookQA): ``choices`` and ``golden_answers``
  holding indices into them (flashrag/evaluator/metrics.py reads them as ``choices[i]``).

Each builder returns the path and, per row, what a right reading gives: (question, gold answers,
kind)."""

from __future__ import annotations

import json
import re
from pathlib import Path

SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search as "
    "many times as your want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
VERL_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
TRL_SYSTEM = (
    "A conversation between user and assistant. The user asks a question, and the assistant solves it. The assistant first "
    "thinks about the reasoning process in the mind and then provides the user with the answer."
)

FLASHRAG_TRAIN = {
    "nq": [
        {"id": "train_0", "question": "total number of death row inmates in the us", "golden_answers": ["2,718"], "metadata": {}},
        {"id": "train_1", "question": "big little lies season 2 how many episodes", "golden_answers": ["seven"], "metadata": {}},
    ],
    "hotpotqa": [
        {
            "id": "train_0",
            "question": "Which magazine was started first Arthur's Magazine or First for Women?",
            "golden_answers": ["Arthur's Magazine"],
            "metadata": {"type": "comparison"},
        },
        {
            "id": "train_1",
            "question": "The Oberoi family is part of a hotel company that has a head office in what city",
            "golden_answers": ["Delhi"],
            "metadata": {"type": "bridge"},
        },
    ],
}
GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her friends in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April "
        "and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A shop sold 1,200 apples on Monday and twice as many on Tuesday. How many apples did it sell in all?",
        "answer": "On Tuesday it sold 2 x 1,200 = <<2*1200=2400>>2,400.\nIn all 1,200 + 2,400 = <<1200+2400=3600>>3,600.\n#### 3,600",
    },
]
MATH_LIGHTEVAL = [
    {
        "problem": "How many vertical asymptotes does the graph of $y=\\frac{2}{x^2+x-6}$ have?",
        "level": "Level 3",
        "type": "Algebra",
        "solution": "The denominator factors into $(x-2)(x+3)$, zero at $x = 2$ and $x = -3$, so there are $\\boxed{2}$ asymptotes.",
    },
    {
        "problem": "Find the distance between the foci of the ellipse \\[x^2 + 4y^2 = 400.\\]",
        "level": "Level 3",
        "type": "Intermediate Algebra",
        "solution": "Dividing by 400, the distance is $2\\sqrt{20^2-10^2} = \\boxed{20\\sqrt3}$.",
    },
]
DEEPMATH = [
    {"question": "Evaluate the limit: \\[ \\lim_{x \\to 0} \\frac{\\sin 3x}{x} \\]", "final_answer": "3", "difficulty": 2.0},
    {"question": "Is every bounded monotone sequence of real numbers convergent?", "final_answer": "Yes", "difficulty": 3.0},
    {"question": "Compute $\\int_0^1 x^2\\,dx$.", "final_answer": "\\dfrac{1}{3}", "difficulty": 1.5},
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?", "final_answer": "72", "difficulty": 1.0},
]
NUMINA_TIR = [
    {
        "problem": "What is the coefficient of $x^2y^6$ in the expansion of $\\left(\\frac{3}{5}x-\\frac{y}{2}\\right)^8$?",
        "solution": "We use the binomial theorem.\n```python\nfrom sympy import binomial\n```\n```output\n63/400\n```\n"
        "The coefficient is $\\boxed{\\frac{63}{400}}$.",
        "messages": [{"role": "user", "content": "What is the coefficient?"}, {"role": "assistant", "content": "We use ..."}],
    },
    {
        "problem": "How many positive divisors does 6! have?",
        "solution": "We have $6! = 720 = 2^4 3^2 5$, so the count is $5\\cdot3\\cdot2=\\boxed{30}$.",
        "messages": [{"role": "user", "content": "How many positive divisors does 6! have?"}, {"role": "assistant", "content": "..."}],
    },
]
FLASHRAG_MULTIPLE_CHOICE = [
    {
        "id": "test_0",
        "question": "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.",
        "golden_answers": [1],
        "choices": ["0", "4", "2", "6"],
        "metadata": {"subject": "abstract_algebra"},
    },
    {
        "id": "test_1",
        "question": "Which of these would let the most heat travel through?",
        "golden_answers": [1],
        "choices": ["a new pair of jeans", "a steel spoon in a cafeteria", "a cotton candy at a store", "a cotton hat"],
        "metadata": {},
    },
]


def choices_layout(question: str, choices: list[str]) -> str:
    return question + "\n\n" + "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices))


def search_r1_merged(out: Path):
    """qa_search_train_merge.py over NQ and HotpotQA: a question stripped, '?' appended."""
    import datasets

    def mapper(source):
        def process(example, index):
            example["question"] = example["question"].strip()
            if example["question"][-1] != "?":
                example["question"] += "?"
            return {
                "data_source": source,
                "prompt": [{"role": "user", "content": SEARCH_R1_PREFIX.format(question=example["question"])}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": example["golden_answers"]}},
                "extra_info": {"split": "train", "index": index},
            }

        return process

    parts = [datasets.Dataset.from_list(rows).map(mapper(source), with_indices=True) for source, rows in FLASHRAG_TRAIN.items()]
    path = out / "search_r1_merge" / "train.parquet"
    path.parent.mkdir(parents=True)
    datasets.concatenate_datasets(parts).to_parquet(str(path))
    expected = [
        (row["question"].strip().rstrip("?") + "?", row["golden_answers"], "qa") for rows in FLASHRAG_TRAIN.values() for row in rows
    ]
    return path, expected


def gsm8k_datasets_folder(out: Path):
    """openai/gsm8k's train and test splits, ``save_to_disk`` as load_dataset gives them."""
    import datasets

    rows = datasets.Dataset.from_list(GSM8K)
    path = out / "gsm8k_disk"
    datasets.DatasetDict(train=rows.select(range(1)), test=rows).save_to_disk(str(path))
    return path, [(row["question"], [row["answer"].split("####")[-1].strip().replace(",", "")], "math") for row in GSM8K]


def verl_gsm8k_folder(out: Path):
    """verl's gsm8k.py: train.parquet and test.parquet in one folder."""
    import datasets

    def mapper(split):
        def process(example, index):
            question, answer = example.pop("question"), example.pop("answer")
            number = re.search(r"#### (\-?[0-9\.\,]+)", answer).group(1).replace(",", "")
            return {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question + " " + VERL_GSM8K_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": number},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }

        return process

    path = out / "verl_gsm8k"
    path.mkdir()
    rows = datasets.Dataset.from_list(GSM8K)
    rows.select(range(2)).map(mapper("train"), with_indices=True).to_parquet(str(path / "train.parquet"))
    rows.map(mapper("test"), with_indices=True).to_parquet(str(path / "test.parquet"))
    return path, [(row["question"], [row["answer"].split("####")[-1].strip().replace(",", "")], "math") for row in GSM8K]


def verl_math_folder(out: Path):
    """verl's math_dataset.py: the instruction in the user turn, the last box as ground truth, an
    example row as JSON beside the parquet."""
    import datasets

    def last_box(text: str) -> str:
        start = text.rfind("\\boxed{") + len("\\boxed{")
        depth, end = 1, start
        while depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        return text[start : end - 1]

    def process(example, index):
        question = example.pop("problem") + " " + VERL_MATH_INSTRUCTION
        return {
            "data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": last_box(example.pop("solution"))},
            "extra_info": {"split": "train", "index": index},
        }

    path = out / "verl_math"
    path.mkdir()
    rows = datasets.Dataset.from_list(MATH_LIGHTEVAL).map(process, with_indices=True)
    rows.to_parquet(str(path / "train.parquet"))
    (path / "train_example.json").write_text(json.dumps(rows[0], indent=2))
    return path, [(row["problem"], [last_box(row["solution"])], "math") for row in MATH_LIGHTEVAL]


def trl_deepmath_folder(out: Path):
    """deepmath_103k.py: prompt and solution, a train/test split saved to disk (the test split read)."""
    import datasets

    def process(example):
        solution = example["final_answer"]
        if solution not in ("True", "False", "Yes", "No"):
            solution = f"${solution}$"
        return {"prompt": [{"role": "user", "content": example["question"]}], "solution": solution}

    rows = datasets.Dataset.from_list(DEEPMATH)
    rows = rows.map(process, remove_columns=rows.column_names)
    path = out / "trl_deepmath"
    datasets.DatasetDict(train=rows.select(range(1)), test=rows).save_to_disk(str(path))
    expected = []
    for row in DEEPMATH:
        bare = row["final_answer"] in ("True", "False", "Yes", "No")
        expected.append((row["question"], [row["final_answer"] if bare else f"${row['final_answer']}$"], "qa" if bare else "math"))
    return path, expected


def trl_numina_tir(out: Path):
    """rloo.py over NuminaMath-TIR: a system turn and the problem; the worked solution kept."""
    import datasets

    rows = datasets.Dataset.from_list(NUMINA_TIR)
    rows = rows.map(
        lambda example: {"prompt": [{"role": "system", "content": TRL_SYSTEM}, {"role": "user", "content": example["problem"]}]},
        remove_columns=["messages", "problem"],
    )
    path = out / "trl_numina_tir.parquet"
    rows.to_parquet(str(path))
    return path, [(NUMINA_TIR[0]["problem"], ["\\frac{63}{400}"], "math"), (NUMINA_TIR[1]["problem"], ["30"], "math")]


def flashrag_multiple_choice(out: Path):
    """FlashRAG's multiple-choice JSONL, golden_answers indexing choices."""
    path = out / "flashrag_mmlu_test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in FLASHRAG_MULTIPLE_CHOICE))
    return path, [
        (choices_layout(row["question"], row["choices"]), [row["choices"][i] for i in row["golden_answers"]], "qa")
        for row in FLASHRAG_MULTIPLE_CHOICE
    ]


PRODUCERS = {
    "search_r1_merged": search_r1_merged,
    "gsm8k_datasets_folder": gsm8k_datasets_folder,
    "verl_gsm8k_folder": verl_gsm8k_folder,
    "verl_math_folder": verl_math_folder,
    "trl_deepmath_folder": trl_deepmath_folder,
    "trl_numina_tir": trl_numina_tir,
    "flashrag_multiple_choice": flashrag_multiple_choice,
}
# the split to read where a producer's folder holds several
SPLITS = {"gsm8k_datasets_folder": "test", "verl_gsm8k_folder": "test", "trl_deepmath_folder": "test"}

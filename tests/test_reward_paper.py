"""Paper-mode reward and validation score against the paper's own code paths, on random groups.

The expectations come from a transcription of the released reward, written here from the
reference's description of it (../shared/reference/paper_rl.md §4.3-4.4: ``efficiency.compute_score``
and ``default_compute_score``; paper_data_stages.md §1.6: ``count_valid_tags`` and
``validate_format``), not from rl/reward.py. It is restricted to answers on which the MATH
string strip only deletes spaces (plain words and integers), so it need not transcribe the
whole strip; the groups mix answers with and without articles, yes/no answers, boxes inside and
outside the answer block, missing blocks, and responses whose tool tags are never closed.
"""

from __future__ import annotations

import math
import random
import re
import string

import pytest

from rl.reward import efficiency_reward, validation_score

# --- the paper's code paths, transcribed ------------------------------------------------------


def count_valid_tags(text: str, tag: str) -> int:
    count, cursor = 0, 0
    while True:
        start = text.find(f"<{tag}>", cursor)
        if start == -1:
            return count
        end = text.find(f"</{tag}>", start)
        if end == -1:
            return count
        count += 1
        cursor = end + len(f"</{tag}>")


def validate_format(text: str) -> bool:
    if text.count("<think>") != text.count("</think>") or text.count("<think>") == 0:
        return False
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    for tag in ("search", "python"):
        cursor = 0
        while (start := text.find(f"<{tag}>", cursor)) != -1:
            close = text.find(f"</{tag}>", start)
            result = text.find("<result>", close) if close != -1 else -1
            result_end = text.find("</result>", result) if result != -1 else -1
            if result_end == -1:
                return False
            cursor = result_end + len("</result>")
    start, end = text.find("<answer>"), text.find("</answer>")
    if start > end:
        return False
    inside = text[start:end]
    return "\\boxed{" in inside and "}" in inside


def last_boxed_content(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def answer_span(text: str) -> str | None:
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end != -1 else -1
    return None if start == -1 else text[start + len("<answer>") : end]


def normalize_answer(s: str) -> str:  # SQuAD's
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def strip_string_words(s: str) -> str:
    """strip_string(deepsearch=True) on plain words and integers: the spaces go."""
    return s.replace("\n", "").replace(" ", "")


def get_f1_score(prediction: str, ground_truth: str) -> float:
    pred = strip_string_words(normalize_answer(prediction))
    gold = strip_string_words(normalize_answer(ground_truth))
    if pred in ("yes", "no", "noanswer") and pred != gold:
        return 0.0
    if gold in ("yes", "no", "noanswer") and pred != gold:
        return 0.0
    common = sum(min(pred.split().count(t), gold.split().count(t)) for t in set(pred.split()))
    if common == 0:
        return 0.0
    precision, recall = common / len(pred.split()), common / len(gold.split())
    return 2 * precision * recall / (precision + recall)


def raw_score(data_source: str, response: str, golds: list[str]) -> float:
    if data_source == "math_effi_rl":
        if answer_span(response) is None:
            return 0.0
        boxed = last_boxed_content(response)  # of the whole response
        return float(boxed is not None and strip_string_words(boxed) == strip_string_words(golds[0]))
    span = answer_span(response)
    boxed = last_boxed_content(span) if span is not None else None
    if boxed is None:
        return 0.0
    return max(get_f1_score(boxed, g) for g in golds)


def compute_score(data_source: str, responses: list[str], golds: list[str], lengths: list[int], sigma_tool: float, sigma_length: float):
    calls = [count_valid_tags(r, "search") + count_valid_tags(r, "python") for r in responses]
    mean_calls = sum(calls) / len(calls)
    mu = sum(lengths) / len(lengths)
    sd = math.sqrt(sum((x - mu) ** 2 for x in lengths) / len(lengths))
    z = [0.0] * len(lengths) if sd == 0 else [(x - mu) / sd for x in lengths]
    mean_z = sum(z) / len(z)
    scores = []
    for r, t, zi in zip(responses, calls, z):
        f_tool = 2 / (1 + math.exp(sigma_tool * (t - mean_calls)))
        f_length = 2 / (1 + math.exp(sigma_length * (zi - mean_z)))
        f_format = 0.0 if validate_format(r) else -1.0
        scores.append(raw_score(data_source, r, golds) * f_tool * f_length + f_format)
    return scores


def default_compute_score(data_source: str, response: str, golds: list[str]) -> float:
    if data_source == "math_effi_rl":
        if not validate_format(response) or answer_span(response) is None:
            return -1.0
        return raw_score(data_source, response, golds)
    span = answer_span(response)
    if not validate_format(response) or span is None or last_boxed_content(span) is None:
        return -1.0
    f1 = raw_score(data_source, response, golds)
    return f1 + 0.1 if "</search>" in response and "</python>" in response and f1 > 0 else f1


# --- random groups ----------------------------------------------------------------------------

QA_GOLDS = [["the Kess river"], ["Kess River", "Pell"], ["a Lorn bridge"], ["yes"], ["no"], ["Ardo"]]
QA_ANSWERS = [
    "Kess River",
    "the Kess river",
    "theKess river",
    "kess",
    "Pell",
    "a Lorn bridge",
    "Lorn Bridge",
    "yes",
    "no",
    "Ardo",
    "an Ardo",
]
MATH_GOLDS = [["42"], ["41", "42"], ["7"], ["1 000"]]
MATH_ANSWERS = ["42", "41", "7", "1000", "1 000", "4 2"]


def random_response(rng: random.Random, answers: list[str]) -> str:
    parts = ["<think>let me see</think>" if rng.random() < 0.9 else ""]
    for _ in range(rng.randint(0, 3)):
        tool = rng.choice(["search", "python"])
        shape = rng.random()
        if shape < 0.7:  # a complete call with its result
            parts.append(f"<{tool}>q</{tool}> <result>\nr\n</result><think>then</think>")
        elif shape < 0.85:  # an opening tag never closed
            parts.append(f"<{tool}>q ")
        else:  # closed, but no result after it
            parts.append(f"<{tool}>q</{tool}><think>no result</think>")
    answer = rng.choice(answers)
    shape = rng.random()
    if shape < 0.65:
        parts.append(f"<answer>The final answer is \\[ \\boxed{{{answer}}} \\]</answer>")
    elif shape < 0.75:
        parts.append(f"<answer>{answer}</answer>")  # no box
    elif shape < 0.85:
        parts.append(f"\\boxed{{{answer}}}")  # no answer block
    else:
        parts.append(f"<answer>\\boxed{{{rng.choice(answers)}}}</answer> so \\boxed{{{answer}}}")  # a box after the block
    if rng.random() < 0.1:
        parts.append(f"<{rng.choice(['search', 'python'])}>")  # an unclosed tag at the very end
    return "".join(parts)


@pytest.mark.parametrize("data_source", ["qa_effi_rl", "math_effi_rl"])
def test_paper_mode_reward_equals_the_papers_compute_score(data_source):
    rng = random.Random(f"paper/{data_source}")
    golds_pool, answers = (QA_GOLDS, QA_ANSWERS) if data_source == "qa_effi_rl" else (MATH_GOLDS, MATH_ANSWERS)
    unclosed = penalised = 0
    for _ in range(300):
        golds = rng.choice(golds_pool)
        responses = [random_response(rng, answers) for _ in range(rng.randint(1, 8))]
        lengths = [rng.randint(10, 400) for _ in responses]
        sigma_tool, sigma_length = rng.choice([0.0, 0.2, 1.0]), rng.choice([0.0, 0.5, 2.0])
        ours = efficiency_reward(data_source, golds, responses, lengths, sigma_tool, sigma_length, mode="paper")
        assert ours.rewards == pytest.approx(compute_score(data_source, responses, golds, lengths, sigma_tool, sigma_length), abs=1e-12)
        for response in responses:
            assert validation_score(data_source, response, golds) == pytest.approx(default_compute_score(data_source, response, golds))
            if any(count_valid_tags(response, t) < response.count(f"<{t}>") for t in ("search", "python")):
                unclosed += 1
                penalised += not validate_format(response)
    # the groups did exercise unclosed tool tags, most of which the paper penalises (not all: an
    # opening tag followed later by a complete call passes its scan)
    assert unclosed > 50 and penalised > 50


def test_the_papers_examples():
    """The reference's worked cases: "Kess River" against "the Kess river" is right (the article
    is normalised away before the spaces go), "theKess river" is wrong; an unclosed tool tag
    costs the format penalty."""
    answer = "<think>a</think><answer>\\boxed{%s}</answer>"
    assert efficiency_reward("qa_effi_rl", ["the Kess river"], [answer % "Kess River"], [5], 0, 0, "paper").rewards == [1.0]
    assert efficiency_reward("qa_effi_rl", ["the Kess river"], [answer % "theKess river"], [5], 0, 0, "paper").rewards == [0.0]
    unclosed = "<think>a</think><search>Kess<answer>\\boxed{Kess River}</answer>"
    assert efficiency_reward("qa_effi_rl", ["the Kess river"], [unclosed], [5], 0, 0, "paper").rewards == [0.0]
    assert validation_score("qa_effi_rl", unclosed, ["the Kess river"]) == -1.0

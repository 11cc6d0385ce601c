"""Paper-mode reward and validation score against a transcription of the paper's released code, on
10,000+ responses drawn from the format's grammar.

The transcription below follows the released functions step by step (ET-Agent,
``ARPO/verl_arpo_entropy/verl/utils/reward_score/``: ``validate_format.py``, ``math.py``,
``deep_research.py``, ``efficiency.py``, ``__init__.py::default_compute_score``), with their
quirks: the first answer block (a lazy regex), ``last_boxed_only_string`` with its ``"\\boxed "``
rule and its ``\\fbox`` fallback, the ``[7:-1]`` slicing, ``remove_boxed``'s assertions, the MATH
strip that raises on malformed answers (and ``is_equiv`` falling back to plain equality), the
F1's normalisation order, and ``validate_format``'s look-ups from each opening tag. It is written
from those files, not from rl/paper_reward.py, and kept close to their structure so that the two
can be read side by side.

The generator covers what an earlier set of 300 hand-shaped groups missed: any number of calls
of both tools, missing and extra closing tags, a result before the closing tag, tags and answer
blocks inside results, zero, one or two answer blocks (and stray halves), every box form
(``\\boxed{}``, nested braces, ``\\boxed x`` with and without ``$``, ``\\fbox{}``, unclosed,
several boxes, boxes outside the block), math and QA answers in many spellings, and sigmas in
[0, 1].
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import subprocess
import sys
from collections import Counter

import pytest

from etagent.rl.paper_reward import validation_score
from etagent.rl.reward import efficiency_reward, kind_of

# --- the released code, transcribed -----------------------------------------------------------


def ref_count_valid_tags(text: str, tag: str) -> int:
    count, current = 0, 0
    while True:
        start = text.find(f"<{tag}>", current)
        if start == -1:
            break
        end = text.find(f"</{tag}>", start + len(f"<{tag}>"))
        if end == -1:
            break
        count += 1
        current = end + len(f"</{tag}>")
    return count


def ref_validate_format(text: str) -> bool:
    if text.count("<think>") != text.count("</think>"):
        return False
    if text.count("<think>") == 0 or text.count("</think>") == 0:
        return False
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    for tool in ("search", "python"):
        current = 0
        while True:
            tool_pos = text.find(f"<{tool}>", current)
            if tool_pos == -1:
                break
            result_pos = text.find("<result>", tool_pos)
            tool_end_pos = text.find(f"</{tool}>", tool_pos)
            result_end_pos = text.find("</result>", result_pos)  # from -1 when there is no <result>, as released
            if -1 in (result_pos, tool_end_pos, result_end_pos):
                return False
            if not (tool_pos < tool_end_pos < result_pos < result_end_pos):
                return False
            current = result_end_pos
    answer_start, answer_end = text.find("<answer>"), text.find("</answer>")
    if answer_start > answer_end:
        return False
    answer = text[answer_start:answer_end]
    return "\\boxed{" in answer and "}" in answer


def ref_extract_answer(text: str) -> str | None:
    match = re.search(r"<answer>(.*?)</answer>", text.strip(), re.DOTALL)
    return match.group(1) if match else None


def ref_last_boxed_only_string(s: str) -> str | None:
    idx = s.rfind("\\boxed")
    if "\\boxed " in s:
        return "\\boxed " + s.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = s.rfind("\\fbox")
        if idx < 0:
            return None
    i, right, open_braces = idx, None, 0
    while i < len(s):
        if s[i] == "{":
            open_braces += 1
        if s[i] == "}":
            open_braces -= 1
            if open_braces == 0:
                right = i
                break
        i += 1
    return None if right is None else s[idx : right + 1]


def ref_remove_boxed(s: str) -> str:
    if "\\boxed " in s:
        assert s[: len("\\boxed ")] == "\\boxed "
        return s[len("\\boxed ") :]
    assert s[: len("\\boxed{")] == "\\boxed{"
    assert s[-1] == "}"
    return s[len("\\boxed{") : -1]


def ref_fix_fracs(s: str) -> str:
    substrs = s.split("\\frac")
    new = substrs[0]
    for sub in substrs[1:]:
        new += "\\frac"
        if sub[0] == "{":  # IndexError on an empty piece, as released
            new += sub
        else:
            if len(sub) < 2:
                return s
            a, b = sub[0], sub[1]
            new += ("{" + a + "}{" + b + "}" + sub[2:]) if b != "{" else ("{" + a + "}" + b + sub[2:])
    return new


def ref_fix_a_slash_b(s: str) -> str:
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        a, b = int(a), int(b)
        assert s == f"{a}/{b}"
        return "\\frac{" + str(a) + "}{" + str(b) + "}"
    except Exception:
        return s


def ref_remove_right_units(s: str) -> str:
    if "\\text{ " in s:
        splits = s.split("\\text{ ")
        assert len(splits) == 2
        return splits[0]
    return s


def ref_remove_right_units_deepsearch(s: str) -> str:
    i, n, out = 0, len(s), []
    while i < n:
        if s.startswith("\\text", i):
            j = i + 5
            while j < n and s[j].isspace():
                j += 1
            if j < n and s[j] == "{":
                j += 1
                depth, content = 1, []
                while j < n and depth > 0:
                    ch = s[j]
                    if ch == "{":
                        depth += 1
                        content.append(ch)
                    elif ch == "}":
                        depth -= 1
                        if depth == 0:
                            j += 1
                            break
                        content.append(ch)
                    else:
                        content.append(ch)
                    j += 1
                out.append("".join(content) if depth == 0 else s[i:j])
                i = j
            else:
                out.append("\\text")
                i += 5
        else:
            out.append(s[i])
            i += 1
    return re.sub(r"[ \t]+", " ", "".join(out)).strip()


def ref_fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    splits = s.split("\\sqrt")
    new = splits[0]
    for piece in splits[1:]:
        if piece[0] != "{":  # IndexError on an empty piece, as released
            new += "\\sqrt{" + piece[0] + "}" + piece[1:]
        else:
            new += "\\sqrt" + piece
    return new


def ref_strip_string(s, deepsearch: bool = False) -> str:
    if not isinstance(s, str):
        s = str(s)
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = ref_remove_right_units_deepsearch(s) if deepsearch else ref_remove_right_units(s)
    s = s.replace("\\%", "").replace("\\%", "")  # the released "\%" is the same two characters
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if len(s) == 0:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = ref_fix_sqrt(s)
    s = s.replace(" ", "")
    s = ref_fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return ref_fix_a_slash_b(s)


def ref_is_equiv(a, b) -> bool:
    if a is None and b is None:
        return True
    if a is None or b is None:
        return False
    try:
        return ref_strip_string(a) == ref_strip_string(b)
    except Exception:
        return a == b


def ref_normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def ref_get_f1_score(prediction: str, ground_truths) -> float:
    if isinstance(ground_truths, str):
        ground_truths = [ground_truths]
    best = 0
    for gold in ground_truths:
        pred = ref_strip_string(ref_normalize_answer(prediction), deepsearch=True)
        ref = ref_strip_string(ref_normalize_answer(gold), deepsearch=True)
        if pred in ["yes", "no", "noanswer"] and pred != ref:
            continue
        if ref in ["yes", "no", "noanswer"] and pred != ref:
            continue
        pred_tokens, ref_tokens = pred.split(), ref.split()
        same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(ref_tokens)
        best = max(best, 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0)
    return best


def ref_compute_score_math(solution: str, ground_truth) -> float:
    if isinstance(ground_truth, list):
        ground_truth = ground_truth[0]
    if ref_extract_answer(solution) is None:
        return 0
    score = 0
    try:
        boxed = ref_last_boxed_only_string(solution)
        if boxed is not None:
            answer = boxed[7:-1] if boxed.startswith("\\boxed") and boxed.endswith("}") else boxed
            score = 1.0 if ref_is_equiv(answer, ground_truth) else 0.0
            ref_get_f1_score(answer, ground_truth)
    except Exception:
        pass
    return score


def ref_compute_score_deep_research(solution: str, ground_truth) -> float:
    answer_part = ref_extract_answer(solution)
    if answer_part is None:
        return 0
    try:
        boxed = ref_last_boxed_only_string(answer_part)
        answer = boxed[7:-1] if boxed.startswith("\\boxed") and boxed.endswith("}") else boxed
    except Exception:  # AttributeError on None: "find box error"
        return 0
    return ref_get_f1_score(answer, ground_truth)


def ref_compute_score(data_source, solution, ground_truth, current_length, other_solutions, other_lengths, sigma_tool, sigma_length):
    if data_source == "math_effi_rl":
        score_func = ref_compute_score_math
    elif data_source == "qa_effi_rl":
        score_func = ref_compute_score_deep_research
    else:
        raise NotImplementedError(data_source)
    solutions = [solution] + other_solutions
    tool_calls = [ref_count_valid_tags(s, "search") + ref_count_valid_tags(s, "python") for s in solutions]
    average_tool_calls = sum(tool_calls) / len(tool_calls)
    lengths = [current_length] + other_lengths
    mean_len = sum(lengths) / len(lengths)
    std_len = math.sqrt(sum((x - mean_len) ** 2 for x in lengths) / len(lengths))
    normalized = [0.0 for _ in lengths] if std_len == 0 else [(x - mean_len) / std_len for x in lengths]
    raw = score_func(solution, ground_truth)
    tool_call = ref_count_valid_tags(solution, "search") + ref_count_valid_tags(solution, "python")
    f_tool = 2 / (1 + math.exp(sigma_tool * (tool_call - average_tool_calls)))
    f_length = 2 / (1 + math.exp(sigma_length * (normalized[0] - sum(normalized) / len(normalized))))
    f_format = 0 if ref_validate_format(solution) else -1
    return raw * f_tool * f_length + f_format, raw, tool_call


def ref_validation_math(solution: str, ground_truth) -> float:  # math.compute_score
    if isinstance(ground_truth, list):
        ground_truth = ground_truth[0]
    if not ref_validate_format(solution) or ref_extract_answer(solution) is None:
        return -1
    score = -1
    try:
        boxed = ref_last_boxed_only_string(solution)
        if boxed is not None:
            answer = boxed[7:-1] if boxed.startswith("\\boxed") and boxed.endswith("}") else boxed
            score = 1.0 if ref_is_equiv(answer, ground_truth) else 0.0
            ref_get_f1_score(answer, ground_truth)
    except Exception:
        pass
    return score


def ref_validation_qa(solution: str, ground_truth) -> float:  # deep_research.compute_score
    if not ref_validate_format(solution):
        return -1
    answer_part = ref_extract_answer(solution)
    if answer_part is None:
        return -1
    try:
        answer = ref_remove_boxed(ref_last_boxed_only_string(answer_part))
    except Exception:
        return -1
    f1 = ref_get_f1_score(answer, ground_truth)
    if f1 > 0 and "</search>" in solution and "</python>" in solution:
        return f1 + 0.1
    return f1 if f1 > 0 else 0


def ref_default_compute_score(data_source: str, solution: str, ground_truth) -> float:
    if data_source == "math_effi_rl":
        return ref_validation_math(solution, ground_truth)
    if data_source == "qa_effi_rl":
        return ref_validation_qa(solution, ground_truth)
    raise NotImplementedError(data_source)


# --- responses drawn from the format's grammar ------------------------------------------------

QA_GOLDS = [["the Kess river"], ["Kess River", "Pell"], ["a Lorn bridge"], ["yes"], ["no"], ["Ardo"], ["1917"], ["Dfrac Hall"]]
QA_ANSWERS = [
    "Kess River", "the Kess river", "theKess river", "kess", "river Kess", "Kess, River!", "Pell", "pell.",
    "a Lorn bridge", "Lorn Bridge", "Lorn-Bridge", "yes", "Yes.", "no", "noanswer", "Ardo", "an Ardo", "1917",
    "\\text{Kess River}", "\\text{ Kess} River", "dfrac hall", "tfrac Hall", "", "  ", "Kess\tRiver", "Kess\u00a0River",
]  # fmt: skip
MATH_GOLDS = [["42"], ["41", "42"], ["\\frac{1}{2}"], ["0.5"], ["50\\%"], ["\\sqrt{2}"], ["3"], ["2 \\text{ cm}"], ["1/2"]]
MATH_ANSWERS = [
    "42", "41", "4 2", "042", "\\frac{1}{2}", "\\frac12", "\\dfrac{1}{2}", "\\tfrac12", "1/2", "0.5", ".5", "1 / 2",
    "50\\%", "50%", "50", "\\sqrt{2}", "\\sqrt2", "\\sqrt", "2\\sqrt", "\\frac", "x = 3", "x=3", "3", "3^\\circ",
    "3^{\\circ}", "\\left(3\\right)", "(3)", "2 \\text{ cm}", "2", "2 \\text{ cm} \\text{ m}", "\\$42", "\\!42",
    "42\\\\", "{.5}", "1_0/2", "\\frac{1}2", "\\frac1", "", "\\text{42}", "\\text {42}",
]  # fmt: skip
BOX_FORMS = [
    "\\boxed{%s}", "\\boxed{%s}", "\\boxed{%s}", "\\boxed{{%s}}", "\\boxed %s", "\\boxed %s$ then", "$\\boxed %s$",
    "\\fbox{%s}", "\\boxed{%s", "\\boxed{\\text{%s}}", "\\boxed{%s}}", "\\boxedx{%s}", "\\boxed}{%s}", "%s",
    "\\boxed{%s} or \\boxed{%s}",
]  # fmt: skip
RESULT_TEXTS = [
    "r", "", "\nDoc 1: the Kess river\n", "<answer>\\boxed{%s}</answer>", "\\boxed{%s}", "<search>x</search>",
    "</search>", "<python>", "</python> <result>", "<think>", "</think>", "<answer>", "</answer>", "\\boxed %s",
]  # fmt: skip


def _box(rng: random.Random, answers: list[str]) -> str:
    form = rng.choice(BOX_FORMS)
    return form % tuple(rng.choice(answers) for _ in range(form.count("%s")))


def _tool_call(rng: random.Random, answers: list[str]) -> str:
    tool = rng.choice(["search", "python"])
    result = rng.choice(RESULT_TEXTS)
    result = result % rng.choice(answers) if "%s" in result else result
    shape = rng.random()
    if shape < 0.55:
        return f"<{tool}>q</{tool}> <result>{result}</result>"
    return rng.choice(
        [
            f"<{tool}>q ",  # never closed
            f"<{tool}>q <result>{result}</result>",  # no closing tag
            f"<{tool}>q</{tool}>",  # no result
            f"<{tool}>q <result>{result}</result></{tool}>",  # a result before the closing tag
            f"<{tool}>q</{tool}></{tool}> <result>{result}</result>",  # an extra closing tag
            f"<{tool}>q</{tool}> <result>{result}",  # a result never closed
            f"</{tool}><{tool}>q</{tool}><result>{result}</result></result>",  # stray closers
        ]
    )


def _answer_block(rng: random.Random, answers: list[str]) -> str:
    shape = rng.random()
    if shape < 0.75:
        return f"<answer>The final answer is \\[ {_box(rng, answers)} \\]</answer>"
    return rng.choice(["<answer>" + _box(rng, answers), _box(rng, answers) + "</answer>", f"</answer>{_box(rng, answers)}<answer>"])


def well_formed_response(rng: random.Random, answers: list[str]) -> str:
    """Paired thinks, complete calls (their results may still hold tags), one answer block."""
    parts = ["<think>let me see</think>"]
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        tool, result = rng.choice(["search", "python"]), rng.choice(RESULT_TEXTS[:4])
        parts.append(f"<{tool}>q</{tool}> <result>{result % rng.choice(answers) if '%s' in result else result}</result>")
        parts.append("<think>then</think>")
    box = f"\\boxed{{{rng.choice(answers)}}}" if rng.random() < 0.6 else _box(rng, answers)
    parts.append(f"<answer>The final answer is \\[ {box} \\]</answer>")
    return "".join(parts)


def random_response(rng: random.Random, answers: list[str]) -> str:
    if rng.random() < 0.45:
        return well_formed_response(rng, answers)
    parts = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        parts.append(rng.choice(["<think>let me see</think>", "<think>let me see</think>", "<think>open", "close</think>"]))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 4, 6])):
        parts.append(_tool_call(rng, answers))
        if rng.random() < 0.6:
            parts.append("<think>then</think>")
    if rng.random() < 0.15:
        parts.append(f"I think it is {_box(rng, answers)}.")  # a box outside any block
    for _ in range(rng.choice([0, 1, 1, 1, 1, 1, 2])):
        parts.append(_answer_block(rng, answers))
    if rng.random() < 0.15:
        parts.append(f" so {_box(rng, answers)}")  # a box after the block
    if rng.random() < 0.05:
        parts.append(f"<{rng.choice(['search', 'python'])}>")  # a tag left open at the very end
    return rng.choice(["", " ", "\n"]) + "".join(parts) + rng.choice(["", "\n"])


def random_groups(seed: str, n_responses: int):
    rng = random.Random(seed)
    drawn = 0
    while drawn < n_responses:
        data_source = rng.choice(["qa_effi_rl", "math_effi_rl"])
        golds_pool, answers = (QA_GOLDS, QA_ANSWERS) if data_source == "qa_effi_rl" else (MATH_GOLDS, MATH_ANSWERS)
        golds = rng.choice(golds_pool)
        answers = answers + golds * 8  # right answers, written as the gold is, often enough
        responses = [random_response(rng, answers) for _ in range(rng.randint(1, 8))]
        lengths = [rng.choice([rng.randint(1, 400), 50]) for _ in responses]
        drawn += len(responses)
        yield data_source, golds, responses, lengths, rng.uniform(0, 1), rng.uniform(0, 1)


def reference_group(data_source, golds, responses, lengths, sigma_tool, sigma_length):
    """The released manager's call for each response: itself, then the rest of its group."""
    out = []
    for i, response in enumerate(responses):
        others = responses[:i] + responses[i + 1 :]
        other_lengths = lengths[:i] + lengths[i + 1 :]
        out.append(ref_compute_score(data_source, response, golds, lengths[i], others, other_lengths, sigma_tool, sigma_length))
    return out


def test_paper_mode_equals_the_released_code_on_10000_generated_responses():
    n = checked = 0
    disagreements = []
    shapes = Counter()
    for data_source, golds, responses, lengths, sigma_tool, sigma_length in random_groups("paper-reward", 10_000):
        ours = efficiency_reward(data_source, golds, responses, lengths, sigma_tool, sigma_length, mode="paper")
        for k, (reward, raw, calls) in enumerate(reference_group(data_source, golds, responses, lengths, sigma_tool, sigma_length)):
            n += 1
            response = responses[k]
            theirs = (reward, raw, calls, ref_default_compute_score(data_source, response, golds))
            mine = (ours.rewards[k], ours.raw[k], ours.tool_calls[k], validation_score(kind_of(data_source), response, golds))
            if not all(math.isclose(a, b, rel_tol=0, abs_tol=1e-9) for a, b in zip(mine, theirs)):
                disagreements.append((data_source, golds, response, mine, theirs))
            checked += 1
            shapes["valid format"] += ref_validate_format(response)
            shapes["raw > 0"] += raw > 0
            shapes["fbox or boxed-space last"] += (ref_last_boxed_only_string(response) or "").startswith(("\\fbox", "\\boxed "))
            shapes["two answer blocks"] += response.count("<answer>") >= 2 and response.count("</answer>") >= 2
            shapes["call missing its closing tag"] += any(
                ref_count_valid_tags(response, t) < response.count(f"<{t}>") for t in ("search", "python")
            )
            shapes["validation -1"] += theirs[3] == -1
    assert checked >= 10_000
    assert not disagreements, f"{len(disagreements)} of {n} differ; first: {disagreements[0]}"
    # the generator reached every shape it is for, each many times
    assert all(count > 300 for count in shapes.values()) and shapes["valid format"] < n - 300, shapes


def test_the_released_codes_quirks_by_example():
    """The cases the issue named, one by one: the first of two answer blocks counts; ``\\fbox``
    and ``\\boxed x`` score 0; a call missing its closing tag borrows the next call's and fails."""
    think = "<think>a</think>"
    two_blocks = think + "<answer>\\boxed{Pell}</answer><answer>\\boxed{Kess}</answer>"
    assert efficiency_reward("qa_effi_rl", ["Pell"], [two_blocks], [5], 0, 0, "paper").raw == [1.0]
    assert efficiency_reward("qa_effi_rl", ["Kess"], [two_blocks], [5], 0, 0, "paper").raw == [0.0]
    for box in ("\\fbox{42}", "\\boxed 42"):
        response = think + f"<answer>{box}</answer>"
        assert efficiency_reward("math_effi_rl", ["42"], [response], [5], 0, 0, "paper").raw == [0.0]
        assert efficiency_reward("math_effi_rl", ["42"], [response], [5], 0, 0, "default").raw == [1.0]
    borrowed = think + "<search>q1 <result>r</result><search>q2</search><result>r</result>" + think + "<answer>\\boxed{1}</answer>"
    assert efficiency_reward("math_effi_rl", ["1"], [borrowed], [5], 0, 0, "paper").rewards == [0.0]  # 1 - 1
    assert ref_validate_format(borrowed) is False


def test_the_reward_command_in_paper_mode_equals_the_released_code():
    """`etagent reward` is what a user checks a reward with by hand: the same groups through it."""
    groups = list(random_groups("paper-reward-cli", 400))
    lines = [
        json.dumps(
            {"data_source": d, "ground_truth": g, "responses": r, "lengths": n, "sigma_tool": st, "sigma_length": sl, "mode": "paper"}
        )
        for d, g, r, n, st, sl in groups
    ]
    done = subprocess.run(
        [sys.executable, "-m", "etagent.launcher", "reward"], input="\n".join(lines), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    for line, group in zip(done.stdout.splitlines(), groups, strict=True):
        expected = [reward for reward, _, _ in reference_group(*group)]
        assert json.loads(line)["rewards"] == pytest.approx(expected, abs=1e-9)

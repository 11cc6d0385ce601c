"""The efficiency reward on hand-computed groups, in both modes, and `etagent reward`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from etagent import protocol
from etagent.rl.paper_reward import validation_score
from etagent.rl.reward import efficiency_reward, length_zscores, raw_correctness, relative_factor, sigma_factor


def response(answer: str, calls: int = 0, tool: str = "search") -> str:
    steps = "".join(f"<{tool}>q{k}</{tool}><result>r{k}</result><think>then</think>" for k in range(calls))
    return f"<think>start</think>{steps}<answer>The final answer is \\[ \\boxed{{{answer}}} \\]</answer>"


def logistic(x: float) -> float:
    return 2 / (1 + math.exp(x))


def test_a_group_by_hand():
    # tool calls 0, 1, 2 (mean 1); lengths 10, 20, 30 (mean 20, population std sqrt(200/3))
    responses = [response("42", 0), response("42", 1, "python"), response("41", 2)]
    r = efficiency_reward("math_effi_rl", ["42"], responses, [10, 20, 30], sigma_tool=0.2, sigma_length=0.5)
    z = 10 / math.sqrt(200 / 3)
    assert r.raw == [1.0, 1.0, 0.0] and r.tool_calls == [0, 1, 2] and r.f_format == [0.0, 0.0, 0.0]
    assert r.f_tool == pytest.approx([logistic(-0.2), 1.0, logistic(0.2)])
    assert r.f_length == pytest.approx([logistic(-0.5 * z), 1.0, logistic(0.5 * z)])
    assert r.rewards == pytest.approx([logistic(-0.2) * logistic(-0.5 * z), 1.0, 0.0])


def test_zero_sigmas_leave_correctness_plus_the_format_penalty():
    bad = "<answer>\\boxed{42}</answer>"  # no <think>: the format check fails
    r = efficiency_reward("math_effi_rl", ["42"], [response("42", 3), bad, response("7")], [5, 50, 500], 0.0, 0.0)
    assert r.f_tool == r.f_length == [1.0, 1.0, 1.0]
    assert r.rewards == [1.0, 1.0 - 1.0, -0.0 + 0.0] and r.f_format == [0.0, -1.0, 0.0]
    wrong_and_bad = efficiency_reward("math_effi_rl", ["42"], ["<answer>\\boxed{1}</answer>"], [3], 0.2, 0.5)
    assert wrong_and_bad.rewards == [-1.0]


def test_equal_lengths_give_zero_z_scores():
    assert length_zscores([7, 7, 7]).tolist() == [0.0, 0.0, 0.0]
    assert relative_factor([2, 2], 0.7).tolist() == [1.0, 1.0]
    assert length_zscores([1, 3]).tolist() == [-1.0, 1.0]  # population std: 1


def test_sigma_decays_linearly_within_a_stage():
    assert [sigma_factor(step, 5) for step in range(1, 6)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sigma_factor(1, 1) == 0.0 and sigma_factor(9, 5) == 0.0


def test_paper_mode_qa_is_exact_match_without_spaces():
    gold = ["the Kess river"]
    # default: token F1 after SQuAD normalisation
    assert raw_correctness(response("Kess River"), gold, "qa_effi_rl", "default") == 1.0
    assert raw_correctness(response("river Kess bank"), ["Kess river"], "qa_effi_rl", "default") == pytest.approx(0.8)
    # paper: SQuAD normalisation (the article goes), then the deepsearch strip deletes the spaces
    assert raw_correctness(response("Kess River"), gold, "qa_effi_rl", "paper") == 1.0
    assert raw_correctness(response("theKess river"), gold, "qa_effi_rl", "paper") == 0.0
    assert raw_correctness(response("river Kess bank"), ["Kess river"], "qa_effi_rl", "paper") == 0.0
    # the normalisation has already removed the backslash and braces when the strip would unwrap \text{}
    assert raw_correctness(response("\\text{Kess} river"), ["Kess river"], "qa_effi_rl", "paper") == 0.0
    assert raw_correctness(response("yes"), ["no"], "qa_effi_rl", "paper") == 0.0
    # an answer without a box scores nothing in the paper, its text in the default mode
    unboxed = "<think>a</think><answer>Kess river</answer>"
    assert raw_correctness(unboxed, ["Kess river"], "qa_effi_rl", "paper") == 0.0
    assert raw_correctness(unboxed, ["Kess river"], "qa_effi_rl", "default") == 1.0


def test_paper_mode_math_reads_the_first_gold_and_the_last_box_anywhere():
    assert raw_correctness(response("42"), ["41", "42"], "math_effi_rl", "paper") == 0.0
    assert raw_correctness(response("42"), ["41", "42"], "math_effi_rl", "default") == 1.0
    after = response("41") + " so \\boxed{42}"
    assert raw_correctness(after, ["42"], "math_effi_rl", "paper") == 1.0  # the whole response's last box
    assert raw_correctness(after, ["42"], "math_effi_rl", "default") == 0.0  # the answer block's
    assert raw_correctness(response("\\frac{1}{2}"), ["0.5"], "math_effi_rl", "paper") == 1.0
    for mode in ("paper", "default"):  # no answer block: nothing
        assert raw_correctness("<think>\\boxed{42}</think>", ["42"], "math_effi_rl", mode) == 0.0
    with pytest.raises(ValueError, match="data_source"):
        raw_correctness(response("1"), ["1"], "gsm8k", "paper")


def test_validation_score_as_the_paper():
    assert validation_score("math", response("42"), ["42"]) == 1.0
    assert validation_score("math", response("1"), ["42"]) == 0.0
    assert validation_score("math", "<answer>\\boxed{42}</answer>", ["42"]) == -1.0
    both = "<think>a</think><search>q</search><result>r</result><think>b</think><python>1</python><result>1</result><think>c</think>"
    assert validation_score("qa", both + "<answer>\\boxed{Pell}</answer>", ["Pell"]) == pytest.approx(1.1)
    assert validation_score("qa", both + "<answer>\\boxed{Kess}</answer>", ["Pell"]) == 0.0
    assert validation_score("qa", "<think>a</think><answer>Pell</answer>", ["Pell"]) == -1.0  # no box


def test_etagent_reward_command(tmp_path):
    groups = [
        {
            "data_source": "math_effi_rl",
            "ground_truth": ["42"],
            "responses": [response("42", 0), response("42", 1, "python"), response("41", 2)],
            "lengths": [10, 20, 30],
            "sigma_tool": 0.2,
            "sigma_length": 0.5,
            "mode": "default",
        },
        {"data_source": "qa_effi_rl", "ground_truth": ["the Kess river"], "responses": [response("Kess River")], "lengths": [4]}
        | {"sigma_tool": 0, "sigma_length": 0, "mode": "paper"},
    ]
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(g) + "\n" for g in groups))
    out = subprocess.run([sys.executable, "-m", "etagent.launcher", "reward", str(path)], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert set(lines[0]) == {"rewards", "raw", "tool_calls", "f_tool", "f_length", "f_format"}
    assert lines[0] == efficiency_reward(**{k: v for k, v in groups[0].items()}).to_json()
    assert lines[1]["raw"] == [1.0]  # paper mode: "kessriver" against "kessriver" (the article normalised away first)
    bad = json.dumps({**groups[0], "lengths": [1, 2]})
    failed = subprocess.run([sys.executable, "-m", "etagent.launcher", "reward"], input=bad + "\n", capture_output=True, text=True)
    assert failed.returncode != 0 and "<stdin>:1: field 'lengths'" in failed.stderr


def test_verl_compute_score_as_verl_calls_it():
    """verl loads the file by path and calls ``compute_score`` per response with keyword
    arguments (its reward_kwargs included); ground truths arrive as numpy arrays from its parquet
    loader. The score is raw correctness plus the format penalty, in either mode."""
    import importlib.util
    from pathlib import Path

    import numpy as np

    path = Path(__file__).resolve().parents[1] / "rl" / "verl_reward.py"
    spec = importlib.util.spec_from_file_location("custom_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compute_score = module.compute_score

    right = compute_score(
        data_source="math_effi_rl", solution_str=response("42", 2), ground_truth=np.array(["41", "42"]), extra_info={"index": 3}
    )
    assert right == {"score": 1.0, "raw": 1.0, "format_penalty": 0.0, "tool_calls": 2}
    # the paper's mode reads only the first gold answer
    paper = compute_score(
        data_source="math_effi_rl", solution_str=response("42"), ground_truth=np.array(["41", "42"]), extra_info=None, mode="paper"
    )
    assert paper["score"] == 0.0
    qa = compute_score(data_source="qa_effi_rl", solution_str=response("river Kess bank"), ground_truth=["Kess river"], extra_info={})
    assert qa["score"] == pytest.approx(0.8)
    bad = compute_score(data_source="qa_effi_rl", solution_str="<answer>\\boxed{x}</answer>", ground_truth="x", extra_info={})
    assert bad == {"score": 0.0, "raw": 1.0, "format_penalty": -1.0, "tool_calls": 0}


def test_an_answer_printed_by_a_tool_is_not_the_policys(toy):
    """A python call prints an answer block with the right boxed answer, and the policy ends with
    EOS without answering. The default mode reads what the policy wrote (the tool's result
    emptied, the calls that ran): no answer, so no reward but the format penalty. The paper's mode
    reads the whole response, as its released code did: the printed answer counts."""
    from transformers import AutoTokenizer

    from etagent import protocol
    from etagent.agent import Budgets, TrajectoryState
    from etagent.records import Question, TokenOrigin, ToolCallRecord
    from etagent.rl.config import RewardSettings
    from etagent.rl.rollout import Prompt
    from etagent.rl.trainer import rewards_of

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    question = Question(id="q", question="What is 2 + 2?", answer=["4"], source="toy_python", kind="math")
    printed = "<answer>\\boxed{4}</answer>"

    def rollout(name: str, pieces: list[tuple[str, TokenOrigin]], calls: int) -> TrajectoryState:
        state = TrajectoryState(name, question, tokenizer.encode("q"), Budgets())
        for text, origin in pieces:
            state.append(tokenizer.encode(text, add_special_tokens=False), origin)
        state.tool_calls = [ToolCallRecord(tool="python", input="print()", output=printed, ok=True)] * calls
        return state

    call = "<think>compute</think><python>print(open('notes.txt').read())</python>"  # the tags are not in the code
    cheat = rollout("cheat", [(call, TokenOrigin.SAMPLED), (protocol.format_result(printed), TokenOrigin.TOOL)], 1)
    honest = rollout(
        "honest",
        [
            (call, TokenOrigin.SAMPLED),
            (protocol.format_result("4"), TokenOrigin.TOOL),
            ("<think>so</think>" + printed, TokenOrigin.SAMPLED),
        ],
        1,
    )
    prompt = Prompt(index=0, data_source="math_effi_rl", question=question)
    for mode in ("default", "paper"):
        settings = RewardSettings(mode=mode, sigma_tool=0.0, sigma_length=0.0, decay=False)
        rows = {r["id"]: r for r in rewards_of([[cheat, honest]], [prompt], settings, 1.0, tokenizer)}
        assert rows["honest"]["raw"] == 1.0 and rows["honest"]["reward"] == 1.0, mode
        if mode == "default":
            # no answer block of its own: raw 0, and its format (no answer) is penalised
            assert rows["cheat"]["raw"] == 0.0 and rows["cheat"]["f_format"] == -1.0 and rows["cheat"]["reward"] == -1.0
            assert rows["cheat"]["tool_calls"] == 1  # the call that ran
        else:
            # the paper's loophole, kept in its mode: the tool's answer block is read
            assert rows["cheat"]["raw"] == 1.0
        assert printed in rows["cheat"]["text"]  # what the report shows is the whole response


@pytest.mark.parametrize("mode", ["default", "paper"])
def test_a_trajectory_the_engine_failed_on_is_in_no_group_statistic(toy, mode):
    """A group of five, one of which the engine failed on (finish reason error, an empty
    response): the four served members' rewards, every term of them, and their GRPO advantages
    are those of the group of four alone (the failure moved the tool-call mean and the length
    z-scores before: one served member's advantage went from -0.234 to -0.285). The failure
    scores nothing and its advantage is 0."""
    from transformers import AutoTokenizer

    from etagent.agent import Budgets, TrajectoryState
    from etagent.records import Question, TokenOrigin, ToolCallRecord
    from etagent.rl.algorithm import grpo_advantages
    from etagent.rl.config import RewardSettings
    from etagent.rl.rollout import Prompt
    from etagent.rl.trainer import rewards_of

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    question = Question(id="q", question="Who was born in 1873?", answer=["Zorvak Telmin"], source="toy_search", kind="qa")

    def rollout(name: str, calls: int, answer: str, filler: int) -> TrajectoryState:
        state = TrajectoryState(name, question, tokenizer.encode("q"), Budgets())
        for _ in range(calls):
            state.append(tokenizer.encode("<think>look</think><search>born 1873</search>", add_special_tokens=False), TokenOrigin.SAMPLED)
            state.append(
                tokenizer.encode(protocol.format_result("Zorvak Telmin was born in 1873."), add_special_tokens=False), TokenOrigin.TOOL
            )
            state.tool_calls.append(ToolCallRecord(tool="search", input="born 1873", output="Zorvak Telmin was born in 1873.", ok=True))
        text = "<think>" + "so " * filler + f"</think><answer>\\boxed{{{answer}}}</answer>"
        state.append(tokenizer.encode(text, add_special_tokens=False), TokenOrigin.SAMPLED)
        state.finish_reason = "answer"
        return state

    served = [
        rollout("a", 1, "Zorvak Telmin", 2),
        rollout("b", 3, "Zorvak Telmin", 9),
        rollout("c", 0, "Kess", 1),
        rollout("d", 2, "Telmin", 5),
    ]
    failed = TrajectoryState("e", question, tokenizer.encode("q"), Budgets())
    failed.finish_reason, failed.error = "error", "RuntimeError: the model failed on this input"
    prompt = Prompt(index=0, data_source="qa_effi_rl", question=question)
    settings = RewardSettings(mode=mode, sigma_tool=0.2, sigma_length=0.5, decay=False)

    alone = rewards_of([served], [prompt], settings, 1.0, tokenizer)
    mixed = rewards_of([served[:2] + [failed] + served[2:]], [prompt], settings, 1.0, tokenizer)
    by_id = {row["id"]: row for row in mixed}
    terms = ("reward", "raw", "tool_calls", "f_tool", "f_length", "f_format", "length")
    for row in alone:
        assert {t: by_id[row["id"]][t] for t in terms} == {t: row[t] for t in terms}
    assert len({row["f_tool"] for row in alone}) > 1 and len({row["f_length"] for row in alone}) > 1  # the terms are at work
    assert (by_id["e"]["reward"], by_id["e"]["raw"], by_id["e"]["finish_reason"]) == (0.0, 0.0, "error")

    scores = torch.tensor([by_id[i]["reward"] for i in "abecd"])
    valid = torch.tensor([by_id[i]["finish_reason"] != "error" for i in "abecd"])
    advantages = grpo_advantages(scores, torch.zeros(5, dtype=torch.long), valid=valid)
    expected = grpo_advantages(torch.tensor([row["reward"] for row in alone]), torch.zeros(4, dtype=torch.long))
    assert advantages[[0, 1, 3, 4]].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert advantages[2].item() == 0.0


def test_truncated_as_wrong_differs_from_train_only_where_a_tool_printed_the_answer(toy):
    """algorithm.truncated=wrong against train, on a rollout cut at its length budget after a
    python call printed an answer block: in the default reward both give raw 0 and the format
    penalty (the policy wrote no answer of its own; a cut response cannot hold one). In the
    paper's mode, which reads the tool's output as the policy's, train scores the printed answer
    and wrong scores 0 (docs/rl.md, "Truncated responses")."""
    from transformers import AutoTokenizer

    from etagent.agent import Budgets, TrajectoryState
    from etagent.records import Question, TokenOrigin, ToolCallRecord
    from etagent.rl.config import RewardSettings
    from etagent.rl.rollout import Prompt
    from etagent.rl.trainer import rewards_of, score_truncated_as_wrong

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    question = Question(id="q", question="What is 2 + 2?", answer=["4"], source="toy_python", kind="math")
    printed = "<think>done</think><answer>\\boxed{4}</answer>"
    cut = TrajectoryState("cut", question, tokenizer.encode("q"), Budgets())
    cut.append(tokenizer.encode("<think>compute</think><python>print(notes)</python>", add_special_tokens=False), TokenOrigin.SAMPLED)
    cut.append(tokenizer.encode(protocol.format_result(printed), add_special_tokens=False), TokenOrigin.TOOL)
    cut.append(tokenizer.encode("<think>so the answer is", add_special_tokens=False), TokenOrigin.SAMPLED)
    cut.tool_calls = [ToolCallRecord(tool="python", input="print(notes)", output=printed, ok=True)]
    cut.finish_reason = "length"
    prompt = Prompt(index=0, data_source="math_effi_rl", question=question)
    for mode, raw_when_trained in (("default", 0.0), ("paper", 1.0)):
        settings = RewardSettings(mode=mode, sigma_tool=0.0, sigma_length=0.0, decay=False)
        [trained] = rewards_of([[cut]], [prompt], settings, 1.0, tokenizer)
        [wrong] = rewards_of([[cut]], [prompt], settings, 1.0, tokenizer)
        score_truncated_as_wrong([wrong])
        assert trained["raw"] == raw_when_trained, mode
        assert (wrong["raw"], wrong["reward"]) == (0.0, wrong["f_format"]), mode
        assert (trained == wrong) == (mode == "default"), mode

"""The flywheel's operations, each on the toy world with real tool execution (the Python sandbox).

The policy and the editor here are scripted (test doubles for control flow, not models): each
answers from the text it is given, by fixed rules, so that every cut point, executed corrected
step, continuation prefix and its token provenance can be checked exactly. The real tiny policy
and a real LLM editor run in tests/test_flywheel_run.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from etagent import protocol
from etagent.agent import AgentLoop
from etagent.config import load_settings
from etagent.flywheel import prompts
from etagent.flywheel.evolve import Flywheel, QuestionRun, select_parent
from etagent.flywheel.steps import (
    EditorReplyError,
    clean_step,
    parse_flaw_reply,
    parse_redundancy_reply,
    reopen_final_think,
    rewrite_problems,
    split_steps,
    step_hint_prefix,
    tool_steps,
    without_reasoning,
)
from etagent.llm import GREEDY, Sampling, SharedBatches
from etagent.llm.text import TextModel
from etagent.records import Question, TokenOrigin
from etagent.tools.executor import build_executor
from tests.support.groups import agent_config, flywheel_settings
from tests.support.scripted import ScriptedModel
from tests.support.trajectories import mask_runs

ANSWER = "<answer>The final answer is \\[ \\boxed{{{}}} \\]</answer>"
RIGHT = Question(id="right", question="What is 51 multiplied by 12?", answer=["612"], source="toy_python", kind="math")
WRONG = Question(id="wrong", question="What is 51 times 12?", answer=["612"], source="toy_python", kind="math")


def response_of(prompt: str) -> str:
    return prompt.split("<|im_start|>assistant\n")[-1]


def policy(prompt: str) -> str:
    """The scripted policy: the agent loop's prompts, and the self-reflector's two prompts."""
    if prompt.endswith(prompts.ANALYSIS_PREFILL.format(step=1)):
        return " The code multiplies 51 by 15, but the question asks for 51 times 12."
    if "Corrected last step:" in prompt:
        return "I must multiply by 12.</think><python>print(51 * 12)</python>"
    response = response_of(prompt)
    results = response.count("</result>")
    last_output = protocol.tool_results(response)[-1] if results else ""
    if "Wait," in response.rsplit("</result>", 1)[-1]:  # a hint: do what it says
        return "</think><python>print(51 * 12)</python>"
    if results == 0:
        product = "12" if "multiplied" in prompt else "15"
        return f"<think>I will compute this.</think><python>print(51 * {product})</python>"
    if results == 1 and response.startswith("<think>I will compute this.</think><python>print(51 * 12)"):
        return "<think>Let me check it again.</think><python>print(51 * 12)</python>"
    return f"<think>Python gives {last_output}.</think>" + ANSWER.format(last_output)


def editor_replies(redundancy: str, rewrite: str = "Short reasoning.</think>") -> Callable[[str], str]:
    def respond(prompt: str) -> str:
        if "Find the FIRST redundant step" in prompt:
            return redundancy
        if "Rewrite ONLY the reasoning" in prompt:
            return rewrite
        if "reaches a WRONG answer" in prompt:
            return "Step: 1\nAnalysis: the multiplier is wrong."
        raise AssertionError(f"unexpected editor prompt {prompt[-200:]!r}")

    return respond


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy / "model")


@pytest.fixture(scope="module")
def executor():
    tools = load_settings("tools", "tiny", ["tools.python.limits.timeout_s=20"])
    with build_executor(tools) as ex:
        yield ex


def make_flywheel(tokenizer, executor, redundancy="Step: no", rewrite="Short reasoning.</think>", rounds=1, editor=True):
    engine = SharedBatches(ScriptedModel(tokenizer, policy))
    loop = AgentLoop(engine, executor, agent_config(timeout_s=None, max_response_tokens=600, seed=0))
    edit = (
        TextModel(SharedBatches(ScriptedModel(tokenizer, editor_replies(redundancy, rewrite))), Sampling.at(1.0), 200, "editor")
        if editor
        else None
    )
    settings = flywheel_settings(rounds=rounds)
    return Flywheel(loop, TextModel(engine, Sampling.at(1.0), 200, "reflector"), edit, settings)


def evolve(flywheel, question) -> QuestionRun:
    run = QuestionRun(question)
    asyncio.run(flywheel.evolve(run))
    return run


def by_op(run: QuestionRun):
    return {t.provenance.operation: t for t in run.trajectories}


def origin_runs(t) -> list[tuple[int, list[int]]]:
    """(origin, token ids) for each run of response tokens of one origin."""
    return mask_runs(t.response_origin, t.response_ids)


# -- text surgery ------------------------------------------------------------------------------

PARENT = (
    "<think>I will compute this.</think><python>print(51 * 12)</python><result>\n612\n</result>"
    "<think>Let me check it again.</think><python>print(51 * 12)</python><result>\n612\n</result>"
    "<think>Python gives 612.</think>" + ANSWER.format(612)
)


def test_steps_cut_after_each_result_and_rejoin():
    steps = split_steps(PARENT)
    assert len(steps) == 3 and "".join(steps) == PARENT
    assert steps[0].endswith("</result>") and steps[2].startswith("<think>Python gives")
    assert len(tool_steps(PARENT)) == 2


def test_editor_replies_are_parsed_strictly():
    assert parse_redundancy_reply("Step: no", 3) is None
    fix = parse_redundancy_reply("Step: 2\nAnalysis: repeats.\nCorrected Step: <think>ok</think>" + ANSWER.format(612), 3)
    assert (fix.step, fix.analysis) == (2, "repeats.") and fix.corrected_step.endswith("</answer>")
    # "Step: now" is not "Step: no"; a missing analysis is fine; out of range and no number are refused
    assert parse_redundancy_reply("Step: 2\nAnalysis: this step: now repeats.\nCorrected Step: <think>x</think>", 3).step == 2
    assert parse_redundancy_reply("Step: 1\nCorrected Step: <think>x</think>", 3).analysis == ""
    with pytest.raises(EditorReplyError, match="out of range"):
        parse_redundancy_reply("Step: 7\nAnalysis: a\nCorrected Step: <think>x</think>", 3)
    with pytest.raises(EditorReplyError, match="Corrected Step"):
        parse_redundancy_reply("Step: 2\nAnalysis: a", 3)
    assert parse_flaw_reply("Step: 2\n", 3) == 2
    with pytest.raises(EditorReplyError):
        parse_flaw_reply("I think the second one", 3)


def test_written_steps_are_cleaned_before_anything_runs():
    # <think> opened and closed, cut after the first call, a written result dropped
    step = clean_step("reasoning <python>print(1)</python><result>\n1\n</result><think>more")
    assert step == "<think>reasoning</think><python>print(1)</python>"
    assert clean_step("<think>just thinking") == "<think>just thinking</think>"
    with pytest.raises(EditorReplyError, match="never closes"):
        clean_step("<think>a</think><search>unfinished")
    with pytest.raises(EditorReplyError, match="empty"):
        clean_step("  ")


def test_rewrite_check_refuses_changed_actions_and_tags_in_reasoning():
    same = PARENT.replace("Let me check it again.", "Check.")
    assert rewrite_problems(PARENT, same) == []
    assert without_reasoning(same) == without_reasoning(PARENT)
    assert rewrite_problems(PARENT, PARENT.replace("print(51 * 12)", "print(12 * 51)", 1)) == ["a tool call, result or the answer changed"]
    assert (
        "contains <search>"
        in rewrite_problems(PARENT, PARENT.replace("Check", "<search>x</search>").replace("Let me", "<search>x</search>"))[0]
    )


def test_hints_are_whole_sentences_after_the_kept_steps():
    hint = prompts.PYTHON_HINTS[0]
    prefix = step_hint_prefix(PARENT, 1, hint)
    assert prefix == split_steps(PARENT)[0] + "<think>" + hint
    with pytest.raises(EditorReplyError):
        step_hint_prefix(PARENT, 3, hint)  # step 3 is the answer, not a tool step
    reopened = reopen_final_think(PARENT, hint)
    head = PARENT[: PARENT.rfind("</result>") + len("</result>")]
    assert reopened == head + "<think>Python gives 612. The final answer is \\[ \\boxed{612} \\] " + hint
    assert "<answer>" not in reopened and reopened.count("<think>") == 3 and reopened.count("</think>") == 2
    # a trajectory that never answered keeps its steps (the reference restarted from nothing)
    unanswered = split_steps(PARENT)[0] + "<think>hmm"
    assert reopen_final_think(unanswered, hint) == unanswered + " " + hint


# -- operations, with the real Python sandbox ----------------------------------------------------


def test_a2_cuts_at_the_redundant_step_runs_the_corrected_call_and_continues(tokenizer, executor):
    reply = (
        "Step: 1\nAnalysis: the check repeats the call.\nCorrected Step: <think>One call is enough.</think><python>print(51 * 12)</python>"
    )
    run = evolve(make_flywheel(tokenizer, executor, redundancy=reply), RIGHT)
    initial, fixed = run.trajectories[0], by_op(run)["A2_redundancy_fix"]
    assert initial.text == PARENT and initial.correct
    corrected = "<think>One call is enough.</think><python>print(51 * 12)</python>"
    # the cut: nothing of the parent from step 1 on; the corrected call ran for real; the policy answered
    assert fixed.text == corrected + "<result>\n612\n</result><think>Python gives 612.</think>" + ANSWER.format(612)
    assert [(c.tool, c.output, c.ok, c.rebuilt) for c in fixed.tool_calls] == [("python", "612", True, False)]
    assert fixed.correct and fixed.tool_calls_written == 1
    p = fixed.provenance
    assert (p.operation, p.parent, p.round, p.edited_step, p.stage) == ("A2_redundancy_fix", "right/initial", 1, 1, "flywheel")
    # provenance per token: the editor's step is GIVEN, the result TOOL, the continuation SAMPLED
    runs = [(o, tokenizer.decode(ids, skip_special_tokens=False)) for o, ids in origin_runs(fixed)]
    assert runs == [
        (TokenOrigin.GIVEN, corrected),
        (TokenOrigin.TOOL, "<result>\n612\n</result>"),
        (TokenOrigin.SAMPLED, "<think>Python gives 612.</think>" + ANSWER.format(612)),
    ]
    stats = run.stats_json()["A2_redundancy_fix"]
    assert (stats["attempted"], stats["parsed"], stats["succeeded"], stats["correct"]) == (1, 1, 1, 1)


def test_a2_with_an_answer_in_the_corrected_step_finishes_without_generating(tokenizer, executor):
    reply = "Step: 2\nAnalysis: repeats.\nCorrected Step: <think>Python gave 612.</think>" + ANSWER.format(612)
    fixed = by_op(evolve(make_flywheel(tokenizer, executor, redundancy=reply), RIGHT))["A2_redundancy_fix"]
    assert fixed.text == split_steps(PARENT)[0] + "<think>Python gave 612.</think>" + ANSWER.format(612)
    assert fixed.finish_reason == "answer" and TokenOrigin.SAMPLED not in fixed.response_origin
    assert fixed.tool_calls_written == 1 and fixed.correct


def test_a1_and_a3_keep_every_action_byte_identical(tokenizer, executor):
    run = evolve(make_flywheel(tokenizer, executor), RIGHT)
    ops = by_op(run)
    assert list(ops) == ["initial", "A1_rerollout", "A3_rewrite"]  # A2: the editor said "Step: no"
    assert ops["A1_rerollout"].text == PARENT and ops["A1_rerollout"].provenance.parent == "right/initial"
    rewritten = ops["A3_rewrite"]
    assert rewritten.text == PARENT.replace("I will compute this.", "Short reasoning.").replace(
        "Let me check it again.", "Short reasoning."
    ).replace("Python gives 612.", "Short reasoning.")
    assert without_reasoning(rewritten.text) == without_reasoning(PARENT)
    assert not rewritten.text.startswith("<think><think>") and rewritten.correct and rewritten.finish_reason == "answer"
    assert [c.output for c in rewritten.tool_calls] == ["612", "612"]
    assert run.stats_json()["A2_redundancy_fix"]["parsed"] == 1 and any(e["outcome"] == "no redundant step" for e in run.events)


def test_a3_refuses_a_rewrite_that_writes_a_tag(tokenizer, executor):
    run = evolve(make_flywheel(tokenizer, executor, rewrite="I will <search>search</search> instead.</think>"), RIGHT)
    assert "A3_rewrite" not in by_op(run)
    assert run.stats_json()["A3_rewrite"]["rejected"] == 1
    assert any(e["operation"] == "A3_rewrite" and e["outcome"] == "rejected" for e in run.events)


def test_b0_b1_b2_b3_repair_a_wrong_trajectory(tokenizer, executor):
    run = evolve(make_flywheel(tokenizer, executor), WRONG)
    ops = by_op(run)
    initial = ops["initial"]
    assert not initial.correct and initial.prediction == "765"
    assert list(ops) == ["initial", "B1_new_step", "B2_step_hint", "B3_trajectory_hint"]
    # B1: the reflector's step replaces step 1 (the one B0 named), its call runs, the policy answers
    b1 = ops["B1_new_step"]
    assert b1.text.startswith("<think>I must multiply by 12.</think><python>print(51 * 12)</python><result>\n612\n</result>")
    assert b1.correct and b1.provenance.edited_step == 1 and b1.tool_calls[0].output == "612"
    # B2: step 1 kept (the flawed one too), then <think> and a whole hint sentence, then the policy
    b2 = ops["B2_step_hint"]
    hint = next(h for h in prompts.PYTHON_HINTS if h in b2.text)
    step1 = split_steps(initial.text)[0]
    assert b2.text.startswith(step1 + "<think>" + hint + "</think><python>print(51 * 12)</python>") and b2.correct
    given = [tokenizer.decode(ids) for o, ids in origin_runs(b2) if o == TokenOrigin.GIVEN]
    assert given[-1].endswith(hint)
    # B3: the final think reopened after the last result, the answer's tags gone, the hint appended
    b3 = ops["B3_trajectory_hint"]
    reopened = step1 + "<think>Python gives 765. The final answer is \\[ \\boxed{765} \\] "
    assert b3.text.startswith(reopened) and any(b3.text.startswith(reopened + h) for h in prompts.PYTHON_HINTS)
    assert b3.correct and b3.tool_calls_written == 2
    assert {t.provenance.parent for t in run.trajectories[1:]} == {"wrong/initial"}
    stats = run.stats_json()
    assert stats["B0_locate_flaw"]["parsed"] == 1 and stats["B2_step_hint"]["correct"] == 1


def test_without_an_editor_only_a1_and_b3_run_and_the_rest_is_counted_as_skipped(tokenizer, executor):
    run = evolve(make_flywheel(tokenizer, executor, editor=False), WRONG)
    assert [t.provenance.operation for t in run.trajectories] == ["initial", "B3_trajectory_hint"]
    stats = run.stats_json()
    assert all(stats[op]["skipped_no_editor"] == 1 for op in ("B0_locate_flaw", "B1_new_step", "B2_step_hint"))


def test_later_rounds_evolve_the_best_trajectory_not_yet_evolved(tokenizer, executor):
    run = evolve(make_flywheel(tokenizer, executor, rounds=3), WRONG)
    assert run.evolved[0] == "wrong/initial" and len(set(run.evolved)) == len(run.evolved) == 3
    # round 2 picks a correct trajectory with the fewest calls: the correct branch runs on it
    assert run.evolved[1] == select_parent(run.trajectories[:4], run.evolved[:1]).id
    assert any(t.provenance.operation == "A1_rerollout" and t.provenance.round == 2 for t in run.trajectories)
    ids = [t.id for t in run.trajectories]
    assert len(ids) == len(set(ids))


# -- export --------------------------------------------------------------------------------------


def test_export_keeps_correct_distinct_trajectories_fewest_calls_first(tokenizer, executor, tmp_path):
    from etagent.flywheel.export import export
    from etagent.flywheel.run import question_record
    from etagent.records import JsonlAppender, SFTExample, read_records
    from etagent.sft.data import IGNORE, tokenize_example

    reply = "Step: 2\nAnalysis: repeats.\nCorrected Step: <think>Python gave 612.</think>" + ANSWER.format(612)
    right = evolve(make_flywheel(tokenizer, executor, redundancy=reply), RIGHT)
    wrong = evolve(make_flywheel(tokenizer, executor), WRONG)
    with JsonlAppender(tmp_path / "trajectories.jsonl") as writer:
        # questions are written as they finish: here the later one first; the data is in question order
        for run in (wrong, right):
            writer.write(question_record(run, timed_out=False, seconds=1.0, editor=True))
    cfg = load_settings("flywheel", "tiny", [f"out_dir={tmp_path}", "export.max_per_question=2"])
    report = export(cfg)

    examples = read_records(tmp_path / "sft" / "sft.jsonl", SFTExample)
    # right: A2 (1 call) before the initial one (2 calls); A1 is a copy of the initial, A3 over the cap
    # wrong: the initial is wrong; B1 (1 call), then B2 before B3 (2 calls each, flywheel order)
    assert [e.id for e in examples] == ["right/r1/A2_redundancy_fix", "right/initial", "wrong/r1/B1_new_step", "wrong/r1/B2_step_hint"]
    assert report["dropped"] == {"not judged correct": 1, "a copy of a kept trajectory": 1, "over max_per_question": 2}
    assert report["kept"] == 4 and report["export"]["tool_calls"] == {1: 2, 2: 2}
    # the prompt in the system turn, tool results masked, SFT trains on the trajectory's own ids
    example = examples[1]
    assert example.messages[0].content == protocol.SYSTEM_PROMPT and example.question == RIGHT.question
    assert [s.train for s in example.segments] == [True, False, True, False, True]
    row = tokenize_example(example, tokenizer)
    assert row.from_token_ids
    trained = tokenizer.decode([t for t in row.labels if t != IGNORE])
    assert "<result>" not in trained and "Let me check it again." in trained
    for fmt in ("alpaca", "sharegpt"):
        import json

        rows = json.loads((tmp_path / "sft" / "llamafactory" / fmt / f"flywheel_{fmt}.json").read_text())
        assert len(rows) == 4 and rows[0]["system"] == protocol.SYSTEM_PROMPT


# -- the judge and the summariser roles ----------------------------------------------------------


def test_the_llm_judge_is_asked_only_when_the_rule_says_wrong(tokenizer, executor):
    from etagent.scoring import LLMJudge

    replies = ScriptedModel(tokenizer, lambda prompt: "Correct")
    flywheel = make_flywheel(tokenizer, executor)
    flywheel.judge = LLMJudge(TextModel(SharedBatches(replies), GREEDY, 8, "judge"))
    right = asyncio.run(flywheel.judgement(RIGHT, "612"))
    assert (right.metric, right.verdict) == ("math_equal", True) and not replies.prompts
    judged = asyncio.run(flywheel.judgement(RIGHT, "six hundred and twelve"))
    assert (judged.metric, judged.verdict, judged.reply) == ("llm_judge", True, "Correct")
    assert "six hundred and twelve" in replies.prompts[0]
    qa = Question(id="qa", question="Who?", answer=["Zorvak Telmin"], source="toy_search", kind="qa")
    assert asyncio.run(flywheel.judgement(qa, "Telmin")).metric == "f1_paper"  # QA: F1 only


def test_search_results_are_summarised_by_the_summariser(tokenizer, toy, server, monkeypatch):
    import json

    from etagent.flywheel.run import SummarisedSearch
    from etagent.protocol import ToolCall
    from tests.support.commands import TOKEN

    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)
    name = json.loads((toy / "corpus.jsonl").read_text().splitlines()[0])["title"]
    summariser = ScriptedModel(tokenizer, lambda prompt: "**Final Information** " + prompt.split("Search results:\n", 1)[1][:40])
    tools = load_settings("tools", "tiny", [f"tools.search.local.url={server}", "tools.search.local.token_env=RETRIEVER_TOKEN"])
    with build_executor(tools) as ex:
        plain = ex.run_sync([ToolCall("search", name)])[0]
        ex.tools["search"] = SummarisedSearch(ex.tools["search"], TextModel(SharedBatches(summariser), GREEDY, 64, "s"))
        [record] = ex.run_sync([ToolCall("search", name)])
    assert plain.ok and name in plain.output
    assert record.ok and record.output == "**Final Information** " + plain.output[:40].strip()
    assert f"Search query: {name}" in summariser.prompts[0]

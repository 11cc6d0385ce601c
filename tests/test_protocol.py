"""The TIR text protocol: parsing, counting, validation and answer extraction, including the
reference's edge cases, plus property tests on generated trajectories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etagent import protocol
from etagent.protocol import (
    FinalAnswer,
    ToolCall,
    count_tool_calls,
    count_valid_tags,
    extract_answer,
    format_result,
    parse_segment,
    split_result_segments,
    strip_results,
    tool_results,
    validate_format,
    validate_template_format,
)

GOOD = (
    "<think>I need the year.</think><search>Zorvak Telmin</search>"
    + format_result("Zorvak Telmin was born in 1873.")
    + "<think>Now compute.</think><python>print(2000 - 1873)</python>"
    + format_result("127")
    + "<think>Done.</think><answer>The final answer is \\[ \\boxed{127} \\]</answer>"
)


# --- the prompt ---------------------------------------------------------------------------------


def test_system_prompt_uses_single_braces_and_every_tag():
    assert "\\boxed{answer here}" in protocol.SYSTEM_PROMPT
    assert "{{" not in protocol.SYSTEM_PROMPT and "\\x08" not in protocol.SYSTEM_PROMPT
    for tag in protocol.TAG_STRINGS:
        assert tag in protocol.SYSTEM_PROMPT


def test_prompt_messages_put_the_protocol_in_the_system_turn():
    messages = protocol.prompt_messages("What is 2+2?")
    assert messages == [{"role": "system", "content": protocol.SYSTEM_PROMPT}, {"role": "user", "content": "What is 2+2?"}]


def test_format_result_is_the_one_insertion_format():
    assert format_result("42") == "<result>\n42\n</result>"
    assert tool_results("x" + format_result("42") + "y") == ["42"]


# --- parse_segment ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segment, expected",
    [
        ("<think>compute</think><python>print(1+1)</python>", ToolCall("python", "print(1+1)")),
        ("<think>look</think><search>  Zorvak Telmin \n</search>", ToolCall("search", "Zorvak Telmin")),
        # nested opening tag: the last opening before the close wins
        ("<python>a = 1<python>print(2)</python>", ToolCall("python", "print(2)")),
        # a closing tag with no opening tag: a call with empty input (the loop answers with an error)
        ("<think>oops</think>print(3)</python>", ToolCall("python", "")),
        ("<answer>The final answer is \\[ \\boxed{7} \\]</answer>", FinalAnswer("7")),
        # the earliest closing tag ends the segment
        ("<search>q</search><python>print(1)</python>", ToolCall("search", "q")),
        ("<answer>\\boxed{3}</answer><search>late</search>", FinalAnswer("3")),
        # ended by EOS or the length limit: neither a call nor an answer
        ("<think>still thinking", None),
        ("", None),
    ],
)
def test_parse_segment(segment, expected):
    assert parse_segment(segment) == expected


def test_parse_segment_ignores_text_after_a_hallucinated_result():
    # The model wrote its own <result>: nothing after it came from a tool, so the call inside
    # the fake result is not read, and the real call before it is.
    segment = "<search>a</search><result>fake <python>print(1)</python></result>"
    assert parse_segment(segment) == ToolCall("search", "a")
    assert parse_segment("<think>x</think><result> <python>evil()</python>") is None


def test_tags_inside_results_do_not_confuse_parsing_of_the_next_segment():
    # A result quoting tags is inserted text; the next generated segment is parsed on its own.
    result = format_result("docs mention </search> and <answer>\\boxed{wrong}</answer>")
    next_segment = "<think>ok</think><answer>\\boxed{right}</answer>"
    assert parse_segment(next_segment) == FinalAnswer("right")
    assert extract_answer("<search>q</search>" + result + next_segment) == "right"


def test_cut_at_stop_keeps_the_earliest_stop():
    assert protocol.cut_at_stop("<search>q</search> more </python>") == "<search>q</search>"
    assert protocol.cut_at_stop("no stop here") == "no stop here"


# --- counting -----------------------------------------------------------------------------------


def test_count_valid_tags_reference_semantics():
    assert count_valid_tags("<search>a</search><search>b</search>", "search") == 2
    # an unclosed opening tag stops the scan
    assert count_valid_tags("<search>a</search><search>b", "search") == 1
    # two openings before one close count once
    assert count_valid_tags("<search><search>a</search>", "search") == 1
    # a stray closing tag before any opening is ignored
    assert count_valid_tags("</search><search>a</search>", "search") == 1
    assert count_valid_tags("", "python") == 0


def test_count_tool_calls_counts_tags_inside_results_as_the_reference_does():
    text = "<search>q</search>" + format_result("page quoting <python>x</python>") + "<answer>\\boxed{1}</answer>"
    assert count_tool_calls(text) == 2
    assert count_tool_calls(strip_results(text)) == 1
    assert count_tool_calls(GOOD) == 2


# --- validate_format ----------------------------------------------------------------------------


def test_validate_format_accepts_a_good_trajectory():
    assert validate_format(GOOD) and validate_template_format(GOOD)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<answer>\\boxed{1}</answer>", "no <think>"),
        ("<think>a<think>b</think><answer>\\boxed{1}</answer>", "2 <think> but 1 </think>"),
        ("<think>a</think>", "0 <answer>"),
        ("<think>a</think><answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>", "2 <answer>"),
        ("<think>a</think></answer>\\boxed{1}<answer>", "</answer> before <answer>"),
        ("<think>a</think><answer>42</answer>", "no \\boxed{}"),
        ("<think>a</think><search>q</search><think>b</think><answer>\\boxed{1}</answer>", "<search> at offset"),
        ("<think>a</think><python>x</python><answer>\\boxed{1}</answer>", "<python> at offset"),
        ("<think>a</think><search>q<result>r</result></search><answer>\\boxed{1}</answer>", "<search> at offset"),
    ],
)
def test_validate_format_rejects(text, reason):
    assert not validate_format(text)
    assert any(reason in p for p in protocol.format_problems(text)), protocol.format_problems(text)


def test_validate_format_matches_the_reference_scan_for_unanswered_calls():
    # The reference pairs each call with the next </tool> <result> </result> and resumes after
    # that result, so a call with no result is accepted when a later call of the same tool has
    # one. Kept as the reference has it (format penalties must match the paper's).
    text = "<think>a</think><python>x</python><python>y</python>" + format_result("1") + "<think>b</think><answer>\\boxed{1}</answer>"
    assert validate_format(text)
    assert not validate_format(text.replace(format_result("1"), ""))


def test_validate_format_is_lenient_where_the_reference_is():
    # text before <think>, text outside tags, several boxes: allowed by the reference's rules
    text = "Sure! <think>a</think> extra <answer>\\boxed{1} or \\boxed{2}</answer>"
    assert validate_format(text)
    assert not validate_template_format(text)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<think>a</think><answer>\\boxed{1}</answer> trailing", "does not end with </answer>"),
        ("x<think>a</think><answer>\\boxed{1}</answer>", "does not start with <think>"),
        ("<think>a</think><answer>\\boxed{1}\\boxed{2}</answer>", "2 \\boxed{ in the answer"),
        ("<think>a</think><answer><think>b</think>\\boxed{1}</answer>", "tags inside the answer"),
    ],
)
def test_template_format_is_stricter(text, reason):
    problems = protocol.template_problems(text)
    assert any(reason in p for p in problems), problems


# --- extract_answer -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>The final answer is \\[ \\boxed{127} \\]</answer>", "127"),
        # nested braces
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("<answer>\\boxed{x^{2}+\\sqrt{y_{1}}}</answer>", "x^{2}+\\sqrt{y_{1}}"),
        # \text{} unwrapped, also nested in the box
        ("<answer>\\boxed{\\text{Paris}}</answer>", "Paris"),
        ("<answer>\\boxed{\\text{\\text{Paris}}}</answer>", "Paris"),
        # a partial \text stays (units are the scorer's business)
        ("<answer>\\boxed{5\\text{ cm}}</answer>", "5\\text{ cm}"),
        # multiple boxes: the last one
        ("<answer>\\boxed{1} no wait \\boxed{2}</answer>", "2"),
        # \fbox counts as a box
        ("<answer>\\fbox{9}</answer>", "9"),
        # brace-less box
        ("<answer>$\\boxed 5$</answer>", "5"),
        # no box inside the answer: the whole answer text
        ("<answer> Paris </answer>", "Paris"),
        # missing answer tags: the last box anywhere
        ("<think>so \\boxed{3} then \\boxed{4}</think>", "4"),
        # nothing at all
        ("<think>no idea</think>", ""),
        # an empty answer block falls back to the last box elsewhere
        ("<think>\\boxed{8}</think><answer> </answer>", "8"),
        # the last answer block wins; a box in an earlier block is ignored
        ("<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>", "2"),
        # an unbalanced box inside the answer: the answer text
        ("<answer>\\boxed{12</answer>", "\\boxed{12"),
        # an answer inside a result is a quote, but the last answer block is still the model's
        ("<search>q</search>" + format_result("<answer>\\boxed{no}</answer>") + "<answer>\\boxed{yes}</answer>", "yes"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed():
    assert protocol.last_boxed("a \\boxed{1} b \\fbox{2}") == "2"
    assert protocol.last_boxed("\\boxed{") is None
    assert protocol.last_boxed("none") is None
    assert protocol.last_boxed("\\boxed{}") == ""


# --- splitting results out ----------------------------------------------------------------------


def test_split_result_segments_marks_exactly_the_inserted_spans():
    pieces = split_result_segments(GOOD)
    assert "".join(p for p, _ in pieces) == GOOD
    assert [p for p, is_result in pieces if is_result] == [format_result("Zorvak Telmin was born in 1873."), format_result("127")]
    assert "<result>" not in strip_results(GOOD)


def test_unclosed_result_stays_policy_text():
    text = "<search>q</search><result>never closed"
    assert split_result_segments(text) == [(text, False)]


# --- property tests on generated trajectories ---------------------------------------------------

# Free text that cannot form tags or boxes: what thoughts, queries and tool outputs are made of.
plain = st.text(alphabet=st.characters(blacklist_characters="<>{}\\$", blacklist_categories=("Cs",)), max_size=40)
answers = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 .,+-=", min_size=1, max_size=20).filter(lambda s: s.strip())
steps = st.lists(st.tuples(st.sampled_from(protocol.TOOLS), plain, plain, plain), max_size=6)


def build(steps_, answer, opening_thought="thinking"):
    text = f"<think>{opening_thought}</think>"
    for tool, payload, output, thought in steps_:
        text += f"<{tool}>{payload}</{tool}>" + format_result(output) + f"<think>{thought}</think>"
    return text + f"<answer>The final answer is \\[ \\boxed{{{answer}}} \\]</answer>"


@settings(max_examples=300, deadline=None)
@given(steps, answers, plain)
def test_generated_trajectories_count_validate_and_extract(steps_, answer, thought):
    text = build(steps_, answer, thought)
    assert count_tool_calls(text) == len(steps_)
    assert count_valid_tags(text, "python") == sum(1 for s in steps_ if s[0] == "python")
    assert validate_format(text)
    assert validate_template_format(text)
    assert extract_answer(text) == answer.strip()
    assert len(tool_results(text)) == len(steps_)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(protocol.TOOLS), plain, plain, plain), min_size=1, max_size=6), answers)
def test_dropping_the_last_result_or_a_closing_think_breaks_the_format(steps_, answer):
    text = build(steps_, answer)
    last_result = text.rindex("<result>")
    close = text.index("</result>", last_result) + len("</result>")
    assert not validate_format(text[:last_result] + text[close:])
    last_close_think = text.rindex("</think>")
    assert not validate_format(text[:last_close_think] + text[last_close_think + len("</think>") :])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(list("ab{}\\ $") + list(protocol.TAG_STRINGS) + ["\\boxed", "\\text{", "\\fbox"]), max_size=40).map("".join)
)
def test_functions_are_total_on_arbitrary_text(text):
    # never raise, and keep their basic invariants on any input
    answer = extract_answer(text)
    assert isinstance(answer, str)
    assert "".join(p for p, _ in split_result_segments(text)) == text
    for tag in protocol.TAGS:
        assert count_valid_tags(text, tag) <= text.count(f"<{tag}>")
    assert isinstance(validate_format(text), bool)
    parse_segment(text)


def test_unwrap_result_is_the_inverse_of_format_result():
    for output in ("84", "", "a\nb", "<answer>x</answer>"):
        assert protocol.unwrap_result(protocol.format_result(output)) == output
    assert protocol.unwrap_result("<result>84</result>") is None  # wrapped some other way

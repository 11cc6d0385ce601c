"""The agent loop at the token level: stored tokens are exactly the generated ones plus the
inserted ones, each with its origin, text is decoded from tokens, budgets (calls, response tokens,
the engine's context) hold, an engine error ends one trajectory only, forks and prefixes keep
what they should, and a run is the same whatever the batch size or tool-completion order."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from functools import partial

import pytest
from transformers import AutoTokenizer

from etagent import protocol
from etagent.agent import AgentLoop, Budgets, SegmentEntropy
from etagent.records import TokenOrigin
from etagent.scoring import rule_judgement
from etagent.tools import ToolOutput
from etagent.tools.executor import ToolExecutor
from tests.support.groups import agent_config
from tests.support.scripted import ANSWER, SCRIPTS, FakePython, FakeSearch, ScriptedEngine, question
from tests.support.trajectories import mask_runs


@pytest.fixture(scope="module", params=["toy", "smollm2"])
def tokenizer(request, toy):
    """Every test of the loop runs on the toy tokenizer and on a real pretrained one (SmolLM2's,
    with its own chat template and special tokens), where each tool tag is three tokens."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer")
    return AutoTokenizer.from_pretrained(toy / "model")


SCRIPT_CONFIG = agent_config(max_search_calls=2, max_budget_messages=1, max_response_tokens=300)
# as RL measures entropies (top 2 log-probabilities over each segment's first 20 tokens)
SCRIPT_ENTROPY = SegmentEntropy(top_logprobs=2, window=20)


def run_loop(tokenizer, names, batch_size, seed, config=SCRIPT_CONFIG):
    rng = random.Random(seed)
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([FakeSearch(rng), FakePython(rng)]), config, SCRIPT_ENTROPY)
    states = [loop.new(question(n), f"{n}/0") for n in names]
    for start in range(0, len(states), batch_size):
        asyncio.run(loop.run(states[start : start + batch_size]))
    return loop, engine, states


def snapshot(loop, states):
    return [
        (
            s.id,
            s.response_ids,
            s.mask,
            [(c.tool, c.input, c.output, c.ok, c.budget_exhausted) for c in s.tool_calls],
            s.finish_reason,
            loop.text(s),
        )
        for s in states
    ]


def test_same_trajectories_whatever_batch_size_tool_order_and_schedule(tokenizer):
    """Per trajectory or in lockstep rounds, however many run together and in whatever order
    their tool calls finish, the trajectories are the same."""
    names = list(SCRIPTS)
    reference = None
    for batch_size, seed, lockstep in ((len(names), 0, False), (1, 1, False), (3, 2, True), (len(names), 3, True)):
        config = dataclasses.replace(SCRIPT_CONFIG, lockstep=lockstep)
        loop, _, states = run_loop(tokenizer, names, batch_size, seed, config)
        shot = snapshot(loop, states)
        reference = reference or shot
        assert shot == reference


def test_tokens_are_generated_plus_inserted_and_the_mask_marks_insertions(tokenizer):
    loop, engine, states = run_loop(tokenizer, list(SCRIPTS), len(SCRIPTS), 0)
    for s in states:
        # walk the response: runs of mask 1 are exactly the engine's outputs, in order; runs of
        # mask 0 decode to the protocol's result text of the matching tool call
        runs = mask_runs(s.mask, s.response_ids)
        policy_runs = [ids for m, ids in runs if m == 1]
        inserted_runs = [ids for m, ids in runs if m == 0]
        assert policy_runs == engine.generated[s.question.id] and len(policy_runs) == s.segments
        assert [tokenizer.decode(ids) for ids in inserted_runs] == [protocol.format_result(c.output) for c in s.tool_calls]
        assert len(s.logprobs) == len(s.response_ids) and all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask) if m == 0)
        record = loop.to_record(s)
        assert record.text == tokenizer.decode(s.response_ids, skip_special_tokens=False)
        assert record.response_mask == s.mask and record.n_tokens == len(s.response_ids)
    # and every prompt sent to the engine was the prompt plus the response so far, token for token
    by_question = {s.question.id: s for s in states}
    for request in engine.requests:
        s = by_question[request.session]
        full = s.prompt_ids + s.response_ids
        assert len(request.prompt_ids) >= len(s.prompt_ids) and full[: len(request.prompt_ids)] == list(request.prompt_ids)


def test_finish_reasons_and_parsing(tokenizer):
    loop, _, states = run_loop(tokenizer, list(SCRIPTS), len(SCRIPTS), 0)
    by = {s.question.id: s for s in states}
    assert by["q-search"].finish_reason == "answer" and loop.to_record(by["q-search"]).prediction == "1873"
    # the result quoted </search> and an <answer>: neither confused the loop
    assert [c.input for c in by["q-search"].tool_calls] == ["Zorvak Telmin"] and by["q-search"].segments == 2
    assert [c.output for c in by["q-python"].tool_calls] == ["84", "84"] and loop.to_record(by["q-python"]).prediction == "84"
    assert by["q-none"].finish_reason == "answer" and by["q-none"].tool_calls == []
    assert by["q-fake"].finish_reason == "fake_result" and by["q-fake"].tool_calls == []
    assert by["q-eos"].finish_reason == "eos" and by["q-eos"].response_ids[-1] == tokenizer.eos_token_id
    assert by["q-long"].finish_reason == "length" and len(by["q-long"].response_ids) == 300
    assert protocol.validate_format(loop.text(by["q-python"]))


def test_over_budget_calls_get_the_budget_message(tokenizer):
    loop, _, states = run_loop(tokenizer, ["q-budget"], 1, 0)
    [s] = states
    calls = s.tool_calls
    assert [c.budget_exhausted for c in calls] == [False, False, True, True]
    assert [c.input for c in calls] == ["a", "b", "c", "d"]
    assert calls[2].output.startswith("Tool budget exhausted: 2 search calls made, the limit is 2.")
    assert s.finish_reason == "budget"  # a second over-budget call after max_budget_messages=1
    text = loop.text(s)
    assert text.count("Tool budget exhausted") == 2 and "<search>e</search>" not in text


def test_total_budget(tokenizer):
    config = agent_config(max_python_calls=6, max_search_calls=6, max_tool_calls=1, max_budget_messages=5)
    loop, _, [s] = run_loop(tokenizer, ["q-python"], 1, 0, config)
    assert [c.budget_exhausted for c in s.tool_calls] == [False, True]
    assert s.tool_calls[1].output.startswith("Tool budget exhausted: 1 tool calls made, the limit is 1.")
    assert s.finish_reason == "answer"


def test_entropies_are_recorded_per_segment(tokenizer):
    loop, engine, [s] = run_loop(tokenizer, ["q-python"], 1, 0)
    import math

    first = engine.generated["q-python"][0]
    expected = -sum(math.exp(lp) * lp for _ in first[:20] for lp in (-0.5, -1.5)) / math.log(len(tokenizer))
    assert len(s.entropies) == 3 and s.entropies[0] == pytest.approx(expected)


def test_only_a_loop_given_an_entropy_setting_asks_for_top_log_probabilities(tokenizer):
    """RL passes its rollout group's SegmentEntropy; the other stages read no entropies, so their
    loops ask the engine for the sampled tokens' log-probabilities only."""
    loop, engine, [s] = run_loop(tokenizer, ["q-python"], 1, 0)
    assert {(r.logprobs, r.logprobs_window) for r in engine.requests} == {(2, 20)} and len(s.entropies) == s.segments
    plain_engine = ScriptedEngine(tokenizer, SCRIPTS)
    plain = AgentLoop(plain_engine, ToolExecutor([FakeSearch(random.Random(0)), FakePython(random.Random(0))]), SCRIPT_CONFIG)
    [p] = [plain.new(question("q-python"), "q-python/0")]
    asyncio.run(plain.run([p]))
    assert {(r.logprobs, r.logprobs_window) for r in plain_engine.requests} == {(0, None)}
    assert p.entropies == [] and p.response_ids == s.response_ids


def test_special_tokens_sampled_by_the_policy_stay_in_the_text(tokenizer):
    """What is scored is what was generated: a special token sampled mid-answer is not dropped."""
    scripts = {"q-special": ["<think>x</think><answer>\\boxed{Z<|im_start|> 41}</answer>"]}
    loop = AgentLoop(ScriptedEngine(tokenizer, scripts), ToolExecutor([]), SCRIPT_CONFIG, SCRIPT_ENTROPY)
    [s] = asyncio.run(loop.run([loop.new(question("q-special"), "s/0")]))
    record = loop.to_record(s)
    assert "<|im_start|>" in record.text and record.text == tokenizer.decode(s.response_ids, skip_special_tokens=False)
    assert record.prediction != "Z 41"


def test_tool_results_are_cut_to_the_response_budget(tokenizer):
    """A result longer than the room left is cut there, its closing tag kept; nothing goes past."""
    rng = random.Random(0)

    class Verbose(FakeSearch):
        async def __call__(self, query):
            return ToolOutput("lorem ipsum dolor " * 200, ok=True)

    config = agent_config(max_response_tokens=120)
    loop = AgentLoop(ScriptedEngine(tokenizer, SCRIPTS), ToolExecutor([Verbose(rng)]), config)
    [s] = asyncio.run(loop.run([loop.new(question("q-search"), "v/0")]))
    text = loop.text(s)
    assert len(s.response_ids) == 120 and s.finish_reason == "length"
    assert text.endswith("</result>") and protocol.tool_results(text) and len(s.tool_calls) == 1


def test_the_engines_context_length_bounds_the_response(tokenizer):
    """Cut by the engine's context, the trajectory says so (finish reason context); cut by its own
    response budget (above), it says length."""
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([]), agent_config(max_response_tokens=4096))
    state = loop.new(question("q-long"), "c/0")
    engine.max_model_len = len(state.prompt_ids) + 50
    asyncio.run(loop.run([state]))
    assert state.finish_reason == "context" and len(state.prompt_ids) + len(state.response_ids) == engine.max_model_len
    assert all(len(r.prompt_ids) + r.max_new_tokens <= engine.max_model_len for r in engine.requests)


def test_an_engine_error_ends_only_its_trajectory(tokenizer):
    scripts = {**SCRIPTS, "q-engine-error": []}
    loop = AgentLoop(ScriptedEngine(tokenizer, scripts), ToolExecutor([FakeSearch(random.Random(0))]), SCRIPT_CONFIG, SCRIPT_ENTROPY)
    states = asyncio.run(loop.run([loop.new(question(n), f"{n}/0") for n in ("q-search", "q-engine-error", "q-none")]))
    assert [s.finish_reason for s in states] == ["answer", "error", "answer"]
    record = loop.to_record(states[1])
    assert record.error == "scripted failure" and record.finish_reason == "error" and record.response_ids == []


def test_seeds_differ_per_step_and_timeouts_can_be_off(tokenizer):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([]), agent_config(seed=5, timeout_s=None))
    epochs = [loop.new(question("q-none"), "q-none/0", seed=step) for step in (0, 1, 0)]
    for state in epochs:
        asyncio.run(loop.run([state]))
    first, second, replay = (r.seed for r in engine.requests)
    assert first != second and first == replay  # the same id in another step draws anew
    assert loop.to_record(epochs[1]).sampling["seed"] == 1


def test_fork_at_a_segment(tokenizer):
    loop, _, [s] = run_loop(tokenizer, ["q-python"], 1, 0)
    assert s.segments == 3 and len(s.tool_calls) == 2
    twin = s.fork("q-python/1", at_segment=1)  # just after the first call's result
    start = s.segment_starts[1].token
    assert twin.response_ids == s.response_ids[:start] and twin.origin == s.origin[:start]
    assert [c.output for c in twin.tool_calls] == ["84"] and twin.segments == 1 and len(twin.entropies) == 1
    assert twin.finish_reason is None and not twin.done
    assert twin.provenance.operation == "fork" and twin.provenance.parent == "q-python/0"
    assert (twin.provenance.branch_segment, twin.provenance.branch_token) == (1, start)
    assert loop.text(twin).endswith(protocol.format_result("84"))
    asyncio.run(loop.run([twin]))  # it samples segment 1 again and goes on from there
    assert twin.finish_reason == "answer" and twin.segments == 3 and twin.executed("python") == 2
    whole = s.fork("q-python/2")
    assert whole.response_ids == s.response_ids and whole.done and whole.provenance.branch_segment == 3
    with pytest.raises(ValueError, match="segment 4 does not exist"):
        s.fork("x", at_segment=4)
    with pytest.raises(ValueError, match="it has finished"):
        s.fork("x", at_segment=3)  # nothing to generate after </answer>


def test_from_prefix_runs_a_trailing_call_and_keeps_the_sources_ids(tokenizer):
    rng = random.Random(0)
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    loop = AgentLoop(engine, ToolExecutor([FakeSearch(rng), FakePython(rng)]), agent_config(max_python_calls=2, max_budget_messages=0))
    _, _, [source_state] = run_loop(tokenizer, ["q-python"], 1, 0)
    source = loop.to_record(source_state)
    # the flywheel's cut: keep the first call and its result, then an edited step ending in a call
    first = source.text.index("</result>") + len("</result>")
    prefix = source.text[:first] + "<think>check again</think><python>print(84 + 0)</python>"
    state = loop.from_prefix(
        question("q-python"), "e/0", prefix, source=source, budgets=Budgets(python=2, search=2), operation="edit", round=1
    )
    assert state.response_ids[: first_ids(source, first, tokenizer)] == source.response_ids[: first_ids(source, first, tokenizer)]
    assert set(state.origin) == {TokenOrigin.GIVEN, TokenOrigin.TOOL}  # nothing sampled here yet
    assert [c.output for c in state.tool_calls] == ["84"] and state.tool_calls[0] == source.tool_calls[0]
    assert state.trailing_call == protocol.ToolCall("python", "print(84 + 0)")
    assert state.provenance.operation == "edit" and state.provenance.round == 1
    asyncio.run(loop.run([state]))
    # the trailing call ran before generation went on; the policy then answered
    assert [c.output for c in state.tool_calls] == ["84", "84"] and state.finish_reason == "answer"
    text = loop.text(state)
    assert text.startswith(prefix + protocol.format_result("84")) and text.count("<result>") == 2
    assert loop.to_record(state).tool_calls_executed == 2


def first_ids(source, chars, tokenizer):
    """How many of the source's ids make up its first ``chars`` characters."""
    return next(
        i for i in range(len(source.response_ids) + 1) if len(tokenizer.decode(source.response_ids[:i], skip_special_tokens=False)) >= chars
    )


def test_from_text_only_and_over_budget_trailing_call(tokenizer):
    rng = random.Random(0)
    loop = AgentLoop(
        ScriptedEngine(tokenizer, SCRIPTS), ToolExecutor([FakeSearch(rng), FakePython(rng)]), agent_config(max_budget_messages=0)
    )
    prefix = (
        "<think>compute</think><python>print(12 * 7)</python>"
        + protocol.format_result("84")
        + "<think>again</think><python>print(1)</python>"
    )
    state = loop.from_prefix(question("q-python"), "t/0", prefix, budgets=Budgets(python=1, search=1))
    [record] = state.tool_calls
    assert record.rebuilt and (record.tool, record.input, record.output) == ("python", "print(12 * 7)", "84")
    asyncio.run(loop.run([state]))
    # the budget of this continuation is 1 python call, already spent in the prefix
    assert state.tool_calls[1].budget_exhausted and state.finish_reason == "budget"


def test_hints_are_trained_text_and_sft_agrees_with_or_without_ids(tokenizer):
    """Token provenance end to end: sampled and given text trained, tool output masked, the same
    labels from the rollout's ids as from its text alone."""
    from etagent.records import SFTExample
    from etagent.sft.data import IGNORE, tokenize_example

    loop, _, [s] = run_loop(tokenizer, ["q-search"], 1, 0)
    twin = s.fork("q-search/1", at_segment=1)
    loop.inject(twin, "<think>Hint: check the result before answering.</think>")
    asyncio.run(loop.run([twin]))
    record = loop.to_record(twin)
    assert TokenOrigin.GIVEN in record.response_origin and TokenOrigin.SAMPLED in record.response_origin
    assert record.n_generated == sum(1 for o in record.response_origin if o == TokenOrigin.SAMPLED)
    with_ids = SFTExample.from_rollout(record, twin.question.question)
    text_only = SFTExample.from_trajectory(record.id, twin.question.question, record.text)
    a, b = tokenize_example(with_ids, tokenizer), tokenize_example(text_only, tokenizer)
    assert a.from_token_ids and not b.from_token_ids
    assert tokenizer.decode(a.input_ids) == tokenizer.decode(b.input_ids)
    if len(tokenizer.encode("<result>", add_special_tokens=False)) == 1:
        assert a.input_ids == b.input_ids and a.labels == b.labels
    else:
        # a BPE tokenizer re-tokenizing the text merges across the edges of inserted text (">" +
        # "<" becomes "><"): from ids SFT trains the rollout's own tokens, from text the canonical ones
        assert a.input_ids != b.input_ids
    for example in (a, b):
        trained = tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE])
        assert "Hint: check the result" in trained and "Doc about" not in trained
        assert "Doc about" in tokenizer.decode(example.input_ids)


def test_from_prefix_matches_records_by_call_and_counts_budget_messages(tokenizer):
    """An edit that drops the source's first call: the kept call keeps its own record (not the
    dropped one's), and budget messages already in the prefix count against max_budget_messages."""
    rng = random.Random(0)
    loop = AgentLoop(ScriptedEngine(tokenizer, SCRIPTS), ToolExecutor([FakeSearch(rng), FakePython(rng)]), agent_config())
    _, _, [source_state] = run_loop(tokenizer, ["q-python"], 1, 0)
    source = loop.to_record(source_state)
    second = source.text.index("<think>check again")
    end = source.text.index("</result>", second) + len("</result>")
    state = loop.from_prefix(question("q-python"), "d/0", source.text[second:end], source=source)
    assert [(c.input, c.rebuilt) for c in state.tool_calls] == [("print(84 + 0)", False)]
    assert state.tool_calls[0] is source.tool_calls[1] or state.tool_calls[0] == source.tool_calls[1]

    budget = "<search>a</search>" + protocol.format_result(
        "Tool budget exhausted: 2 search calls made, the limit is 2. No more search calls will run; answer with the information you have."
    )
    state = loop.from_prefix(question("q-search"), "d/1", budget * 2)
    assert state.budget_messages == 2 and all(c.budget_exhausted for c in state.tool_calls)


class HangingSearch:
    """A search tool double that never answers for one query and answers the others at once."""

    name = "search"

    async def __call__(self, query):
        if query == "hang":
            await asyncio.sleep(3600)
        return ToolOutput(f"Doc about {query}.", ok=True)


def test_a_tool_that_hangs_past_its_timeout_ends_only_its_own_trajectory(tokenizer):
    """Every trajectory runs on its own: while one waits on a search that never answers, the
    others go on and finish; the hung call fails at the tool's timeout (0.5 s), and the trajectory
    ends there at its own wall-clock limit (0.3 s), with the failure recorded."""
    scripts = {
        "q-hang": ["<think>look</think><search>hang</search>", "<think>never</think>" + ANSWER.format(1)],
        **{f"q-fast{i}": ["<think>look</think><search>fast</search>", "<think>found</think>" + ANSWER.format(i)] for i in range(4)},
    }
    engine = ScriptedEngine(tokenizer, scripts)
    executor = ToolExecutor([HangingSearch()], timeout_s={"search": 0.5})
    loop = AgentLoop(engine, executor, agent_config(max_response_tokens=300, timeout_s=0.3))
    finished: dict[str, float] = {}

    async def run_and_time(state):
        await loop.run_one(state)
        finished[state.id] = time.monotonic()

    async def main():
        states = [loop.new(question(name), f"{name}/0") for name in scripts]
        start = time.monotonic()
        await asyncio.gather(*(run_and_time(s) for s in states))
        return states, start

    states, start = asyncio.run(main())
    by_name = {s.question.id: s for s in states}
    hung = by_name.pop("q-hang")
    assert all(s.finish_reason == "answer" for s in by_name.values())
    assert all(finished[s.id] - start < 0.4 for s in by_name.values())  # none waited for the hung call
    assert hung.finish_reason == "timeout" and 0.5 <= finished[hung.id] - start < 2.0
    [call] = hung.tool_calls
    assert not call.ok and call.failure == "timeout" and "did not answer within 0.5 seconds" in call.output


def test_streamed_sampling_keeps_its_window_and_writes_in_question_order(tokenizer):
    """The sampling stages' stream: at most window x n trajectories unfinished at a time, a new
    question started as soon as n have finished, and the groups handed over in question order
    whatever order they finish in (tool latencies are random); the same groups as lockstep
    rounds over batches of the same size."""
    from etagent.sampling import Sampler

    names = ["q-python", "q-search", "q-none", "q-budget", "q-eos", "q-fake", "q-long", "q-search"]
    questions = [question(name).model_copy(update={"id": f"{name}#{i}"}) for i, name in enumerate(names)]
    runs = {}
    for lockstep in (False, True):
        engine = ScriptedEngine(tokenizer, SCRIPTS)
        executor = ToolExecutor([FakeSearch(random.Random(4)), FakePython(random.Random(5))])
        sampler = Sampler(
            engine,
            executor,
            dataclasses.replace(SCRIPT_CONFIG, lockstep=lockstep),
            n=2,
            stage="test",
            judge=partial(rule_judgement, qa_pass_mark=0.8),
        )
        active, most = 0, 0
        run_one = sampler.loop.run_one

        async def counting(state, run_one=run_one):
            nonlocal active, most
            active += 1
            most = max(most, active)
            try:
                return await run_one(state)
            finally:
                active -= 1

        sampler.loop.run_one = counting
        runs[lockstep] = list(sampler.stream(questions, window=3))
        if not lockstep:
            assert most == 6  # 3 questions x 2 trajectories in flight, never more
    streamed, rounds = runs[False], runs[True]
    assert [g.id for g in streamed] == [q.id for q in questions] == [g.id for g in rounds]
    assert [[t.response_ids for t in g.trajectories] for g in streamed] == [[t.response_ids for t in g.trajectories] for g in rounds]

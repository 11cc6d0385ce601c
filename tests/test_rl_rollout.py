"""The ARPO tree rollout and AEPO's switches (rl/rollout.py, rl/algorithm.py).

The rollout tests drive the real agent loop with a scripted engine and a scripted search tool,
test doubles for control flow only: the engine replays a fixed segment per tool round of each
question and reports a scripted exact entropy for it, so every branch decision's dH is known.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import settings as settings_of_hypothesis
from hypothesis import strategies as st
from transformers import AutoTokenizer

from etagent import protocol
from etagent.agent import AgentLoop, SegmentEntropy
from etagent.llm import Sample
from etagent.records import Question, TokenOrigin
from etagent.rl.algorithm import entropy_aware_advantages, entropy_moments, entropy_standardisation, policy_loss
from etagent.rl.config import RolloutSettings
from etagent.rl.rollout import (
    DELTA_H,
    GroupRollout,
    PartialRollout,
    Prompt,
    TreeRollout,
    aepo_branches,
    arpo_branch_probability,
    dynamic_root_count,
    make_rollout,
    rollout_metrics,
    segment_entropy,
    stale_tokens,
)
from etagent.tools import ToolOutput
from etagent.tools.executor import ToolExecutor
from tests.support.groups import agent_config

ANSWER = "<think>done</think><answer>The final answer is \\[ \\boxed{1} \\]</answer>"


class ScriptedEngine:
    """Segment k of a question (k = tool results so far) is ``"<search>q{k}</search>"`` while
    k < the question's number of calls, then the answer. Its exact entropy is
    ``entropy(question, k)`` (``self.entropy``, replaceable between steps), reported as the
    first position's so that the segment's entropy (the sum / ln |V|) is exactly that value."""

    max_model_len = 4096

    def __init__(self, tokenizer, calls: dict[str, int]):
        self.tokenizer, self.calls = tokenizer, calls
        self.entropy = lambda question, k: 0.0
        self.log_v = math.log(len(tokenizer))

    async def agenerate(self, requests):
        out = []
        for r in requests:
            text = self.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
            question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            k = text.split("<|im_start|>assistant\n", 1)[1].count("<result>")
            segment = f"<search>q{k}</search>" if k < self.calls[question] else ANSWER
            ids = self.tokenizer.encode(segment, add_special_tokens=False)
            stop = next(s for s in r.stop if segment.endswith(s))
            entropy = [self.entropy(question, k) * self.log_v] + [0.0] * (len(ids) - 1)
            out.append([Sample(ids, [-0.1] * len(ids), "stop", stop, [{i: -0.1} for i in ids], entropy)])
        return out


class Search:
    name = "search"

    async def __call__(self, query):
        return ToolOutput(f"about {query}", ok=True)


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy / "model")


def setup(tokenizer, calls: dict[str, int]):
    engine = ScriptedEngine(tokenizer, calls)
    config = agent_config(max_search_calls=50, max_response_tokens=4000, max_segment_tokens=64, timeout_s=None, seed=0)
    loop = AgentLoop(engine, ToolExecutor([Search()]), config, SegmentEntropy(top_logprobs=1, window=20))
    prompts = [Prompt(Question(id=q, question=q, answer=["1"], source="toy", kind="qa"), i, "qa_effi_rl") for i, q in enumerate(calls)]
    return engine, loop, prompts


def settings(**fields) -> RolloutSettings:
    """RL's rollout group: the tiny preset's tree, with ``fields`` changed."""
    tiny = dict(
        n=8,
        kind="tree",
        initial_rollouts=4,
        beam_size=2,
        branch_probability=0.5,
        entropy_weight=0.2,
        delta_h="after_result",
        entropy="topk",
        top_logprobs=10,
        entropy_window=20,
        dynamic_roots=False,
        branch_penalty=False,
    )
    return RolloutSettings(**{**tiny, **fields})


def tree(n=8, roots=4, p=0.5, w=0.2, beam=2, **switches) -> TreeRollout:
    return TreeRollout(
        settings(n=n, initial_rollouts=roots, beam_size=beam, branch_probability=p, entropy_weight=w, entropy="exact", **switches)
    )


def operations(group) -> list[str]:
    return [t.provenance.operation for t in group]


def test_no_branching_gives_each_root_its_fill_ins_at_once(tokenizer):
    """p = 0 and dH = 0: no path forks; each root ends with its share of the budget (n - roots
    split evenly: 1 each here) and is replaced at once by that many fresh rollouts, which follow it
    in the group."""
    _, loop, prompts = setup(tokenizer, {"three": 3, "direct": 0})
    out = tree(p=0.0).generate(loop, prompts, step=1, seed=0)
    for index, group in enumerate(out.groups):
        assert len(group) == 8 and all(t.done for t in group)
        assert [t.id for t in group] == [f"step1/{index}/{i}{fill}" for i in range(4) for fill in ("", "+0")]
        assert set(operations(group)) == {"rollout"}
    assert out.counts["fill_ins"] == 8 and out.counts["branches"] == 0
    assert out.counts["depth"] == 4  # "three": three calls, four segments
    assert [t.segments for t in out.groups[0]] == [4] * 8


def test_all_branching_spends_the_budget_on_branches_lagged(tokenizer):
    """lagged (ARPO's released code), p = 1: every path forks after each new result while it has
    budget; each fork halves what is left, so 2 roots of 16 give 4, 8, 16 paths at results 1, 2,
    3, as the reference's rounds do; no fill-ins, and every rollout ends with the answer."""
    _, loop, prompts = setup(tokenizer, {"five": 5})
    out = tree(n=16, roots=2, p=1.0, delta_h="lagged").generate(loop, prompts, step=1, seed=0)
    [group] = out.groups
    assert len(group) == 16 and len({t.id for t in group}) == 16
    assert out.counts["branches"] == 14 and out.counts["fill_ins"] == 0
    assert [out.counts[f"branched_result{r}"] for r in (1, 2, 3)] == [2, 4, 8]
    by_id = {t.id: t for t in group}
    forks = [t for t in group if t.provenance.operation == "fork"]
    assert len(forks) == 14 and all(t.id.startswith(t.provenance.parent + ".") for t in forks)
    assert all(t.finish_reason == "answer" and t.executed() == 5 for t in group)
    # a fork keeps its source's prefix, token for token
    for fork in forks:
        cut = fork.provenance.branch_token
        assert fork.response_ids[:cut] == by_id[fork.provenance.parent].response_ids[:cut]
    # the calls a fork copied ran once, in its source
    assert out.counts["tool_calls_executed"] == sum(t.executed_here() for t in group) < sum(t.executed() for t in group)


def test_all_branching_forks_at_results(tokenizer):
    """after_result (ARPO's paper), p = 1: a path decides at each tool result once it has
    generated the segment after it, and its copy resamples that segment: every fork starts right
    after a result of its source, keeps the source's tokens before it, and decides again only at
    its own later results; the group is n, all answered, none a duplicate of its source."""
    _, loop, prompts = setup(tokenizer, {"five": 5})
    out = tree(n=16, roots=2, p=1.0).generate(loop, prompts, step=1, seed=0)
    [group] = out.groups
    assert len(group) == 16 and out.counts["branches"] == 14 and out.counts["fill_ins"] == 0
    assert "decisions_result0" not in out.counts  # a root's first segment comes from the prompt: no result yet
    # at their first result both roots fork; the copies resample the segment after it
    assert out.counts["branched_result1"] == 2
    by_id = {t.id: t for t in group}
    result_end = tokenizer.encode("\n</result>", add_special_tokens=False)
    for fork in (t for t in group if t.provenance.operation == "fork"):
        source, at = by_id[fork.provenance.parent], fork.provenance.branch_segment
        assert at >= 1 and fork.provenance.branch_token == source.segment_starts[at].token
        assert fork.response_ids[: fork.provenance.branch_token] == source.response_ids[: fork.provenance.branch_token]
        assert fork.response_ids[fork.provenance.branch_token - len(result_end) : fork.provenance.branch_token] == result_end
        assert fork.forked_calls == at  # one search per earlier segment
    assert all(t.finish_reason == "answer" and t.executed() == 5 for t in group)
    assert out.counts["tool_calls_executed"] == sum(t.executed_here() for t in group) < sum(t.executed() for t in group)


def test_early_finishes_and_beam(tokenizer):
    """A root that answers at once leaves its whole budget to fresh rollouts; a beam of 3 lets a
    path fork twice at one result; the group is exactly n in every case. Worked by hand, one root
    with a budget of 5: each fork takes 1 and halves the rest with its source."""
    _, loop, prompts = setup(tokenizer, {"direct": 0, "one": 1, "two": 2})
    out = tree(n=6, roots=1, p=1.0, beam=3).generate(loop, prompts, step=1, seed=0)
    assert [len(g) for g in out.groups] == [6, 6, 6]
    direct, one, two = out.groups
    assert operations(direct) == ["rollout"] * 6
    # "one": the root answers after its result and forks there twice (copies with budgets 2 and
    # 0, the root keeps 1); the copies answer; the root's 1 and the first copy's 2 become fresh
    # rollouts, each after the path that left it
    assert operations(one) == ["rollout", "fork", "rollout", "rollout", "fork", "rollout"]
    assert [t.id.removeprefix("step1/1/") for t in one] == ["0", "0.1.0", "0.1.0+0", "0.1.0+1", "0.1.1", "0+0"]
    # "two": the root forks twice at its first result (budgets 2, 0; it keeps 1) and once at its
    # second; the first copy, at its second result, forks twice with its 2
    assert operations(two) == ["rollout"] + ["fork"] * 5
    assert [t.provenance.branch_segment for t in two[1:]] == [1, 2, 2, 1, 2]
    lagged = tree(n=6, roots=1, p=1.0, beam=3, delta_h="lagged").generate(loop, prompts, step=1, seed=0)
    assert [len(g) for g in lagged.groups] == [6, 6, 6]
    assert operations(lagged.groups[2]) == ["rollout"] + ["fork"] * 5


def test_branch_probability_is_p_plus_w_dh(tokenizer):
    """ARPO's rule: P(fork) = clamp(p + w dH, 0, 1). With after_result, dH is the entropy of the
    segment right after a result minus the path's first segment's, so the first decision already
    sees the rise (1.5 here: P = 0.2 + 0.2 x 1.5 = 0.5); with lagged (the released code) a path's
    first decision reads its first segment against itself (dH = 0, P = p) and the rise only at its
    second. Checked on the function and on 300 scripted decisions per case."""
    assert arpo_branch_probability(0.5, 0.2, 1.0) == pytest.approx(0.7)
    assert arpo_branch_probability(0.5, 0.2, -3.0) == 0.0
    assert arpo_branch_probability(0.5, 0.2, 4.0) == 1.0
    calls = {f"q{i}": 1 for i in range(300)}
    engine, loop, prompts = setup(tokenizer, calls)
    engine.entropy = lambda question, k: 0.4 + 1.5 * k  # first segment 0.4, the one after a result 1.9: dH = 1.5
    out = tree(n=3, roots=1, p=0.2, w=0.2, beam=3).generate(loop, prompts, step=1, seed=0)
    metrics = rollout_metrics([out.counts])
    assert metrics["rollout/mean_delta_h"] == pytest.approx(1.5)
    assert metrics["rollout/branch_rate_result1"] == pytest.approx(0.5, abs=0.05)
    assert "rollout/branch_rate_result0" not in metrics  # no result before a root's first segment

    lagged = tree(n=3, roots=1, p=0.2, w=0.2, beam=3, delta_h="lagged").generate(loop, prompts, step=1, seed=0)
    assert lagged.counts["delta_h_sum"] / lagged.counts["decisions_result1"] == pytest.approx(0.0)  # the first segment itself
    assert lagged.counts["branched_result1"] / lagged.counts["decisions_result1"] == pytest.approx(0.2, abs=0.05)
    # 2 calls per question give the lagged rule a second result, where roots with budget left see dH = 1.5
    engine.calls = {q: 2 for q in calls}
    metrics = rollout_metrics([tree(n=3, roots=1, p=0.2, w=0.2, beam=3, delta_h="lagged").generate(loop, prompts, step=2, seed=0).counts])
    assert metrics["rollout/branch_rate_result1"] == pytest.approx(0.2, abs=0.05)
    assert metrics["rollout/branch_rate_result2"] == pytest.approx(0.5, abs=0.08)


def test_a_path_with_no_room_left_never_forks(tokenizer):
    """A result that fills the response budget leaves its path no room: the path ends there and
    is not copied (ARPO's length filter; a copy would end at once, identical to its source, and
    count twice in the group). The group is made of fresh rollouts instead."""
    engine, loop, prompts = setup(tokenizer, {"two": 2})
    first = tokenizer.encode("<search>q0</search>", add_special_tokens=False)
    result = tokenizer.encode(protocol.format_result("about q0"), add_special_tokens=False)
    loop.config = replace(loop.config, max_response_tokens=len(first) + len(result))
    for delta_h in ("after_result", "lagged"):
        out = tree(n=4, roots=2, p=1.0, delta_h=delta_h).generate(loop, prompts, step=1, seed=0)
        [group] = out.groups
        assert out.counts["branches"] == 0 and len(group) == 4
        assert {t.provenance.operation for t in group} == {"rollout"} and {t.finish_reason for t in group} == {"length"}


@pytest.mark.parametrize("delta_h", ["after_result", "lagged"])
def test_baseline_entropy_belongs_to_this_step(tokenizer, delta_h):
    """The reference keeps each slot's first-segment entropy across steps, so step 2 compares
    with step 1's paths. Here step 1's first segments are at 10 and step 2's at 0 with 1 after a
    result: with p = 0, w = 1, step 2 forks at every decision that reads a segment after a result
    (dH = +1), where a stale baseline (dH = 1 - 10) would never fork."""
    engine, loop, prompts = setup(tokenizer, {"two": 2})
    rollout = tree(n=4, roots=1, p=0.0, w=1.0, delta_h=delta_h)
    engine.entropy = lambda question, k: 10.0 if k == 0 else 0.0
    first = rollout.generate(loop, prompts, step=1, seed=0)
    assert first.counts["branches"] == 0
    engine.entropy = lambda question, k: float(k > 0)
    second = rollout.generate(loop, prompts, step=2, seed=0)
    # at the second result both rules read a segment after a result against the first (dH = +1)
    assert second.counts["branched_result2"] == second.counts["decisions_result2"] > 0


def test_a_resumed_step_draws_the_same_tree(tokenizer):
    """The branch draws come from the run's seed and the step: the same step gives the same tree."""
    engine, loop, prompts = setup(tokenizer, {"a": 3, "b": 2, "c": 4})
    engine.entropy = lambda question, k: 0.3 * k
    one = tree().generate(loop, prompts, step=7, seed=3)
    two = tree().generate(loop, prompts, step=7, seed=3)
    assert [[(t.id, t.provenance.parent, t.response_ids) for t in g] for g in one.groups] == [
        [(t.id, t.provenance.parent, t.response_ids) for t in g] for g in two.groups
    ]
    other = tree().generate(loop, prompts, step=8, seed=3)
    assert [[t.provenance.parent for t in g] for g in other.groups] != [[t.provenance.parent for t in g] for g in one.groups]


def test_group_rollout_keeps_its_interface(tokenizer):
    _, loop, prompts = setup(tokenizer, {"one": 1})
    out = GroupRollout(5).generate(loop, prompts, step=1, seed=0)
    assert [len(g) for g in out.groups] == [5] and out.counts == {"tool_calls_executed": 5.0}
    assert rollout_metrics([out.counts]) == {"rollout/tool_calls_executed": 5.0}


def test_rollout_metrics_add_up_over_ranks():
    ranks = [
        {"roots": 4, "branches": 3, "fill_ins": 1, "depth": 3, "delta_h_sum": 1.0, "decisions_result1": 4, "branched_result1": 2},
        {"roots": 4, "branches": 1, "fill_ins": 0, "depth": 5, "delta_h_sum": 2.0, "decisions_result1": 2, "branched_result1": 0,
         "decisions_result2": 4, "branched_result2": 1},
    ]  # fmt: skip
    m = rollout_metrics(ranks)
    assert (m["rollout/roots"], m["rollout/branches"], m["rollout/fill_ins"], m["rollout/depth"]) == (8, 4, 1, 5)
    assert m["rollout/mean_delta_h"] == pytest.approx(3.0 / 10)
    assert m["rollout/branch_rate_result1"] == pytest.approx(2 / 6) and m["rollout/branch_rate_result2"] == pytest.approx(0.25)


# -- AEPO ------------------------------------------------------------------------------------


def test_dynamic_root_count_by_hand():
    # floor(16 * sigmoid(0.5 * (2 - 0))) + 1 = floor(16 * 0.7311) + 1 = 12
    assert dynamic_root_count(16, 2.0, 0.0) == 12
    assert dynamic_root_count(16, 0.0, 0.0) == 9
    assert dynamic_root_count(16, 0.0, 40.0) == 1
    assert dynamic_root_count(16, 40.0, 0.0) == 16  # floor(16 * ~1) + 1 = 17, clamped to n


def test_dynamic_roots_come_from_a_discarded_probe(tokenizer):
    """One probe per prompt runs to its end with tools; H_root is its first segment's entropy,
    H_tool the mean of all its segments', the first included (AEPO's code). Root counts follow
    the formula; probes are not in the groups, their calls are counted as executed."""
    engine, loop, prompts = setup(tokenizer, {"calm-tools": 2, "calm-start": 2})
    entropies = {"calm-tools": [4.0, 0.0, 0.0], "calm-start": [0.0, 3.0, 5.0]}
    engine.entropy = lambda question, k: entropies[question][k]
    out = tree(n=8, roots=4, p=0.0, w=0.0, dynamic_roots=True).generate(loop, prompts, step=1, seed=0)
    # H_tool: (4 + 0 + 0) / 3 and (0 + 3 + 5) / 3
    expected = [dynamic_root_count(8, 4.0, 4.0 / 3), dynamic_root_count(8, 0.0, 8.0 / 3)]
    assert expected == [7, 2]  # floor(8 sigmoid(4/3)) + 1 = floor(6.33) + 1; floor(8 sigmoid(-4/3)) + 1 = floor(1.67) + 1
    assert out.counts["dynamic_roots"] == sum(expected) == out.counts["roots"]
    assert [len(g) for g in out.groups] == [8, 8]
    assert not any("probe" in t.id for g in out.groups for t in g)
    # no branching (p = 0, w = 0): "calm-start" got 2 roots, each replaced by 3 fill-ins once it ended
    assert [t.provenance.operation for t in out.groups[1]] == ["rollout"] * 8 and out.counts["fill_ins"] == 1 + 6
    assert out.counts["tool_calls_executed"] == 2 * 2 + 16 * 2  # the probes' calls and the groups'


def test_aepo_branch_rule_direction_and_penalty(tokenizer):
    """AEPO branches when clamp((u + w dH)(1 - 0.05 c), 0, 1) >= p: a larger p branches less
    (ARPO's opposite), and each decision in a row that made copies damps it."""
    assert aepo_branches(0.3, 0.5, 0.2, 1.0, 0)  # 0.5 >= 0.5
    assert not aepo_branches(0.3, 0.6, 0.2, 1.0, 0)
    assert not aepo_branches(0.3, 0.5, 0.2, 1.0, 2)  # 0.5 * 0.9 < 0.5
    assert not aepo_branches(0.99, 0.01, 0.2, 1.0, 20)  # damped to 0
    # through the rollout: p = 0 always branches under AEPO's rule, never under ARPO's (w = 0)
    _, loop, prompts = setup(tokenizer, {"three": 3})
    aepo = tree(n=8, roots=2, p=0.0, w=0.0, branch_penalty=True).generate(loop, prompts, step=1, seed=0)
    arpo = tree(n=8, roots=2, p=0.0, w=0.0).generate(loop, prompts, step=1, seed=0)
    assert aepo.counts["branches"] == 6 and arpo.counts["branches"] == 0


def test_entropy_balanced_clipping_passes_a_gradient_on_a_clipped_token():
    """A > 0 and r = 1.5 > 1 + 0.2: the standard loss has no gradient there; AEPO's upper bound
    (1 + eps) r / sg(r) gives d loss / d log pi = -A (1 + eps), the unclipped gradient scaled by
    (1 + eps) / r. The value of the loss is the same."""
    old = torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, 2)
    advantages = torch.tensor([2.0])
    results = {}
    for balanced in (False, True):
        logprobs = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
        terms = policy_loss(logprobs, old, advantages, mask, 1, 0.2, 0.2, 3.0, entropy_balanced_clipping=balanced)
        terms.loss.backward()
        results[balanced] = (terms.loss.item(), logprobs.grad[0].tolist(), terms.clipped_tokens.item())
    assert results[False][0] == pytest.approx(results[True][0])
    assert results[False][1][0] == 0.0 and results[True][1][0] == pytest.approx(-2.0 * 1.2)
    # the unclipped token is the same either way: d(-A r)/d log pi = -A r
    assert results[False][1][1] == pytest.approx(-2.0 * 1.1) == results[True][1][1]
    assert results[False][2] == results[True][2] == 1


def test_entropy_balanced_clipping_is_finite_on_a_masked_token_of_very_low_probability():
    """A tool result's token has old log-probability 0 (nothing sampled it) and is masked; at a
    new log-probability of -120 its ratio underflows to 0 in float32, and r / sg(r) was 0 / 0 =
    NaN, which the mask does not remove (0 x NaN). The loss and its gradient are finite, and equal
    to those with the masked token left out."""
    old = torch.tensor([[-1.0, 0.0, -2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages = torch.tensor([0.7])
    logprobs = torch.tensor([[-0.6, -120.0, -2.1]], requires_grad=True)
    terms = policy_loss(logprobs, old, advantages, mask, 2, 0.2, 0.2, 3.0, entropy_balanced_clipping=True)
    terms.loss.backward()
    assert torch.isfinite(terms.loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1].item() == 0.0
    kept = torch.tensor([[-0.6, -2.1]], requires_grad=True)
    alone = policy_loss(kept, old[:, [0, 2]], advantages, torch.ones(1, 2), 2, 0.2, 0.2, 3.0, entropy_balanced_clipping=True)
    alone.loss.backward()
    assert terms.loss.item() == pytest.approx(alone.loss.item())
    assert logprobs.grad[0, [0, 2]].tolist() == pytest.approx(kept.grad[0].tolist())


def test_entropy_aware_advantage_by_hand():
    """z over the masked tokens (mean 2, unbiased std 1 for entropies 1, 2, 3; the padded 9 left
    out): A (1 + 0.2 z) = 0.8 A, A, 1.2 A; no gradient flows through the entropy. The moments of
    two micro-batches summed give the standardisation of their tokens together."""
    entropy = torch.tensor([[1.0, 2.0, 3.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mean, std = entropy_standardisation(entropy_moments(entropy, mask))
    assert (mean, std) == pytest.approx((2.0, 1.0))
    scaled = entropy_aware_advantages(torch.tensor([-0.5]), entropy, mean, std)
    assert scaled[0, :3].tolist() == pytest.approx([-0.4, -0.5, -0.6])
    assert not scaled.requires_grad
    flat = torch.full((1, 3), 0.7)
    assert entropy_standardisation(entropy_moments(flat, torch.ones(1, 3))) == pytest.approx((0.7, 1.0))  # std 0 counts as 1
    assert entropy_aware_advantages(torch.tensor([1.0]), flat, 0.7, 1.0).tolist() == [[1.0, 1.0, 1.0]]
    parts = entropy_moments(entropy[:, :2], mask[:, :2]) + entropy_moments(entropy[:, 2:], mask[:, 2:])
    assert entropy_standardisation(parts) == pytest.approx((2.0, 1.0))


def test_tree_settings_refuse_bad_numbers():
    with pytest.raises(ValueError, match="initial_rollouts"):
        TreeRollout(settings(n=4, initial_rollouts=5))
    with pytest.raises(ValueError, match="entropy"):
        TreeRollout(settings(n=4, initial_rollouts=2, entropy="mean"))
    with pytest.raises(ValueError, match="beam_size"):
        TreeRollout(settings(n=4, initial_rollouts=2, beam_size=0))


class DelayedEngine(ScriptedEngine):
    """The scripted engine, answering each request after a random delay of its own (0-3 ms): paths
    finish their steps in an order that changes with ``order_seed``."""

    def __init__(self, tokenizer, calls, order_seed: int):
        super().__init__(tokenizer, calls)
        self.delays = random.Random(order_seed)

    async def agenerate(self, requests):
        await asyncio.sleep(self.delays.uniform(0.0, 0.003))
        return await super().agenerate(requests)


@settings_of_hypothesis(max_examples=25, deadline=None)
@given(
    calls=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    n=st.integers(1, 12),
    roots_share=st.floats(0.0, 1.0),
    beam=st.integers(1, 3),
    p=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    delta_h=st.sampled_from(DELTA_H),
    penalty=st.booleans(),
)
def test_the_tree_is_the_same_whatever_order_paths_finish_in(tokenizer, calls, n, roots_share, beam, p, delta_h, penalty):
    """Every path decides when its own step ends; the same seeds give the same groups, path for
    path, and the same counts, whether the paths run streamed with two different random orders
    of finishing or in lockstep rounds over every prompt. Each group has exactly n trajectories,
    unique ids, every fork's source in the group."""
    questions = {f"q{i}-{c}": c for i, c in enumerate(calls)}
    roots = 1 + round(roots_share * (n - 1))
    runs = []
    for order_seed, lockstep in ((0, False), (1, False), (2, True)):
        engine = DelayedEngine(tokenizer, questions, order_seed)
        engine.entropy = lambda question, k: 0.1 * len(question) + 0.4 * k
        _, loop, prompts = setup(tokenizer, questions)
        loop.engine = engine
        loop.config = replace(loop.config, lockstep=lockstep)
        rollout = tree(n=n, roots=roots, p=p, beam=beam, delta_h=delta_h, branch_penalty=penalty)
        runs.append(rollout.generate(loop, prompts, step=2, seed=5))
    shape = lambda out: [[(t.id, t.response_ids, t.provenance.parent) for t in g] for g in out.groups]  # noqa: E731
    assert shape(runs[0]) == shape(runs[1]) == shape(runs[2])
    assert runs[0].counts == runs[1].counts == runs[2].counts
    for group in runs[0].groups:
        ids = {t.id for t in group}
        assert len(group) == n == len(ids) and all(t.done for t in group)
        assert all(t.provenance.parent in ids for t in group if t.provenance.operation == "fork")


def test_a_fork_is_decided_without_waiting_for_another_path(tokenizer):
    """Two roots of one prompt, p = 1, a budget of one copy each: the engine holds whichever
    root's segment after its first result comes second, until a third such request arrives,
    which only the other root's copy can send. With a barrier over the prompt's paths that copy
    would wait for the held segment and the step would never end (the hold times out after 10 s);
    without one the copy is made, sends its request, and releases it."""
    engine, loop, prompts = setup(tokenizer, {"one": 1})
    answer = engine.agenerate
    after_result, released = [], asyncio.Event()

    async def holding(requests):
        [r] = requests
        if tokenizer.decode(list(r.prompt_ids)).split("<|im_start|>assistant\n", 1)[1].count("<result>") == 1:
            after_result.append(r)
            if len(after_result) == 2:
                await asyncio.wait_for(released.wait(), timeout=10)
            elif len(after_result) == 3:
                released.set()
        return await answer(requests)

    engine.agenerate = holding
    out = tree(n=4, roots=2, p=1.0).generate(loop, prompts, step=1, seed=0)
    [group] = out.groups
    assert len(after_result) == 4 and operations(group) == ["rollout", "fork", "rollout", "fork"]


@pytest.mark.parametrize("kind", ["group", "tree"])
def test_top_logprobs_are_asked_for_only_where_the_tree_reads_them(tokenizer, kind):
    """What the engine is asked for, counted: a group rollout asks for no top log-probabilities
    (the sampled token's own only); the tree asks for top_logprobs per position over the first
    entropy_window positions of each segment, which is what its entropy reads."""
    engine = ScriptedEngine(tokenizer, {"two": 2, "none": 0})
    asked = []
    answer = engine.agenerate

    async def counting(requests):
        asked.extend((r.logprobs, r.logprobs_window) for r in requests)
        return await answer(requests)

    engine.agenerate = counting
    rollout_settings = settings(kind=kind, n=4, initial_rollouts=2, top_logprobs=7, entropy_window=13)
    config = agent_config(max_search_calls=50, max_response_tokens=4000, max_segment_tokens=64, timeout_s=None, seed=0)
    loop = AgentLoop(engine, ToolExecutor([Search()]), config, segment_entropy(rollout_settings))
    prompts = [
        Prompt(Question(id=q, question=q, answer=["1"], source="toy", kind="qa"), i, "qa_effi_rl") for i, q in enumerate(["two", "none"])
    ]
    out = make_rollout(rollout_settings).generate(loop, prompts, step=1, seed=0)
    assert [len(g) for g in out.groups] == [4, 4] and len(asked) >= 8
    assert set(asked) == ({(0, None)} if kind == "group" else {(7, 13)})


# -- partial rollouts ------------------------------------------------------------------------


def partial(rollout, pool, quota=2, extra=2, max_staleness=1, on_stale="drop") -> PartialRollout:
    s = settings(partial=True, partial_extra=extra, max_staleness=max_staleness, on_stale=on_stale, stale_tokens="tis")
    return PartialRollout(rollout, s, quota, pool, rank=0)


def partial_setup(tokenizer, calls):
    engine, loop, prompts = setup(tokenizer, calls)
    loop.config = replace(loop.config, lockstep=True)  # rounds: what stops where does not depend on timing
    return engine, loop, prompts


def run_steps(rollout: PartialRollout, loop, prompts, steps, per_step=2):
    """Steps as the trainer runs them: the weights' version is the updates so far, and each step's
    own prompts are ``per_step`` of the pool in turn."""
    out = []
    for step in steps:
        loop.version = step - 1
        chosen = [prompts[(step - 1) * per_step % len(prompts) + i] for i in range(per_step)]
        out.append(rollout.generate(loop, chosen, step, seed=0))
    return out


def test_partial_rollouts_carry_unfinished_groups_with_their_versions(tokenizer):
    """Quota 1, 1 extra group, in rounds: step 1 (version 0) starts "slow" (2 calls) and a quick
    one from the pool (1 call); the quick one completes first and is trained on, "slow" carries
    over after 2 segments; step 2 (version 1) samples its answer with the new weights and trains
    on it: its trajectories span 2 versions, their first 2 segments stale by 1."""
    calls = {"slow": 2, "quick-a": 1, "quick-b": 1, "quick-c": 1}
    _, loop, prompts = partial_setup(tokenizer, calls)
    rollout = partial(GroupRollout(2), prompts, quota=1, extra=1)
    [first] = run_steps(rollout, loop, prompts, [1], per_step=1)
    assert [p.question.id for p in first.prompts] != ["slow"]
    [carried] = rollout.in_flight
    assert carried.prompt.question.id == "slow" and [p.state.segment_versions for p in carried.paths] == [[0, 0], [0, 0]]
    assert rollout_metrics([first.counts])["partial/carried_share"] == 0
    [second] = run_steps(rollout, loop, prompts, [2], per_step=1)
    assert [p.question.id for p in second.prompts] == ["slow"]
    stale = sampled = 0
    for t in second.groups[0]:
        assert t.segment_versions == [0, 0, 1] and t.executed() == 2 and t.finish_reason == "answer"
        marks = stale_tokens(t, 1)
        assert marks == [o == TokenOrigin.SAMPLED and i < t.segment_starts[2].token for i, o in enumerate(t.origin)]
        stale, sampled = stale + sum(marks), sampled + t.n_generated
    metrics = rollout_metrics([second.counts])
    assert metrics["partial/carried_share"] == 1 and metrics["partial/versions_spanned"] == 2
    assert metrics["partial/staleness_max"] == metrics["partial/staleness_mean"] == 1
    assert metrics["partial/stale_token_share"] == pytest.approx(stale / sampled) and metrics["partial/dropped_share"] == 0


def test_partial_rollouts_drop_a_group_past_the_staleness_bound(tokenizer):
    """on_stale=drop, max_staleness 1: "slow", begun at step 1 (version 0) and still running at step 3
    (version 2), would train on tokens 2 versions old; it is dropped at the start of step 3,
    counted, and never trained on."""
    calls = {"slow": 12, "quick-a": 1, "quick-b": 1, "quick-c": 1, "quick-d": 1}
    _, loop, prompts = partial_setup(tokenizer, calls)
    rollout = partial(GroupRollout(2), prompts, quota=1, extra=1)
    steps = run_steps(rollout, loop, prompts, [1, 2, 3], per_step=1)
    metrics = [rollout_metrics([s.counts]) for s in steps]
    assert [m["partial/dropped_share"] for m in metrics] == [0, 0, 1]
    assert all(m["partial/staleness_max"] <= 1 for m in metrics)
    assert all(p.question.id != "slow" for s in steps for p in s.prompts)
    assert all(tree.prompt.question.id != "slow" for tree in rollout.in_flight)


def test_partial_rollouts_wait_for_their_oldest_groups(tokenizer):
    """on_stale=wait: a step trains on its oldest groups, waiting for them, even when a younger one
    completes first (it carries over, complete, and is trained on next); no token is older than
    ceil(extra / quota) = 1 version."""
    calls = {"slow": 3, "quick-a": 0, "quick-b": 0, "quick-c": 0}
    _, loop, prompts = partial_setup(tokenizer, calls)
    rollout = partial(GroupRollout(2), prompts, quota=1, extra=1, on_stale="wait")
    first, second = run_steps(rollout, loop, prompts, [1, 2], per_step=1)
    assert [p.question.id for p in first.prompts] == ["slow"]  # step 1's own prompt, the oldest
    assert second.prompts[0].question.id.startswith("quick") and rollout_metrics([second.counts])["partial/carried_share"] == 1
    assert all(rollout_metrics([s.counts])["partial/staleness_max"] <= 1 for s in (first, second))


def test_resumed_partial_rollouts_carry_over_the_same_groups(tokenizer):
    """The groups in flight, saved as RL's checkpoint saves them (pickled) and restored into a new
    rollout, give the next step the uninterrupted run's groups, token for token; twice."""
    import pickle

    calls = {"slow-a": 4, "quick-a": 0, "slow-b": 3, "quick-b": 1, "quick-c": 0, "mid": 2}
    engine, loop, prompts = partial_setup(tokenizer, calls)
    engine.entropy = lambda question, k: 0.2 * k
    straight = partial(tree(n=4, roots=2, p=0.5), prompts, quota=2, extra=2)
    run_steps(straight, loop, prompts, [1])
    saved = pickle.dumps(straight.state())
    [expected] = run_steps(straight, loop, prompts, [2])
    shape = lambda out: [[(t.id, t.response_ids, t.segment_versions) for t in g] for g in out.groups]  # noqa: E731
    for _ in range(2):
        resumed = partial(tree(n=4, roots=2, p=0.5), prompts, quota=2, extra=2)
        resumed.restore(loop, pickle.loads(saved))
        [again] = run_steps(resumed, loop, prompts, [2])
        assert shape(again) == shape(expected) and again.counts == expected.counts


def test_streamed_partial_rollouts_stop_between_segments(tokenizer):
    """Streamed, with random engine delays: the step stops once its quota is complete, the paths
    still running stop at their next engine call (the request in flight cancelled), and when they
    go on, every trajectory ends with its question's calls, each with its result: nothing was cut
    mid-step."""
    calls = {f"q{i}": i % 4 for i in range(8)}
    engine = DelayedEngine(tokenizer, calls, order_seed=3)
    _, loop, prompts = setup(tokenizer, calls)
    loop.engine = engine
    rollout = partial(GroupRollout(3), prompts, quota=2, extra=3)
    for out in run_steps(rollout, loop, prompts, [1, 2, 3, 4]):
        assert len(out.groups) == 2
        for group in out.groups:
            for t in group:
                assert t.finish_reason == "answer" and t.executed() == calls[t.question.id]
                assert t.response_ids.count(tokenizer.convert_tokens_to_ids("<result>")) == calls[t.question.id]


def test_stale_tokens_are_masked_or_weighed_against_their_version():
    """A trajectory of two segments, the first sampled by version 0 (log-probabilities -1.0, -2.0),
    then a tool result, then one by version 1 (-0.5). At step 2 (version 1): mask leaves the first
    segment out of the loss; TIS weighs each token by min(exp(old - rollout), cap), by hand."""
    from etagent.agent import SegmentStart, TrajectoryState
    from etagent.rl.algorithm import truncated_importance_weights
    from etagent.rl.batch import pack

    t = TrajectoryState("t", Question(id="q", question="q", answer=["1"], source="toy", kind="qa"), [5, 6], budgets=None)
    t.segment_starts = [SegmentStart(0, 0, 0), SegmentStart(3, 1, 0)]
    t.segment_versions = [0, 1]
    t.response_ids, t.origin = [10, 11, 12, 13], [TokenOrigin.SAMPLED] * 2 + [TokenOrigin.TOOL] + [TokenOrigin.SAMPLED]
    t.logprobs = t.tempered_logprobs = [-1.0, -2.0, 0.0, -0.5]
    t.finish_reason = "answer"
    assert pack([t], 0).loss_mask.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    masked = pack([t], 0, masked_before=1)
    assert masked.loss_mask.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    old = torch.tensor([[-1.2, -1.0, 0.0, -0.5]])
    weights = truncated_importance_weights(old, masked.rollout_logprobs, 2.0)
    expected = [min(math.exp(-1.2 + 1.0), 2.0), min(math.exp(-1.0 + 2.0), 2.0), 1.0, 1.0]
    assert weights[0].tolist() == pytest.approx(expected)

"""Evaluation: benchmark formats, metric formulas on hand-made cases, the judge's failures,
kill-and-resume giving the same metrics, the toy world end to end with the radar chart (the
radar's own rules, chart and judge: tests/test_radar.py), and what the engine, not the policy,
ended (a question longer than the context) counted and ending every sampling stage degraded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from etagent.config import build, load_settings
from etagent.evaluation.benchmarks import BENCHMARKS, benchmark_file, load_benchmark
from etagent.evaluation.config import EvaluationJudge
from etagent.evaluation.metrics import aggregate, behaviour
from etagent.records import Question, ToolCallRecord, Trajectory
from etagent.scoring import call_behaviour, correctness, sample_metrics
from tests.support.commands import TOKEN, eval_command
from tests.support.servers import serve, until_the_client_leaves

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


# --- benchmark files -------------------------------------------------------------------------------


def test_every_benchmark_format_loads():
    expected = {
        "aime24": ("Find 2+3.", ["5"], "math"),
        "aime25": ("Find 4+4.", ["8"], "math"),
        "amc23": ("What is 1/2 + 1/4?", ["\\frac{3}{4}"], "math"),
        "math500": ("Simplify 6/8.", ["\\frac{3}{4}"], "math"),
        "gsm8k": ("Tom has 1,000 apples and buys 250. How many?", ["1250"], "math"),
        "olympiadbench": ("Solve x+1=3.", ["$2$"], "math"),
        "math": ("What is 7*6?", ["42"], "math"),
        "2wiki": ("Who directed Film X?", ["Jane Doe", "J. Doe"], "qa"),
        "gaia": ("How many legs?", ["4"], "qa"),
        "webwalker": ("会议在哪一年举办？", ["2021"], "qa"),
        "gpqa": ("Which particle? (A) e (B) mu (C) tau (D) nu", ["(D)", "nu"], "qa"),
    }
    for name in BENCHMARKS:
        if name == "toy":
            continue
        questions = load_benchmark(name, benchmark_file(FIXTURES, name))
        assert questions and all(q.kind == BENCHMARKS[name].kind and q.source == name for q in questions)
        if name in expected:
            q = questions[0]
            assert (q.question, q.answer, q.kind) == expected[name]
    [mc, assertion] = load_benchmark("csbench", benchmark_file(FIXTURES, "csbench"))
    assert mc.question == "Which is paging?\n\nA. a\nB. b\nC. c\nD. d" and mc.answer == ["B"]
    assert assertion.answer == ["True"]
    [mmlu] = load_benchmark("mmlu-pro", benchmark_file(FIXTURES, "mmlu-pro"))
    assert mmlu.question.endswith("\n\nA. Ohm\nB. Hooke\nC. Boyle") and mmlu.answer == ["B"]


def test_bad_benchmark_rows_name_file_line_and_field(tmp_path):
    path = tmp_path / "gsm8k" / "test.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm8k/test.jsonl:1: field 'answer'"):
        load_benchmark("gsm8k", path)


# --- metric formulas ---------------------------------------------------------------------------------


def sample(**kw):
    base = dict(
        em=0.0,
        f1=0.0,
        acc=0.0,
        em_paper=0.0,
        f1_paper=0.0,
        acc_paper=0.0,
        f1_raw_whitespace=0.0,
        is_equiv=0.0,
        math_verify=0.0,
        math_equal=0.0,
    )
    base.update(
        python_calls=0,
        search_calls=0,
        tool_calls=0,
        executed_calls=0,
        successful_calls=0,
        length_chars=10,
        n_tokens=5,
        valid_format=True,
        has_prediction=True,
        finish_reason="answer",
    )
    base.update(kw)
    return base


def test_efficiency_over_zero_one_two_tool_calls():
    questions = [
        ("math", [sample(math_equal=1.0, tool_calls=0)]),
        ("math", [sample(math_equal=1.0, tool_calls=1, executed_calls=1, successful_calls=1)]),
        ("math", [sample(math_equal=1.0, tool_calls=2, executed_calls=2, successful_calls=1)]),
        ("math", [sample(math_equal=0.0, tool_calls=3, executed_calls=3)]),
    ]
    out = aggregate(questions, 0.8, bootstrap_rounds=50)
    assert out["correctness"] == 75.0
    assert out["efficiency"] == pytest.approx(100 * (1 + 1 + 0.5 + 0) / 4)
    assert out["tool_calls"] == 1.5 and out["successful_execution"] == pytest.approx(2 / 6, abs=1e-4)
    assert out["tool_productivity"] == pytest.approx(0.75 * 1.5 / 1.6 * 100, abs=0.01)
    low, high = out["correctness_ci95"]
    assert 0 <= low <= 75 <= high <= 100


def test_correctness_uses_the_judge_for_math_and_f1_for_qa():
    assert correctness(sample(math_equal=0.0, llm_judge=True), "math") == 1.0
    assert correctness(sample(math_equal=1.0, llm_judge=None), "math") == 1.0  # judge failed: rule
    assert correctness(sample(math_equal=1.0), "math") == 1.0
    assert correctness(sample(f1_paper=0.4, math_equal=1.0), "qa") == 0.4
    out = aggregate([("math", [sample(llm_judge=True)]), ("math", [sample(llm_judge=None, math_equal=0.0)])], 0.8, bootstrap_rounds=10)
    assert out["judge_failures"] == 1 and out["llm_judge"] == 100.0 and out["correctness"] == 50.0


def test_call_behaviour_per_tool():
    both = {"search": 1, "python": 1}
    assert call_behaviour({"search": 1, "python": 1}, both) == (False, False)
    assert call_behaviour({"search": 2, "python": 1}, both) == (True, False)
    assert call_behaviour({"search": 1}, both) == (False, True)
    assert call_behaviour({"search": 2}, both) == (True, True)  # a second search instead of Python
    assert call_behaviour({}, {"search": 0, "python": 0}) == (False, False)
    assert call_behaviour({"search": 1}, {}) == (True, False)


def toy_sample(source: str, needed: dict, calls: list[str], right: bool) -> tuple[str, str, dict]:
    """(kind, source, metrics) of one hand-made toy trajectory making the given calls."""
    kind = "qa" if source in ("toy_search", "toy_none") else "math"
    text = "<think>x</think>" + "".join(f"<{tool}>q</{tool}><result>\nr\n</result>" for tool in calls)
    text += "<answer>The final answer is \\[ \\boxed{" + ("gold" if right else "other") + "} \\]</answer>"
    records = [ToolCallRecord(tool=tool, input="q", output="r", ok=True) for tool in calls]
    trajectory = Trajectory(id="t", text=text, tool_calls=records, prediction="gold" if right else "other")
    question = Question(id="q", question="?", answer=["gold"], source=source, kind=kind, needed_calls=needed)
    return kind, source, sample_metrics(trajectory, question)


def test_behaviour_per_kind_on_hand_made_groups():
    search, python, both, none = (
        {"search": 1, "python": 0},
        {"search": 0, "python": 1},
        {"search": 1, "python": 1},
        {"search": 0, "python": 0},
    )
    questions = [
        [toy_sample("toy_search", search, ["search"], True), toy_sample("toy_search", search, ["search", "search"], True)],
        [toy_sample("toy_search", search, [], False), toy_sample("toy_search", search, ["search"], False)],
        [toy_sample("toy_python", python, ["python"], True), toy_sample("toy_python", python, ["search"], False)],
        [toy_sample("toy_both", both, ["search", "python", "python"], True), toy_sample("toy_both", both, ["search"], False)],
        [toy_sample("toy_none", none, [], True), toy_sample("toy_none", none, ["search"], True)],
    ]
    rows = [{"source": q[0][1], "kind": q[0][0], "samples": [m for _, _, m in q]} for q in questions]
    rows.append({"source": "hotpotqa", "kind": "qa", "samples": [sample()]})  # no needed calls: not counted
    out = behaviour(rows, 0.8)
    assert set(out) == {"toy_search", "toy_python", "toy_both", "toy_none", "all"}
    assert out["toy_search"] == {
        "questions": 2,
        "samples": 4,
        "correctness": 50.0,
        "tool_calls": 1.0,
        "redundant_rate": 25.0,
        "insufficient_rate": 25.0,
        "redundant_when_solved": 50.0,  # of the 2 right answers, one searched twice
    }
    # a search where Python was needed is both redundant and insufficient
    assert out["toy_python"]["redundant_rate"] == 50.0 and out["toy_python"]["insufficient_rate"] == 50.0
    assert out["toy_both"]["redundant_rate"] == 50.0 and out["toy_both"]["insufficient_rate"] == 50.0
    assert out["toy_none"]["redundant_rate"] == 50.0 and out["toy_none"]["insufficient_rate"] == 0.0
    assert out["toy_none"]["correctness"] == 100.0 and out["toy_none"]["tool_calls"] == 0.5
    assert out["all"]["samples"] == 10 and out["all"]["redundant_rate"] == 40.0 and out["all"]["insufficient_rate"] == 30.0
    # solved: 2 search, 1 python, 1 both, 2 none; redundant among them: search 1, both 1, none 1
    assert out["toy_python"]["redundant_when_solved"] == 0.0 and out["all"]["redundant_when_solved"] == 50.0
    assert behaviour([{"source": "hotpotqa", "kind": "qa", "samples": [sample()]}], 0.8) == {}


def test_pass_at_k_in_aggregates_matches_brute_force():
    import itertools

    outcomes = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]]
    questions = [("math", [sample(math_equal=float(o)) for o in row]) for row in outcomes]
    out = aggregate(questions, 0.8, bootstrap_rounds=10)
    for k in (1, 2, 4):
        brute = (
            sum(
                sum(any(row[i] for i in c) for c in itertools.combinations(range(4), k)) / len(list(itertools.combinations(range(4), k)))
                for row in outcomes
            )
            / 4
        )
        assert out[f"pass@{k}"] == pytest.approx(100 * brute, abs=0.01)


# --- the judge against a server -------------------------------------------------------------------


def fake_judge():
    """An OpenAI-compatible judge scripted by the prediction (a control-flow stand-in for a judge
    model): 'right' -> Correct, 'wrong' -> Incorrect, 'garbage' -> unreadable, 'slow' -> times out."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        import re

        prompt = (await request.json())["messages"][0]["content"]
        prediction = re.search(r"Predicted answer: (.*)", prompt).group(1).strip()
        if prediction == "slow":  # answers only after the client timed out and left
            await until_the_client_leaves(request)
        if prediction == "down":
            return JSONResponse({"error": "x"}, status_code=500)
        reply = {"right": "Correct", "wrong": "Incorrect", "garbage": "I refuse"}.get(prediction, "Correct")
        return {"choices": [{"message": {"content": reply}}]}

    return app


def scored_eval(tmp_path, judge_url):
    from etagent.evaluation.run import score
    from etagent.records import Question, ToolCallRecord, Trajectory, TrajectoryGroup, write_jsonl

    out = tmp_path / "ds"
    out.mkdir()
    groups = []
    for i, prediction in enumerate(["right", "wrong", "garbage", "slow", "down", "7"]):
        q = Question(id=f"q{i}", question=f"What is {i}?", answer=["7"], source="aime24", kind="math")
        text = f"<think>x</think><python>print(7)</python><result>\n7\n</result><answer>\\boxed{{{prediction}}}</answer>"
        t = Trajectory(
            id=f"q{i}/0",
            text=text,
            prediction=prediction,
            tool_calls=[ToolCallRecord(tool="python", input="print(7)", output="7", ok=True)],
            finish_reason="answer",
        )
        groups.append(TrajectoryGroup.for_question(q, [t]))
    write_jsonl(out / "trajectories.jsonl", groups)
    cfg = load_settings(
        "evaluation",
        "tiny",
        [
            "judge.enabled=true",
            f"judge.engine.openai.urls=[{judge_url}]",
            "judge.engine.openai.timeout_s=0.5",
            "judge.engine.openai.attempts=2",
            "judge.attempts=2",
        ],
    )
    from etagent.evaluation.run import make_judge

    settings = build(EvaluationJudge, cfg.judge)
    score(out, settings, make_judge(settings))
    return [json.loads(line) for line in (out / "scored.jsonl").read_text().splitlines()]


def test_judge_timeouts_and_garbage_are_retried_then_counted_as_failures(tmp_path):
    with serve(fake_judge()) as url:
        rows = scored_eval(tmp_path, url + "/v1")
    verdicts = {row["id"]: row["samples"][0] for row in rows}
    assert verdicts["q0"]["llm_judge"] is True and verdicts["q1"]["llm_judge"] is False
    for failing in ("q2", "q3", "q4"):
        assert verdicts[failing]["llm_judge"] is None and verdicts[failing]["llm_judge_reason"].startswith("failed")
    assert verdicts["q5"]["llm_judge"] is True and verdicts["q5"]["llm_judge_reason"] == "rule"
    out = aggregate([("math", row["samples"]) for row in rows], 0.8, bootstrap_rounds=10)
    assert out["judge_failures"] == 3


# --- end to end on the toy world ------------------------------------------------------------------


def test_toy_evaluation_end_to_end_resumes_after_a_kill_and_draws_the_radar(sft_model, toy, server, tmp_path, capsys):
    env = dict(os.environ, RETRIEVER_TOKEN=TOKEN)
    whole = tmp_path / "whole"
    subprocess.run(eval_command(sft_model, toy, server, whole, "limit=24"), check=True, env=env, capture_output=True, timeout=1200)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        eval_command(sft_model, toy, server, killed, "limit=24"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    trajectories = killed / "toy" / "trajectories.jsonl"
    deadline = time.monotonic() + 600
    while not (trajectories.exists() and len(trajectories.read_text().splitlines()) >= 8):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(trajectories.read_text().splitlines())
    assert 8 <= done_before < 24
    subprocess.run(eval_command(sft_model, toy, server, killed, "limit=24"), check=True, env=env, capture_output=True, timeout=1200)

    a, b = (json.loads((d / "toy" / "metrics.json").read_text()) for d in (whole, killed))
    ids = [json.loads(line)["id"] for line in (killed / "toy" / "scored.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 24  # no question scored twice
    for key in ("questions", "samples", "correctness", "efficiency", "tool_calls", "pass@1", "pass@2", "valid_format"):
        assert a[key] == b[key], key
    table = (whole / "summary.md").read_text()
    assert "toy P/Effi" in table and f"{a['correctness']:.1f} / {a['efficiency']:.1f}" in table
    # the runs side by side, and how they use tools per kind of toy question
    printed = subprocess.run(
        [sys.executable, "-m", "etagent.evaluation.table", str(whole), str(killed), "--out", str(tmp_path / "table")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    behaviour = a["behaviour"]["all"]
    row = (
        f"{behaviour['correctness']:.1f} | {behaviour['tool_calls']:.2f} | {behaviour['redundant_rate']:.1f} | "
        f"{behaviour['insufficient_rate']:.1f} | {behaviour['redundant_when_solved']:.1f} |"
    )
    lines = (tmp_path / "table_behaviour.md").read_text().splitlines()
    assert [line for line in lines if "| all |" in line] == [f"| toy | all | {run} | {row}" for run in ("whole", "killed")]
    assert {line.split(" | ")[1] for line in lines[2:]} == set(a["behaviour"])  # every kind evaluated, and "all"
    assert "Tool use per kind" in printed and lines[-1] in printed

    radar_out = tmp_path / "radar"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "etagent.radar.run",
            f"runs=[{whole},{killed}]",
            "labels=[first,resumed]",
            f"tokenizer={sft_model / 'model'}",
            f"out_dir={radar_out}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    radar = json.loads((radar_out / "radar.json").read_text())
    axes = radar["first"]["axes"]
    assert axes == radar["resumed"]["axes"]
    assert 0 <= axes["Conciseness"] <= 100 and axes["Reasoning Length"] >= 0
    assert (radar_out / "radar.png").stat().st_size > 10_000 and (radar_out / "radar.svg").exists()
    with capsys.disabled():
        print(
            f"\ntoy evaluation (24 questions x 2): {json.dumps({k: a[k] for k in ('correctness', 'efficiency', 'tool_calls', 'valid_format', 'pass@1', 'pass@2')})}"
        )
        print(f"radar axes: {axes}")
        print(result.stdout[-600:])


# --- what the engine, not the policy, ended --------------------------------------------------


def test_every_way_a_trajectory_ends_is_counted_once_and_over_the_share_degrades():
    """The class: over random runs of trajectories ending in every finish reason the agent loop
    gives, the context's cuts are exactly the ``context`` ones (those with no token generated:
    prompts longer than the context), the engine's failures exactly the ``error`` ones by cause,
    and a run is degraded exactly when one of the shares is over ``tools.max_failure_share``."""
    import random

    from etagent.sampling import context_overflow, degraded_reasons, engine_failures
    from etagent.tools.executor import failure_counts

    reasons = ("answer", "eos", "length", "context", "budget", "timeout", "format", "fake_result", "error")
    rng = random.Random(0)
    for _ in range(300):
        trajectories = [
            Trajectory(
                id=f"q/{i}",
                text="",
                finish_reason=(reason := rng.choice(reasons)),
                n_generated=rng.choice([0, 5]),
                error=rng.choice(["every server failed: 400 maximum context length", "decoding thread failed: x"])
                if reason == "error"
                else None,
            )
            for i in range(rng.randint(0, 12))
        ]
        overflow, failures = context_overflow(trajectories), engine_failures(trajectories)
        cut = [t for t in trajectories if t.finish_reason == "context"]
        failed = [t for t in trajectories if t.finish_reason == "error"]
        assert overflow["trajectories"] == failures["trajectories"] == len(trajectories)
        assert overflow["overflowed"] == len(cut) and overflow["prompt_too_long"] == sum(t.n_generated == 0 for t in cut)
        assert failures["failed"] == len(failed) == sum(failures["by_cause"].values())
        assert set(failures["by_cause"]) <= {"every server failed", "decoding thread failed"}
        share = rng.choice([0.0, 0.05, 0.25, 1.0])
        metrics = {"tool_failures": failure_counts([]), "context_overflow": overflow, "engine_failures": failures}
        expected = bool(trajectories) and max(len(cut), len(failed)) / len(trajectories) > share
        assert bool(degraded_reasons(metrics, share)) == expected


def test_questions_longer_than_the_context_are_counted_and_end_the_evaluation_degraded(toy, tmp_path, capsys):
    """Two questions longer than the toy model's context (2048 tokens) beside one of the toy
    world's: each long one is cut before one token is generated (finish reason context) and
    scored wrong. The evaluation counts them per dataset (metrics.json, summary.json, summary.md,
    the manifest) and, over tools.max_failure_share, exits 3 with one line naming the dataset, the
    count and the setting. Resumed with a share the user accepts, it exits 0 and still says so."""
    from etagent.evaluation.run import main
    from etagent.question_formats import read_questions

    questions = tmp_path / "questions.jsonl"
    [short] = [q for q in read_questions(toy / "questions" / "test.jsonl") if q.source == "toy_none"][:1]
    long = [{"id": f"long-{i}", "question": "How old is Zorvak " * 600, "answer": ["1"], "kind": "qa"} for i in range(2)]
    questions.write_text("".join(json.dumps(row) + "\n" for row in [*long, short.to_json()]))
    out = tmp_path / "eval"
    argv = [
        f"model={toy / 'model'}",
        f"files.toy={questions}",
        f"out_dir={out}",
        "tools.search.local.url=http://127.0.0.1:9",
        "tools.search.attempts=1",
        "agent.max_response_tokens=32",
        "n=1",
        "bootstrap_rounds=10",
    ]
    with pytest.raises(SystemExit) as exit_status:
        main(argv)
    assert exit_status.value.code == 3
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("degraded: ")]
    assert line.startswith(
        "degraded: toy: 2 of 3 trajectories cut by the engine's context (66.7%), 2 of them prompts longer than the context"
    )
    assert line.endswith("over tools.max_failure_share=0.05 (summary.md says so): rerun into a new out_dir once fixed")
    metrics = json.loads((out / "toy" / "metrics.json").read_text())
    assert metrics["context_overflow"] == {"trajectories": 3, "overflowed": 2, "prompt_too_long": 2, "share": 0.6667}
    assert metrics["engine_failures"]["failed"] == 0
    groups = [json.loads(line) for line in (out / "toy" / "trajectories.jsonl").read_text().splitlines()]
    cut = [g["trajectories"][0] for g in groups if g["question"] == long[0]["question"]]
    assert [(t["finish_reason"], t["n_generated"]) for t in cut] == [("context", 0), ("context", 0)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["degraded"] == ["toy"] and "cut by the engine's context" in summary["degraded_reasons"]["toy"][0]
    assert "Context overflow on toy: 2 of 3 trajectories" in (out / "summary.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "degraded" and manifest["metrics"]["toy"]["context_overflow"]["overflowed"] == 2

    main([*argv, "tools.max_failure_share=1"])  # resumed: the rollouts are done, the share is the user's
    assert "2 of 3 trajectories cut by the engine's context" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("stage", ["direct_rollout", "flywheel"])
def test_the_other_sampling_stages_end_degraded_on_questions_longer_than_the_context(stage, toy, tmp_path, capsys):
    """Direct rollout (through etagent/sampling.py, as evaluation) and the flywheel (its own
    loop) count the context's cuts the same way, and over tools.max_failure_share exit 3 with
    one line and a degraded manifest."""
    import importlib

    main = importlib.import_module(f"etagent.{stage}.run").main
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "long", "question": "How old is Zorvak " * 600, "answer": ["1"], "kind": "qa"}) + "\n")
    out = tmp_path / "out"
    argv = [f"model={toy / 'model'}", f"questions={questions}", f"out_dir={out}", "tools.search.local.url=http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exit_status:
        main([*argv, "n=2"] if stage == "direct_rollout" else [*argv, "flywheel.rounds=1"])
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert exit_status.value.code == 3 and line.startswith("degraded: ") and "trajectories cut by the engine's context (100.0%)" in line
    assert "over tools.max_failure_share=0.05" in line
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "degraded" and manifest["metrics"]["context_overflow"]["prompt_too_long"] >= 1

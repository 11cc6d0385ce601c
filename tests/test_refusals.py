"""Every probe of "runs that never lie" (issue 26), run as a user runs it: the ``etagent`` command
in a subprocess, asserting its exit status (2: a user error, 3: a degraded run) and its message.

Most probes are refused before any model loads; the resume, lock, degraded and partial-input
probes run the real stages on the toy world (the SFT'd toy policy, the real retriever)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from etagent.question_formats import read_questions
from etagent.records import RLRow, write_rl_parquet
from tests.support.commands import DEGRADED, etagent, evaluate_args, refused, rollout_args

ROOT = Path(__file__).resolve().parents[1]


# --- settings out of range: refused before any work, naming the key ------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("n=0", "setting n: must be an integer >= 1, got 0"),
        ("n=-1", "setting n: must be an integer >= 1, got -1"),
        ("limit=0", "setting limit: must be an integer >= 1 or null, got 0"),
        ("limit=-2", "setting limit: must be an integer >= 1 or null, got -2"),
        ("batch_questions=0", "setting batch_questions: must be an integer >= 1, got 0"),
        ("agent.sampling.temperature=-1", "setting agent.sampling.temperature: must be a number >= 0, got -1"),
        # a shared group's schema refuses a value of the wrong type, or a key it lacks, at load
        ("agent.sampling.temperature=hot", "Value 'hot' of type 'str' could not be converted to Float (key agent.sampling.temperature)"),
        ("+tools.python.timeout=5", "tools.python.timeout is not a setting of its group"),
        ("ray.workers=many", "Value 'many' of type 'str' could not be converted to Integer (key ray.workers)"),
        ("tools.max_failure_share=2", "setting tools.max_failure_share: must be a number >= 0.0 and <= 1.0, got 2"),
        ("model=runs/no/such/model", "setting model: no model at 'runs/no/such/model'"),
    ],
)
def test_direct_rollout_refuses_settings_out_of_range(toy, tmp_path, override, message):
    out = tmp_path / "out"
    refused(etagent(*rollout_args(toy / "model", toy / "questions" / "rl.jsonl", out), override), message)
    assert not out.exists()  # nothing written: no empty trajectories.jsonl left behind


@pytest.mark.parametrize(
    "override, message",
    [
        ("n=0", "setting n: must be an integer >= 1, got 0"),
        ("limit=0", "setting limit: must be an integer >= 1 or null, got 0"),
        ("limit=-1", "setting limit: must be an integer >= 1 or null, got -1"),
        ("batch_questions=0", "setting batch_questions: must be an integer >= 1, got 0"),
        ("datasets=[nope]", "setting datasets: 'nope' is not a known benchmark"),
        # the judge is a text model: its sampling typed at load, its engine checked at start
        ("+judge.sampling.temprature=0", "judge.sampling.temprature is not a setting of its group"),
        ("judge.enabled=true", "setting judge.engine.openai.urls: is empty: give the URL(s) serving judge"),
    ],
)
def test_evaluation_refuses_settings_out_of_range(toy, tmp_path, override, message):
    out = tmp_path / "out"
    refused(etagent(*evaluate_args(toy / "model", toy / "questions" / "test.jsonl", out), override), message)
    assert not out.exists()


def test_a_misspelt_key_is_refused_naming_it(toy, tmp_path):
    result = etagent("sft", f"model={toy / 'model'}", "train.lerning_rate=1")
    refused(result, "Could not override 'train.lerning_rate': Key 'lerning_rate' not in 'SFTTrainSettings'")
    assert "To append" not in result.stderr  # Hydra's hint to add the key with +, which the schema refuses too


@pytest.mark.parametrize(
    "command, override",
    [
        ("sft", "+train.lerning_rate=1"),
        ("rl", "+rollout.beam_sise=4"),
        ("rl", "+reward.sigma_tol=0.1"),
        ("direct-rollout", "+qa_passmark=0.8"),
        ("pareto", "+mixed_outcome.math_treshold=0.5"),
        ("radar", "+judge.round=3"),
        ("flywheel", "+export.max_per_questions=2"),
        ("retriever", "+serve.prot=9000"),
    ],
)
def test_a_key_added_to_any_stage_is_refused_at_load_naming_it(tmp_path, command, override):
    """Every stage's config is typed by its schema (<stage>/config.py): ``+key=value`` cannot add
    a setting that no code reads."""
    args = [command, "build"] if command == "retriever" else [command]
    result = etagent(*args, override, f"out_dir={tmp_path / 'out'}" if command not in ("retriever",) else f"index_dir={tmp_path / 'out'}")
    refused(result, f"{override[1:].split('=')[0]} is not a setting of its group")
    assert not (tmp_path / "out").exists()


def test_sft_refuses_a_learning_rate_that_is_not_a_number(toy, tmp_path):
    out = tmp_path / "out"
    result = etagent("sft", f"model={toy / 'model'}", f"data.path={toy / 'sft.jsonl'}", f"out_dir={out}", "train.learning_rate=fast")
    refused(result, "Value 'fast' of type 'str' could not be converted to Float (key train.learning_rate)")
    assert not out.exists()


@pytest.fixture
def rl_parquet(toy, tmp_path) -> Path:
    questions = read_questions(toy / "questions" / "rl.jsonl")[:8]
    return write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], tmp_path / "rl.parquet")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=-3", "setting train.max_steps: must be an integer >= 1 or null, got -3"),
        ("data.prompts_per_step=0", "setting data.prompts_per_step: must be an integer >= 1, got 0"),
        ("optim.lr=fast", "Value 'fast' of type 'str' could not be converted to Float (key optim.lr)"),
        ("reward.sigma_tool=-1", "setting reward.sigma_tool: must be a number >= 0, got -1"),
        ("agent.sampling.temperature=0", "setting agent.sampling.temperature: must be a number > 0, got 0"),
        # the trainer's log-probabilities are over the whole vocabulary: truncated sampling would bias the ratio
        ("agent.sampling.top_p=0.9", "setting agent.sampling.top_p: is 0.9: RL samples from the policy's whole distribution"),
        ("agent.sampling.top_k=20", "setting agent.sampling.top_k: is 20: RL samples from the policy's whole distribution"),
        ("agent.sampling.repetition_penalty=1.1", "setting agent.sampling.repetition_penalty: is 1.1"),
        # vLLM refuses every request asking for more top log-probabilities than its engine allows
        ("engine.kind=vllm rollout.top_logprobs=21", "setting rollout.top_logprobs: is 21, over the vllm engine's limit of 20"),
        # the colocated engine is one per rank: a tensor-parallel group would span ranks sampling different prompts
        (
            "engine.kind=vllm engine.vllm.tensor_parallel_size=2",
            "setting engine.vllm.tensor_parallel_size: is 2: RL's colocated engine is one per rank",
        ),
        ("model=runs/no/such/model", "setting model: no model at 'runs/no/such/model'"),
        # ARPO's tree branches on entropies measured from the top log-probabilities
        ("rollout.top_logprobs=0", "setting rollout.top_logprobs: is 0, and the tree branches on entropies measured with them"),
        ("+agent.logprobs=10", "agent.logprobs is not a setting of its group"),  # moved to rollout.top_logprobs
        # partial rollouts weigh stale tokens by TIS, which needs its cap
        ("rollout.partial=true algorithm.tis_cap=null", "setting algorithm.tis_cap: is null, and partial rollouts with stale_tokens=tis"),
        # waiting for its oldest groups bounds staleness by ceil(extra / share): 9 extra over the tiny preset's 8 is 2
        (
            "rollout.partial=true rollout.on_stale=wait rollout.partial_extra=9",
            "setting rollout.max_staleness: is 1, and with on_stale=wait a step's groups can be up to ceil(partial_extra / prompts per process) = 2",
        ),
        # LoRA's dropout would make the trainer's forward differ from the sampler's
        ("lora.enabled=true lora.dropout=0.05", "setting lora.dropout: is 0.05: RL's ratio compares the trainer's log-probabilities"),
        # the engine runs in the trainer's process: RL takes no servers' settings
        ("engine.openai.urls=[http://127.0.0.1:8011/v1]", "Could not override 'engine.openai.urls': engine.openai is null in this stage"),
        ("engine.openai={urls:[http://127.0.0.1:8011/v1]}", "Could not override 'engine.openai': engine.openai is null in this stage"),
    ],
)
def test_rl_refuses_settings_out_of_range(toy, rl_parquet, tmp_path, override, message):
    out = tmp_path / "rl"
    refused(etagent("rl", f"model={toy / 'model'}", f"data.train={rl_parquet}", f"out_dir={out}", *override.split(" ")), message)
    assert not out.exists()  # no manifest saying "complete" with no model


# --- bad input files: refused naming file, line and field ----------------------------------------


def write_questions(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


def test_empty_cut_off_and_blank_questions_are_refused(toy, tmp_path):
    model, out = toy / "model", tmp_path / "out"
    good = [q.to_json() for q in read_questions(toy / "questions" / "rl.jsonl")[:2]]
    empty = write_questions(tmp_path / "empty.jsonl", [])
    refused(etagent(*rollout_args(model, empty, out)), "empty.jsonl: field '(file)': no questions in the file")
    cut = write_questions(tmp_path / "cut.jsonl", good, tail='{"id": "x", "quest')
    refused(etagent(*rollout_args(model, cut, out)), "cut.jsonl:3: field '(line)': cut off")
    blank = write_questions(tmp_path / "blank.jsonl", [good[0], {**good[1], "question": " "}])
    refused(etagent(*rollout_args(model, blank, out)), "blank.jsonl:2: field 'question': Value error, empty question")
    flywheel = ["flywheel", f"model={model}", f"out_dir={out}"]
    refused(etagent(*flywheel, f"questions={blank}"), "blank.jsonl:2: field 'question': Value error, empty question")
    refused(etagent(*flywheel, f"questions={empty}"), "no questions in the file")
    refused(etagent(*evaluate_args(model, empty, out)), "empty.jsonl: field '(file)': no questions for benchmark toy")
    assert not out.exists()


def test_sft_names_the_line_of_a_negative_token_id(toy, tmp_path):
    line = json.loads((toy / "sft.jsonl").read_text().splitlines()[0])
    line.update(response_ids=[-1, 5], response_mask=[1, 1])
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(line) + "\n")
    result = etagent("sft", f"model={toy / 'model'}", f"data.path={data}", f"out_dir={tmp_path / 'out'}")
    refused(result, "sft.jsonl:1: field 'response_ids.0': Input should be greater than or equal to 0")


def test_rl_names_the_row_of_an_empty_ground_truth(toy, rl_parquet, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(rl_parquet)
    rows = table.to_pylist()
    rows[2]["reward_model"]["ground_truth"] = [""]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), bad)
    result = etagent("rl", f"model={toy / 'model'}", f"data.train={bad}", f"out_dir={tmp_path / 'rl'}")
    refused(result, "bad.parquet:3: field 'reward_model.ground_truth': Value error, empty gold answer")


def test_score_names_the_line_of_a_byte_that_is_not_utf8(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_bytes(b'{"prediction": "4", "answers": ["4"]}\n{"prediction": "\xff", "answers": ["4"]}\n')
    result = etagent("score", str(data))
    refused(result, "p.jsonl:2: field '(line)': not UTF-8: byte 0xff")
    assert json.loads(result.stdout.splitlines()[0])["correctness"] == 1.0  # the good line before it is scored


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sigma_tool": -1}, "<stdin>:1: field 'sigma_tool': must be a number >= 0, got -1"),
        ({"lengths": [10, -5]}, "<stdin>:1: field 'lengths': must be integers >= 0"),
        ({"responses": [], "lengths": []}, "<stdin>:1: field 'responses': empty"),
    ],
)
def test_reward_refuses_negative_sigmas_and_lengths(change, message):
    group = {
        "data_source": "qa_effi_rl",
        "ground_truth": ["Pell"],
        "responses": ["<answer>Pell</answer>", "<answer>Kess</answer>"],
        "lengths": [10, 12],
        "sigma_tool": 0.2,
        "sigma_length": 0.5,
    }
    assert etagent("reward", stdin=(json.dumps(group) + "\n").encode()).returncode == 0
    refused(etagent("reward", stdin=(json.dumps({**group, **change}) + "\n").encode()), message)


# --- real runs: resume, one writer, degradation, partial input -----------------------------------


@pytest.mark.slow  # 11-32 s; the default run is at its 15-minute budget (CI runs it with the slow tests)
def test_a_rerun_with_other_settings_is_refused_naming_them(sft_model_full, toy, server, tmp_path):
    model, questions = sft_model_full / "model", toy / "questions" / "test.jsonl"
    out = tmp_path / "rollouts"
    first = etagent(*rollout_args(model, questions, out, server, "limit=2", "n=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    written = (out / "trajectories.jsonl").read_text()
    refused(etagent(*rollout_args(model, questions, out, server, "limit=2", "n=2")), "(n: 1 then, 2 now)")
    assert (out / "trajectories.jsonl").read_text() == written  # nothing lost or added
    more = etagent(*rollout_args(model, questions, out, server, "limit=3", "n=1"))  # more questions: allowed
    assert more.returncode == 0 and len((out / "trajectories.jsonl").read_text().splitlines()) == 3

    evaluation = tmp_path / "eval"
    assert etagent(*evaluate_args(model, questions, evaluation, server, "limit=2")).returncode == 0
    refused(etagent(*evaluate_args(model, questions, evaluation, server, "limit=2", "n=2")), "(n: 1 then, 2 now)")


def test_a_second_run_on_the_same_output_directory_is_refused(toy, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from etagent.rundir import claim_output\n"
            "from etagent.sampling import SamplingConfig\n"
            "with claim_output(sys.argv[1], stage='direct_rollout/stage1', schema=SamplingConfig, config={}):\n"
            "    print('held', flush=True); time.sleep(120)\n",
            str(out),
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        result = etagent(*rollout_args(toy / "model", toy / "questions" / "rl.jsonl", out))
        refused(result, f"{out} is being written by another run (pid {holder.pid}, direct_rollout/stage1")
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "trajectories.jsonl").exists()


@pytest.mark.slow  # 20-35 s: kept out of the default run's 15 minutes
def test_tool_failures_over_the_share_end_the_run_degraded(sft_model_full, toy, tmp_path):
    """The retriever is down (nothing listens on the port): every search fails. Direct rollout
    and evaluation write their outputs, say so in the summary and manifest, and exit 3."""
    model, questions = sft_model_full / "model", toy / "questions" / "test.jsonl"
    out = tmp_path / "rollouts"
    result = etagent(*rollout_args(model, questions, out, "http://127.0.0.1:9", "limit=3", "n=1", "tools.search.attempts=1"))
    refused(result, "tool calls failed", status=DEGRADED)
    assert "search ConnectError" in result.stderr and "over tools.max_failure_share=0.05" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "degraded" and manifest["metrics"]["tool_failures"]["by_tool"]["search"]["ConnectError"] > 0

    evaluation = tmp_path / "eval"
    result = etagent(*evaluate_args(model, questions, evaluation, "http://127.0.0.1:9", "limit=3", "tools.search.attempts=1"))
    refused(result, "toy: ", status=DEGRADED)
    summary = (evaluation / "summary.md").read_text()
    assert "Tool failures on toy:" in summary and "DEGRADED: on toy" in summary
    assert json.loads((evaluation / "manifest.json").read_text())["status"] == "degraded"

    # a share the user accepts: the same outage is counted and shown, and the run succeeds
    tolerant = etagent(
        *rollout_args(
            model,
            questions,
            tmp_path / "tolerant",
            "http://127.0.0.1:9",
            "limit=3",
            "n=1",
            "tools.search.attempts=1",
            "tools.max_failure_share=1",
        )
    )
    assert tolerant.returncode == 0 and "tool failures: " in tolerant.stdout and "search ConnectError" in tolerant.stdout


@pytest.mark.slow  # 11-32 s; the default run is at its 15-minute budget (CI runs it with the slow tests)
def test_partial_input_runs_only_when_asked(sft_model_full, toy, tmp_path):
    model = sft_model_full / "model"
    good = [q.to_json() for q in read_questions(toy / "questions" / "test.jsonl")[:1]]
    cut = write_questions(tmp_path / "cut.jsonl", good, tail='{"id": "x", "quest')
    result = etagent(
        *rollout_args(model, cut, tmp_path / "out", "http://127.0.0.1:9", "n=1", "partial_input_ok=true", "tools.max_failure_share=1")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping an incomplete last line" in result.stderr
    assert len((tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()) == 1

    # an empty benchmark file, allowed: the summary says there is nothing, and the radar refuses it
    empty = write_questions(tmp_path / "empty.jsonl", [])
    evaluation = tmp_path / "eval"
    result = etagent(*evaluate_args(model, empty, evaluation, "http://127.0.0.1:9", "partial_input_ok=true"))
    assert result.returncode == 0 and "toy: no questions" in result.stdout, result.stderr[-3000:]
    radar = etagent("radar", f"runs=[{evaluation}]", f"tokenizer={model}", f"out_dir={tmp_path / 'radar'}")
    refused(radar, "toy/metrics.json: no samples (the evaluation ran on no questions)")


def test_pareto_refuses_an_unfinished_direct_rollout(tmp_path):
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    (rollouts / "trajectories.jsonl").write_text("")
    (rollouts / "manifest.json").write_text(json.dumps({"status": "running", "config": {}}))
    result = etagent("pareto", f"rollouts={rollouts}", f"out_dir={tmp_path / 'rl_data'}")
    refused(result, "the direct rollout has not finished (status running)")


def test_rl_stops_before_updating_on_rollouts_whose_tools_failed(sft_model, toy, tmp_path):
    questions = read_questions(toy / "questions" / "test.jsonl")[:4]
    parquet = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], tmp_path / "rl.parquet")
    out = tmp_path / "rl"
    result = etagent(
        "rl",
        f"model={sft_model / 'model'}",
        f"data.train={parquet}",
        f"out_dir={out}",
        "tools.search.local.url=http://127.0.0.1:9",
        "tools.search.attempts=1",
        "data.prompts_per_step=4",
        "rollout.kind=group",
        "rollout.n=2",
        "agent.max_response_tokens=256",
    )
    refused(result, "step 1: ", status=DEGRADED)
    assert "search ConnectError" in result.stderr and "stopped before updating on these rollouts" in result.stderr
    assert not (out / "model").exists() and json.loads((out / "manifest.json").read_text())["status"] == "running"

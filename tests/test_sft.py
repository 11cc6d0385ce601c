"""SFT: tokenization shared with rollouts, tool results masked out of the loss, LLaMA-Factory
import, resume continuing the same loss curve, and a 2-process CPU run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from etagent import protocol
from etagent.records import SFTExample, export_llamafactory
from etagent.sft.data import IGNORE, build_dataset, load_examples, tokenize_example
from etagent.sft.run import Collator
from tests.support.commands import sft_command
from tests.support.groups import agent_config

TRAJECTORY = (
    "<think>I need the year.</think><search>Zorvak Telmin</search>"
    + protocol.format_result('"Zorvak Telmin"\nZorvak Telmin was born in 1873 in Quellport.')
    + "<think>So 1873.</think><answer>The final answer is \\[ \\boxed{1873} \\]</answer>"
)


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy / "model")


def test_prompt_tokens_are_the_rollouts(tokenizer):
    example = SFTExample.from_trajectory("e", "In which year was Zorvak Telmin born?", TRAJECTORY)
    row = tokenize_example(example, tokenizer)
    prompt = protocol.encode_prompt(tokenizer, "In which year was Zorvak Telmin born?")
    assert row.input_ids[: len(prompt)] == prompt and all(label == IGNORE for label in row.labels[: len(prompt)])
    assert row.input_ids[-1] == tokenizer.eos_token_id and row.labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(row.input_ids[len(prompt) : -1]) == TRAJECTORY


def test_labels_mask_exactly_the_tool_results(tokenizer):
    example = SFTExample.from_trajectory("e", "q?", TRAJECTORY)
    row = tokenize_example(example, tokenizer)
    prompt_len = len(protocol.encode_prompt(tokenizer, "q?"))
    response_ids, response_labels = row.input_ids[prompt_len:-1], row.labels[prompt_len:-1]
    masked = tokenizer.decode([t for t, label in zip(response_ids, response_labels) if label == IGNORE])
    trained = tokenizer.decode([t for t, label in zip(response_ids, response_labels) if label != IGNORE])
    assert masked == protocol.format_result('"Zorvak Telmin"\nZorvak Telmin was born in 1873 in Quellport.')
    assert trained == protocol.strip_results(TRAJECTORY)


def test_loss_has_no_gradient_from_tool_result_tokens(toy, tokenizer):
    """Masking tested on the loss itself: the gradient of the model's training loss with respect to
    the logits that predict a tool-result token is exactly zero (whatever that token is, the loss
    does not change), and non-zero for every policy token; the loss is the mean negative
    log-likelihood of the policy tokens. (A result token still changes later predictions through
    attention, as it should: the model reads results, it is never trained to write them.)"""
    model = AutoModelForCausalLM.from_pretrained(toy / "model").eval()
    row = tokenize_example(SFTExample.from_trajectory("e", "q?", TRAJECTORY), tokenizer)
    batch = Collator(tokenizer.pad_token_id, flatten=False)([{"input_ids": row.input_ids, "labels": row.labels}])
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep_logits)
    loss = model(**batch).loss
    loss.backward()
    handle.remove()
    grad = captured["logits"].grad[0]  # position i predicts token i + 1
    prompt_len = len(protocol.encode_prompt(tokenizer, "q?"))
    for i in range(prompt_len - 1, len(row.input_ids) - 1):
        predicts_policy_token = row.labels[i + 1] != IGNORE
        assert (grad[i].abs().sum().item() > 0) == predicts_policy_token, i
    logprobs = torch.log_softmax(captured["logits"][0].detach().float(), -1)
    policy = [i for i, label in enumerate(row.labels) if label != IGNORE]
    nll = [-logprobs[i - 1, row.labels[i]].item() for i in policy]
    assert loss.item() == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_label_mask_lines_up_with_the_agent_loops_mask(tokenizer, toy):
    """A rollout's token ids and mask, turned into an SFT example, are used as they are; and the
    same rollout given as text gets the same labels (segments tokenized as the loop appends)."""
    import asyncio
    import random

    from etagent.agent import AgentLoop
    from etagent.tools.executor import ToolExecutor
    from tests.support.scripted import SCRIPTS, FakePython, FakeSearch, ScriptedEngine, question

    rng = random.Random(0)
    loop = AgentLoop(ScriptedEngine(tokenizer, SCRIPTS), ToolExecutor([FakeSearch(rng), FakePython(rng)]), agent_config())
    state = loop.new(question("q-python"), "t/0")
    asyncio.run(loop.run([state]))
    record = loop.to_record(state)
    with_ids = SFTExample.from_trajectory(
        "t", "q-python", record.text, response_ids=record.response_ids, response_mask=record.response_mask
    )
    as_text = SFTExample.from_trajectory("t", "q-python", record.text)
    a, b = tokenize_example(with_ids, tokenizer), tokenize_example(as_text, tokenizer)
    prompt_len = len(state.prompt_ids)
    assert a.from_token_ids and not b.from_token_ids
    assert a.input_ids[prompt_len:-1] == state.response_ids
    assert [label != IGNORE for label in a.labels[prompt_len:-1]] == [bool(m) for m in state.mask]
    assert a.input_ids == b.input_ids and a.labels == b.labels


def test_cutoff_drops_and_reports(tokenizer):
    short = SFTExample.from_trajectory("short", "q?", TRAJECTORY)
    long = SFTExample.from_trajectory("long", "q?", "<think>" + "word " * 400 + "</think><answer>\\boxed{1}</answer>")
    rows, report = build_dataset([short, long], tokenizer, cutoff_len=200)
    assert [r.id for r in rows] == ["short"]
    assert report["dropped_over_cutoff"] == 1 and report["kept"] == 1


def test_llamafactory_files_import_with_the_prompt_in_the_system_turn(tmp_path, tokenizer):
    example = SFTExample.from_trajectory("e", "In which year was Zorvak Telmin born?", TRAJECTORY)
    # the paper's layout: the protocol prompt as the alpaca instruction, the question as input
    (tmp_path / "paper.json").write_text(
        json.dumps([{"instruction": protocol.SYSTEM_PROMPT, "input": example.question, "output": TRAJECTORY}])
    )
    [alpaca] = load_examples(tmp_path / "paper.json", "alpaca")
    assert alpaca.system == protocol.SYSTEM_PROMPT and alpaca.question == example.question
    export_llamafactory([example], tmp_path, name="ours", fmt="sharegpt")
    [sharegpt] = load_examples(tmp_path / "ours.json", "sharegpt")
    (tmp_path / "tools.json").write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "q?"},
                        {"from": "gpt", "value": "<think>a</think><search>x</search>"},
                        {"from": "observation", "value": "doc"},
                        {"from": "gpt", "value": "<think>b</think><answer>\\boxed{1}</answer>"},
                    ]
                }
            ]
        )
    )
    [with_observation] = load_examples(tmp_path / "tools.json", "sharegpt")
    for loaded in (alpaca, sharegpt):
        assert tokenize_example(loaded, tokenizer).input_ids == tokenize_example(example, tokenizer).input_ids
    assert [s.train for s in with_observation.segments] == [True, False, True]
    assert (
        with_observation.response
        == "<think>a</think><search>x</search>" + protocol.format_result("doc") + "<think>b</think><answer>\\boxed{1}</answer>"
    )
    (tmp_path / "bad.json").write_text(json.dumps([{"instruction": "x"}]))
    with pytest.raises(ValueError, match=r"bad.json:1: field 'output'"):
        load_examples(tmp_path / "bad.json", "alpaca")


# --- training runs ---------------------------------------------------------------------------------


def losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "loss_history.json").read_text())
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.mark.slow  # 11-32 s; the default run is at its 15-minute budget (CI runs it with the slow tests)
def test_resume_from_a_mid_run_checkpoint_continues_the_same_loss_curve(toy, tmp_path):
    settings = ["train.max_steps=16", "train.save_steps=8", "train.logging_steps=1", "train.batch_size=4", "train.save_total_limit=3"]
    whole = tmp_path / "whole"
    subprocess.run(sft_command(toy, whole, "threads=1", *settings), check=True, capture_output=True, timeout=600)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(sft_command(toy, killed, "threads=1", *settings), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "checkpoint-8" / "trainer_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # let the checkpoint finish writing
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "model").exists()
    resumed = subprocess.run(sft_command(toy, killed, "threads=1", *settings), check=True, capture_output=True, text=True, timeout=600)
    assert "resuming from" in resumed.stderr
    full, after = losses(whole), losses(killed)
    assert set(range(9, 17)) <= set(after)
    for step in range(9, 17):
        assert after[step] == pytest.approx(full[step], abs=1e-4), step

    # a finished run, rerun, is left as it is: no step past max_steps, the model and manifest
    # unchanged (a stage made from the model would otherwise refuse to resume)
    before = {path.name: path.read_bytes() for path in [*(whole / "model").iterdir(), whole / "manifest.json"]}
    again = subprocess.run(sft_command(toy, whole, "threads=1", *settings), check=True, capture_output=True, text=True, timeout=600)
    assert "already complete" in again.stdout
    assert {path.name: path.read_bytes() for path in [*(whole / "model").iterdir(), whole / "manifest.json"]} == before
    assert {p.name for p in (whole / "checkpoints").iterdir()} == {"checkpoint-8", "checkpoint-16"}


@pytest.mark.slow  # 11-32 s; the default run is at its 15-minute budget (CI runs it with the slow tests)
def test_two_process_cpu_run_trains_and_saves_a_working_model(toy, tmp_path):
    """Through scripts/sft.sh, as docs/sft.md launches it (torchrun, 2 processes, gloo)."""
    out = tmp_path / "ddp"
    command = [
        "bash",
        str(Path(__file__).parents[1] / "scripts" / "sft.sh"),
        *sft_command(toy, out, "threads=1", "train.max_steps=6", "train.batch_size=4", "train.logging_steps=1")[3:],
    ]
    env = {
        **os.environ,
        "NPROC": "2",
        "TORCHRUN_ARGS": f"--master_port {29500 + os.getpid() % 1000}",
        "ETAGENT_VENV": str(Path(sys.executable).parents[1]),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["steps"] == 6
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    prompt = torch.tensor([protocol.encode_prompt(tokenizer, "What is 3 times 4?")])
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt.shape[1] + 5


# Held-out questions the tiny preset answered right in the measured run, two of each kind: a
# regression in the toy world, its tokenizer or the SFT recipe shows here first.
HANDFUL = [
    "test-search-0003",
    "test-search-0004",
    "test-python-0000",
    "test-python-0001",
    "test-both-0005",
    "test-both-0006",
    "test-none-0001",
    "test-none-0002",
]


@pytest.mark.slow
def test_tiny_preset_answers_held_out_questions_with_the_right_tools(sft_model_full, toy, server, capsys, monkeypatch):
    """The acceptance run: the tiny model trained from scratch on the toy seed trajectories (the
    tiny preset, as the demo runs it), then run through the agent loop with the real tools on
    the 200 held-out toy questions, greedy. It must answer them, not only write the protocol:
    a regression in the toy world, the tokenizer or the recipe shows here."""
    from etagent.config import load_settings
    from etagent.records import TrajectoryGroup, read_jsonl
    from etagent.sampling import run_sampling
    from etagent.scoring import rule_correctness, rule_judgement

    manifest = json.loads((sft_model_full / "manifest.json").read_text())
    final_loss = manifest["metrics"]["final_logged_loss"]
    monkeypatch.setenv("RETRIEVER_TOKEN", "test-token-123")
    out = sft_model_full.parent / "held-out"
    cfg = load_settings(
        "direct_rollout",
        "tiny",
        [
            f"model={sft_model_full / 'model'}",
            f"questions={toy / 'questions' / 'test.jsonl'}",
            f"out_dir={out}",
            "n=1",
            "agent.sampling.temperature=0",
            f"tools.search.local.url={server}",
            "tools.search.local.token_env=RETRIEVER_TOKEN",
            "batch_questions=50",
        ],
    )
    run_sampling(cfg, "sft-check", judge=partial(rule_judgement, qa_pass_mark=cfg.qa_pass_mark))
    groups = read_jsonl(out / "trajectories.jsonl", TrajectoryGroup)
    needed = {"toy_search": "search", "toy_python": "python", "toy_both": "search"}
    valid = sum(protocol.validate_format(g.trajectories[0].text) for g in groups) / len(groups)
    needing = [g for g in groups if g.source in needed]
    right = sum(bool(g.trajectories[0].tool_calls) and g.trajectories[0].tool_calls[0].tool == needed[g.source] for g in needing) / len(
        needing
    )
    correct = {g.id: rule_correctness(g.trajectories[0].prediction or "", g.answer, g.kind) == 1.0 for g in groups}
    per_kind = {kind: [correct[g.id] for g in groups if g.source == kind] for kind in ("toy_search", "toy_python", "toy_both", "toy_none")}
    with capsys.disabled():
        print(
            f"\ntiny SFT: {manifest['counts']['steps']} steps, final training loss {final_loss:.3f}; held-out: format-valid {valid:.3f}, right first tool {right:.3f} ({len(needing)} questions need one)"
        )
        print(
            f"held-out correctness (greedy) {sum(correct.values()) / len(correct):.3f}; "
            + ", ".join(f"{kind} {sum(v) / len(v):.2f}" for kind, v in per_kind.items())
            + f"; handful {sum(correct[i] for i in HANDFUL)} of {len(HANDFUL)}"
        )
    calls = [c for g in groups for c in g.trajectories[0].tool_calls]
    assert len(groups) == 200
    assert sum(c.ok for c in calls) >= 0.95 * len(calls)  # the tools really answered
    assert final_loss < 0.1  # measured: 0.052
    assert valid >= 0.95
    assert right >= 0.9
    # measured on 2 cores: 0.82 (search 0.74, python 0.92, both 0.62, none 1.00); the bounds leave
    # room for a different CPU's arithmetic, not for a regression
    assert sum(correct.values()) / len(correct) >= 0.65
    assert all(sum(v) / len(v) >= 0.4 for v in per_kind.values()), per_kind
    assert sum(correct[i] for i in HANDFUL) >= 6, [(i, correct[i]) for i in HANDFUL]


def test_llamafactory_exports_round_trip_with_tool_results_masked(tmp_path, tokenizer):
    """All three exports re-import with the same masked spans and the same labels; the
    observation export gives LLaMA-Factory the results as observation turns (which it masks)."""
    text = (
        "<think>look it up</think><search>Zorvak Telmin</search>"
        + protocol.format_result("Zorvak Telmin was born in 1873.")
        + "<think>compute</think><python>print(2024 - 1873)</python><result>151</result>"  # wrapped otherwise
        + "<think>done</think><answer>\\boxed{151}</answer>"
    )
    example = SFTExample.from_trajectory("e", "How old is Zorvak Telmin?", text)
    masked = [s.text for s in example.segments if not s.train]
    expected = tokenize_example(example, tokenizer)
    for fmt in ("alpaca", "sharegpt", "sharegpt_observation"):
        path = export_llamafactory([example], tmp_path / fmt, name="ours", fmt=fmt)
        [back] = load_examples(path, "alpaca" if fmt == "alpaca" else "sharegpt")
        assert back.response == text and [s.text for s in back.segments if not s.train] == masked, fmt
        again = tokenize_example(back, tokenizer)
        assert (again.input_ids, again.labels) == (expected.input_ids, expected.labels), fmt
    [row] = json.loads((tmp_path / "sharegpt_observation" / "ours.json").read_text())
    roles = [t["from"] for t in row["conversations"]]
    assert roles == ["human", "gpt", "observation", "gpt", "observation", "gpt"]
    assert row["conversations"][2]["value"] == "Zorvak Telmin was born in 1873."
    assert row["conversations"][4]["value"] == "<result>151</result>"
    info = json.loads((tmp_path / "sharegpt_observation" / "dataset_info.json").read_text())
    assert info["ours"]["formatting"] == "sharegpt"
    # a trajectory cut off inside its tool output cannot end with an assistant turn: left out
    cut = SFTExample.from_trajectory("cut", "q?", "<search>x</search>" + protocol.format_result("doc"))
    path = export_llamafactory([cut, example], tmp_path / "cut", name="ours", fmt="sharegpt_observation")
    assert len(json.loads(path.read_text())) == 1


@pytest.mark.slow
def test_a_step_that_leaves_the_weights_non_finite_keeps_the_last_good_checkpoint(toy, tmp_path):
    """A learning rate of 1e37 (the largest declared) with a linear warm-up over two steps: step
    1 runs at 0 (a good checkpoint is saved), then the weights grow past what float32 holds and
    a step leaves them non-finite. The run stops at that step with exit status 4 and one line
    naming it; checkpoint-1 is intact, every checkpoint written is finite, and no model is
    written."""
    from safetensors.torch import load_file

    out = tmp_path / "sft"
    overrides = ("threads=1", "train.max_steps=6", "train.save_steps=1", "train.logging_steps=1", "train.learning_rate=1e37")
    command = [*sft_command(toy, out, *overrides), "train.lr_scheduler=linear", "train.warmup_ratio=0.5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 4, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("diverged: SFT step ") and "the optimizer step left" in last and "checkpoint-" in last, last
    assert "Traceback" not in result.stderr
    step = int(last.removeprefix("diverged: SFT step ").split(":")[0])
    checkpoints = sorted((p for p in (out / "checkpoints").iterdir()), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == [f"checkpoint-{k}" for k in range(1, step)]  # every step before the broken one
    assert f"the last checkpoint is {checkpoints[-1]}" in last
    for checkpoint in checkpoints:
        weights = load_file(str(checkpoint / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), checkpoint
    assert not (out / "model").exists()

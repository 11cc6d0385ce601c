"""Rollouts as tensors: padding, the loss mask by token origin, log-probabilities equal to an
unpadded forward pass of each sequence, micro-batches; the RL parquet read back as prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from etagent.agent import Budgets, TrajectoryState
from etagent.records import Question, RecordError, RLRow, TokenOrigin, write_rl_parquet
from rl.batch import micro_batches, pack, token_logprobs
from rl.policy import Policy
from rl.rollout import read_prompts

QUESTION = Question(id="q", question="?", answer=["1"], source="toy", kind="qa")


def trajectory(prompt: list[int], pieces: list[tuple[list[int], TokenOrigin]]) -> TrajectoryState:
    t = TrajectoryState(id="t", question=QUESTION, prompt_ids=prompt, budgets=Budgets(6, 6, None, 100))
    for ids, origin in pieces:
        t.append(ids, origin, [-0.5] * len(ids) if origin == TokenOrigin.SAMPLED else None)
    return t


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return Policy(Qwen2ForCausalLM(config), chunk_tokens=4).eval()


def test_pack_pads_prompts_left_and_responses_right_and_masks_by_origin():
    a = trajectory([1, 2, 3], [([4, 5], TokenOrigin.SAMPLED), ([6, 7, 8], TokenOrigin.TOOL), ([9], TokenOrigin.SAMPLED)])
    b = trajectory([1], [([10], TokenOrigin.GIVEN), ([11, 12], TokenOrigin.SAMPLED)])
    batch = pack([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 1, 10, 11, 12, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 9, [0, 0, 1, 1, 1, 1, 0, 0, 0]]
    assert batch.position_ids[1, 2:6].tolist() == [0, 1, 2, 3]
    # the policy gradient covers sampled tokens only: not tool output, not given text
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert batch.rollout_logprobs[0].tolist() == [-0.5, -0.5, 0, 0, 0, -0.5]
    assert batch.tokens() == [9, 4]


def test_log_probs_of_the_padded_batch_equal_each_sequence_alone(model):
    trajectories = [
        trajectory([1, 2, 3, 4], [([5, 6, 7], TokenOrigin.SAMPLED), ([8, 9], TokenOrigin.TOOL), ([10], TokenOrigin.SAMPLED)]),
        trajectory([11], [([12, 13], TokenOrigin.SAMPLED)]),
        trajectory([14, 15], [([16], TokenOrigin.SAMPLED)]),
    ]
    batch = pack(trajectories, pad_id=0)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, batch, with_entropy=True)
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            alone = torch.log_softmax(model.lm(ids).logits[0].float(), -1)
            expected = [alone[len(t.prompt_ids) + k - 1, tok].item() for k, tok in enumerate(t.response_ids)]
            assert logprobs[i, : len(t.response_ids)].tolist() == pytest.approx(expected, abs=1e-5)
        # a micro-batch of some rows, trimmed of the columns only others needed, gives the same
        part = batch.select([1, 2])
        assert part.input_ids.shape[1] < batch.input_ids.shape[1]
        again, _ = token_logprobs(model, part)
        for row, original in ((0, 1), (1, 2)):
            n = len(trajectories[original].response_ids)
            assert again[row, :n].tolist() == pytest.approx(logprobs[original, :n].tolist(), abs=1e-5)
            assert part.loss_mask[row, :n].tolist() == batch.loss_mask[original, :n].tolist()
    assert entropy.shape == logprobs.shape and bool((entropy >= 0).all())


def test_micro_batches_keep_to_the_token_budget():
    assert micro_batches([10, 10, 10, 30, 5], 30) == [[0, 1, 2], [3], [4]]
    assert micro_batches([50], 30) == [[0]]  # too long for the budget: alone
    assert micro_batches([], 30) == []


def test_prompts_from_the_rl_parquet(tmp_path):
    questions = [Question(id=f"q{i}", question=f"what is {i}?", answer=[str(i)], source="toy_python", kind="math") for i in range(3)]
    path = write_rl_parquet([RLRow.for_question(q, i, "train") for i, q in enumerate(questions)], tmp_path / "rl.parquet")
    prompts = read_prompts(path)
    assert [(p.question.id, p.question.question, p.question.answer, p.index, p.data_source) for p in prompts] == [
        (f"q{i}", f"what is {i}?", [str(i)], i, "math_effi_rl") for i in range(3)
    ]
    rows = [RLRow.for_question(q, 0, "train") for q in questions[:2]]
    with pytest.raises(RecordError, match=r"rl.parquet:2: field 'extra_info.index'"):
        read_prompts(write_rl_parquet(rows, tmp_path / "rl.parquet"))
    row = RLRow.for_question(questions[0], 0, "train")
    row.prompt[0].content = "Be brief."
    with pytest.raises(RecordError, match=r"field 'prompt.0.content'"):
        read_prompts(write_rl_parquet([row], tmp_path / "rl.parquet"))

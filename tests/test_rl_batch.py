"""Rollouts as tensors: padding, the loss mask by token origin, log-probabilities equal to an
unpadded forward pass of each sequence and to the full log-softmax (with a bounded peak memory at
Qwen's vocabulary), micro-batches (padded or packed: the same loss and gradients as one padded
pass), the batch plan over ranks; the RL parquet read back as prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from etagent.agent import Budgets, TrajectoryState
from etagent.records import Question, RecordError, RLRow, TokenOrigin, write_rl_parquet
from etagent.rl.algorithm import entropy_from_logprobs, policy_loss
from etagent.rl.batch import BatchPlan, balanced_partition, batch_plan, micro_batches, pack, token_logprobs
from etagent.rl.policy import Policy
from etagent.rl.rollout import read_prompts

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
        logprobs, entropy = token_logprobs(model, batch.micro([0, 1, 2], packed=False), with_entropy=True)
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            alone = torch.log_softmax(model.lm(ids).logits[0].float(), -1)
            expected = [alone[len(t.prompt_ids) + k - 1, tok].item() for k, tok in enumerate(t.response_ids)]
            assert logprobs[i, : len(t.response_ids)].tolist() == pytest.approx(expected, abs=1e-5)
        # a micro-batch of some rows, trimmed of the columns only others needed, gives the same
        part = batch.micro([1, 2], packed=False)
        assert part.input_ids.shape[1] < batch.input_ids.shape[1]
        again, _ = token_logprobs(model, part)
        for row, original in ((0, 1), (1, 2)):
            n = len(trajectories[original].response_ids)
            assert again[row, :n].tolist() == pytest.approx(logprobs[original, :n].tolist(), abs=1e-5)
            assert part.loss_mask[row, :n].tolist() == batch.loss_mask[original, :n].tolist()
    assert entropy.shape == logprobs.shape and bool((entropy >= 0).all())


def test_log_probs_are_of_the_tempered_distribution_the_hf_engine_sampled(toy):
    """At T = 0.7 the trainer's log-probabilities are log softmax(logits / 0.7), as verl's actor
    computes them, and equal the hf engine's tempered ones for the tokens it sampled; pack()
    carries those (not the raw ones) as the rollout's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from etagent.llm import GenerationRequest, Sampling
    from etagent.llm.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    lm = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32).eval()
    engine = HFEngine.from_model(lm, tokenizer)
    prompt = tokenizer.encode("<|im_start|>user\nWho works as a baker?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    [[sample]] = engine.generate(
        [GenerationRequest(sampling=Sampling.at(temperature=0.7), prompt_ids=tuple(prompt), max_new_tokens=12, seed=3)]
    )
    t = TrajectoryState(id="t", question=QUESTION, prompt_ids=prompt, budgets=Budgets(6, 6, None, 100))
    t.append(list(sample.token_ids), TokenOrigin.SAMPLED, list(sample.logprobs), sample.tempered_logprobs)
    batch = pack([t], pad_id=0)
    assert batch.rollout_logprobs[0].tolist() == pytest.approx(sample.tempered_logprobs, abs=1e-6)
    assert sample.tempered_logprobs != pytest.approx(sample.logprobs, abs=1e-3)
    with torch.no_grad():
        tempered, _ = token_logprobs(Policy(lm, chunk_tokens=4, temperature=0.7), batch.micro([0], packed=False))
        raw, _ = token_logprobs(Policy(lm, chunk_tokens=4), batch.micro([0], packed=False))
    assert tempered[0].tolist() == pytest.approx(sample.tempered_logprobs, abs=1e-4)
    assert raw[0].tolist() == pytest.approx(sample.logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        Policy(lm, chunk_tokens=4, temperature=0.0)


def test_micro_batches_group_rows_longest_first_within_the_token_budget():
    # padded, a group costs its rows x its longest row; packed, the sum of its rows
    assert micro_batches([5, 20, 5, 20, 10], 40, packed=False) == [[1, 3], [0, 2, 4]]
    assert micro_batches([5, 20, 5, 20, 10], 50, packed=False) == [[1, 3], [0, 2, 4]]
    assert micro_batches([5, 20, 5, 20, 10], 50, packed=True) == [[1, 3, 4], [0, 2]]
    assert micro_batches([50], 30, packed=True) == [[0]]  # too long for the budget: alone
    assert micro_batches([], 30, packed=False) == []


def test_a_mini_batch_is_dealt_over_the_ranks_in_equal_counts_and_even_tokens():
    tokens = [900, 100, 120, 880, 500, 510, 90, 110]  # as rank 0 drew 900, 100, 120, 880: 2000 against 1210
    groups = balanced_partition(tokens, 2)
    assert [len(g) for g in groups] == [4, 4] and sorted(i for g in groups for i in g) == list(range(8))
    sums = [sum(tokens[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= 40, sums
    assert balanced_partition([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    # longest first deals 4 2 1 | 2 2 1 (7 | 5); as drawn, 1 1 4 | 2 2 2 is 6 | 6 and stays
    assert balanced_partition([1, 1, 4, 2, 2, 2], 2) == [[0, 1, 2], [3, 4, 5]]


def test_a_packed_micro_batch_is_the_rows_real_tokens_with_restarting_positions():
    a = trajectory([1, 2, 3], [([4, 5], TokenOrigin.SAMPLED), ([6], TokenOrigin.TOOL)])
    b = trajectory([7], [([8, 9], TokenOrigin.SAMPLED)])
    micro = pack([a, b], pad_id=0).micro([0, 1], packed=True)
    assert micro.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert micro.attention_mask is None
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2]]
    # each response token is predicted by the position before it; b's third column is past its end
    assert micro.scored.tolist() == [[2, 3, 4], [6, 7, 6]]
    assert micro.loss_mask.tolist() == [[1, 1, 0], [1, 1, 0]]


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_and_padded_micro_batches_give_the_loss_and_gradients_of_one_padded_pass(device):
    """The PPO loss (a token mean over the mini-batch) and every parameter's gradient, with the
    rows in one padded forward pass (as before micro-batches were grouped by length), in padded
    micro-batches of similar lengths, and packed into sequences without padding, agree to 1e-5.
    The model attends with sdpa, which reads packed position ids as a block-diagonal mask (what
    flash-attention, the GPU presets' implementation, reads as separate sequences)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    policy = Policy(Qwen2ForCausalLM(config), chunk_tokens=8).to(device)
    generator = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(1, 50, (n,), generator=generator).tolist()

    trajectories = []
    for prompt, segments in [(3, [4, 2, 5]), (7, [1]), (2, [9, 3, 2]), (5, [2]), (4, [6, 4, 1]), (1, [3])]:
        pieces = [(ids(n), TokenOrigin.TOOL if k % 2 else TokenOrigin.SAMPLED) for k, n in enumerate(segments)]
        trajectories.append(trajectory(ids(prompt), pieces))
    batch = pack(trajectories, pad_id=0).to(torch.device(device))
    old = batch.rollout_logprobs + 0.1 * torch.randn(batch.loss_mask.shape, generator=generator).to(device)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, 0.5], device=device)
    tokens = float(batch.loss_mask.sum())

    def loss_and_grads(groups, packed):
        policy.zero_grad(set_to_none=True)
        total = 0.0
        for rows in groups:
            micro = batch.micro(rows, packed)
            logprobs, _ = token_logprobs(policy, micro)
            terms = policy_loss(
                logprobs, old[rows, : micro.response_width], advantages[rows], micro.loss_mask, tokens, clip_low=0.2, clip_high=0.28
            )
            terms.loss.backward()
            total += terms.loss.item()
        return total, {name: p.grad.clone() for name, p in policy.named_parameters()}

    every_row = list(range(len(trajectories)))
    expected_loss, expected_grads = loss_and_grads([every_row], packed=False)
    row_tokens = batch.tokens()
    for packed in (False, True):
        groups = micro_batches(row_tokens, 30, packed)
        assert len(groups) > 1 and sorted(r for g in groups for r in g) == every_row
        loss, grads = loss_and_grads(groups, packed)
        assert loss == pytest.approx(expected_loss, abs=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=f"{name}, packed={packed}")
    # packed, the forward passes compute the real tokens and nothing else
    assert sum(batch.micro(g, True).tokens() for g in micro_batches(row_tokens, 30, True)) == sum(row_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_padded_micro_batch_of_unequal_rows_has_finite_gradients_in_bf16_on_cuda():
    """A padded micro-batch of rows of very different lengths on CUDA in bf16, with sdpa (a
    masked kernel) and gradient checkpointing, as the RL paper preset runs without flash-attn: the
    loss and every gradient are finite and within 10% of float32's. Written after a NaN gradient
    at an RL item's first non-zero advantages on an H200; this test does not reproduce that NaN
    (the old, left-padded layout of these rows gave finite gradients there too), it guards the
    layout the trainer uses now."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    lm = Qwen2ForCausalLM(config).cuda()
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    generator = torch.Generator().manual_seed(2)

    def ids(n):
        return torch.randint(1, 512, (n,), generator=generator).tolist()

    trajectories = [trajectory(ids(p), [(ids(r), TokenOrigin.SAMPLED)]) for p, r in [(40, 200), (5, 3), (90, 20), (12, 120)]]
    batch = pack(trajectories, pad_id=0).to(torch.device("cuda"))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], device="cuda")
    rows = list(range(len(trajectories)))
    micro = batch.micro(rows, packed=False)
    tokens = float(batch.loss_mask.sum())

    def loss_and_grads(dtype):
        policy = Policy(lm.to(dtype), chunk_tokens=64).train()
        policy.zero_grad(set_to_none=True)
        logprobs, _ = token_logprobs(policy, micro)
        loss = policy_loss(logprobs, logprobs.detach().float() - 0.05, advantages, micro.loss_mask, tokens).loss
        loss.backward()
        return loss.item(), {name: p.grad.float().clone() for name, p in policy.named_parameters()}

    reference_loss, reference = loss_and_grads(torch.float32)
    loss, grads = loss_and_grads(torch.bfloat16)
    assert loss == pytest.approx(reference_loss, rel=0.05)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert (grad - reference[name]).norm() <= 0.1 * reference[name].norm() + 1e-6, name


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


def test_chunked_log_probs_equal_the_full_log_softmax_with_their_gradients():
    """rl/policy.py's chunked log-probabilities and entropies against the previous computation
    (the model's full logits, one float32 log-softmax), in float32 on CPU: within 1e-6, and the
    same gradients."""
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    lm = Qwen2ForCausalLM(config)
    chunked = Policy(lm, chunk_tokens=512)
    prompt, width = 20, 320
    ids = torch.randint(0, 3000, (4, prompt + width))
    mask, positions = torch.ones_like(ids), torch.arange(prompt + width)[None].expand(4, -1)

    scored = torch.arange(4)[:, None] * (prompt + width) + torch.arange(prompt - 1, prompt + width - 1)[None]  # row-major positions
    logprobs, entropy = chunked(ids, mask, positions, scored, with_entropy=True)
    logprobs.sum().backward()
    ours = {name: p.grad.clone() for name, p in lm.named_parameters()}
    lm.zero_grad()
    log_probs = torch.log_softmax(lm(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, prompt - 1 : -1].float(), -1)
    full = log_probs.gather(-1, ids[:, prompt:, None]).squeeze(-1)
    full.sum().backward()

    assert (logprobs - full).abs().max().item() <= 1e-6
    assert (entropy - entropy_from_logprobs(log_probs.detach())).abs().max().item() <= 1e-6
    for name, p in lm.named_parameters():  # the same up to the order of float32 sums over chunks
        assert ((ours[name] - p.grad).norm() / p.grad.norm()).item() < 1e-5, name


@pytest.mark.slow
def test_log_probs_peak_memory_at_qwens_vocabulary():
    """Forward and backward of the log-probabilities and entropies of 8192 response tokens at a
    151,936 vocabulary, on CPU (bench/logprob_memory.py, its own process): the full float32
    logits alone are 4.6 GiB, and the previous computation peaked at 18.7 GiB (measured with the
    bench); the chunked one stays under 1.5 GiB."""
    command = [sys.executable, "bench/logprob_memory.py", "--method", "chunked", "--vocab", "151936", "--tokens", "8192"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1], check=True)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["peak_bytes"] < 1.5 * 2**30, found


@pytest.mark.parametrize("preset", ["paper", "tiny"])
def test_the_presets_batch_plan_on_1_to_16_ranks(preset):
    """The same optimizer steps of the same number of sequences on every world size the step's
    prompts divide over; any other world size is refused before work starts, naming the key."""
    from etagent.config import load_settings

    cfg = load_settings("rl", preset)
    per_step, n, mini = cfg.data.prompts_per_step, cfg.rollout.n, cfg.train.mini_batch_prompts
    for world in range(1, 17):
        if per_step % world:
            with pytest.raises(ValueError, match=r"data.prompts_per_step: \d+ is not a multiple of the number of processes"):
                batch_plan(per_step, n, mini, world)
            continue
        plan = batch_plan(per_step, n, mini, world)
        assert plan.optimizer_steps == per_step // mini
        assert plan.sequences_per_rank * world == per_step * n
        assert plan.mini_batch_sequences_per_rank * world == mini * n
        assert plan.mini_batch_sequences_per_rank * plan.optimizer_steps == plan.sequences_per_rank
    if preset == "paper":  # 64 prompts x 16 rollouts, mini-batches of 4 prompts: 16 optimizer steps
        assert [w for w in range(1, 17) if per_step % w == 0] == [1, 2, 4, 8, 16]
        assert batch_plan(per_step, n, mini, 16) == BatchPlan(4, 64, 4, 16)


def test_a_mini_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match=r"train.mini_batch_prompts x rollout.n = 1 x 2 sequences does not split evenly over 4"):
        batch_plan(8, 2, 1, 4)
    with pytest.raises(ValueError, match=r"multiple of train.mini_batch_prompts \(3\)"):
        batch_plan(8, 2, 3, 1)
    with pytest.raises(ValueError, match=r"data.prompts_per_step: must be at least 1"):
        batch_plan(0, 2, 1, 1)


def test_an_update_whose_gradient_is_not_finite_stops_before_its_optimizer_step(toy):
    """A NaN among the old log-probabilities of one policy token (what a broken rollout engine
    would give) makes the loss and the gradient NaN: the update raises NonFiniteUpdate naming the
    mini-batch and the input, before the optimizer step, so the policy's weights are unchanged."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from etagent.rl.actor import NonFiniteUpdate, StepBatch, update
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy

    created = not dist.is_initialized()
    init_distributed(torch.device("cpu"))
    try:
        policy, _ = load_policy(toy / "model", torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=64)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        trajectories = [trajectory([1, 2, 3], [([4 + i, 5, 6], TokenOrigin.SAMPLED)]) for i in range(4)]
        batch = pack(trajectories, pad_id=0)
        old = batch.rollout_logprobs.clone()
        old[1, 2] = float("nan")
        cfg = OmegaConf.create(
            {
                "train": {"micro_batch_tokens": 64, "share_prefixes": False},
                "algorithm": {
                    "clip_low": 0.2,
                    "clip_high": 0.28,
                    "clip_c": 3.0,
                    "entropy_balanced_clipping": False,
                    "entropy_aware_advantage": False,
                    "log_ratio_clamp": 20.0,
                },
                "optim": {"grad_clip": 1.0},
            }
        )
        before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
        plan = batch_plan(prompts_per_step=2, n=2, mini_batch_prompts=1, world=1)
        with pytest.raises(
            NonFiniteUpdate,
            match=r"mini-batch 1 of 2: gradient norm [0-9.e+-]+, a micro-batch loss not finite, so .*old log-probabilities: 1 of 6 policy tokens",
        ):
            update(trainer_state(policy, optimizer, plan, cfg), StepBatch(batch, torch.tensor([1.0, -1.0, 1.0, -1.0]), old, None))
        assert all(torch.equal(v.full_tensor(), before[k]) for k, v in policy.state_dict().items())
        # a finite gradient whose step overflows the weights: caught right after the step,
        # before the next mini-batch (and before the trainer's save). The overflow is scripted (a
        # control-flow test): AdamW's step, then one weight past float32's range, as a step of a
        # far too high learning rate leaves it.
        from torch.distributed.tensor import DTensor

        # So is a step that leaves a weight finite but far past any trained model's (1e37, as
        # one step at a learning rate of 1e36 does): over the run's limit, 1e4 or 100 times the
        # largest weight it started with (etagent/divergence.py).
        for value in (float("inf"), 1e37):

            class OverflowingAdamW(torch.optim.AdamW):
                def step(self, closure=None, value=value):
                    super().step(closure)
                    with torch.no_grad():
                        weight = next(iter(policy.parameters()))
                        (weight.to_local() if isinstance(weight, DTensor) else weight).view(-1)[0] = value

            overflowing = OverflowingAdamW(policy.parameters(), lr=1e-3)
            advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
            with pytest.raises(
                NonFiniteUpdate,
                match=r"mini-batch 1 of 2: its optimizer step \(gradient norm [0-9.e+-]+\) left 1 parameter values not finite or over 1e\+04",
            ):
                update(trainer_state(policy, overflowing, plan, cfg), StepBatch(batch, advantages, batch.rollout_logprobs, None))
            with torch.no_grad():
                weight = next(iter(policy.parameters()))
                (weight.to_local() if isinstance(weight, DTensor) else weight).view(-1)[0] = 0.0
    finally:
        if created:
            dist.destroy_process_group()


def test_trajectories_the_engine_failed_on_are_counted_masked_and_stop_the_step_over_the_share(tmp_path):
    """A trajectory the engine failed on after sampling some tokens (a request it refused
    mid-rollout): none of its tokens is in the loss mask; the step's failures are counted by
    cause; over tools.max_failure_share the step stops before updating (DegradedRun, exit 3).
    The trainer is a namespace holding the two things the check reads (a control-flow test)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from etagent.errors import DegradedRun
    from etagent.rl.distributed import init_distributed
    from etagent.rl.trainer import check_engine_failures

    served = trajectory([1, 2], [([4, 5], TokenOrigin.SAMPLED), ([6], TokenOrigin.TOOL), ([7], TokenOrigin.SAMPLED)])
    failed = trajectory([1, 2], [([4, 8], TokenOrigin.SAMPLED), ([6], TokenOrigin.TOOL)])
    failed.finish_reason, failed.error = "error", "RequestRejected: top_logprobs 21 over max_logprobs 20"
    batch = pack([served, failed], pad_id=0)
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1], [0, 0, 0, 0]]

    created = not dist.is_initialized()
    init_distributed(torch.device("cpu"))
    try:
        groups = [[served, failed], [served, served]]
        trainer = SimpleNamespace(cfg=OmegaConf.create({"tools": {"max_failure_share": 0.3}}), out=tmp_path)
        assert check_engine_failures(trainer, 1, groups) == {"engine/failed": 1, "engine/failure_share": 0.25}
        trainer.cfg.tools.max_failure_share = 0.2
        with pytest.raises(DegradedRun, match=r"step 1: the engine failed on 1 of 4 trajectories \(25.0%: RequestRejected \(1\)\)"):
            check_engine_failures(trainer, 1, groups)
    finally:
        if created:
            dist.destroy_process_group()


def trainer_state(policy, optimizer, plan, cfg):
    """What rl/actor.py's update reads of the trainer (rl/trainer.py's Trainer), for tests that
    run an update alone: the policy, its optimizer, the batch plan, the settings, the device."""
    from types import SimpleNamespace

    return SimpleNamespace(policy=policy, optimizer=optimizer, plan=plan, cfg=cfg, device=torch.device("cpu"))


def update_settings(micro_batch_tokens: int, entropy_aware: bool, share_prefixes: bool = False):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "train": {"micro_batch_tokens": micro_batch_tokens, "share_prefixes": share_prefixes},
            "algorithm": {
                "clip_low": 0.2,
                "clip_high": 0.28,
                "clip_c": 3.0,
                "entropy_balanced_clipping": True,
                "entropy_aware_advantage": entropy_aware,
                "log_ratio_clamp": 20.0,
            },
            "optim": {"grad_clip": 100.0},
        }
    )


def test_aepos_entropy_aware_step_does_not_depend_on_the_micro_batches(toy):
    """AEPO's entropy-aware advantage standardises the token entropies over the optimizer step's
    tokens (every micro-batch, every rank), so one step from the same weights gives the same
    gradient norm and the same weights after an SGD step at micro_batch_tokens 8192 (one pass)
    and 24 (a pass per row or two), as a step without it does. Standardised per micro-batch, as the reference did,
    the norms differed (0.390 against 0.331 in the probe that found it)."""
    import torch.distributed as dist

    from etagent.rl.actor import StepBatch, update
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy

    created = not dist.is_initialized()
    init_distributed(torch.device("cpu"))
    try:
        generator = torch.Generator().manual_seed(0)
        trajectories = [
            trajectory(
                torch.randint(5, 900, (3 + k % 3,), generator=generator).tolist(),
                [(torch.randint(5, 900, (4 + 2 * k,), generator=generator).tolist(), TokenOrigin.SAMPLED)],
            )
            for k in range(4)
        ]
        batch = pack(trajectories, pad_id=0)
        advantages = torch.tensor([1.0, -0.5, 0.8, -1.2])
        plan = batch_plan(prompts_per_step=2, n=2, mini_batch_prompts=2, world=1)

        def step(micro_batch_tokens: int, entropy_aware: bool):
            policy, _ = load_policy(toy / "model", torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=64)
            # plain SGD at lr 1: the weights move by the gradient itself (AdamW's first step is
            # about lr sign(g), which rounding flips where g is near 0)
            optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
            old = batch.rollout_logprobs - 0.05  # ratios off 1, as after a first mini-batch
            settings = update_settings(micro_batch_tokens, entropy_aware)
            metrics = update(trainer_state(policy, optimizer, plan, settings), StepBatch(batch, advantages, old, None))
            return metrics["actor/grad_norm"], {k: v.full_tensor() for k, v in policy.state_dict().items()}

        for entropy_aware in (False, True):
            norm_whole, weights_whole = step(8192, entropy_aware)
            norm_parts, weights_parts = step(24, entropy_aware)
            assert norm_parts == pytest.approx(norm_whole, rel=1e-5), entropy_aware
            for name, value in weights_whole.items():
                torch.testing.assert_close(weights_parts[name], value, atol=1e-6, rtol=0)
    finally:
        if created:
            dist.destroy_process_group()


def test_the_base_models_dropout_is_off_while_training_and_kept_in_the_export(toy, tmp_path):
    """A model whose config asks for attention dropout (0.5 here) trains without it, as TRL's
    GRPO does: RL's ratio compares the trainer's log-probabilities with the sampler's, which runs
    without dropout, so in train mode two forwards give the same numbers, those of eval mode. The
    exported model's config keeps the model's own 0.5."""
    import json
    import shutil

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from etagent.rl.checkpoint import export_model
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy

    model = tmp_path / "model"
    shutil.copytree(toy / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    created = not dist.is_initialized()
    init_distributed(torch.device("cpu"))
    try:
        policy, _ = load_policy(model, torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=64)
        assert policy.dropout == {"attention_dropout": 0.5}
        ids = torch.randint(5, 900, (2, 24), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(24).expand_as(ids)
        scored = torch.arange(23).expand(2, 23) + torch.tensor([[0], [24]])
        runs = []
        for training in (True, True, False):
            policy.train(training)
            with torch.no_grad():
                runs.append(policy(ids, torch.ones_like(ids), positions, scored)[0])
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
        export_model(tmp_path / "export", policy.lm, AutoTokenizer.from_pretrained(model), torch.float32, 1 << 20, dropout=policy.dropout)
        assert json.loads((tmp_path / "export" / "config.json").read_text())["attention_dropout"] == 0.5
    finally:
        if created:
            dist.destroy_process_group()


def random_tree_group(rng, vocab: int, prompt: list[int]) -> list[TrajectoryState]:
    """One prompt's rollouts as an ARPO tree would leave them: a tree of depth 1 to 4 whose nodes
    branch 1 to 4 ways, each node a sampled segment, most of them followed by a tool result
    (inserted tokens, out of the loss); a path from the root to a leaf is one trajectory, its
    shared prefix copied, as the rollout copies it."""
    paths: list[list[tuple[list[int], TokenOrigin]]] = []

    def grow(pieces, depth):
        segment = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        here = pieces + [(segment, TokenOrigin.SAMPLED)]
        if depth > 1 and rng.random() < 0.8:
            here = here + [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))], TokenOrigin.TOOL)]
        if depth == 1:
            paths.append(here)
            return
        for _ in range(rng.randint(1, 4)):
            grow(here, depth - 1)

    grow([], rng.randint(1, 4))
    return [trajectory(prompt, path) for path in paths]


def random_tree_batch(seed: int, vocab: int = 50, prompt_tokens: int = 8):
    """Two to three prompts' groups (prompts of 3 to ``prompt_tokens`` + 2 tokens, sharing their
    first 2: a system turn), shuffled together as a mini-batch holds them, with random advantages."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(2)]
    trajectories = []
    for _ in range(rng.randint(2, 3)):
        prompt = system + [rng.randrange(3, vocab) for _ in range(rng.randint(1, prompt_tokens))]
        trajectories += random_tree_group(rng, vocab, prompt)
    rng.shuffle(trajectories)
    return pack(trajectories, pad_id=0), torch.tensor([rng.uniform(-1, 1) for _ in trajectories])


@pytest.mark.parametrize("seed", range(12))
def test_a_prefix_tree_pass_gives_each_paths_log_probs_and_gradients(model, seed):
    """Random ARPO-shaped trees (depths 1-4, branching 1-4, tool-result spans, prompts sharing a
    system turn): the rows computed as one prefix tree (each shared token once) give every
    response token's log-probability and entropy of the rows' own padded passes to 1e-5 in
    float32, and the gradient of a masked token-mean loss to 1e-5 (a shared token's gradient is
    the sum over the paths that hold it). The tree computes fewer positions than the paths hold."""
    batch, advantages = random_tree_batch(seed)
    rows = list(range(batch.input_ids.shape[0]))
    tree = batch.micro_tree(rows)
    flat = batch.micro(rows, packed=False)
    assert tree.tokens() < sum(batch.tokens())
    results = []
    for micro in (tree, flat):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, micro, with_entropy=True)
        loss = (logprobs * advantages[:, None] * micro.loss_mask).sum() / micro.loss_mask.sum()
        loss.backward()
        results.append((logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (tree_lp, tree_entropy, tree_grads), (flat_lp, flat_entropy, flat_grads) = results
    width = tree.response_width
    mask = batch.loss_mask[:, :width].bool() | (batch.attention_mask[:, batch.prompt_width :][:, :width].bool())
    torch.testing.assert_close(tree_lp[mask], flat_lp[:, :width][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(tree_entropy[mask], flat_entropy[:, :width][mask], atol=1e-5, rtol=0)
    for name, grad in flat_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, atol=1e-5, rtol=0)


def test_a_prefix_tree_pass_gives_the_same_gradients_bitwise_on_one_and_two_threads():
    """The same seeds give the same update: a prefix tree pass scores a shared position once per
    path, and the gradients those repeats add up to are bitwise the same on every call, on 2 torch
    threads as on 1. (Gathering them with advanced indexing did not: its CPU backward adds the
    repeats in an order that changes from call to call once the rows are wide enough, here a
    hidden size of 128, and the demo's RL rows moved from run to run.)"""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=2800, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    policy = Policy(Qwen2ForCausalLM(config), chunk_tokens=64).eval()
    batch, advantages = random_tree_batch(1, vocab=2800, prompt_tokens=40)
    tree = batch.micro_tree(list(range(batch.input_ids.shape[0])))

    def gradients(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        policy.zero_grad()
        logprobs, _ = token_logprobs(policy, tree)
        ((logprobs * advantages[:, None] * tree.loss_mask).sum() / tree.loss_mask.sum()).backward()
        return [p.grad.clone() for p in policy.parameters()]

    threads = torch.get_num_threads()
    try:
        runs = [gradients(2) for _ in range(4)] + [gradients(1)]
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_the_update_on_prefix_trees_is_the_flat_update(toy):
    """One RL update (rl/actor.py) of the toy policy on random trees, with train.share_prefixes on
    and off, AEPO's clipping and entropy-aware advantage on, TIS weights on: the same loss,
    gradient norm, clip fraction and weights after an SGD step, to 1e-5; with sharing on, the
    update computes fewer positions (actor/computed_over_path_tokens below 1)."""
    import torch.distributed as dist

    from etagent.rl.actor import StepBatch, update
    from etagent.rl.distributed import init_distributed
    from etagent.rl.policy import load_policy

    created = not dist.is_initialized()
    init_distributed(torch.device("cpu"))
    try:
        batch, advantages = random_tree_batch(3, vocab=900, prompt_tokens=40)
        rows = batch.input_ids.shape[0]
        plan = BatchPlan(prompts_per_rank=1, sequences_per_rank=rows, mini_batch_sequences_per_rank=rows, optimizer_steps=1)
        old = batch.rollout_logprobs - 0.05

        def step(share: bool):
            policy, _ = load_policy(toy / "model", torch.device("cpu"), compute_dtype=torch.float32, chunk_tokens=64)
            optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
            cfg = update_settings(512, entropy_aware=True, share_prefixes=share)
            cfg.algorithm.tis_cap = 2.0
            metrics = update(trainer_state(policy, optimizer, plan, cfg), StepBatch(batch, advantages, old, None, tis_cap=2.0))
            return metrics, {k: v.full_tensor() for k, v in policy.state_dict().items()}

        (shared, shared_weights), (flat, flat_weights) = step(True), step(False)
        for key in ("actor/loss", "actor/grad_norm", "actor/clip_fraction", "actor/entropy", "rollout_correction/ratio_mean"):
            assert shared[key] == pytest.approx(flat[key], rel=1e-5, abs=1e-6), key
        assert shared["actor/computed_over_path_tokens"] < 0.9 <= flat["actor/computed_over_path_tokens"]
        for name, value in flat_weights.items():
            torch.testing.assert_close(shared_weights[name], value, atol=1e-5, rtol=0)
    finally:
        if created:
            dist.destroy_process_group()

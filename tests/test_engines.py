"""Generation engines: the hf engine on the tiny toy model (log-probabilities against a forward
pass, stops, seeds, left padding), and the openai engine's pool against local servers speaking
vLLM's completions format."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from etagent import protocol
from etagent.llm import GenerationRequest, Sampling
from etagent.llm.hf import HFEngine
from etagent.llm.openai_engine import OpenAIEngine
from etagent.net import ExternalCallError
from tests.support.servers import free_port, serve


@pytest.fixture(scope="module")
def hf(toy):
    torch.manual_seed(0)
    return HFEngine(str(toy / "model"), max_batch_size=8)


def prompts(engine, questions=("What is 12 times 7?", "In which year was Zorvak Telmin born?", "Hi")):
    return [protocol.encode_prompt(engine.tokenizer, q) for q in questions]


def forward_logprobs(engine, prompt, tokens):
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + tokens])).logits[0].float()
    raw = torch.log_softmax(logits, -1)
    return raw[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_logprobs_and_entropy_match_a_forward_pass_in_a_left_padded_batch(hf):
    ps = prompts(hf)
    assert len({len(p) for p in ps}) == 3  # different lengths: the batch is left-padded
    requests = [
        GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), n=2, max_new_tokens=12, logprobs=3, seed=i)
        for i, p in enumerate(ps)
    ]
    results = hf.generate(requests)
    for p, samples in zip(ps, results):
        assert len(samples) == 2
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) == len(s.top_logprobs) == len(s.entropy) == 12 and s.finish_reason == "length"
            raw, expected = forward_logprobs(hf, p, s.token_ids)
            assert max(abs(a - b) for a, b in zip(expected, s.logprobs)) < 1e-4
            exact = (-(raw.exp() * raw).sum(-1)).tolist()
            assert max(abs(a - b) for a, b in zip(exact, s.entropy)) < 1e-4
            for position, top in enumerate(s.top_logprobs):
                best = raw[position].topk(3)
                assert set(best.indices.tolist()) <= set(top) and s.token_ids[position] in top


def test_seeded_samples_do_not_depend_on_the_batch(hf):
    p = prompts(hf)[0]
    alone = hf.generate([GenerationRequest(tuple(p), n=3, max_new_tokens=10, seed=7)])[0]
    others = [GenerationRequest(tuple(q), n=2, max_new_tokens=5, seed=1) for q in prompts(hf)]
    mixed = hf.generate([others[1], GenerationRequest(tuple(p), n=3, max_new_tokens=10, seed=7), others[2]])[1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in mixed]
    # the shorter rows left the batch half-way; the others' numbers are those of the lone run
    assert all(max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4 for x, y in zip(alone, mixed))
    assert len({tuple(s.token_ids) for s in alone}) == 3  # the n samples differ
    again = hf.generate([GenerationRequest(tuple(p), n=1, max_new_tokens=10, seed=8)])[0][0]
    assert again.token_ids != alone[0].token_ids


def test_greedy_and_filters(hf):
    p = prompts(hf)[1]
    greedy = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=8)])[0][0]
    top1 = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0, top_k=1), max_new_tokens=8, seed=3)])[0][0]
    tiny_p = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0, top_p=1e-9), max_new_tokens=8, seed=4)])[0][0]
    assert greedy.token_ids == top1.token_ids == tiny_p.token_ids
    raw, _ = forward_logprobs(hf, p, greedy.token_ids)
    assert greedy.token_ids == raw.argmax(-1).tolist()


def test_stop_strings_are_enforced_while_generating(hf):
    p = prompts(hf)[0]
    free = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=20)])[0][0]
    # stop on the text of the 5th greedy token: generation must end exactly there, keeping it
    stop_text = hf.tokenizer.decode(free.token_ids[4:5])
    first = next(i for i in range(20) if stop_text in hf.tokenizer.decode(free.token_ids[: i + 1]))
    stopped = hf.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=20, stop=("never-there", stop_text))]
    )[0][0]
    assert stopped.finish_reason == "stop" and stopped.stop == stop_text
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_repetition_penalty_changes_greedy_choices(hf):
    p = prompts(hf)[2]
    plain = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=30)])[0][0]
    penalised = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0, repetition_penalty=5.0), max_new_tokens=30)])[
        0
    ][0]
    assert plain.token_ids != penalised.token_ids
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))


# --- the openai engine ----------------------------------------------------------------------------


def fake_vllm_server(name, log, fail=0):
    """Answers /v1/completions in vLLM's format (token ids as "token_id:N" with logprobs) and
    /v1/chat/completions; a scripted stand-in for `vllm serve` to test the pool's control flow."""
    app = FastAPI()
    state = {"fail": fail}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.append((name, body))
        if state["fail"]:
            state["fail"] -= 1
            return JSONResponse({"error": "overloaded"}, status_code=503)
        if isinstance(body["prompt"], str):
            return {"choices": [{"index": 0, "text": f"{name} says hi", "finish_reason": "stop", "stop_reason": None}]}
        choices = []
        for i in range(body["n"]):
            tokens = [10 + i, 11, 12]
            finish, stop_reason = [("stop", "</search>"), ("stop", None), ("length", None)][i % 3]
            choices.append(
                {
                    "index": i,
                    "text": "...",
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens],
                        "token_logprobs": [-0.5, -0.25, -0.125],
                        "top_logprobs": [{f"token_id:{t}": -0.5, "token_id:99": -1.0, "token_id:98": -2.0} for t in tokens],
                    },
                }
            )
        return {"choices": choices[::-1]}  # out of order on purpose

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        log.append((name, body))
        return {"choices": [{"message": {"content": f"{name}: {body['messages'][-1]['content']}"}}]}

    return app


def test_openai_engine_sends_every_setting_and_parses_token_ids():
    log = []
    with serve(fake_vllm_server("a", log)) as url:
        engine = OpenAIEngine([url + "/v1"], "policy")
        request = GenerationRequest(
            (1, 2, 3),
            sampling=Sampling.at(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1),
            n=3,
            max_new_tokens=64,
            stop=("</search>",),
            logprobs=2,
            seed=5,
            session="q1",
        )
        [samples] = engine.generate([request])
    body = log[0][1]
    assert body["prompt"] == [1, 2, 3] and body["top_k"] == 20 and body["min_p"] == 0.05 and body["repetition_penalty"] == 1.1
    assert body["stop"] == ["</search>"] and body["include_stop_str_in_output"] and body["return_tokens_as_token_ids"] and body["seed"] == 5
    assert [s.token_ids for s in samples] == [[10, 11, 12], [11, 11, 12], [12, 11, 12]]
    assert [(s.finish_reason, s.stop) for s in samples] == [("stop", "</search>"), ("eos", None), ("length", None)]
    assert samples[0].logprobs == [-0.5, -0.25, -0.125]
    assert samples[0].top_logprobs[0] == {10: -0.5, 99: -1.0}


def test_openai_engine_pins_sessions_and_fails_over():
    log = []
    with serve(fake_vllm_server("a", log)) as a, serve(fake_vllm_server("b", log, fail=100)) as b:
        engine = OpenAIEngine([a + "/v1", b + "/v1"], "policy", attempts=2, timeout_s=5)
        r = lambda session: GenerationRequest((1,), max_new_tokens=3, session=session)  # noqa: E731
        engine.generate([r("s1")])  # s1 pinned to a
        engine.generate([r("s2")])  # s2 pinned to b, which fails twice, then a answers
        engine.generate([r("s1"), r("s2"), r("s1")])
    servers = [name for name, _ in log]
    assert servers[0] == "a"
    assert servers[1:4] == ["b", "b", "a"]  # two attempts on the pinned server, then fail-over
    assert servers[4:] == ["a", "a", "a"]  # s2 re-pinned to a
    dead = OpenAIEngine([f"http://127.0.0.1:{free_port()}/v1"], "policy", attempts=1, timeout_s=1)
    [[failed]] = dead.generate([r("x")])  # a failed request is an error sample, not a failed batch
    assert failed.finish_reason == "error" and "every server failed" in failed.error
    with pytest.raises(ExternalCallError, match="every server failed"):
        asyncio.run(dead.chat([{"role": "user", "content": "hi"}]))


def test_openai_engine_chat_sends_the_sampling_it_is_given():
    log = []
    with serve(fake_vllm_server("a", log)) as url:
        engine = OpenAIEngine([url + "/v1"], "judge")
        greedy = asyncio.run(engine.chat([{"role": "user", "content": "hello"}], max_new_tokens=8))
        sampled = asyncio.run(
            engine.chat([{"role": "user", "content": "hi"}], Sampling.at(1.0, top_k=5), max_new_tokens=9, stop=["</a>"], seed=3)
        )
    assert greedy == "a: hello" and sampled == "a: hi"
    first, second = log[0][1], log[1][1]
    assert first["temperature"] == 0.0 and first["max_tokens"] == 8 and first["messages"] == [{"role": "user", "content": "hello"}]
    assert second["temperature"] == 1.0 and second["top_k"] == 5 and second["max_tokens"] == 9
    assert second["stop"] == ["</a>"] and second["seed"] == 3


def test_entropy_helpers():
    from etagent.llm import exact_segment_entropy, topk_segment_entropy

    top = [{1: math.log(0.5), 2: math.log(0.25)}] * 30
    per_position = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25))
    assert topk_segment_entropy(top, vocab_size=100, window=20) == pytest.approx(20 * per_position / math.log(100))
    assert exact_segment_entropy([1.0] * 25, 100, window=20) == pytest.approx(20 / math.log(100))
    assert exact_segment_entropy(None, 100) is None


# --- lifecycle, context, windows (hf) -------------------------------------------------------------


def test_hf_weight_update(toy):
    from tests.support.weight_updates import assert_weight_update, check_weight_update

    assert_weight_update(check_weight_update(HFEngine(str(toy / "model")), toy / "model"))


def test_hf_engine_shares_the_trainers_model(hf):
    shared = HFEngine.from_model(hf.model, hf.tokenizer)
    p = prompts(hf)[0]
    greedy = GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=6)
    assert shared.generate([greedy])[0][0].token_ids == hf.generate([greedy])[0][0].token_ids
    norm = shared.model.model.norm.weight
    with torch.no_grad():
        saved = norm.clone()
        norm.mul_(-1.0)  # a "training step" on the trainer's module, seen by the engine at once
        flipped = shared.generate([greedy])[0][0]
        norm.copy_(saved)
    assert flipped.logprobs != hf.generate([greedy])[0][0].logprobs
    shared.sleep(1)
    shared.wake_up(["weights"])  # nothing to free on CPU, nothing moved: still usable
    assert shared.generate([greedy])[0][0].token_ids == hf.generate([greedy])[0][0].token_ids


def test_hf_requests_beyond_the_context_fail_alone(hf):
    p = prompts(hf)[0]
    too_long = GenerationRequest(tuple(p) * 200, max_new_tokens=4)
    near_end = tuple(p) * (hf.max_model_len // len(p) + 1)  # longer than the context, then cut to 3 short of it
    capped = GenerationRequest(near_end[: hf.max_model_len - 3], sampling=Sampling.at(temperature=0), max_new_tokens=50)
    [failed], [ok], [fine] = hf.generate([too_long, capped, GenerationRequest(tuple(p), max_new_tokens=3, seed=1)])
    assert failed.finish_reason == "error" and f"max_model_len {hf.max_model_len}" in failed.error and not failed.token_ids
    assert ok.finish_reason in ("length", "eos") and len(ok.token_ids) <= 3
    assert fine.finish_reason in ("length", "eos") and fine.error is None


def test_hf_top_logprobs_and_entropy_only_in_the_window(hf):
    p = prompts(hf)[0]
    [s] = hf.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, logprobs=3, logprobs_window=5, seed=2)]
    )[0]
    assert len(s.token_ids) == len(s.logprobs) == 12 and len(s.top_logprobs) == len(s.entropy) == 5
    [plain] = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, seed=2)])[0]
    assert plain.top_logprobs == [] and plain.entropy is None and plain.token_ids == s.token_ids


def test_hf_never_samples_ids_the_tokenizer_lacks(toy):
    """A model with more logits than tokens (as Qwen2.5 has): the extra ids, however likely, are never drawn."""
    engine = HFEngine(str(toy / "model"))
    n = len(engine.tokenizer)
    head = engine.model.lm_head
    engine.model.config.vocab_size = n + 64
    bigger = torch.nn.Linear(head.in_features, n + 64, bias=False)
    with torch.no_grad():
        bigger.weight[:n] = head.weight
        bigger.weight[n:] = head.weight[:64] * 50  # the padding logits dominate
    engine.model.lm_head = bigger
    p = prompts(engine)[0]
    for request in (
        GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=8),
        GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=8, seed=3),
    ):
        [s] = engine.generate([request])[0]
        assert all(t < n for t in s.token_ids)


def test_counter_uniform_is_uniform_and_device_free():
    from etagent.llm.hf import counter_uniform

    seeds = torch.arange(50_000, dtype=torch.long) * 7919 + 12345
    u = counter_uniform(seeds, torch.full_like(seeds, 3))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u[:10], counter_uniform(seeds[:10], torch.full_like(seeds[:10], 3)))
    assert not torch.equal(u, counter_uniform(seeds, torch.full_like(seeds, 4)))


def test_a_seeded_row_draws_the_same_whatever_filters_its_batch_needs(hf):
    """Rows with top-k, with top-p, or with neither make the batch take different candidate paths
    (top-k, full sort, unsorted); a row's draw must not follow them."""
    p, q = prompts(hf)[0], prompts(hf)[1]
    plain = GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, seed=7)
    alone = hf.generate([plain])[0][0].token_ids
    with_top_p = hf.generate(
        [GenerationRequest(tuple(q), sampling=Sampling.at(temperature=1.0, top_p=0.9), max_new_tokens=12, seed=1), plain]
    )[1][0].token_ids
    filtered = GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0, top_k=50), max_new_tokens=12, seed=7)
    filtered_alone = hf.generate([filtered])[0][0].token_ids
    with_top_k = hf.generate(
        [GenerationRequest(tuple(q), sampling=Sampling.at(temperature=1.0, top_k=5), max_new_tokens=12, seed=1), filtered]
    )[1][0].token_ids
    assert alone == with_top_p and filtered_alone == with_top_k


def test_a_shared_model_in_training_mode_decodes_in_eval_and_stays_in_training(hf, toy):
    """A trainer's module is in train mode, often with gradient checkpointing (which turns the KV
    cache off in train mode): the engine decodes in eval mode and gives the module back as it was."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy / "model")
    model.gradient_checkpointing_enable()
    model.train()
    shared = HFEngine.from_model(model, hf.tokenizer)
    greedy = GenerationRequest(tuple(prompts(hf)[0]), sampling=Sampling.at(temperature=0), max_new_tokens=10)
    assert shared.generate([greedy])[0][0].token_ids == hf.generate([greedy])[0][0].token_ids
    shared.sleep()  # the decoding thread has ended: the module is the trainer's again
    assert model.training
    assert model.config._attn_implementation == "sdpa"  # decoding's attention was given back


def test_decoding_attention_equals_transformers_sdpa_on_grouped_heads_with_masks():
    """On a CPU the decoding thread attends with the grouped keys and values as they are, where
    transformers' sdpa repeats them per head whenever a mask is given: the same numbers bit for bit,
    on random shapes, groupings and padding masks (decoding's one query and prefill's many, causal)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from etagent.llm.hf import _grouped_sdpa

    generator = torch.Generator().manual_seed(0)
    for case in range(200):
        rows, kv_heads, groups, dim = (int(x) for x in torch.randint(1, 6, (4,), generator=generator))
        keys_length = int(torch.randint(1, 80, (1,), generator=generator))
        queries = 1 if case % 2 else int(torch.randint(1, keys_length + 1, (1,), generator=generator))
        module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
        query = torch.randn(rows, kv_heads * groups, queries, dim * 8, generator=generator)
        key, value = (torch.randn(rows, kv_heads, keys_length, dim * 8, generator=generator) for _ in range(2))
        # left padding per row, and causality over the last `queries` positions
        padding = torch.randint(0, keys_length - queries + 1, (rows,), generator=generator)
        columns = torch.arange(keys_length)
        mask = (columns[None, None, :] >= padding[:, None, None]) & (
            columns[None, None, :] <= (keys_length - queries + torch.arange(queries))[None, :, None]
        )
        mask = mask[:, None]  # (rows, 1, queries, keys)
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
        got, _ = _grouped_sdpa(module, query, key, value, mask, scaling=0.125)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_cache_grows_in_place_and_keeps_what_it_returned():
    """_GrowingLayer: positions of any count appended one update after another read back as one
    concatenation would give them, across the buffer's growths, and views it returned before a
    growth keep their values."""
    from etagent.llm.hf import _GrowingLayer

    generator = torch.Generator().manual_seed(1)
    start = torch.randn(3, 2, 5, 4, generator=generator)
    layer, keys, views = _GrowingLayer(start, -start), [start], []
    for _ in range(60):
        new = torch.randn(3, 2, int(torch.randint(1, 9, (1,), generator=generator)), 4, generator=generator)
        got_keys, got_values = layer.update(new, -new)
        keys.append(new)
        views.append((got_keys, torch.cat(keys, dim=2)))
        torch.testing.assert_close(got_values, -torch.cat(keys, dim=2), rtol=0, atol=0)
    assert layer.get_seq_length() == sum(k.shape[2] for k in keys) > 64 * 3  # several growths
    for view, expected in views:
        torch.testing.assert_close(view, expected, rtol=0, atol=0)


def test_requests_that_join_a_running_batch_get_what_they_get_alone(hf):
    """Continuous batching: requests submitted while others decode join the running batch between
    two decoding steps (left-padded into its cache) and leave it as they finish; each gets the
    tokens and log-probabilities it gets when decoded alone."""
    ps = prompts(hf)
    long = GenerationRequest(tuple(ps[0]), max_new_tokens=150, seed=1, logprobs=2)
    others = [GenerationRequest(tuple(p), n=2, max_new_tokens=12 + 5 * k, seed=20 + k, logprobs=2) for k, p in enumerate(ps * 2)]
    hf.sleep()  # nothing stored from earlier tests
    alone = [hf.generate([r])[0] for r in [long, *others]]
    hf.sleep()
    joined = hf.counts["joined_running"]

    async def staggered():
        async def submit(r, delay):
            await asyncio.sleep(delay)
            return (await hf.agenerate([r]))[0]

        return await asyncio.gather(submit(long, 0.0), *(submit(r, 0.05 + 0.03 * k) for k, r in enumerate(others)))

    together = asyncio.run(staggered())
    assert hf.counts["joined_running"] > joined  # some rows did join a batch already running
    for a, b in zip(alone, together):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        assert all(max(abs(x - y) for x, y in zip(s.logprobs, t.logprobs)) < 1e-4 for s, t in zip(a, b))
        assert all(x.keys() == y.keys() for s, t in zip(a, b) for x, y in zip(s.top_logprobs, t.top_logprobs))


def test_a_request_that_continues_a_stopped_one_prefills_only_what_is_new(hf):
    """A row that ends at a stop string leaves its keys and values behind; a request of the same
    session whose prompt starts with that row's prompt and tokens (a trajectory after its tool
    result) starts from them, and samples what it samples with everything recomputed."""
    p = list(prompts(hf)[1])
    hf.sleep()
    greedy = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=12)])[0][0]
    stop = hf.tokenizer.decode(greedy.token_ids[:6])[-2:]
    stopped = hf.generate([GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=12, stop=(stop,), session="q")])[
        0
    ][0]
    assert stopped.finish_reason == "stop"
    result = hf.tokenizer.encode("<result>\n42\n</result>", add_special_tokens=False)
    follow = GenerationRequest(tuple(p + stopped.token_ids + result), max_new_tokens=10, seed=5, logprobs=3, session="q")
    before = dict(hf.counts)
    reused = hf.generate([follow])[0][0]
    assert hf.counts["reused_tokens"] - before.get("reused_tokens", 0) == len(p) + len(stopped.token_ids) - 1
    assert hf.counts["prefill_tokens"] - before["prefill_tokens"] == len(result) + 1
    hf.sleep()  # forget it: the same request from scratch
    fresh = hf.generate([follow])[0][0]
    assert reused.token_ids == fresh.token_ids
    assert max(abs(a - b) for a, b in zip(reused.logprobs, fresh.logprobs)) < 1e-4
    # another session does not see it
    hf.generate([GenerationRequest(tuple(p + stopped.token_ids + result), max_new_tokens=2, session="other")])
    assert hf.counts["reused_tokens"] == before.get("reused_tokens", 0) + len(p) + len(stopped.token_ids) - 1


def test_without_continuous_batching_each_call_is_decoded_by_itself(toy):
    """continuous_batching off: concurrent calls never share a batch (the next one's rows wait
    until the last one's are done) and nothing is kept between calls, so a row's numbers depend
    on its own call only."""
    engine = HFEngine(str(toy / "model"), max_batch_size=8, continuous_batching=False)
    ps = prompts(engine)
    calls = [[GenerationRequest(tuple(p), n=2, max_new_tokens=10 + 4 * k, seed=k, stop=("e",), session="s")] for k, p in enumerate(ps)]
    alone = [engine.generate(c) for c in calls]

    async def together():
        return await asyncio.gather(*(engine.agenerate(c) for c in calls))

    mixed = asyncio.run(together())
    assert engine.counts["joined_running"] == 0 and engine.counts["reused_tokens"] == 0
    assert [[s.token_ids for s in r[0]] for r in alone] == [[s.token_ids for s in r[0]] for r in mixed]
    assert all(a.logprobs == b.logprobs for r, q in zip(alone, mixed) for a, b in zip(r[0], q[0]))


@pytest.mark.slow  # 44 s in the default run, which CI measured at 911.7 s against its 15 minutes (2026-11-28)
def test_a_program_that_exits_while_the_engine_decodes_exits_cleanly(toy):
    """A program whose main thread ends while the engine is still decoding (a generate call in
    flight on another thread; the same window, shorter, follows every call's last step) exits
    with status 0: interpreter exit stops the decoding thread between two steps and waits for
    it. Torn down inside a torch operation, the process aborted with "terminate called without
    an active exception" (status 134) every time before the fix. A real subprocess."""
    import subprocess
    import sys
    from pathlib import Path

    program = (
        "import threading, time\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from etagent.llm import GenerationRequest, Sampling\n"
        "from etagent.llm.hf import HFEngine\n"
        f"path = {str(toy / 'model')!r}\n"
        "engine = HFEngine.from_model(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))\n"
        "requests = [GenerationRequest(prompt_ids=(5, 6, 7), sampling=Sampling.at(temperature=1.0), max_new_tokens=1000, seed=i) for i in range(32)]\n"
        "threading.Thread(target=engine.generate, args=(requests,), daemon=True).start()\n"
        "time.sleep(1.0)\n"
        "print('leaving while decoding', engine.counts['decode_steps'] > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "leaving while decoding True"


def test_a_cancelled_hf_request_leaves_the_batch_and_sleep_waits_for_the_thread(hf):
    """A caller that stops waiting (RL's partial rollouts stop a step mid-segment) has its rows
    dropped at the decoding thread's next step, so they cost no more decoding; the others are
    answered with what they get alone; sleep() returns once the thread has ended, so a trainer
    may change the weights the engine reads."""
    ps = prompts(hf)
    keep = GenerationRequest(tuple(ps[1]), max_new_tokens=20, seed=3)
    drop = GenerationRequest(tuple(ps[0]), max_new_tokens=400, seed=4)
    hf.sleep()
    [alone] = hf.generate([keep])
    steps = hf.counts["decode_steps"]

    async def run():
        dropped = asyncio.create_task(hf.agenerate([drop]))
        [kept] = await hf.agenerate([keep])
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return kept

    kept = asyncio.run(run())
    hf.sleep()
    assert hf._worker is None
    assert [s.token_ids for s in kept] == [s.token_ids for s in alone]
    assert hf.counts["decode_steps"] - steps < 100  # not the dropped row's 400

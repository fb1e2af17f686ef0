"""Prefix caching and chunked prefill: a request that starts from cached blocks, or whose
prompt is computed in chunks between decode steps, generates what a fresh prefill does.
Prefixes are shared in whole blocks (16 tokens here), and never the prompt's last token."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.engine.scheduler import Admission
from tests.engine.test_engine import _hf_greedy
from tests.helpers.checkpoints import save_tiny_llama

SYSTEM = "you are a helpful assistant that answers in one short sentence. "
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="float32").eval()


@pytest.fixture(scope="module")
def engine(checkpoint):
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=0)
    eng = Engine.from_pretrained(str(checkpoint), cfg).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def chunked(checkpoint):
    """Prompts longer than 16 tokens are computed 16 at a time; no prefix caching, so every
    token of every prompt goes through the chunks."""
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_prefill_tokens=16, max_loras_per_batch=0,
                       enable_prefix_caching=False)
    eng = Engine.from_pretrained(str(checkpoint), cfg).start()
    yield eng
    eng.shutdown()


def _ids(engine, text):
    return engine.tokenizer.encode(text)


def _cacheable(common: int, prompt_len: int, block: int = 16) -> int:
    """Tokens of a prompt found cached when `common` of its first tokens are in full blocks:
    whole blocks, all before the prompt's last token."""
    return min(common, prompt_len - 1) // block * block


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_shared_system_prompt_is_computed_once(engine, hf_model):
    first = engine.generate_batch([SYSTEM + "what is a fox?"], GREEDY)[0]
    assert first.cached_tokens == 0
    before = engine.stats()
    prompt = SYSTEM + "and the dog?"
    second = engine.generate_batch([prompt], GREEDY)[0]
    ids = _ids(engine, prompt)
    assert second.cached_tokens == _cacheable(_common(ids, _ids(engine, SYSTEM + "what is a fox?")), len(ids)) > 0
    assert second.token_ids == _hf_greedy(hf_model, ids, GREEDY.max_tokens)
    after = engine.stats()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == second.cached_tokens
    assert after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"] == len(ids)
    assert after["extend_steps"] == before["extend_steps"] + 1
    assert engine.compiles_after_warmup == 0


def test_the_next_turn_reuses_the_previous_answer(engine, hf_model):
    """A chat's next request repeats the conversation so far: all of it is in the cache except
    the last generated token, which was never fed back (in whole blocks)."""
    prompt = _ids(engine, SYSTEM + "name three colours.")
    answer = engine.generate_batch([prompt], GREEDY)[0]
    follow = prompt + answer.token_ids + _ids(engine, " and three more?")
    out = engine.generate_batch([follow], GREEDY)[0]
    assert out.cached_tokens == _cacheable(len(prompt) + len(answer.token_ids) - 1, len(follow))
    assert out.cached_tokens > len(prompt) - 16  # blocks filled while decoding count too
    assert out.token_ids == _hf_greedy(hf_model, follow, GREEDY.max_tokens)


def test_a_running_requests_blocks_are_shared(engine, hf_model):
    """While a long request runs, a request sharing its prompt's start takes those blocks."""
    long_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = SYSTEM + "tell a long story about the sea"
    started, done = threading.Event(), threading.Event()
    got = []

    def emit(out):
        got.append(out)
        started.set()
        if out.finished:
            done.set()

    engine.submit(prompt, long_params, emit)
    assert started.wait(60)
    other = SYSTEM + "tell a long story about the sky"
    out = engine.generate_batch([other], GREEDY)[0]
    assert done.wait(60)
    assert not got[0].finished  # the first request was still running when the other came
    ids = _ids(engine, other)
    assert out.cached_tokens == _cacheable(_common(ids, _ids(engine, prompt)), len(ids)) > 0
    assert out.token_ids == _hf_greedy(hf_model, ids, GREEDY.max_tokens)
    assert [t for o in got for t in o.token_ids] == _hf_greedy(hf_model, _ids(engine, prompt), 40)


def test_short_or_disabled_prefixes_are_recomputed(engine, checkpoint):
    engine.generate_batch(["a short one"], GREEDY)
    assert engine.generate_batch(["a short two"], GREEDY)[0].cached_tokens == 0  # under 16 tokens
    engine.generate_batch([SYSTEM + "x"], GREEDY)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    out = engine.generate_batch([SYSTEM + "y"], params)[0]
    assert out.cached_tokens == 0  # prompt log-probabilities need every position computed
    assert len(out.prompt_logprobs) == len(_ids(engine, SYSTEM + "y"))


def test_long_prompts_are_chunked_and_match_transformers(chunked, hf_model):
    prompts = [SYSTEM + "what is the tallest mountain on earth?", "short", SYSTEM * 2]
    outs = chunked.generate_batch(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ids = _ids(chunked, prompt)
        assert out.token_ids == _hf_greedy(hf_model, ids, GREEDY.max_tokens)
        assert out.prompt_tokens == len(ids)
    long_tokens = sum(len(_ids(chunked, p)) for p in prompts if len(_ids(chunked, p)) > 16)
    assert chunked.stats()["extend_steps"] >= long_tokens // 16
    assert chunked.compiles_after_warmup == 0


def test_decoding_goes_on_between_chunks(chunked):
    """A short request admitted with a long one finishes before the long prompt is read:
    each engine step computes at most 16 prompt tokens, then decodes."""
    order = []
    done = threading.Event()

    def emitter(name):
        def emit(out):
            if out.finished:
                order.append(name)
                if len(order) == 2:
                    done.set()
        return emit

    scheduler = chunked.scheduler
    admit = scheduler.admit
    # Both are admitted in one step (however the submitting thread is scheduled): whole, the
    # long prompt would give its one token in that step, before the short request's third.
    scheduler.admit = lambda *a, **kw: Admission() if 0 < len(scheduler.waiting) < 2 else admit(*a, **kw)
    try:
        chunked.submit(SYSTEM * 2, SamplingParams(max_tokens=1, temperature=0.0), emitter("long"))
        chunked.submit("hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), emitter("short"))
        assert done.wait(60)
    finally:
        scheduler.admit = admit
    assert order == ["short", "long"]


def test_chunked_prompt_logprobs_and_penalties_equal_one_pass(engine, chunked):
    prompt = SYSTEM + "count: one two three four five"
    params = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=3, logprobs=2,
                            repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)
    whole = engine.generate_batch([prompt], params)[0]
    parts = chunked.generate_batch([prompt], params)[0]
    assert parts.token_ids == whole.token_ids
    assert len(parts.prompt_logprobs) == len(whole.prompt_logprobs) == len(_ids(engine, prompt))
    assert parts.prompt_logprobs[0] is None
    for a, b in zip(parts.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for a, b in zip(parts.logprobs, whole.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_seeded_sampling_is_the_same_from_a_cached_prefix(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    prompt = SYSTEM + "pick random words"
    engine.generate_batch([prompt], GREEDY)  # leaves the prompt's blocks cached
    cached = engine.generate_batch([prompt], params)[0]
    n = len(_ids(engine, prompt))
    assert cached.cached_tokens == _cacheable(n, n) > 0
    fresh = engine.generate_batch([prompt], dataclasses.replace(params, prompt_logprobs=0))[0]
    assert fresh.cached_tokens == 0
    assert cached.token_ids == fresh.token_ids


def test_the_default_step_budget_is_capped():
    """A long max_seq_len does not make one step compute a whole long prompt (prefill
    attention scores grow with the square of the step's tokens)."""
    assert EngineConfig(max_seq_len=512).prefill_budget == 512
    assert EngineConfig(max_seq_len=32768).prefill_budget == 2048
    assert EngineConfig(max_seq_len=32768, max_prefill_tokens=8192).prefill_budget == 8192
    assert EngineConfig(max_seq_len=32768).prefill_buckets()[-1] == 2048


def test_a_step_that_loses_the_cache_fails_its_requests_and_the_next_ones_run(engine, hf_model):
    """A step that fails after consuming (donating) the KV cache fails the requests in it;
    the engine starts over with an empty cache and no stale prefixes, and serves on."""
    programs = engine.runner.programs
    launch = programs.call  # every step program goes through it

    def failing(name, fn, args):
        if name != "decode":
            return launch(name, fn, args)
        for a in args[1].arrays:  # the KV cache, donated
            a.delete()
        raise RuntimeError("device fault")

    prompt = SYSTEM + "after a fault"
    engine.generate_batch([prompt], GREEDY)  # leaves the prompt's blocks cached
    programs.call = failing
    try:
        with pytest.raises(RuntimeError, match="device fault"):
            engine.generate_batch([prompt], GREEDY)
    finally:
        del programs.call
    out = engine.generate_batch([prompt], GREEDY)[0]
    assert out.cached_tokens == 0  # what the blocks held went with the cache
    assert out.token_ids == _hf_greedy(hf_model, _ids(engine, prompt), GREEDY.max_tokens)
    assert len(engine.scheduler.free_rows) == engine.config.max_batch
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable


def test_requests_arriving_together_compute_their_shared_prompt_once(engine):
    """The n choices of a request (or requests with one system prompt arriving together):
    the first computes the prompt, the others wait a step and share its blocks."""
    prompt = "sampling four times from one prompt that is long enough to be shared by all four"
    n = len(_ids(engine, prompt))
    cached = _cacheable(n, n)
    assert cached >= 16
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in range(4)]
    before = engine.stats()
    outs = engine.generate_batch([prompt] * 4, params)
    computed = engine.stats()["prompt_tokens"] - before["prompt_tokens"]
    assert computed == n + 3 * (n - cached)  # the others compute only what follows the shared blocks
    assert sorted(o.cached_tokens for o in outs) == [0, cached, cached, cached]
    fresh = [engine.generate_batch([prompt], [dataclasses.replace(p, prompt_logprobs=0)])[0] for p in params]
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]


def test_the_rests_of_several_cached_prompts_are_computed_in_one_step(engine, hf_model):
    """Three requests admitted together, each starting with a cached system prompt: their
    short rests go through one step (a group each), not one step each."""
    engine.generate_batch([SYSTEM + "warm the cache"], GREEDY)
    questions = [SYSTEM + "first question?", SYSTEM + "a second one", SYSTEM + "and a third, longer question"]
    scheduler = engine.scheduler
    admit = scheduler.admit

    def admit_together(*args, **kw):  # hold admissions until all three have arrived
        if 0 < len(scheduler.waiting) < len(questions):
            return Admission()
        return admit(*args, **kw)

    scheduler.admit = admit_together
    before = engine.stats()
    try:
        outs = engine.generate_batch(questions, GREEDY)
    finally:
        scheduler.admit = admit
    assert engine.stats()["extend_steps"] == before["extend_steps"] + 1
    for prompt, out in zip(questions, outs):
        assert out.cached_tokens == _cacheable(len(_ids(engine, SYSTEM)), len(_ids(engine, prompt))) > 0
        assert out.token_ids == _hf_greedy(hf_model, _ids(engine, prompt), GREEDY.max_tokens)
    assert engine.compiles_after_warmup == 0

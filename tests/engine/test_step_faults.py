"""A failure in the engine fails the requests that caused it, and the engine serves on.

Faults are injected where real ones arise: a step (its inputs or the device call) that
raises for a batch holding one bad request, with or without having consumed the KV cache,
and host work on one request's output (here its detokenizer) that raises. The other
requests of the batch give exactly the tokens they give on a healthy engine.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lora_runtime.engine import spmd
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import ISOLATION_STEPS, Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.engine.scheduler import Admission
from lora_runtime.errors import HostLostError
from tests.helpers.checkpoints import save_tiny_llama

POISON_SEED = 777  # the request whose steps fail
STEPS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # No prefix cache: every prompt goes through the packed prefill, run after run.
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=0, enable_prefix_caching=False)
    eng = Engine.from_pretrained(str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))), cfg).start()
    yield eng
    eng.shutdown()


def _prompts(engine) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, engine.model_config.vocab_size, size=12 + 3 * i).tolist() for i in range(4)]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, seed=seed)


def _healthy(engine) -> list[list[int]]:
    prompts = _prompts(engine)
    return [o.token_ids for o in engine.generate_batch(prompts, [_params(i) for i in range(4)])]


def _poisoned(engine, method: str, *, lose_cache: bool, after_steps: int):
    """Makes runner.<method> raise for any batch holding the poison request's row, once it
    has run `after_steps` such steps (so the failure can come mid-stream)."""
    runner = engine.runner
    real = getattr(runner, method)
    seen = [0]

    def step(inputs, pool, host_work=None):
        seeds = np.asarray(inputs.sampling.seed)
        if (seeds[:, 1] == POISON_SEED).any() and (seeds[:, 0] == 0).all():
            seen[0] += 1
            if seen[0] > after_steps:
                if lose_cache:
                    for a in runner.kv_cache.arrays:
                        a.delete()
                raise RuntimeError("poisoned step")
        return real(inputs, pool, host_work)

    return real, step


def _admitted_together(engine, count: int):
    """The scheduler's admit, holding the first admission until `count` requests wait (the
    requests of one generate_batch then share their prefill, as on a busy engine); returns the
    real one. Later admissions (a failed step's requests, retried) are not held."""
    scheduler = engine.scheduler
    admit = scheduler.admit
    held = [True]

    def together(*args, **kw):
        if held[0] and 0 < len(scheduler.waiting) < count:
            return Admission()
        held[0] = held[0] and not scheduler.waiting
        return admit(*args, **kw)

    scheduler.admit = together
    return admit


@pytest.mark.parametrize(("method", "after_steps"), [("prefill", 0), ("dispatch_decode", 2)])
@pytest.mark.parametrize("lose_cache", [False, True], ids=["cache-kept", "cache-lost"])
def test_a_step_failing_for_one_request_fails_that_request_alone(engine, method, after_steps, lose_cache):
    healthy = _healthy(engine)
    prompts = _prompts(engine)
    before = engine.stats()
    real, step = _poisoned(engine, method, lose_cache=lose_cache, after_steps=after_steps)
    setattr(engine.runner, method, step)
    # All four in one batch from their prefill on, so the first failing step holds the others.
    admit = _admitted_together(engine, len(prompts))
    try:
        params = [_params(i) for i in range(3)] + [_params(POISON_SEED)]
        outs = engine.generate_batch(prompts, params, return_errors=True)
    finally:
        setattr(engine.runner, method, real)
        engine.scheduler.admit = admit
    assert [o.token_ids for o in outs[:3]] == healthy[:3]
    assert all(o.error is None and o.finish_reason == "length" for o in outs[:3])
    assert outs[3].error is not None and "poisoned step" in str(outs[3].error)
    after = engine.stats()
    assert after["failed"] - before["failed"] == 1
    assert after["failed_steps"] - before["failed_steps"] == 2  # the batch's step, then the poison's alone
    assert after["isolated_steps"] > before["isolated_steps"]
    # The engine serves on: every row and block is back, and the same requests give the same tokens.
    assert len(engine.scheduler.free_rows) == engine.config.max_batch
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable
    assert _healthy(engine) == healthy


def test_a_step_failing_for_everyone_fails_each_request_and_the_engine_serves_on(engine):
    """A fault no request caused (every step raises): each is tried alone, then failed."""
    healthy = _healthy(engine)
    real = engine.runner.dispatch_decode

    def broken(inputs, pool, host_work=None):
        raise RuntimeError("device fault")

    engine.runner.dispatch_decode = broken
    try:
        outs = engine.generate_batch(_prompts(engine), [_params(i) for i in range(4)], return_errors=True)
    finally:
        engine.runner.dispatch_decode = real
    assert all("device fault" in str(o.error) for o in outs)
    assert _healthy(engine) == healthy


@pytest.mark.parametrize(("noticed_after_s", "consumed"), [(0.0, False), (0.3, False), (0.0, True)],
                         ids=["noticed-first", "noticed-later", "cache-consumed"])
def test_a_step_failing_because_a_host_died_fails_its_requests_as_the_host_loss(engine, noticed_after_s, consumed):
    """On a multi-host replica, a step whose collective's peer died raises the runtime's own
    error (Gloo's "Connection reset by peer" on CPU), possibly before the watcher of that
    host's connection has seen it close. Its requests fail with HostLostError (a 503 to
    retry), all at once: no request caused it, so none is run alone as a suspect. No device op
    is tried after it, not even a reset of a cache the step consumed (the lost link refuses
    every op, and the engine's loop would end on it)."""
    healthy = _healthy(engine)
    prompts = _prompts(engine)
    mirror = spmd.Mirror({})  # the leader's side of the op link, with no follower to send to
    real = engine.runner.dispatch_decode
    why = "host 1 closed its connection (EOFError)"

    def dying(inputs, pool, host_work=None):
        if noticed_after_s:
            threading.Timer(noticed_after_s, mirror.lose, (why,)).start()
        else:
            mirror.lose(why)
        if consumed:
            for a in engine.runner.kv_cache.arrays:
                a.delete()
        raise RuntimeError("INTERNAL: Error dispatching computation: Gloo all-reduce failed: Connection reset by peer")

    before = engine.stats()
    engine.runner.mirror, engine.runner.dispatch_decode = mirror, dying
    admit = _admitted_together(engine, len(prompts))
    try:
        outs = engine.generate_batch(prompts, [_params(i) for i in range(4)], return_errors=True)
    finally:
        engine.runner.mirror, engine.runner.dispatch_decode = None, real
        engine.scheduler.admit = admit
    assert engine.runner.reset_if_lost() == consumed  # what the next healthy run needs
    assert all(isinstance(o.error, HostLostError) and o.error.status_code == 503 for o in outs), outs
    assert all(why in str(o.error) and "Gloo" in str(o.error.__cause__) for o in outs)
    after = engine.stats()
    assert after["failed"] - before["failed"] == 4
    assert after["failed_steps"] - before["failed_steps"] == 1
    assert after["isolated_steps"] == before["isolated_steps"]
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable
    assert _healthy(engine) == healthy


def test_a_request_whose_output_handling_raises_fails_alone(engine, monkeypatch):
    """Host work on one request's tokens (its detokenizer here) raising fails that request;
    the batch's others are not held back by a step of their own."""
    healthy = _healthy(engine)
    prompts = _prompts(engine)
    poison = next(t for t in range(3, engine.model_config.vocab_size)
                  if all(t not in p[-8:] + h for p, h in zip(prompts, healthy)))
    prompts[2] = prompts[2][:-1] + [poison]  # in the poisoned request's detokenizer window
    real = engine.tokenizer.decode

    def decode(ids, **kw):
        if poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a token the tokenizer cannot decode")
        return real(ids, **kw)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    before = engine.stats()
    outs = engine.generate_batch(prompts, [_params(i) for i in range(4)], return_errors=True)
    monkeypatch.undo()
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [h for i, h in enumerate(healthy) if i != 2]
    assert isinstance(outs[2].error, Exception) and "cannot decode" in str(outs[2].error)
    after = engine.stats()
    assert after["failed"] - before["failed"] == 1 and after["failed_steps"] == before["failed_steps"]
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable


def test_a_suspect_that_passes_alone_rejoins_the_batch(engine):
    """A step that fails once (a fault of the moment): nobody fails; each suspect passes
    its steps alone and the tokens are those of a healthy run."""
    healthy = _healthy(engine)
    real = engine.runner.dispatch_decode
    calls = [0]

    def flaky(inputs, pool, host_work=None):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("transient")
        return real(inputs, pool, host_work)

    before = engine.stats()
    engine.runner.dispatch_decode = flaky
    try:
        outs = engine.generate_batch(_prompts(engine), [_params(i) for i in range(4)], return_errors=True)
    finally:
        engine.runner.dispatch_decode = real
    assert [o.token_ids for o in outs] == healthy and all(o.error is None for o in outs)
    after = engine.stats()
    assert after["failed"] == before["failed"] and after["failed_steps"] - before["failed_steps"] == 1
    assert after["isolated_steps"] - before["isolated_steps"] == 4 * ISOLATION_STEPS


def test_an_admission_failing_for_one_request_fails_that_request_alone(engine, monkeypatch):
    """Bookkeeping that raises while requests are admitted (here the prefix lookup, for one
    request's prompt): the waiting requests are admitted one by one and only that one fails."""
    healthy = _healthy(engine)
    prompts = _prompts(engine)
    scheduler = engine.scheduler
    lookup = scheduler._lookup

    def poisoned(seq, key):
        if seq.params.seed == POISON_SEED:
            raise KeyError("a block hash that is not there")
        return lookup(seq, key)

    monkeypatch.setattr(scheduler, "_lookup", poisoned)
    before = engine.stats()
    params = [_params(i) for i in range(3)] + [_params(POISON_SEED)]
    outs = engine.generate_batch(prompts, params, return_errors=True)
    monkeypatch.undo()
    assert [o.token_ids for o in outs[:3]] == healthy[:3] and all(o.error is None for o in outs[:3])
    assert "block hash" in str(outs[3].error)
    assert engine.stats()["failed"] - before["failed"] == 1
    assert len(scheduler.waiting) == 0 and engine.scheduler.pool.num_free == engine.scheduler.pool.usable

"""Host work overlaps the device: a decode step is dispatched before the text of the step
before it is made (detokenizing, stop strings, stream items), and a sequence that a stop
string ends there gives up the token the already dispatched step computed for it."""

from __future__ import annotations

import numpy as np
import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.device_inputs import DeviceInputs
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from tests.helpers.checkpoints import save_tiny_llama

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=0)
    eng = Engine.from_pretrained(str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))), cfg).start()
    yield eng
    eng.shutdown()


def _prompts(engine) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, engine.model_config.vocab_size, size=10 + 2 * i).tolist() for i in range(3)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _spied_decode(engine, monkeypatch) -> list[str]:
    """Records "dispatch" (a decode step's forward launched), "get" (a step's tokens read on
    the host) and "text" (detokenizing) in order."""
    events: list[str] = []
    dispatch = engine.runner.dispatch_decode

    def spy(inputs, pool, host_work=None):
        def work():  # runs once the step's forward is dispatched
            events.append("dispatch")
            return host_work() if host_work is not None else None

        pending = dispatch(inputs, pool, work)
        get = pending.get

        def waited():
            events.append("get")
            return get()

        pending.get = waited
        return pending

    decode = engine.tokenizer.decode

    def text(ids, **kw):
        events.append("text")
        return decode(ids, **kw)

    monkeypatch.setattr(engine.runner, "dispatch_decode", spy)
    monkeypatch.setattr(engine.tokenizer, "decode", text)
    return events


def test_each_decode_step_is_dispatched_before_the_one_before_is_read(engine, monkeypatch):
    """async_decode: a decode step goes to the device before the host reads the tokens of the
    step before it (the device reads them there), and the text of those tokens is made while
    it computes; only the last tokens' text is made with no step in flight."""
    events = _spied_decode(engine, monkeypatch)
    outs = engine.generate_batch(_prompts(engine), _greedy())
    monkeypatch.undo()
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    in_flight, behind, text_in_flight, text_idle = 0, 0, 0, 0
    for e in events:
        if e == "dispatch":
            in_flight += 1
        elif e == "get":
            behind += in_flight >= 2  # the next step was already on the device
            in_flight -= 1
        elif in_flight:
            text_in_flight += 1
        else:
            text_idle += 1
    assert in_flight == 0, events
    # NEW_TOKENS - 1 decode steps follow the prefill (more if the requests were admitted in
    # two steps); all but the last were read with the next one dispatched.
    assert behind >= NEW_TOKENS - 2, events
    assert text_in_flight >= NEW_TOKENS - 2 and text_idle > 0, events


def test_without_async_decode_text_is_made_while_the_next_step_runs(engine, monkeypatch):
    """async_decode off: each step's tokens are read before the next step is built, and the
    text of the step before is made between its dispatch and that read."""
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"async_decode": False}))
    events = _spied_decode(engine, monkeypatch)
    outs = engine.generate_batch(_prompts(engine), _greedy())
    monkeypatch.undo()
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    windows, inside, outside, open_ = 0, 0, 0, False
    for e in events:
        if e == "dispatch":
            windows, open_ = windows + 1, True
            seen = False
        elif e == "get":
            assert open_
            open_ = False
            inside += seen
        elif open_:
            seen = True
        else:
            outside += 1
    assert windows >= NEW_TOKENS - 1 and inside == windows, events
    assert outside > 0  # the last tokens' text, made when their sequences finish


def test_a_stop_string_found_a_step_late_drops_the_extra_token(engine):
    """The stop string is found in the text of token k while step k + 1 is running: the
    output ends at token k, with the text cut before the stop string, as without overlap."""
    prompt = _prompts(engine)[0]
    tokens = engine.generate_batch([prompt], _greedy())[0].token_ids
    texts = [engine.tokenizer.decode(tokens[:k]) for k in range(NEW_TOKENS + 1)]
    full = texts[-1]

    def first_with(stop):  # the token whose text completes the stop string's first occurrence
        return next(k for k in range(1, NEW_TOKENS + 1) if stop in texts[k])

    # A two-character stop string first completed by the third token or later.
    stop = next(full[i:i + 2] for i in range(len(full) - 1) if first_with(full[i:i + 2]) >= 3)
    k = first_with(stop)
    out = engine.generate_batch([prompt], _greedy(stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:k] and out.completion_tokens == k
    assert out.text == full[: full.find(stop)]
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.usable


def test_a_decode_step_resends_only_what_moved(engine, monkeypatch):
    """Within a batch that keeps its sequences, a decode step sends its tokens, positions and
    cache slots, the sampler's step and sometimes a block table; the sampling parameters,
    the rows and the rest come from the device copies."""
    dispatch = engine.runner.dispatch_decode
    per_step = []

    def counted(inputs, pool, host_work=None):
        before = (engine.runner.inputs.sent, engine.runner.inputs.reused)
        pending = dispatch(inputs, pool, host_work)
        sent, reused = engine.runner.inputs.sent - before[0], engine.runner.inputs.reused - before[1]
        per_step.append((tuple(inputs.rows.tolist()), sent, reused))
        return pending

    monkeypatch.setattr(engine.runner, "dispatch_decode", counted)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.model_config.vocab_size, size=12).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = engine.generate_batch(prompts, params)
    monkeypatch.undo()
    # The requests may join the batch over its first steps; count the steps whose batch holds
    # the same sequences in the same rows as the step before.
    steady = [(sent, reused) for (rows, sent, reused), (before, *_) in zip(per_step[1:], per_step) if rows == before]
    assert len(steady) >= 6, per_step
    assert all(sent <= 5 for sent, _ in steady), per_step
    assert all(reused >= 14 for _, reused in steady), per_step  # of 19 small leaves a step
    # The outputs are those of a run whose every input went to the device afresh.
    engine.runner.inputs = DeviceInputs(engine.runner.mesh)
    again = engine.generate_batch(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]


def _join_running(engine, long_prompt, prompt, long_params, params) -> tuple:
    """Submits a long request, then, once it streams, a second one: (the long output, the
    second's output)."""
    import threading

    streaming, finished = threading.Event(), threading.Semaphore(0)
    parts = {"long": [], "new": []}

    def gather(name):
        def emit(out):
            parts[name].extend(out.token_ids)
            if out.token_ids:
                streaming.set()
            if out.finished:
                finished.release()
        return emit

    engine.submit(long_prompt, long_params, gather("long"))
    assert streaming.wait(60)
    engine.submit(prompt, params, gather("new"))
    for _ in range(2):
        assert finished.acquire(timeout=60)
    return parts["long"], parts["new"]


def test_a_prompt_joining_running_streams_goes_to_the_device_behind_their_step(engine, monkeypatch):
    """async_decode: a prompt that arrives while others decode is dispatched behind the decode
    step in flight, that step's tokens are read while it computes, and its own first token is
    read once the next decode step is dispatched behind it; the outputs are those of each
    request alone."""
    long_prompt, prompt = _prompts(engine)[:2]
    long_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = [engine.generate_batch([p], q)[0].token_ids for p, q in ((long_prompt, long_params),
                                                                     (prompt, _greedy()))]
    events: list[str] = []
    runner = engine.runner
    dispatch_decode, dispatch_prefill = runner.dispatch_decode, runner.dispatch_prefill

    def traced(kind, dispatch):
        def spy(inputs, pool, host_work=None):
            def work():
                events.append(f"{kind} dispatched")
                return host_work() if host_work is not None else None

            pending = dispatch(inputs, pool, work)
            get = pending.get

            def read():
                events.append(f"{kind} read")
                return get()

            pending.get = read
            return pending
        return spy

    monkeypatch.setattr(runner, "dispatch_decode", traced("decode", dispatch_decode))
    monkeypatch.setattr(runner, "dispatch_prefill", traced("prefill", dispatch_prefill))
    long_out, new_out = _join_running(engine, long_prompt, prompt, long_params, _greedy())
    monkeypatch.undo()
    assert [long_out, new_out] == alone
    at = events.index("prefill dispatched")
    # The long request's decode step was in flight (dispatched, not read) when the prompt went
    # to the device; then its tokens were read, the next decode dispatched, then the prompt's.
    assert events[:at].count("decode dispatched") - events[:at].count("decode read") == 1, events
    assert events[at + 1: at + 4] == ["decode read", "decode dispatched", "prefill read"], events


def test_a_sequence_preempted_before_its_prefill_is_read_recomputes(engine, monkeypatch):
    """A sequence preempted for blocks after its prefill was dispatched (the decode step's block
    reservation) gives up that prefill's token and recomputes from its tokens: its output is the
    one it has alone, and the stream beside it is untouched."""
    long_prompt, prompt = _prompts(engine)[:2]
    long_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = [engine.generate_batch([p], q)[0].token_ids for p, q in ((long_prompt, long_params),
                                                                     (prompt, _greedy()))]
    scheduler = engine.scheduler
    reserve = scheduler.reserve_decode_blocks
    preempted = []

    def reserve_under_pressure():
        step = engine._prefill_in_flight
        if step is not None and not preempted:  # as if no block were free: the newest goes
            seq = step.members[0][0]
            scheduler.preempt(seq)
            preempted.append(seq)
        return reserve()

    monkeypatch.setattr(scheduler, "reserve_decode_blocks", reserve_under_pressure)
    before = scheduler.preemptions
    long_out, new_out = _join_running(engine, long_prompt, prompt, long_params, _greedy())
    monkeypatch.undo()
    assert len(preempted) == 1 and scheduler.preemptions == before + 1
    assert [long_out, new_out] == alone
    assert scheduler.pool.num_free == scheduler.pool.usable


def test_a_prompt_step_between_decode_steps_leaves_their_sampling_copies(engine, monkeypatch):
    """The decode steps keep their own device copies of the sampling inputs: the decode step
    after a prompt step, its rows unchanged (the new ones join the step after), sends what a
    steady step sends, not the sampling rows the prompt step's sampler replaced."""
    long_prompt, prompt = _prompts(engine)[:2]
    long_params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    dispatch = engine.runner.dispatch_decode
    per_step = []

    def counted(inputs, pool, host_work=None):
        sent = engine.runner.inputs.sent
        pending = dispatch(inputs, pool, host_work)
        per_step.append((tuple(inputs.rows.tolist()), engine.runner.inputs.sent - sent))
        return pending

    monkeypatch.setattr(engine.runner, "dispatch_decode", counted)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.5, seed=1, ignore_eos=True)
    _join_running(engine, long_prompt, prompt, long_params, params)
    monkeypatch.undo()
    joined = next(i for i, (rows, _) in enumerate(per_step) if rows[1] >= 0)
    rows, sent = per_step[joined - 1]  # the decode step dispatched behind the prompt step
    assert rows == per_step[joined - 2][0] and sent <= 5, per_step

"""The engine end to end on a tiny HF checkpoint: batching, streaming, stops, cancellation."""

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.errors import InvalidRequestError
from tests.helpers.checkpoints import save_tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "the quick brown fox",
    "hello",
    "naïve café — déjà vu, 東京 and 北京, emoji 🙂🚀 and the lazy dog jumps",
    "numbers 0123",
    "a",
    "this is a tiny tokenizer for tests and it is fine",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# The module's engine shape. A test that needs an engine of its own (one it drains, or with
# another stream interval) builds it alike, so it reads the compiled steps from the session's
# compilation cache instead of compiling them again.
ENGINE_SHAPE = dict(max_batch=4, max_seq_len=96, max_loras_per_batch=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine.from_pretrained(str(checkpoint), EngineConfig(**ENGINE_SHAPE)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="float32").eval()


def _hf_greedy(hf_model, prompt_ids, n):
    import torch

    out = hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


def test_greedy_matches_transformers(engine, hf_model):
    for prompt in PROMPTS[:3]:
        out = engine.generate_batch([prompt], GREEDY)[0]
        ids = engine.tokenizer.encode(prompt)
        assert out.token_ids == _hf_greedy(hf_model, ids, GREEDY.max_tokens)
        assert out.finish_reason == "length"
        assert out.completion_tokens == GREEDY.max_tokens
        assert out.prompt_tokens == len(ids)


def test_concurrent_requests_equal_their_single_runs(engine):
    alone = [engine.generate_batch([p], GREEDY)[0] for p in PROMPTS]
    # More requests than rows (4), with different lengths: they join as rows free up.
    together = engine.generate_batch(PROMPTS * 2, GREEDY)
    for i, out in enumerate(together):
        assert out.token_ids == alone[i % len(PROMPTS)].token_ids
        assert out.text == alone[i % len(PROMPTS)].text


def _every_option() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.7, seed=n) for n in (1, 3, 5, 7, 9, 11)] + [
        SamplingParams(max_tokens=4, top_p=0.5, top_k=3, seed=1),
        SamplingParams(max_tokens=4, min_p=0.2, seed=2),
        SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                       logit_bias=((5, 3.0),)),
        SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(7,)),
        SamplingParams(max_tokens=4, temperature=0.9, seed=3, allowed_token_ids=(5, 9, 40)),
        SamplingParams(max_tokens=4, temperature=0.0, bad_words=("the", "fox jumps")),
    ]


def _run_every_option(engine) -> list[list[list[int]]]:
    """Every option in a batch, twice (the second time, prompts start from cached blocks);
    the token ids of each time."""
    options = _every_option()
    prompts = (PROMPTS * 3)[:len(options)]  # one prompt per option: each option runs
    extends = engine.stats()["extend_steps"]
    outs = [[o.token_ids for o in engine.generate_batch(prompts, options)] for _ in range(2)]
    assert engine.stats()["extend_steps"] > extends
    return outs


def test_nothing_compiles_after_warmup(engine):
    """Counted from JAX's own compile events on the engine's thread: every sampling option,
    prompt log-probabilities and prefix-cache hits (extend steps) run on warmed programs."""
    _run_every_option(engine)
    assert engine.compiles_after_warmup == 0
    buckets = engine.config.prefill_buckets()
    # at least: prefill, prompt log-probabilities and extend per bucket, several-row extend per
    # bucket up to 64, decode
    assert engine.warm_compiles >= 3 * len(buckets) + len([b for b in buckets if b <= 64]) + 1


def test_a_restart_over_proven_programs_skips_the_warm_up_runs_and_compiles_nothing(engine, checkpoint):
    """The module's engine ran the largest steps once (or an engine alike did before it), with
    every program from the program store: an engine started alike over the same compilation
    cache then skips those runs, and still compiles nothing after warm-up, on any option,
    with the same outputs."""
    assert engine.runner.programs.traced == 0 and len(engine.runner.programs) > 0
    restarted = Engine.from_pretrained(str(checkpoint), EngineConfig(**ENGINE_SHAPE)).start()
    try:
        assert restarted.warm_ran is False
        # Seeded and greedy rows give the same tokens (unseeded ones draw from each engine's
        # own generator).
        fixed = [i for i, o in enumerate(_every_option()) if o.seed is not None or o.temperature == 0]
        assert len(fixed) >= 9
        for ours, theirs in zip(_run_every_option(restarted), _run_every_option(engine)):
            assert [ours[i] for i in fixed] == [theirs[i] for i in fixed]
        assert restarted.compiles_after_warmup == 0
    finally:
        restarted.shutdown()
    # Another shape (one no other test builds) is another set of programs: its first start runs them.
    other = Engine.from_pretrained(str(checkpoint), EngineConfig(**dict(ENGINE_SHAPE, max_batch=3, max_seq_len=80)))
    other.start()
    try:
        assert other.warm_ran is True
    finally:
        other.shutdown()


def test_only_the_allowed_token_ids_are_generated(engine):
    """vLLM's allowed_token_ids: sampled or greedy, every token is one of them (EOS is not
    listed, so each runs to max_tokens); with a grammar, a token both allow; the others in
    the batch are unconstrained."""
    allowed = (5, 9, 40, 41)
    params = [SamplingParams(max_tokens=6, temperature=1.5, seed=s, allowed_token_ids=allowed) for s in range(3)]
    params += [SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=allowed), GREEDY]
    outs = engine.generate_batch(PROMPTS[:5], params)
    for out in outs[:4]:
        assert len(out.token_ids) == 6 and set(out.token_ids) <= set(allowed), out.token_ids
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # sampled among them, not one forced path
    assert outs[4].token_ids == engine.generate_batch([PROMPTS[4]], GREEDY)[0].token_ids
    assert not set(outs[4].token_ids) <= set(allowed)
    # A grammar and allowed ids: the digits the grammar allows, narrowed to those listed.
    tok = engine.tokenizer
    digits = {tok.token_to_id(d) for d in "0123456789"} - {None}
    keep = tuple(sorted(digits))[:2]
    guided = SamplingParams(max_tokens=5, temperature=1.0, seed=4, allowed_token_ids=keep,
                            guided={"kind": "regex", "value": "[0-9]{5}", "param": "guided_regex"})
    out = engine.generate_batch([PROMPTS[0]], guided)[0]
    assert out.token_ids and set(out.token_ids) <= set(keep), out.token_ids
    for bad, match in (((), "allowed_token_ids is empty"), ((3, 10**6), r"allowed_token_ids \[1000000\] outside")):
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=2, allowed_token_ids=bad))


def test_bad_words_are_never_generated(engine):
    """vLLM's bad_words: a word's tokens never come out in its order. Greedy output with its
    first token banned differs there; a two-token word from the output is never completed
    again; other rows are unchanged."""
    from lora_runtime.engine.bad_words import bad_words_ids

    tok = engine.tokenizer
    plain = engine.generate_batch([PROMPTS[0]], GREEDY)[0]
    first = tok.decode([plain.token_ids[0]])
    banned = bad_words_ids(tok, [first])
    params = dataclasses.replace(GREEDY, bad_words=(first,))
    outs = engine.generate_batch([PROMPTS[0], PROMPTS[1]], [params, GREEDY])
    assert outs[0].token_ids[0] != plain.token_ids[0]
    assert not {ids[0] for ids in banned if len(ids) == 1} & set(outs[0].token_ids)
    assert outs[1].token_ids == engine.generate_batch([PROMPTS[1]], GREEDY)[0].token_ids
    # A two-token word from an output (one whose text encodes back to those two tokens).
    hello = engine.generate_batch([PROMPTS[1]], GREEDY)[0].token_ids
    pairs = [tuple(hello[i:i + 2]) for i in range(len(hello) - 1)]
    pair = next(p for p in pairs if p in bad_words_ids(tok, [tok.decode(list(p))]))
    got = engine.generate_batch([PROMPTS[1]], dataclasses.replace(GREEDY, bad_words=(tok.decode(list(pair)),)))[0]
    runs = {tuple(got.token_ids[i:i + 2]) for i in range(len(got.token_ids) - 1)}
    assert pair not in runs and got.token_ids != hello, (pair, got.token_ids)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        engine.generate_batch([PROMPTS[0]], dataclasses.replace(GREEDY, bad_words=("  ",)))


def test_streamed_deltas_add_up_to_the_whole_text(engine):
    async def run():
        parts = []
        async for out in engine.generate(PROMPTS[2], GREEDY):
            parts.append(out)
        return parts

    parts = asyncio.run(run())
    assert len(parts) > 1 and parts[-1].finished
    full = engine.generate_batch([PROMPTS[2]], GREEDY)[0]
    assert "".join(p.text for p in parts) == full.text
    assert [t for p in parts for t in p.token_ids] == full.token_ids
    # Random weights may emit bytes that never form a character; the stream then shows
    # exactly what a full decode shows, never a split character of its own.
    assert full.text == engine.tokenizer.decode(full.token_ids)


def test_a_slow_consumer_gets_merged_items(engine):
    """Outputs that queue up while the consumer is busy come as one item with all of them."""
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)

    async def run():
        parts = []
        async for out in engine.generate(PROMPTS[0], long):
            parts.append(out)
            await asyncio.sleep(0.2)  # a consumer slower than the steps
        return parts

    parts = asyncio.run(run())
    full = engine.generate_batch([PROMPTS[0]], long)[0]
    assert parts[-1].finished and len(parts) < long.max_tokens
    assert [t for p in parts for t in p.token_ids] == full.token_ids
    assert "".join(p.text for p in parts) == full.text
    assert [lp.logprob for p in parts for lp in p.logprobs] == pytest.approx([lp.logprob for lp in full.logprobs])
    assert parts[-1].completion_tokens == long.max_tokens


def test_an_unstreamed_request_comes_in_two_items(engine):
    """stream=False: the first item, then the rest of the request in one item, the same
    tokens, text and log-probabilities as a streamed run."""
    long = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1)

    async def run(prompt):
        return [out async for out in engine.generate(prompt, long, stream=False)]

    parts = asyncio.run(run(PROMPTS[0]))
    full = engine.generate_batch([PROMPTS[0]], long)[0]
    assert len(parts) <= 2 and parts[-1].finished  # streamed, it would be about 14
    assert [t for p in parts for t in p.token_ids] == full.token_ids
    assert "".join(p.text for p in parts) == full.text
    assert [lp.logprob for p in parts for lp in p.logprobs] == pytest.approx([lp.logprob for lp in full.logprobs])


def test_stream_interval_ms_spaces_the_items_and_loses_no_token(checkpoint, engine):
    """stream_interval_ms: after the first item, items come at least that far apart, each
    with every token since the one before; the item that ends the request goes at once."""
    long = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, logprobs=1)
    cfg = EngineConfig(**ENGINE_SHAPE, stream_interval_ms=20)
    spaced = Engine.from_pretrained(str(checkpoint), cfg).start()

    async def run(prompt):
        loop = asyncio.get_running_loop()
        return [(loop.time(), out) async for out in spaced.generate(prompt, long)]

    try:
        timed = asyncio.run(run(PROMPTS[0]))
    finally:
        spaced.shutdown()
    parts = [out for _, out in timed]
    gaps = [b - a for (a, _), (b, _) in zip(timed, timed[1:-1])]
    assert parts[-1].finished and all(not p.finished for p in parts[:-1])
    assert len(parts) >= 3, [len(p.token_ids) for p in parts]  # 80 decode steps take longer than 40 ms
    assert all(g >= 0.0199 for g in gaps), gaps
    assert len(parts) <= 2 + (timed[-1][0] - timed[0][0]) / 0.02
    full = engine.generate_batch([PROMPTS[0]], long)[0]
    assert [t for p in parts for t in p.token_ids] == full.token_ids
    assert "".join(p.text for p in parts) == full.text
    assert [lp.logprob for p in parts for lp in p.logprobs] == pytest.approx([lp.logprob for lp in full.logprobs])


def test_stream_interval_holds_items_until_that_many_tokens(checkpoint, engine):
    """After the first token, items wait for stream_interval new tokens; the one that finishes
    the request goes at once. Together they are the whole output."""
    long = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1)
    cfg = EngineConfig(**ENGINE_SHAPE, stream_interval=5)
    spaced = Engine.from_pretrained(str(checkpoint), cfg).start()

    async def run(prompt):
        return [out async for out in spaced.generate(prompt, long)]

    try:
        # The first item is not held for 5 tokens. It holds 1 unless this consumer fell behind on
        # busy cores, and then the tokens that came meanwhile are merged into it; an engine that
        # held it would give 5 or more every time, so a few tries tell the two apart.
        for _ in range(4):
            parts = asyncio.run(run(PROMPTS[0]))
            if len(parts[0].token_ids) < 5:
                break
        stop_text = spaced.generate_batch([PROMPTS[0]], long)[0].text[3:5]
        stopped = asyncio.run(_run_stopped(spaced, PROMPTS[0], long, stop_text))
    finally:
        spaced.shutdown()
    counts = [len(p.token_ids) for p in parts]
    assert counts[0] < 5 and parts[-1].finished
    assert all(c >= 5 for c in counts[1:-1]) and sum(counts) == long.max_tokens
    assert len(parts) <= 1 + -(-(long.max_tokens - 1) // 5)
    full = engine.generate_batch([PROMPTS[0]], long)[0]
    assert [t for p in parts for t in p.token_ids] == full.token_ids
    assert "".join(p.text for p in parts) == full.text
    assert [lp.logprob for p in parts for lp in p.logprobs] == pytest.approx([lp.logprob for lp in full.logprobs])
    # A stop string finishes the request inside an interval: its item goes then, cut at the stop.
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"
    assert "".join(p.text for p in stopped) == full.text[:full.text.index(stop_text)]


async def _run_stopped(engine, prompt, params, stop):
    stopping = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, stop=(stop,))
    return [out async for out in engine.generate(prompt, stopping)]


def test_stop_string_cuts_the_text(engine):
    full = engine.generate_batch([PROMPTS[0]], GREEDY)[0]
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    out = engine.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text


def test_stop_token_id_and_max_tokens(engine):
    full = engine.generate_batch([PROMPTS[1]], GREEDY)[0]
    target = full.token_ids[3]
    first = full.token_ids.index(target)
    out = engine.generate_batch([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(target,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]
    short = engine.generate_batch([PROMPTS[1]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert short.token_ids == full.token_ids[:2] and short.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate_batch([PROMPTS[3]], p)[0]
    mixed = engine.generate_batch([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [GREEDY, p, GREEDY])[1]
    assert alone.token_ids == mixed.token_ids
    other = engine.generate_batch([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=1.0, seed=4321, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_prompt_too_long_is_refused_before_any_work(engine):
    before = dict(engine.counters)
    with pytest.raises(InvalidRequestError, match="max_seq_len=96"):
        engine.generate_batch(["x" * 500], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens=90"):
        engine.generate_batch([PROMPTS[2]], SamplingParams(max_tokens=90))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate_batch([[]], GREEDY)
    assert engine.counters == before


def test_cancelled_request_frees_its_row(engine):
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def run():
        agen = engine.generate(PROMPTS[1], long)
        first = await agen.__anext__()
        await agen.aclose()  # the client went away
        return first

    first = asyncio.run(run())
    assert not first.finished
    # The abort reaches the loop thread; then every row is free again.
    for _ in range(200):
        if not engine.scheduler.running and len(engine.scheduler.free_rows) == engine.config.max_batch:
            break
        threading.Event().wait(0.01)
    assert not engine.scheduler.running
    assert sorted(engine.scheduler.free_rows) == list(range(engine.config.max_batch))
    # And the engine still serves.
    assert engine.generate_batch([PROMPTS[0]], GREEDY)[0].completion_tokens == GREEDY.max_tokens


def test_abort_by_id_while_waiting_and_running(engine):
    outs = {}
    done = threading.Event()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def collect(out):
        if out.finished:
            outs[out.request_id] = out
            if len(outs) == 6:
                done.set()

    ids = [engine.submit(PROMPTS[0], long, collect) for _ in range(6)]  # 2 wait for rows
    for rid in ids:
        engine.abort(rid)
    assert done.wait(30)
    assert all(outs[r].finish_reason in ("abort", "length") for r in ids)
    assert sum(outs[r].finish_reason == "abort" for r in ids) >= 2


@pytest.mark.usefixtures("engine")  # built first: this engine reads its steps from the cache
def test_warmup_runs_only_the_largest_shape_of_each_kind_of_step(checkpoint):
    """Every shape is compiled ahead of time; running the smaller ones too would cost time
    that grows with depth and check nothing more (test_nothing_compiles_after_warmup: they
    then run without a compile). This engine's programs are taken as never proven (an
    engine alike may have started over the session's cache before)."""
    eng = Engine.from_pretrained(str(checkpoint), EngineConfig(**ENGINE_SHAPE))
    eng.runner.programs.proven = lambda check: False
    steps = eng._warm_steps()
    largest: dict[tuple, int] = {}
    for kind, inputs, _ in steps:
        family = (kind, inputs.sampling.temperature.shape[0])  # decode and prefill, extend of 1 or of several
        largest[family] = max(largest.get(family, 0), inputs.tokens.shape[0])
    ran = []

    def counted(kind: str):
        step = getattr(eng.runner, kind)

        def run(inputs, pool, *rest):
            ran.append((kind, inputs.sampling.temperature.shape[0], inputs.tokens.shape[0]))
            return step(inputs, pool, *rest)
        return run

    for kind in ("prefill", "extend", "decode"):
        setattr(eng.runner, kind, counted(kind))
    eng.start()
    try:
        assert sorted(ran) == sorted((*family, n) for family, n in largest.items())
        assert len(ran) == 4 < len(steps)
    finally:
        eng.shutdown()


@pytest.mark.usefixtures("engine")  # built first: this engine reads its steps from the cache
def test_drain_finishes_running_requests_and_refuses_new_ones(checkpoint):
    from lora_runtime.errors import CapacityError

    eng = Engine.from_pretrained(str(checkpoint), EngineConfig(**ENGINE_SHAPE)).start()
    try:
        long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = []
        eng.submit(PROMPTS[0], long, outs.append)

        async def drain():
            return await eng.drain(timeout_s=60)

        assert asyncio.run(drain()) is True
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outs) == 30
        with pytest.raises(CapacityError, match="shutting down"):
            eng.submit(PROMPTS[1], GREEDY, outs.append)
        assert eng.is_alive()
    finally:
        eng.shutdown()
    assert not eng.is_alive()


def test_logprobs_match_transformers(engine, hf_model):
    """Each generated token's log-probability and the 5 likeliest tokens at that step, against
    log_softmax of transformers' logits; sampling at a temperature does not change them."""
    import torch

    prompt = PROMPTS[0]
    ids = engine.tokenizer.encode(prompt)
    for temperature in (0.0, 0.7):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=5)
        [out] = engine.generate_batch([prompt], params, [None])
        assert len(out.logprobs) == len(out.token_ids) == 6
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0]
        ref = torch.log_softmax(logits.double(), dim=-1).numpy()[len(ids) - 1 : -1]
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(lp.logprob - ref[step, token]) < 1e-4
            want = np.argsort(-ref[step])[:5]
            assert [t for t, _ in lp.top] == want.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], ref[step, want], atol=1e-4)
            if temperature == 0.0:
                assert lp.top[0][0] == token


def test_no_logprobs_unless_asked_and_the_limit(engine):
    [out] = engine.generate_batch([PROMPTS[1]], GREEDY, [None])
    assert out.logprobs is None
    with pytest.raises(InvalidRequestError, match=r"logprobs=21 must be in \[0, 20\]"):
        engine.submit(PROMPTS[1], SamplingParams(logprobs=21), lambda o: None)
    [out] = engine.generate_batch([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0, logprobs=0), [None])
    assert [lp.top for lp in out.logprobs] == [(), (), ()][: len(out.token_ids)]


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (2.0, 0.0), (0.5, -0.7)])
def test_presence_and_frequency_penalties_match_a_transformers_loop(engine, hf_model, presence, frequency):
    """Greedy tokens under OpenAI's penalties: argmax of transformers' logits minus frequency x
    count minus presence x [count > 0], counts over the tokens generated so far."""
    import torch

    ids = engine.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    # In a batch with unpenalized rows, which must stay as they are.
    outs = engine.generate_batch([PROMPTS[3], PROMPTS[0]], [params, GREEDY], [None, None])
    want, counts = [], np.zeros(hf_model.config.vocab_size)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf_model(torch.tensor([ids + want])).logits[0, -1].double().numpy()
            token = int(np.argmax(logits - frequency * counts - presence * (counts > 0)))
            want.append(token)
            counts[token] += 1
    assert outs[0].token_ids == want
    [plain] = engine.generate_batch([PROMPTS[0]], GREEDY, [None])
    assert outs[1].token_ids == plain.token_ids


def test_a_reused_row_starts_its_counts_afresh(engine):
    """A penalized sequence gives the same tokens alone as after other sequences used its row."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    [first] = engine.generate_batch([PROMPTS[5]], params, [None])
    engine.generate_batch(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), None)
    [again] = engine.generate_batch([PROMPTS[5]], params, [None])
    assert again.token_ids == first.token_ids


def test_penalty_out_of_range_is_refused(engine):
    with pytest.raises(InvalidRequestError, match=r"presence_penalty=3.0 must be in \[-2, 2\]"):
        engine.submit(PROMPTS[0], SamplingParams(presence_penalty=3.0), lambda o: None)


def test_prompt_logprobs_match_transformers_and_max_tokens_zero(engine, hf_model):
    """Each prompt token's log-probability given the tokens before it (None for the first),
    and the 3 likeliest there; with max_tokens=0 nothing is generated. Packed with another
    prompt in one prefill, so each sequence's positions must be its own."""
    import torch

    prompts = [PROMPTS[2], PROMPTS[0]]
    params = [SamplingParams(max_tokens=0, prompt_logprobs=3), SamplingParams(max_tokens=2, temperature=0.0)]
    outs = engine.generate_batch(prompts, params, [None, None])
    assert outs[0].token_ids == [] and outs[0].text == "" and outs[0].finish_reason == "length"
    assert outs[0].completion_tokens == 0 and outs[1].prompt_logprobs is None and len(outs[1].token_ids) == 2
    ids = engine.tokenizer.encode(prompts[0])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    got = outs[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        assert abs(got[t].logprob - ref[t - 1, ids[t]]) < 1e-4
        want = np.argsort(-ref[t - 1])[:3]
        assert [i for i, _ in got[t].top] == want.tolist()


def _hf_greedy_loop(hf_model, ids, steps, adjust):
    """Greedy tokens from transformers' logits, adjusted per step by adjust(logits, generated, step)."""
    import torch

    out = []
    with torch.no_grad():
        for step in range(steps):
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            out.append(int(np.argmax(adjust(logits.copy(), out, step))))
    return out


def test_repetition_penalty_matches_a_transformers_loop(engine, hf_model):
    """HF's repetition penalty over the prompt's and the generated tokens."""
    penalty = 1.8
    ids = engine.tokenizer.encode(PROMPTS[0])

    def adjust(logits, out, step):
        for t in set(ids) | set(out):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        return logits

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
    [got] = engine.generate_batch([PROMPTS[0]], params, [None])
    assert got.token_ids == _hf_greedy_loop(hf_model, ids, 8, adjust)
    [plain] = engine.generate_batch([PROMPTS[0]], GREEDY, [None])
    assert plain.token_ids[:8] != got.token_ids  # the penalty changes something here


def test_min_tokens_holds_back_stop_tokens(engine, hf_model):
    ids = engine.tokenizer.encode(PROMPTS[1])
    [plain] = engine.generate_batch([PROMPTS[1]], GREEDY, [None])
    stop = plain.token_ids[0]
    [early] = engine.generate_batch([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  stop_token_ids=(stop,)), [None])
    assert early.token_ids == [stop]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=3)
    [held] = engine.generate_batch([PROMPTS[1]], params, [None])

    def adjust(logits, out, step):
        if step < 3:
            logits[stop] = -np.inf
        return logits

    want = _hf_greedy_loop(hf_model, ids, 8, adjust)
    want = want[: want.index(stop, 3) + 1] if stop in want[3:] else want
    assert held.token_ids == want and len(held.token_ids) >= 3 and stop not in held.token_ids[:3]


def test_stop_string_kept_on_request(engine):
    text = engine.generate_batch([PROMPTS[0]], GREEDY)[0].text
    stop = text[2:4]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,),
                            include_stop_str_in_output=True)
    out = engine.generate_batch([PROMPTS[0]], params)[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop) + len(stop)]


def test_tensor_parallel_gives_the_same_tokens_and_log_probabilities(engine, checkpoint):
    """Penalties, min_tokens, seeded top-p sampling and (prompt) log-probabilities with the
    model sharded over 2 devices, against the 1-device engine."""
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5,
                       min_tokens=2, logprobs=2, prompt_logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1]]
    sharded = Engine.from_pretrained(
        str(checkpoint), EngineConfig(**ENGINE_SHAPE, tensor_parallel_size=2)
    ).start()
    try:
        got = sharded.generate_batch(prompts, params, [None, None])
    finally:
        sharded.shutdown()
    want = engine.generate_batch(prompts, params, [None, None])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got[0].logprobs + got[0].prompt_logprobs[1:], want[0].logprobs + want[0].prompt_logprobs[1:]):
        assert abs(g.logprob - w.logprob) < 1e-4 and [t for t, _ in g.top] == [t for t, _ in w.top]

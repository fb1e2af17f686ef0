"""Preemption: with fewer KV blocks than the running requests need, the newest give their
blocks back and recompute later; every stream continues where it stopped, with the tokens
an unpreempted run gives (greedy, seeded sampling, penalties, log-probabilities)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.kv_cache import block_bytes
from tests.engine.test_engine import _hf_greedy
from tests.helpers.checkpoints import save_tiny_llama

PROMPTS = ["the quick brown fox", "hello world, this is", "numbers 0123456789 and", "naïve café — déjà vu"]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.3,
                   repetition_penalty=1.3),
    SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True, logprobs=2),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(checkpoint, **overrides) -> Engine:
    cfg = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=0, **overrides)
    return Engine.from_pretrained(str(checkpoint), cfg).start()


@pytest.fixture(scope="module")
def roomy(checkpoint):
    # Scheduled by priority: with every priority 0, as first come, first served.
    eng = _engine(checkpoint, scheduling_policy="priority")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tight(checkpoint):
    """10 blocks of 16 tokens: four requests of ~8 + 40 tokens need 12 at their longest (as
    many as its batch rows)."""
    config = ModelConfig.from_pretrained(str(checkpoint))
    eng = _engine(checkpoint, kv_cache_bytes=11 * block_bytes(config, 16))  # 10 usable + the null block
    yield eng
    eng.shutdown()


def test_preempted_streams_continue_as_if_never_preempted(roomy, tight, checkpoint):
    from transformers import AutoModelForCausalLM

    assert tight.scheduler.pool.usable == 10
    want = roomy.generate_batch(PROMPTS, PARAMS)
    got = tight.generate_batch(PROMPTS, PARAMS)
    stats = tight.stats()
    assert stats["preemptions"] > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == "length"
        assert g.completion_tokens == 40 and g.prompt_tokens == w.prompt_tokens
    for a, b in zip(want[3].logprobs, got[3].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="float32").eval()
    assert got[0].token_ids == _hf_greedy(hf, tight.tokenizer.encode(PROMPTS[0]), 40)
    # Nothing leaks: every block is free again, the cached ones still findable.
    assert tight.scheduler.pool.num_free == tight.scheduler.pool.usable
    assert not tight.scheduler.running and not tight.scheduler.waiting
    assert tight.compiles_after_warmup == 0


def test_a_preempted_stream_keeps_streaming_its_tokens_in_order(tight):
    """Outputs arrive as deltas; across a preemption no token is repeated or lost."""
    parts: dict[int, list] = {i: [] for i in range(4)}
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(out):
            parts[i].append(out)
            if out.finished:
                done.release()
        return emit

    before = tight.stats()["preemptions"]
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        tight.submit(prompt, params, emitter(i))
    for _ in range(4):
        assert done.acquire(timeout=120)
    assert tight.stats()["preemptions"] > before
    for i in range(4):
        tokens = [t for out in parts[i] for t in out.token_ids]
        assert len(tokens) == 40 and parts[i][-1].completion_tokens == 40


def test_preempted_constrained_streams_keep_their_grammar(roomy, tight):
    """Sequences under grammars, preempted and recomputed, go on where their grammar was: the
    same tokens as without preemption, every one allowed."""
    import json

    from lora_runtime.engine.grammar import GuidedSpec

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40}
    spec = GuidedSpec("json_schema", json.dumps(schema))
    params = [SamplingParams(max_tokens=40, temperature=t, seed=5 + i, guided=spec)
              for i, t in enumerate((0.0, 0.0, 1.0, 1.0))]
    before = tight.stats()["preemptions"]
    want = roomy.generate_batch(PROMPTS, params)
    got = tight.generate_batch(PROMPTS, params)
    assert tight.stats()["preemptions"] > before
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == "length"
        assert g.text.startswith("[") and all(part.strip().isdigit() for part in g.text[1:].split(",")[:-1])


class _Streams:
    """The tokens and finishing order of `n` submitted streams, and waits on their first
    tokens and their ends."""

    def __init__(self, n: int):
        self.tokens: dict[int, list[int]] = {i: [] for i in range(n)}
        self.finished: list[int] = []
        self._started, self._done = threading.Semaphore(0), threading.Semaphore(0)

    def emitter(self, i: int):
        def emit(out):
            if not self.tokens[i] and out.token_ids:
                self._started.release()
            self.tokens[i] += out.token_ids
            if out.finished:
                self.finished.append(i)
                self._done.release()
        return emit

    def wait_started(self, n: int) -> None:
        for _ in range(n):
            assert self._started.acquire(timeout=120)

    def wait_done(self, n: int) -> None:
        for _ in range(n):
            assert self._done.acquire(timeout=120)


def test_an_urgent_request_preempts_the_least_urgent_and_every_stream_keeps_its_tokens(roomy):
    """With every row taken by requests of priority 1, a request of priority 0 takes the
    newest one's row at once and finishes first; the preempted one recomputes and gives the
    tokens it would have given alone."""
    urgent_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long = [dataclasses.replace(p, max_tokens=96) for p in PARAMS]
    want = roomy.generate_batch(PROMPTS + ["urgent:"], long + [urgent_params])
    streams = _Streams(5)
    before = roomy.stats()["preemptions"]
    for i, (prompt, params) in enumerate(zip(PROMPTS, long)):
        roomy.submit(prompt, params, streams.emitter(i), priority=1)
    streams.wait_started(4)  # all four rows decode
    roomy.submit("urgent:", urgent_params, streams.emitter(4), priority=0)
    streams.wait_done(5)
    assert streams.finished[0] == 4 and roomy.stats()["preemptions"] == before + 1
    assert [streams.tokens[i] for i in range(5)] == [w.token_ids for w in want]
    assert roomy.scheduler.pool.num_free == roomy.scheduler.pool.usable


def test_a_priority_needs_scheduling_by_priority(tight):
    from lora_runtime.errors import InvalidRequestError

    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='fcfs'") as caught:
        tight.submit("hi", params, lambda out: None, priority=1)
    assert caught.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="must be an integer"):
        tight.submit("hi", params, lambda out: None, priority=2**31)
    assert not tight.scheduler.waiting and not tight.scheduler.running


def test_an_urgent_request_preempts_the_holders_of_an_adapter_slot_and_every_stream_keeps_its_tokens(checkpoint,
                                                                                                      tmp_path):
    """Two adapter slots, held by three streams of priority 1 (two on one adapter, one on
    another): a request of priority 0 for a third adapter preempts the stream holding the
    slot with fewer holders, finishes first, and every stream gives the tokens it would alone."""
    from tests.integration.adapters import save_peft_adapter

    adapters = {name: save_peft_adapter(checkpoint, tmp_path / name, seed=i, rank=4)
                for i, name in enumerate(("a", "b", "c"))}
    eng = Engine.from_pretrained(str(checkpoint), EngineConfig(
        max_batch=4, max_seq_len=128, max_loras_per_batch=2, max_lora_rank=4, lora_backend="reference",
        max_prefill_tokens=16, scheduling_policy="priority"))
    for name, path in adapters.items():
        eng.lora_manager.register(name, str(path))
    eng.start()
    try:
        long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        urgent = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        jobs = [("the quick brown fox", long, "a"), ("hello world, this is", long, "a"),
                ("numbers 0123456789 and", long, "b"), ("urgent:", urgent, "c")]
        want = [eng.generate_batch([p], params, [a])[0].token_ids for p, params, a in jobs]
        streams = _Streams(4)
        before = eng.stats()["preemptions"]
        for i, (prompt, params, adapter) in enumerate(jobs[:3]):
            eng.submit(prompt, params, streams.emitter(i), adapter=adapter, priority=1)
        streams.wait_started(3)  # both slots held, a row free
        prompt, params, adapter = jobs[3]
        eng.submit(prompt, params, streams.emitter(3), adapter=adapter, priority=0)
        streams.wait_done(4)
        assert streams.finished[0] == 3 and eng.stats()["preemptions"] == before + 1
        assert streams.finished[-1] == 2  # the preempted stream, on adapter b, recomputed
        assert [streams.tokens[i] for i in range(4)] == want
    finally:
        eng.shutdown()

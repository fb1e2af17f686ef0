"""The scheduler's prefix-cache decisions, step by step: which row a request gets, how much of
its prompt is cached, when it waits for a request that is computing the same prompt."""

from __future__ import annotations

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.engine.scheduler import Scheduler
from lora_runtime.engine.sequence import Sequence

PROMPT = list(range(10, 50))  # 40 tokens
CONFIG = EngineConfig(max_batch=3, max_seq_len=128, max_loras_per_batch=0)


def _seq(prompt, rid="r", **params) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=SamplingParams(**params), seed=0,
                    adapter=None, emit=lambda out: None, detokenizer=None, eos_token_ids=frozenset())


def _prefill(scheduler, seqs):
    for s in seqs:
        scheduler.computed(s, len(s.prompt_ids) - s.computed)


def test_a_request_waits_for_one_computing_its_prompt_then_copies_its_row():
    sched = Scheduler(CONFIG, None)
    first, second = _seq(PROMPT, "a"), _seq(PROMPT + [7, 8], "b")
    sched.add(first)
    sched.add(second)
    admitted, _ = sched.admit()
    assert admitted == [first] and list(sched.waiting) == [second]
    _prefill(sched, admitted)
    sched.step += 1
    admitted, _ = sched.admit()
    assert admitted == [] and list(sched.extending) == [second]
    assert second.cached_tokens == second.computed == len(PROMPT)
    assert sched.take_copies() == [(first.row, second.row)] and first.row != second.row


def test_a_starving_request_does_not_wait_for_a_sharer():
    sched = Scheduler(CONFIG.model_copy(update={"max_wait_steps": 1}), None)
    first, second = _seq(PROMPT, "a"), _seq(PROMPT, "b")
    sched.add(first)
    sched.admit()
    sched.add(second)
    sched.step += 5  # second has now waited past max_wait_steps
    admitted, _ = sched.admit()
    assert admitted == [second] and second.cached_tokens == 0


def test_short_shared_starts_and_log_probability_requests_do_not_wait():
    sched = Scheduler(CONFIG, None)
    short = list(range(10, 20))  # 10 tokens < prefix_cache_min_tokens
    seqs = [_seq(short, "a"), _seq(short + [1], "b"), _seq(PROMPT, "c"), _seq(PROMPT, "d", prompt_logprobs=1)]
    sched.add(seqs[0])
    sched.add(seqs[1])
    assert sched.admit()[0] == seqs[:2]
    sched2 = Scheduler(CONFIG, None)
    sched2.add(seqs[2])
    sched2.add(seqs[3])
    assert sched2.admit()[0] == seqs[2:]


def test_a_finished_requests_row_is_taken_as_it_is_and_empty_rows_go_first():
    sched = Scheduler(CONFIG, None)
    first = _seq(PROMPT, "a")
    sched.add(first)
    sched.admit()
    _prefill(sched, [first])
    first.output_ids = [1, 2, 3]
    row = first.row
    sched.finish(first)
    key, held = sched.contents.get(row)
    assert list(held) == PROMPT + [1, 2]  # the last token was never fed back

    fresh = _seq([99] * 20, "b")  # shares nothing: gets an empty row, the cached one stays
    sched.add(fresh)
    assert sched.admit()[0] == [fresh] and fresh.row != row
    turn = _seq(PROMPT + [1, 2, 3, 60, 61], "c")
    sched.add(turn)
    sched.admit()
    assert turn.row == row and turn.cached_tokens == len(PROMPT) + 2 and sched.take_copies() == []


def test_prefix_caching_off_caches_nothing():
    sched = Scheduler(CONFIG.model_copy(update={"enable_prefix_caching": False}), None)
    first, second = _seq(PROMPT, "a"), _seq(PROMPT, "b")
    sched.add(first)
    sched.add(second)
    assert sched.admit()[0] == [first, second]
    assert first.cached_tokens == second.cached_tokens == 0 and sched.prefix_query_tokens == 0

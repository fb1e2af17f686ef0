"""The scheduler over blocks, step by step: admission while blocks last, shared prefix blocks,
waiting for a request that computes the same prompt, preemption and exact block accounting."""

from __future__ import annotations

import random

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.engine.scheduler import Scheduler
from lora_runtime.engine.sequence import Sequence

PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 before the last token
CONFIG = EngineConfig(max_batch=3, max_seq_len=128, max_loras_per_batch=0)


def _seq(prompt, rid="r", **params) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=SamplingParams(**params), seed=0,
                    adapter=None, emit=lambda out: None, detokenizer=None, eos_token_ids=frozenset())


def _sched(config=CONFIG, num_blocks=64) -> Scheduler:
    return Scheduler(config, None, num_blocks=num_blocks, block_size=16)


def _prefill(sched, seqs):
    for s in seqs:
        sched.computed(s, s.prefill_len - s.computed)


def _check_accounting(sched):
    """Every block is free or held, and each held block's refcount is its holders."""
    holders = {}
    for seq in sched.running.values():
        for b in seq.blocks:
            holders[b] = holders.get(b, 0) + 1
    assert all(sched.pool.refcount(b) == n for b, n in holders.items())
    assert sched.pool.num_free + len(holders) == sched.pool.usable
    for row, seq in sched.running.items():
        assert list(sched.block_table[row, :len(seq.blocks)]) == seq.blocks
        assert not sched.block_table[row, len(seq.blocks):].any()


def test_a_request_waits_for_one_computing_its_prompt_then_shares_its_blocks():
    sched = _sched()
    first, second = _seq(PROMPT, "a"), _seq(PROMPT + [7, 8], "b")
    sched.add(first)
    sched.add(second)
    adm = sched.admit()
    assert adm.packed == [first] and list(sched.waiting) == [second]
    _prefill(sched, adm.packed)
    sched.step += 1
    adm = sched.admit()
    assert adm.packed == [] and adm.placed == [second] and list(sched.extending) == [second]
    assert second.cached_tokens == second.computed == 32
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    _check_accounting(sched)


def test_a_starving_request_does_not_wait_for_a_sharer():
    sched = _sched(CONFIG.model_copy(update={"max_wait_steps": 1}))
    first, second = _seq(PROMPT, "a"), _seq(PROMPT, "b")
    sched.add(first)
    sched.admit()
    sched.add(second)
    sched.step += 5  # second has now waited past max_wait_steps
    assert sched.admit().packed == [second] and second.cached_tokens == 0


def test_short_shared_starts_and_log_probability_requests_do_not_wait():
    sched = _sched()
    short = list(range(10, 20))  # 10 tokens: not even a full block
    seqs = [_seq(short, "a"), _seq(short + [1], "b"), _seq(PROMPT, "c"), _seq(PROMPT, "d", prompt_logprobs=1)]
    sched.add(seqs[0])
    sched.add(seqs[1])
    assert sched.admit().packed == seqs[:2]
    sched2 = _sched()
    sched2.add(seqs[2])
    sched2.add(seqs[3])
    assert sched2.admit().packed == seqs[2:]


def test_a_finished_requests_blocks_serve_its_next_turn_output_included():
    sched = _sched()
    first = _seq(PROMPT, "a")
    sched.add(first)
    sched.admit()
    _prefill(sched, [first])
    for t in range(10):  # decode 10 tokens: the 3rd block (tokens 32..47) fills
        first.output_ids.append(100 + t)
        sched.reserve_decode_blocks()
        sched.computed(first, 1)
    held = list(first.blocks)
    sched.finish(first)
    assert sched.pool.num_free == sched.pool.usable and sched.pool.num_cached == 3
    turn = _seq(PROMPT + [100 + t for t in range(10)] + [60, 61], "c")
    sched.add(turn)
    adm = sched.admit()
    assert adm.placed == [turn] and turn.cached_tokens == 48 and turn.blocks[:3] == held[:3]
    _check_accounting(sched)


def test_prefix_caching_off_caches_nothing():
    sched = _sched(CONFIG.model_copy(update={"enable_prefix_caching": False}))
    first, second = _seq(PROMPT, "a"), _seq(PROMPT, "b")
    sched.add(first)
    sched.add(second)
    assert sched.admit().packed == [first, second]
    _prefill(sched, [first, second])
    assert first.cached_tokens == second.cached_tokens == 0 and sched.prefix_query_tokens == 0
    assert sched.pool.num_cached == 0


def test_admission_stops_when_blocks_run_out():
    """A prompt of 3 blocks with one block kept per running sequence: the third request waits."""
    sched = _sched(CONFIG.model_copy(update={"enable_prefix_caching": False}), num_blocks=8)  # 7 usable
    seqs = [_seq([i] * 40, str(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    adm = sched.admit()
    assert adm.packed == seqs[:2] and list(sched.waiting) == seqs[2:]
    _check_accounting(sched)


def test_decode_preempts_the_newest_and_it_resumes_with_its_tokens():
    sched = _sched(CONFIG.model_copy(update={"enable_prefix_caching": False}), num_blocks=5)  # 4 usable
    old, new = _seq([1] * 31, "old"), _seq([2] * 15, "new")
    sched.add(old)
    sched.add(new)
    assert sched.admit().packed == [old, new]  # 2 + 1 blocks, one spare
    _prefill(sched, [old, new])
    old.output_ids.append(7)
    new.output_ids.append(8)
    sched.reserve_decode_blocks()  # new's token 15 fits its block; old's 31 too
    sched.computed(old, 1)
    sched.computed(new, 1)
    old.output_ids.append(7)
    new.output_ids.append(8)
    preempted = sched.reserve_decode_blocks()  # both need a block, one is left: the newest gives way
    assert preempted == [new] and sched.decoding() == [old] and list(sched.waiting) == [new]
    assert new.row is None and new.blocks == [] and new.prefill_len == 17 and new.preemptions == 1
    assert sched.preemptions == 1
    _check_accounting(sched)
    sched.finish(old)
    adm = sched.admit()
    assert adm.placed == [new] and new.computed == 0 and new.token_ids() == [2] * 15 + [8, 8]
    assert sched.pool.num_free + len(new.blocks) == sched.pool.usable


def test_no_block_leaks_after_a_random_workload():
    """Random prompts (many sharing prefixes) arriving, decoding, finishing and being preempted
    on a small cache: accounting holds after every step, and every block is free at the end."""
    rng = random.Random(0)
    sched = _sched(EngineConfig(max_batch=6, max_seq_len=128, max_loras_per_batch=0), num_blocks=20)
    stems = [[rng.randrange(100) for _ in range(40)] for _ in range(3)]
    pending = [_seq(rng.choice(stems)[: rng.randrange(5, 40)] + [rng.randrange(100) for _ in range(rng.randrange(1, 30))],
                    str(i)) for i in range(40)]
    budget = {s.request_id: rng.randrange(1, 128 - len(s.prompt_ids)) for s in pending}  # some grow long
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())
        adm = sched.admit()
        _prefill(sched, adm.packed)
        for s in list(sched.extending):
            sched.computed(s, min(16, s.prefill_len - s.computed))
        for s in sched.decoding():
            if s.computed == s.num_tokens:  # its prefill just ended: the first token
                s.output_ids.append(rng.randrange(100))
        sched.reserve_decode_blocks()
        for s in sched.decoding():
            sched.computed(s, 1)
            s.output_ids.append(rng.randrange(100))
            if len(s.output_ids) >= budget[s.request_id]:
                sched.finish(s)
        _check_accounting(sched)
        sched.step += 1
        if not pending and not sched.has_work():
            break
    assert not sched.has_work() and not pending
    assert sched.pool.num_free == sched.pool.usable and sched.preemptions > 0 and sched.pool.num_cached > 0
    assert not sched._pending


def _prio(prompt, rid, priority, **params) -> Sequence:
    seq = _seq(prompt, rid, **params)
    seq.priority = priority
    return seq


def test_the_most_urgent_waiting_request_is_admitted_first_and_preempts_less_urgent_ones_for_a_row():
    sched = _sched()  # 3 rows
    low = [_prio(range(i, i + 20), f"low{i}", 5) for i in range(3)]
    for s in low:
        sched.add(s)
    assert sched.admit().packed == low
    _prefill(sched, low)
    sched.step += 1
    late, urgent, same = _prio(range(100, 110), "late", 5), _prio(range(200, 210), "urgent", -1), \
        _prio(range(300, 310), "same", 5)
    for s in (late, urgent, same):
        sched.add(s)
    adm = sched.admit()
    # The urgent one takes the newest low-priority row; requests of equal priority preempt nothing.
    assert adm.packed == [urgent] and low[2].row is None and low[2].preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["low2", "late", "same"]
    assert sorted(s.request_id for s in sched.running.values()) == ["low0", "low1", "urgent"]
    _check_accounting(sched)


def test_a_request_short_of_blocks_preempts_less_urgent_ones_least_urgent_first():
    sched = _sched(num_blocks=11)  # 10 usable blocks of 16 tokens
    mid, low = _prio(range(0, 60), "mid", 1), _prio(range(100, 160), "low", 2)  # 4 blocks each
    for s in (mid, low):
        sched.add(s)
    assert sched.admit().packed == [mid, low]
    _prefill(sched, [mid, low])
    sched.step += 1
    urgent = _prio(range(200, 250), "urgent", 0, max_tokens=1)  # 4 blocks
    sched.add(urgent)
    assert sched.admit().placed == [urgent]
    assert low.row is None and mid.row is not None  # the least urgent went, and only it
    _check_accounting(sched)
    # A decode step short of a block takes it from the least urgent running request too.
    for s in (mid, urgent):
        sched.computed(s, s.prefill_len - s.computed)
    victims = []
    while not victims:
        for s in sched.decoding():
            s.output_ids.append(1)
        victims = sched.reserve_decode_blocks()
    assert victims == [mid]
    _check_accounting(sched)


def test_without_priorities_nothing_is_preempted_for_a_waiting_request():
    sched = _sched(num_blocks=9)
    first = _seq(range(0, 120), "a")  # 8 blocks: all of them
    sched.add(first)
    sched.admit()
    second = _seq(range(200, 210), "b")
    sched.add(second)
    assert sched.admit().placed == [] and first.row is not None and first.preemptions == 0


def test_the_wait_bound_holds_among_the_most_urgent():
    sched = _sched(CONFIG.model_copy(update={"max_wait_steps": 1, "max_batch": 1}))
    low, urgent = _prio(range(0, 20), "low", 3), _prio(range(50, 70), "urgent", 0)
    sched.add(low)
    sched.step += 5  # low has waited past the bound...
    sched.add(urgent)
    assert sched.admit().packed == [urgent]  # ...yet a more urgent one goes first


def test_once_a_starving_request_is_in_the_rest_join_in_the_same_step():
    """Overloaded, every waiting request soon waits past max_wait_steps: the oldest goes first,
    and the others still fill the free rows in the same step (not one admission a step)."""
    sched = _sched(CONFIG.model_copy(update={"max_wait_steps": 2, "max_batch": 4}))
    seqs = [_seq(range(10 * i, 10 * i + 8), f"r{i}") for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    sched.step += 3  # all of them have waited past the bound
    assert sched.admit().placed == seqs[:4] and list(sched.waiting) == seqs[4:]
    _check_accounting(sched)


class _Slots:
    """The AdapterSlots protocol over `n` device slots of one rank: a slot holds one adapter (its
    name is its content) and counts references; an adapter that is not resident takes the first
    unreferenced slot. Every adapter is fetched but those in `fetching`."""

    def __init__(self, n: int):
        self.held: list[str | None] = [None] * n
        self.refs = [0] * n
        self.fetching: set[str] = set()  # adapters still on their way from storage
        self.staged: list[str] = []  # what the scheduler last asked to stage ahead (2 at most)

    def is_resident(self, name):
        return name in self.held

    def is_host_cached(self, name):
        return True

    def is_ready(self, name):
        return name not in self.fetching

    def can_acquire(self, name):
        return name in self.held or 0 in self.refs

    def held_slots_for(self, name):
        return {} if self.can_acquire(name) else dict(enumerate(self.refs))

    def acquire_slot(self, name):
        slot = self.held.index(name) if name in self.held else self.refs.index(0)
        self.held[slot] = name
        self.refs[slot] += 1
        return slot

    def release_slot(self, name, slot):
        self.refs[slot] -= 1

    def prefetch(self, names):
        pass

    def stage_ahead(self, names):
        self.staged = list(dict.fromkeys(n for n in names if n not in self.held))[:2]

    def content_of(self, name):
        return name.encode()

    def slot_content(self, slot):
        return None if self.held[slot] is None else self.held[slot].encode()


def _lora_seq(prompt, rid, adapter, max_tokens):
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens), seed=0,
                    adapter=adapter, emit=lambda out: None, detokenizer=None, eos_token_ids=frozenset())


def test_a_request_starving_for_a_slot_drains_the_slot_that_frees_first_while_others_join():
    """Two slots, held by running requests for "a" (10 tokens left) and "b" (30): a request for
    "c", passed over past max_wait_steps, waits for a slot. Nothing new joins "a"'s slot, which
    frees first; requests for "b" and the base model keep joining, but for one row kept for
    "c"; when "a"'s last holder finishes, "c" takes its slot before anyone else."""
    config = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=2, max_wait_steps=2)
    sched = Scheduler(config, _Slots(2), num_blocks=64, block_size=16)
    a1, b1 = _lora_seq(range(10, 20), "a1", "a", 10), _lora_seq(range(20, 30), "b1", "b", 30)
    for seq in (a1, b1):
        sched.add(seq)
    assert sched.admit().placed == [a1, b1]
    _prefill(sched, [a1, b1])
    cold = _lora_seq(range(30, 40), "c", "c", 5)
    sched.add(cold)
    assert sched.admit().placed == []  # no slot for "c"
    sched.step += 3  # "c" has waited past max_wait_steps
    a2, b2, base = (_lora_seq(range(40, 50), "a2", "a", 5), _lora_seq(range(50, 60), "b2", "b", 5),
                    _lora_seq(range(60, 70), "base", None, 5))
    for seq in (a2, b2, base):
        sched.add(seq)
    assert sched.admit().placed == [b2]  # "a" drains; "b" joins; the last free row stays for "c"
    assert list(sched.waiting) == [cold, a2, base]
    drained = a1.slot
    sched.finish(a1)  # "a"'s slot frees
    placed = sched.admit().placed
    assert placed[0] is cold and cold.slot == drained and a2 not in placed
    _check_accounting(sched)


def test_a_starving_request_waiting_for_its_adapters_bytes_lets_in_only_requests_that_take_no_slot():
    """A starving request whose adapter is still on its way (a slot is free for it) does not stop
    the batch: requests for the base model and for held slots join, one row kept for it; a
    request for a resident adapter nobody holds does not (it would take the free slot)."""
    config = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=2, max_wait_steps=2)
    slots = _Slots(2)
    sched = Scheduler(config, slots, num_blocks=64, block_size=16)
    x1, a1 = _lora_seq(range(0, 10), "x1", "x", 2), _lora_seq(range(10, 20), "a1", "a", 30)
    for seq in (x1, a1):
        sched.add(seq)
    assert sched.admit().placed == [x1, a1]
    _prefill(sched, [x1, a1])
    free = x1.slot
    sched.finish(x1)  # "x" stays resident, held by nobody
    cold = _lora_seq(range(30, 40), "c", "c", 5)
    slots.fetching.add("c")
    sched.add(cold)
    assert sched.admit().placed == [] and slots.staged == ["c"]  # staged ahead, first in line
    sched.step += 3  # "c" starves
    x2, a2, base = (_lora_seq(range(40, 50), "x2", "x", 5), _lora_seq(range(50, 60), "a2", "a", 5),
                    _lora_seq(range(60, 70), "base", None, 5))
    for seq in (x2, a2, base):
        sched.add(seq)
    assert sched.admit().placed == [a2, base] and list(sched.waiting) == [cold, x2]
    slots.fetching.clear()
    placed = sched.admit().placed
    assert placed == [cold] and cold.slot == free  # the free slot went to "c"
    # Three admissions loaded their adapter ("x", "a", then "c"); "c" waited in the queue the longest.
    assert sched.adapter_slot_waits == 3 and sched.adapter_slot_wait_seconds > 0
    _check_accounting(sched)


def test_the_first_in_line_is_staged_first_though_it_arrived_later():
    """A preempted request waits at the front of the queue, though others arrived before it: its
    adapter is the first the scheduler asks to stage (the wait bound protects it first)."""
    config = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=1, max_wait_steps=2)
    slots = _Slots(1)
    slots.held, slots.refs = ["z"], [1]  # the only slot, held
    sched = Scheduler(config, slots, num_blocks=64, block_size=16)
    early = [_lora_seq(range(10 * i, 10 * i + 5), f"e{i}", f"e{i}", 5) for i in range(3)]
    for seq in early:
        sched.add(seq)
    sched.step += 1
    late = _lora_seq(range(50, 55), "late", "late", 5)
    sched.add(late)
    sched.waiting.rotate(1)  # at the front, as preempt() puts a request
    assert sched.admit().placed == [] and slots.staged == ["late", "e0"]


def test_a_starving_request_waiting_for_blocks_still_stops_every_admission():
    """A starving request that waits for KV blocks, not a slot, drains nothing: no other
    request joins past it."""
    config = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=2, max_wait_steps=2)
    sched = Scheduler(config, _Slots(2), num_blocks=8, block_size=16)
    big = _lora_seq(range(0, 90), "big", "a", 5)
    sched.add(big)
    assert sched.admit().placed == [big]
    _prefill(sched, [big])
    long = _lora_seq(range(100, 190), "long", "a", 5)  # needs 6 of the 8 blocks: waits
    sched.add(long)
    assert sched.admit().placed == []
    sched.step += 3
    short = _lora_seq(range(200, 205), "short", "a", 5)
    sched.add(short)
    assert sched.admit().placed == [] and list(sched.waiting) == [long, short]


def test_a_starving_request_that_preempts_for_its_slot_keeps_no_row_back():
    """A starving urgent request whose slot frees by preempting less urgent holders is placed at
    once; the requests behind it then take the rows left, none kept back for it."""
    config = EngineConfig(max_batch=3, max_seq_len=128, max_loras_per_batch=2, max_wait_steps=2,
                          scheduling_policy="priority")
    slots = _Slots(2)
    sched = Scheduler(config, slots, num_blocks=64, block_size=16)
    a1, b1 = _lora_seq(range(10, 20), "a1", "a", 10), _lora_seq(range(20, 30), "b1", "b", 30)
    a1.priority = b1.priority = 5
    for seq in (a1, b1):
        sched.add(seq)
    assert sched.admit().placed == [a1, b1]
    _prefill(sched, [a1, b1])
    urgent = _lora_seq(range(30, 40), "c", "c", 5)
    slots.fetching.add("c")  # not preempted for while it is still in storage
    sched.add(urgent)
    assert sched.admit().placed == []
    sched.step += 3
    slots.fetching.clear()
    base = _lora_seq(range(60, 70), "base", None, 5)
    sched.add(base)
    placed = sched.admit().placed
    assert placed == [urgent, base] and sched.preemptions == 1 and not sched.free_rows
    _check_accounting(sched)

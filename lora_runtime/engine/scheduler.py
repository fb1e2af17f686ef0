"""Continuous batching over a paged KV cache, with adapters: who runs, who waits, who gives way.

A running request holds a batch row (at most `max_batch` run at once), KV blocks for the
tokens it has computed (handed out as it grows, see block_pool.py) and, if it names an
adapter, a refcount on that adapter's device slot, so the distinct adapters in a batch
never exceed the slots (`max_loras_per_batch`). Requests whose adapter is already resident
are admitted first; a request passed over for more than `max_wait_steps` steps stops other
admissions until it is admitted, which bounds its wait by the longest running request (once it
is in, the rest join in the same step, so an overloaded queue, where every request soon waits
that long, still fills the free rows). When what it waits for is its adapter (a slot, every
one held by running requests, or the adapter's bytes), requests that take no new slot (the
base model, or an adapter whose slot running requests hold) keep joining, one row and the
starving prompt's blocks kept free for it, but none joins the held slot that frees first, so
that slot drains. The adapters of the requests first in line are fetched, padded and staged
on the devices ahead of their slots (the manager's fetch threads), so a slot, once free,
takes only the adapter's write.

A request whose prompt starts with full blocks another request computed (same tokens,
same adapter content) takes those blocks by reference and computes only the rest. Such
requests, and prompts longer than one prefill step's budget, are computed chunk by chunk
("extending") instead of in the packed prefill of fresh prompts. A request whose prompt
shares blocks that a running request is still computing waits for them.

When a decode step needs a block and none is free, the newest running requests are
preempted: their blocks go back (full ones stay cached), and they wait at the front of the
queue to recompute prompt and output so far, then continue where they stopped.

Each request has a priority (lower is more urgent; 0 unless the deployment schedules by
priority). Waiting requests are admitted most urgent first; one that finds no row or no
blocks preempts running requests of a less urgent priority, least urgent and newest first,
and a decode step short of blocks preempts the same way. One whose adapter finds every slot
held (and is fetched) preempts every holder of a slot whose holders are all less urgent
(the least urgent, then the fewest). The wait bound above applies among
the most urgent waiting requests, so a less urgent one waits as long as more urgent ones
keep coming (as vLLM's priority scheduling).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from lora_runtime.engine.block_pool import BlockPool, block_hashes
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sequence import Sequence

BASE_KEY = b""  # the K/V key of the base model (no adapter)
# Admission keeps blocks for the running sequences' growth: `growth_ratio` of each one's
# remaining max_tokens. The ratio starts at GROWTH_RATIO_START, is raised after every
# preemption (growth was underestimated) and decays each admission step towards
# GROWTH_RATIO_MIN (max_tokens is usually a loose bound), as SGLang's new-token ratio does.
GROWTH_RATIO_START, GROWTH_RATIO_MIN, GROWTH_RATIO_DECAY = 0.5, 0.1, 0.002
GROWTH_RATIO_STEP = 0.2


class AdapterSlots(Protocol):
    """What the scheduler needs from the LoRA manager."""

    def is_resident(self, name: str) -> bool: ...
    def is_host_cached(self, name: str) -> bool: ...
    def is_ready(self, name: str) -> bool: ...
    def can_acquire(self, name: str) -> bool: ...
    def held_slots_for(self, name: str) -> dict[int, int]: ...
    def acquire_slot(self, name: str) -> int: ...
    def release_slot(self, name: str, slot: int) -> None: ...
    def prefetch(self, names: list[str]) -> None: ...
    def stage_ahead(self, names: Iterable[str]) -> None: ...
    def content_of(self, name: str) -> bytes | None: ...
    def slot_content(self, slot: int) -> bytes | None: ...


@dataclasses.dataclass
class Admission:
    """What one admit() did: `packed` go to this step's packed prefill; `placed` are every
    sequence that got a row (packed ones and those now extending); `failed` could not get
    their adapter (with the error)."""

    packed: list[Sequence] = dataclasses.field(default_factory=list)
    placed: list[Sequence] = dataclasses.field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = dataclasses.field(default_factory=list)


class Scheduler:
    """Host bookkeeping of waiting and running sequences and their blocks; engine thread only."""

    def __init__(self, config: EngineConfig, adapters: AdapterSlots | None, *, num_blocks: int, block_size: int):
        self.config = config
        self.adapters = adapters
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.pages_per_seq = math.ceil(config.max_seq_len / block_size)
        # Row r's blocks in position order; 0 (the null block) past them and for free rows.
        self.block_table = np.zeros((config.max_batch, self.pages_per_seq), np.int32)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.extending: collections.deque[Sequence] = collections.deque()  # running, still prefilling
        self.free_rows: list[int] = list(range(config.max_batch))
        self._pending: collections.Counter[bytes] = collections.Counter()  # blocks running prefills will fill
        self._order = itertools.count()
        self.prefix_query_tokens = 0  # prompt tokens of admissions that looked up the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found cached
        self.preemptions = 0
        self.adapter_slot_waits = 0  # admissions that first loaded the request's adapter into a slot
        self.adapter_slot_wait_seconds = 0.0  # those requests' time in the queue
        self.growth_ratio = GROWTH_RATIO_START
        self.step = 0

    # ---- arrival and admission -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.arrival = self.step
        seq.queued_at = time.monotonic()
        seq.order = next(self._order)
        seq.prefill_len = len(seq.prompt_ids)
        self.waiting.append(seq)
        if seq.adapter is not None and self.adapters is not None:
            if not (self.adapters.is_resident(seq.adapter) or self.adapters.is_host_cached(seq.adapter)):
                self.adapters.prefetch([seq.adapter])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, packed_budget: int | None = None, only: Sequence | None = None) -> Admission:
        """Moves waiting sequences into free rows while blocks last.

        At most `packed_budget` prompt tokens (default the whole prefill budget) go to this
        step's packed prefill; sequences starting from cached blocks, or longer than the
        budget, are placed in `extending`. A sequence is admitted only if its prefill's blocks
        fit beside the blocks the running sequences are expected to grow into (`growth_ratio`
        of their remaining max_tokens, at least a block each), so decode rarely preempts.
        With `only`, no other sequence is considered (a suspect of a failed step, which the
        engine runs alone); without, suspects are not considered.
        """
        out = Admission()
        if not self.waiting:
            return out
        top = min(s.priority for s in self.waiting)
        if not self.free_rows and not any(s.priority > top for s in self.running.values()):
            return out  # no row, and none a waiting request may preempt
        budget = self.config.prefill_budget
        packed_budget = budget if packed_budget is None else packed_budget
        oldest = next(s for s in self.waiting if s.priority == top)  # first in line of the most urgent
        starving = only is None and self.step - oldest.arrival > self.config.max_wait_steps
        if only is None and self.adapters is not None:
            self._stage_ahead(oldest)
        # A starving request that waits for its adapter (a slot, or its bytes) lets in only requests
        # that need no new slot, and drains the held slot that frees first: nothing new joins it.
        keeping = starving and not self._is_warm(oldest)
        joinable: set[bytes | None] = set()
        if only is not None:
            candidates = [only] if only in self.waiting else []
        else:
            candidates = sorted(self.waiting, key=lambda s: (s.priority, not self._is_warm(s), s.arrival, s.order))
            if starving:  # it goes first; the rest follow once it is in (while it waits, only what `keeping` lets in)
                candidates.remove(oldest)
                candidates.insert(0, oldest)
                if keeping:
                    joinable = self._held_contents() - {None, self._drain_for(oldest)}
        held_back = starving  # the starving request still waits
        if only is None:
            candidates = [s for s in candidates if s.suspect_steps == 0]
        used = 0
        self.growth_ratio = max(GROWTH_RATIO_MIN, self.growth_ratio - GROWTH_RATIO_DECAY)
        reserve = sum(self._growth(s) for s in self.running.values())
        for seq in candidates:
            kept = 0  # blocks kept back for the starving request while others join past it
            if seq is not oldest and held_back:
                if not keeping:
                    break  # it waits for a row, blocks or the step's budget: nobody passes it
                if seq.priority != top or (seq.adapter is not None and
                                           self.adapters.content_of(seq.adapter) not in joinable):
                    continue  # would take a new slot, or the draining one
                if len(self.free_rows) <= 1:
                    break  # the starving request's row stays free
                kept = math.ceil(oldest.prefill_len / self.block_size)
            if not self.free_rows and not self._preempt_below(seq):
                break
            hits = self._lookup(seq, self._predicted_key(seq))
            if (not starving or seq is not oldest) and self._sharer_computing(seq, len(hits)):
                continue  # a running request is computing this prompt's next blocks: take them next
            packed = not hits and seq.prefill_len <= budget
            if packed and used + seq.prefill_len > packed_budget:
                continue  # waits for the next packed step rather than computing alone
            while not self._fits(seq, hits, reserve + kept):
                if not self._preempt_below(seq):
                    break
                hits = self._lookup(seq, seq.kv_key)  # the victim's blocks may be among them, freed
                reserve = sum(self._growth(s) for s in self.running.values())
            if not self._fits(seq, hits, reserve + kept):
                break  # the blocks come back as running requests finish; keep the queue's order
            packed = not hits and seq.prefill_len <= budget
            try:
                if not self._take_slot(seq):
                    continue
            except Exception as err:  # the adapter could not be loaded: fail this request only
                self.waiting.remove(seq)
                out.failed.append((seq, err))
                if seq is oldest:
                    held_back = False
                continue
            key = self._slot_key(seq)
            if key != seq.kv_key:  # the adapter's content was unknown or changed: look again
                hits = self._lookup(seq, key)
                packed = not hits and seq.prefill_len <= budget
                if not self._fits(seq, hits, reserve + kept) or (packed and used + seq.prefill_len > packed_budget):
                    self._release_slot(seq)
                    continue
            self.waiting.remove(seq)
            self._place(seq, hits)
            if seq is oldest:
                held_back = False  # it is in: the rest join as usual
            reserve += self._growth(seq)
            out.placed.append(seq)
            if packed:
                used += seq.prefill_len
                out.packed.append(seq)
            else:
                self.extending.append(seq)
        return out

    def _drain_for(self, seq: Sequence) -> bytes | None:
        """When `seq` waits for an adapter slot that running sequences hold, every one it could
        take: the content (LoRAManager's identity of the weights) of the held slot whose
        holders finish first (the fewest tokens left to the longest of them). Admissions skip
        requests for that content until its slot frees, so the slot drains while the rest of
        the batch stays full. None when `seq` waits for no held slot."""
        if seq.adapter is None or self.adapters is None or self.adapters.can_acquire(seq.adapter):
            return None
        held = self.adapters.held_slots_for(seq.adapter)
        holders = {slot: users for slot, users in self._slot_holders().items() if slot in held}
        if not holders:
            return None
        slot = min(holders, key=lambda k: (max(s.params.max_tokens - len(s.output_ids) for s in holders[k]), k))
        return self.adapters.slot_content(slot)

    def _preempt_below(self, seq: Sequence) -> bool:
        """Preempts the least urgent, newest running sequence if it is less urgent than `seq`
        (its priority is greater); whether there was one."""
        lower = [s for s in self.running.values() if s.priority > seq.priority]
        if not lower:
            return False
        self.preempt(max(lower, key=lambda s: (s.priority, s.order)))
        return True

    def _fits(self, seq: Sequence, hits: list[int], reserve: int) -> bool:
        free_hits = sum(self.pool.refcount(b) == 0 for b in hits)  # taking them removes them from the free queue
        need = math.ceil(seq.prefill_len / self.block_size) - len(hits)
        return need + free_hits + reserve <= self.pool.num_free

    def _growth(self, seq: Sequence) -> int:
        """Blocks a running sequence is expected to take beyond those it holds (at least one)."""
        remaining = seq.params.max_tokens - len(seq.output_ids)
        expected = min(seq.num_tokens + math.ceil(self.growth_ratio * remaining), self.config.max_seq_len)
        return max(1, math.ceil(expected / self.block_size) - len(seq.blocks))

    def _predicted_key(self, seq: Sequence) -> bytes | None:
        """The K/V key the sequence will have, if known before taking its adapter's slot."""
        if seq.adapter is None or self.adapters is None:
            return BASE_KEY
        return self.adapters.content_of(seq.adapter)

    def _slot_key(self, seq: Sequence) -> bytes | None:
        if seq.adapter is None or self.adapters is None:
            return BASE_KEY
        return self.adapters.slot_content(seq.slot)

    def _lookup(self, seq: Sequence, key: bytes | None) -> list[int]:
        """The cached blocks the sequence's prefill starts with (worth using), under `key`.

        The last prefill token is always computed (its logits give the next token), so only
        blocks wholly before it count. Sets the sequence's hash chain for `key`.
        """
        if key is None:
            return []
        if seq.kv_key != key:
            seq.kv_key, seq.block_hashes = key, []
        if not self.config.enable_prefix_caching:
            return []
        self._extend_hashes(seq, seq.prefill_len // self.block_size)
        if seq.wants_prompt_logprobs:
            return []  # every prompt position's logits are wanted: compute them all
        bs = self.block_size
        hits = self.pool.lookup(seq.block_hashes[: (seq.prefill_len - 1) // bs])
        return hits if len(hits) * bs >= self.config.prefix_cache_min_tokens else []

    def _extend_hashes(self, seq: Sequence, blocks: int) -> None:
        """Extends the sequence's hash chain to its first `blocks` full blocks (tokens only grow)."""
        have = len(seq.block_hashes)
        if have < blocks:
            tokens = seq.token_ids(0, blocks * self.block_size)
            seq.block_hashes += block_hashes(tokens, self.block_size, seq.kv_key, start=have,
                                             parent=seq.block_hashes[-1] if have else None)

    def _sharer_computing(self, seq: Sequence, hits: int) -> bool:
        """Whether running prefills are computing at least prefix_cache_min_tokens of this
        sequence's next blocks (requests arriving together with one system prompt, or the n
        choices of one request): then it waits and takes them once they are full."""
        if not self._pending or seq.kv_key is None or seq.wants_prompt_logprobs:
            return False
        bs = self.block_size
        shared = 0
        for h in seq.block_hashes[hits:(seq.prefill_len - 1) // bs]:
            if not self._pending[h]:
                break
            shared += 1
        return shared * bs >= self.config.prefix_cache_min_tokens

    def _place(self, seq: Sequence, hits: list[int]) -> None:
        """Gives the sequence a row and the blocks of its prefill: `hits` shared, the rest new."""
        bs = self.block_size
        row = min(self.free_rows)
        self.free_rows.remove(row)
        self.pool.take(hits)
        seq.blocks = hits + self.pool.allocate(math.ceil(seq.prefill_len / bs) - len(hits))
        seq.row = row
        seq.computed = seq.registered = len(hits) * bs
        self.block_table[row, : len(seq.blocks)] = seq.blocks
        if seq.preemptions == 0:
            seq.cached_tokens = seq.computed
        if self.config.enable_prefix_caching and seq.kv_key is not None:
            if seq.params.prompt_logprobs is None:
                self.prefix_query_tokens += seq.prefill_len
                self.prefix_hit_tokens += seq.computed
            self._pending.update(seq.block_hashes[len(hits):seq.prefill_len // bs])
        self.running[row] = seq

    def _held_contents(self) -> set[bytes | None]:
        """The contents of the adapter slots running sequences hold: joining them takes no slot."""
        return {self.adapters.slot_content(slot) for slot in self._slot_holders()}

    def _stage_ahead(self, first: Sequence) -> None:
        """Has the manager stage, off this thread, the adapters of the requests first in line
        (`first`, the one the wait bound protects, then the most urgent and oldest), so that a
        slot, once free, takes only its write."""
        queue = sorted(self.waiting, key=lambda s: (s is not first, s.priority, s.arrival, s.order))
        self.adapters.stage_ahead(s.adapter for s in queue if s.adapter is not None and s.suspect_steps == 0)

    def _is_warm(self, seq: Sequence) -> bool:
        return seq.adapter is None or self.adapters is None or self.adapters.is_resident(seq.adapter)

    def _take_slot(self, seq: Sequence) -> bool:
        if seq.adapter is None or self.adapters is None:
            seq.slot = -1
            return True
        adapters = self.adapters
        if not adapters.can_acquire(seq.adapter) and not self._preempt_for_slot(seq):
            return False  # every slot is held: wait for one
        if not adapters.is_ready(seq.adapter):
            return False  # fetched and padded off this thread meanwhile; decode goes on
        loads = not adapters.is_resident(seq.adapter)
        seq.slot = adapters.acquire_slot(seq.adapter)  # the slot write alone
        if loads:
            self.adapter_slot_waits += 1
            self.adapter_slot_wait_seconds += time.monotonic() - seq.queued_at
        return True

    def _preempt_for_slot(self, seq: Sequence) -> bool:
        """Frees an adapter slot for `seq` by preempting every running sequence that holds it,
        when all of them are less urgent and `seq`'s adapter is fetched (never for one still
        in storage); the slot whose holders are least urgent, then fewest. Whether it did."""
        adapters = self.adapters
        if not any(s.priority > seq.priority for s in self.running.values()) or not adapters.is_ready(seq.adapter):
            return False
        by_slot = self._slot_holders()
        options = [users for slot, refs in adapters.held_slots_for(seq.adapter).items()
                   if len(users := by_slot.get(slot, [])) == refs and all(u.priority > seq.priority for u in users)]
        if not options:
            return False
        for user in max(options, key=lambda users: (min(u.priority for u in users), -len(users))):
            self.preempt(user)
        return adapters.can_acquire(seq.adapter)

    def _slot_holders(self) -> dict[int, list[Sequence]]:
        """Adapter slot -> the running sequences holding it."""
        holders: dict[int, list[Sequence]] = {}
        for s in self.running.values():
            if s.slot >= 0:
                holders.setdefault(s.slot, []).append(s)
        return holders

    def _release_slot(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.adapters is not None and seq.slot >= 0:
            self.adapters.release_slot(seq.adapter, seq.slot)
        seq.slot = -1

    # ---- progress ------------------------------------------------------------------------

    def computed(self, seq: Sequence, n: int) -> None:
        """Records that `n` more tokens of a running sequence have their K/V in its blocks;
        blocks that became full are named (hash chain) so later prompts can share them."""
        seq.computed += n
        bs = self.block_size
        full = seq.computed // bs
        if seq.kv_key is not None and self.config.enable_prefix_caching and full * bs > seq.registered:
            self._extend_hashes(seq, full)
            for i in range(seq.registered // bs, full):
                self.pool.register(seq.blocks[i], seq.block_hashes[i])
                if i < seq.prefill_len // bs:  # blocks of its prefill were pending (see _place)
                    self._unpend(seq.block_hashes[i])
            seq.registered = full * bs
        if not seq.prefilling and seq in self.extending:
            self.extending.remove(seq)

    def _unpend(self, block_hash: bytes) -> None:
        if self._pending[block_hash] > 1:
            self._pending[block_hash] -= 1
        else:
            self._pending.pop(block_hash, None)

    def reserve_decode_blocks(self) -> list[Sequence]:
        """Gives every decoding sequence a block for the token it feeds next; when none is free,
        preempts the newest running sequences. Returns those preempted."""
        preempted: list[Sequence] = []
        bs = self.block_size
        for seq in sorted(self.decoding(), key=lambda s: s.order):
            if seq.row is None:
                continue  # preempted for an older one in this loop
            index = (seq.num_tokens - 1 + seq.ahead) // bs  # its next input token is its last in flight
            if index < len(seq.blocks):
                continue
            while self.pool.num_free == 0:
                self.growth_ratio = min(1.0, self.growth_ratio + GROWTH_RATIO_STEP)
                victim = max(self.running.values(), key=lambda s: (s.priority, s.order))
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.row is None:
                continue
            (block,) = self.pool.allocate(1)
            seq.blocks.append(block)
            self.block_table[seq.row, index] = block
        return preempted

    def decoding(self) -> list[Sequence]:
        """Running sequences whose next step is a decode step: past their prompt, and not ended by
        max_tokens or max_seq_len with the tokens in flight (Sequence.ahead)."""
        return [s for s in self.running.values() if not s.prefilling and not s.finished
                and (s.ahead == 0 or (len(s.output_ids) + s.ahead < s.params.max_tokens
                                      and s.num_tokens + s.ahead < self.config.max_seq_len))]

    def preempt(self, seq: Sequence) -> None:
        """Takes a running sequence's row, blocks and slot back; it waits at the front of the
        queue to recompute its prompt and output so far, then continues."""
        self._vacate(seq, forget=False)
        seq.ahead = 0  # a token in flight is dropped when its step settles (engine.py)
        seq.computed = seq.registered = 0
        seq.prefill_len = seq.num_tokens
        seq.preemptions += 1
        self.preemptions += 1
        seq.queued_at = time.monotonic()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, *, keep_content: bool = True) -> None:
        """Frees the row, blocks and adapter reference of a running or waiting sequence; its full
        blocks stay cached unless `keep_content` is False (a failed step)."""
        if seq.row is not None and self.running.get(seq.row) is seq:
            self._vacate(seq, forget=not keep_content)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _vacate(self, seq: Sequence, *, forget: bool) -> None:
        del self.running[seq.row]
        if seq in self.extending:
            self.extending.remove(seq)
        if seq.kv_key is not None and self.config.enable_prefix_caching:
            for h in seq.block_hashes[seq.registered // self.block_size: seq.prefill_len // self.block_size]:
                self._unpend(h)  # pending blocks it will not fill now
        self.pool.release(seq.blocks, forget=forget)
        self.block_table[seq.row] = 0
        self.free_rows.append(seq.row)
        seq.row, seq.blocks = None, []
        self._release_slot(seq)

    def forget_cached(self) -> None:
        """The cache's contents were lost: no block may be found by its prefix any more."""
        self.pool.forget_all()

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running.values():
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

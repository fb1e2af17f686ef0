"""Continuous batching with adapters: which waiting requests join the running batch.

A running request holds a KV cache row and, if it names an adapter, a refcount on that
adapter's device slot, so the distinct adapters in a batch never exceed the slots
(`max_loras_per_batch`). Requests whose adapter is already resident are admitted
first; a request passed over for more than `max_wait_steps` steps stops all other
admissions until it is admitted, which bounds its wait by the longest running request.

A request whose prompt starts with what a row already holds (see prefix_cache.py) gets
that row, or a copy of it, and computes only the rest; such requests, and prompts longer
than one prefill step's budget, are computed chunk by chunk ("extending") instead of in
the packed prefill of fresh prompts.
"""

from __future__ import annotations

import collections
from typing import Protocol

import numpy as np

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.prefix_cache import BASE, AdapterKey, RowContents, common_prefix
from lora_runtime.engine.sequence import Sequence


class AdapterSlots(Protocol):
    """What the scheduler needs from the LoRA manager."""

    def is_resident(self, name: str) -> bool: ...
    def is_host_cached(self, name: str) -> bool: ...
    def is_fetching(self, name: str) -> bool: ...
    def can_acquire(self, name: str) -> bool: ...
    def acquire_slot(self, name: str) -> int: ...
    def release_slot(self, name: str, slot: int) -> None: ...
    def prefetch(self, names: list[str]) -> None: ...
    def generation_of(self, name: str) -> int | None: ...
    def slot_generation(self, slot: int) -> int | None: ...


class Scheduler:
    """Host bookkeeping of waiting and running sequences; used by the engine thread only."""

    def __init__(self, config: EngineConfig, adapters: AdapterSlots | None):
        self.config = config
        self.adapters = adapters
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.extending: collections.deque[Sequence] = collections.deque()  # running, prompt not yet computed
        self.free_rows: list[int] = list(range(config.max_batch))  # least recently freed first
        self.contents = RowContents(config.max_batch)
        self.pending_copies: list[tuple[int, int]] = []  # (source row, new row) to copy before any step
        self.prefix_query_tokens = 0  # prompt tokens of requests that could use a cached prefix
        self.prefix_hit_tokens = 0  # of those, tokens found in a row
        self.step = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival = self.step
        self.waiting.append(seq)
        if seq.adapter is not None and self.adapters is not None:
            if not (self.adapters.is_resident(seq.adapter) or self.adapters.is_host_cached(seq.adapter)):
                self.adapters.prefetch([seq.adapter])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, packed_budget: int | None = None) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """Moves waiting sequences into free rows.

        Returns the sequences admitted for one packed prefill step (at most `packed_budget`
        prompt tokens, default the whole prefill budget), and those that failed to get
        their adapter (with the error), which the engine finishes with that error. Admitted
        sequences that start from a cached prefix or whose prompt exceeds the budget go to
        `extending` instead; rows to copy for them are in `pending_copies`.
        """
        admitted: list[Sequence] = []
        failed: list[tuple[Sequence, Exception]] = []
        if not self.waiting or not self.free_rows:
            return admitted, failed
        budget = self.config.prefill_budget
        packed_budget = budget if packed_budget is None else packed_budget
        oldest = self.waiting[0]
        starving = self.step - oldest.arrival > self.config.max_wait_steps
        if starving:
            candidates = [oldest]  # starving: nothing else joins until it does
        else:
            candidates = sorted(self.waiting, key=lambda s: (not self._is_warm(s), s.arrival))
        used = 0
        for seq in candidates:
            if not self.free_rows:
                break
            n = len(seq.prompt_ids)
            key = self._predicted_key(seq)
            hit = self._find_prefix(seq, key)
            if not starving and self._sharer_computing(seq, key, 0 if hit is None else hit[2]):
                continue  # a running request is computing this prompt's start: take it from its row next
            packed = hit is None and n <= budget
            if packed and used + n > packed_budget:
                continue  # waits for the next packed step rather than computing alone
            try:
                if not self._take_slot(seq):
                    continue
            except Exception as err:  # the adapter could not be loaded: fail this request only
                self.waiting.remove(seq)
                failed.append((seq, err))
                continue
            self.waiting.remove(seq)
            if hit is not None and self._key(seq) != hit[0]:
                hit = None  # the adapter was registered anew meanwhile: its K/V differ
            self._place(seq, hit)
            if packed:
                used += n
                admitted.append(seq)
            else:
                self.extending.append(seq)
        return admitted, failed

    def computed(self, seq: Sequence, n: int) -> None:
        """Records that `n` more prompt tokens of a running sequence are in its row."""
        seq.computed += n
        self.contents.set(seq.row, self._key(seq), seq.prompt_ids[: seq.computed])
        if seq.computed == len(seq.prompt_ids) and seq in self.extending:
            self.extending.remove(seq)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _predicted_key(self, seq: Sequence) -> AdapterKey | None:
        if seq.adapter is None or self.adapters is None:
            return BASE
        generation = self.adapters.generation_of(seq.adapter)
        return None if generation is None else (seq.adapter, generation)

    def _key(self, seq: Sequence) -> AdapterKey | None:
        if seq.adapter is None or self.adapters is None:
            return BASE
        generation = self.adapters.slot_generation(seq.slot)
        return None if generation is None else (seq.adapter, generation)

    def _find_prefix(self, seq: Sequence, key: AdapterKey | None) -> tuple[AdapterKey, int, int] | None:
        """(key, row, length) of the longest cached prefix of the prompt worth using, or None."""
        if not self.config.enable_prefix_caching or seq.params.prompt_logprobs is not None or key is None:
            return None
        n = len(seq.prompt_ids)
        # A free row is taken as it is; a running row is copied, so free rows win ties.
        rows = self.free_rows + list(self.running)
        hit = self.contents.best(key, np.asarray(seq.prompt_ids), rows, limit=n - 1)
        if hit is None or hit.length < self.config.prefix_cache_min_tokens:
            return None
        return key, hit.row, hit.length

    def _sharer_computing(self, seq: Sequence, key: AdapterKey | None, cached: int) -> bool:
        """Whether a running request whose prompt is not computed yet shares at least
        prefix_cache_min_tokens more of this prompt than is cached now (requests arriving
        together with one system prompt, or the n choices of one request): then this one
        waits until those tokens are in that request's row, and copies them."""
        if not self.config.enable_prefix_caching or seq.params.prompt_logprobs is not None or key is None:
            return False
        prompt, limit = np.asarray(seq.prompt_ids), len(seq.prompt_ids) - 1
        for other in self.running.values():
            if other.computed < len(other.prompt_ids) and self._key(other) == key:
                shared = min(common_prefix(np.asarray(other.prompt_ids), prompt), limit)
                if shared - cached >= self.config.prefix_cache_min_tokens:
                    return True
        return False

    def _place(self, seq: Sequence, hit: tuple[AdapterKey, int, int] | None) -> None:
        """Gives the sequence a row: the free row holding its prefix, else the least valuable
        free row (empty, else least recently freed), into which a running row's prefix is copied."""
        if hit is not None and hit[1] in self.free_rows:
            row = hit[1]
        else:
            empty = [r for r in self.free_rows if self.contents.get(r) is None]
            row = empty[0] if empty else self.free_rows[0]
            if hit is not None:
                self.pending_copies.append((hit[1], row))
        self.free_rows.remove(row)
        seq.row = row
        seq.computed = seq.cached_tokens = 0 if hit is None else hit[2]
        if self.config.enable_prefix_caching and seq.params.prompt_logprobs is None:
            self.prefix_query_tokens += len(seq.prompt_ids)
            self.prefix_hit_tokens += seq.cached_tokens
        self.contents.set(row, self._key(seq), seq.prompt_ids[: seq.computed])
        self.running[row] = seq

    def _is_warm(self, seq: Sequence) -> bool:
        return seq.adapter is None or self.adapters is None or self.adapters.is_resident(seq.adapter)

    def _take_slot(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            seq.slot = -1
            return True
        adapters = self.adapters
        if adapters.is_fetching(seq.adapter):
            return False  # its files are still on the way; decode goes on meanwhile
        if not adapters.can_acquire(seq.adapter):
            return False
        seq.slot = adapters.acquire_slot(seq.adapter)
        return True

    def finish(self, seq: Sequence, *, keep_content: bool = True) -> None:
        """Frees the row and the adapter reference of a running or waiting sequence; the row
        keeps its K/V as a cached prefix unless `keep_content` is False (a failed step)."""
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
            if seq in self.extending:
                self.extending.remove(seq)
            if keep_content:
                # The last sampled token was never fed back, so its K/V are not in the row.
                written = seq.prompt_ids[: seq.computed]
                if seq.computed == len(seq.prompt_ids):
                    written = written + seq.output_ids[:-1]
                self.contents.set(seq.row, self._key(seq), written)
            else:
                self.contents.clear(seq.row)
            self.free_rows.append(seq.row)
            seq.row = None
            if seq.adapter is not None and self.adapters is not None:
                self.adapters.release_slot(seq.adapter, seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running.values():
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

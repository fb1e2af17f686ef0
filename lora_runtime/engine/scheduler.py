"""Continuous batching with adapters: which waiting requests join the running batch.

A running request holds a KV cache row and, if it names an adapter, a refcount on that
adapter's device slot, so the distinct adapters in a batch never exceed the slots
(`max_loras_per_batch`). Requests whose adapter is already resident are admitted
first; a request passed over for more than `max_wait_steps` steps stops all other
admissions until it is admitted, which bounds its wait by the longest running request.
"""

from __future__ import annotations

import collections
from typing import Protocol

from lora_runtime.engine.config import EngineConfig
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


class Scheduler:
    """Host bookkeeping of waiting and running sequences; used by the engine thread only."""

    def __init__(self, config: EngineConfig, adapters: AdapterSlots | None):
        self.config = config
        self.adapters = adapters
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.free_rows: list[int] = list(range(config.max_batch - 1, -1, -1))
        self.step = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival = self.step
        self.waiting.append(seq)
        if seq.adapter is not None and self.adapters is not None:
            if not (self.adapters.is_resident(seq.adapter) or self.adapters.is_host_cached(seq.adapter)):
                self.adapters.prefetch([seq.adapter])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """Moves waiting sequences into free rows for one prefill step.

        Returns the admitted sequences and those that failed to get their adapter
        (with the error), which the engine finishes with that error.
        """
        admitted: list[Sequence] = []
        failed: list[tuple[Sequence, Exception]] = []
        if not self.waiting or not self.free_rows:
            return admitted, failed
        budget = self.config.prefill_budget
        oldest = self.waiting[0]
        if self.step - oldest.arrival > self.config.max_wait_steps:
            candidates = [oldest]  # starving: nothing else joins until it does
        else:
            candidates = sorted(self.waiting, key=lambda s: (not self._is_warm(s), s.arrival))
        used = 0
        for seq in candidates:
            if not self.free_rows:
                break
            if used + len(seq.prompt_ids) > budget:
                continue
            try:
                if not self._take_slot(seq):
                    continue
            except Exception as err:  # the adapter could not be loaded: fail this request only
                self.waiting.remove(seq)
                failed.append((seq, err))
                continue
            self.waiting.remove(seq)
            seq.row = self.free_rows.pop()
            self.running[seq.row] = seq
            used += len(seq.prompt_ids)
            admitted.append(seq)
        return admitted, failed

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

    def finish(self, seq: Sequence) -> None:
        """Frees the row and the adapter reference of a running or waiting sequence."""
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
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

"""Host bookkeeping of a replica's adapters: registry view → host LRU cache → device slots.

Plain Python (no Ray). One lock guards the bookkeeping, held only for short host work and
never across a device step. The pool has one owner: the thread that dispatches the steps
(the engine's loop, once it calls `set_device_owner`). Every slot write runs there; a
write asked for on another thread (register or sync of a pinned adapter, set_pinned) is
handed to the owner and waited for. Fetches, parsing and the padding to the slot layout
run on fetch threads, one in-flight future per adapter version, so concurrent requests
for a cold adapter fetch it once and the owner only issues the slot write. A few padded
adapters wait on the devices for their slots (`max_staged`): those the scheduler names as first
in line (`stage_ahead`), staged before a slot frees for them.

Adapters are identified by content (LoRAAdapter.content_id, a hash of the weights and
scalings), not by name: the host cache and the device slots are keyed by it, so two names
for the same weights share one host copy and one slot, re-registering the same weights
reloads nothing, and new weights under an old name get a slot of their own.

An adapter with modules_to_save copies (embed_tokens, lm_head) also takes a saved-module
slot per copy; those are few, so making room for one may evict the least used idle adapter
holding one, whatever its rank class.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lora_runtime.errors import (AdapterNotFoundError, AdapterUnavailableError, CapacityError, InvalidAdapterError,
                                 ServingError)
from lora_runtime.lora.adapter import EMBED, HEAD, LoRAAdapter, check_room
from lora_runtime.lora.batch_info import (SAVED_COLUMNS, SLOT_BIAS, SLOT_DORA, SLOT_EMBED, SLOT_HEAD,
                                          LoRABatchInfo, build_batch_info)
from lora_runtime.lora.base_weights import BaseWeights, same_weights
from lora_runtime.lora.dora import output_terms, warm_up_scales
from lora_runtime.lora.eviction import HALF_LIFE_PER_SLOT, UseScores
from lora_runtime.lora.host_cache import HostAdapterCache
from lora_runtime.lora.memory_pool import (
    LoRAMemoryPool, OutputTerms, StagedSlot, saved_modules_within, stage_slot, write_saved, write_slot,
)
from lora_runtime.lora.sources import SourcePolicy, load_adapter
from lora_runtime.native_thread import name_native_thread

Key = tuple[str, int]  # (adapter name, version)
# (the slot layout already on the devices with its DoRA terms (StagedSlot), or, on a replica
#  over several hosts, group -> (A [L, n*R, in], (B_i [L, R, out_i], ...)) on the host in the
#  pool's dtype (LoRAAdapter.pool_weights),
#  None, or those hosts' DoRA terms once computed with the write,
#  the modules_to_save copies in the pool's dtype: module -> [vocab, hidden])
Weights = tuple[StagedSlot | dict, OutputTerms | None, dict[str, np.ndarray]]
STAGED_TTL_S = 5.0  # a staged adapter nobody took for this long may make room for another
# Adapters staged on the devices at once, waiting for their slot writes (the memory plan
# keeps room for them and one more being written: lora_runtime/engine/memory_plan.py).
MAX_STAGED = 4


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One adapter of the registry as a replica sees it."""

    name: str
    source: str  # URL (see sources.py)
    version: int
    pinned: bool = False
    content: bytes | None = None  # the content id the admin validated, when the registry records it


@dataclasses.dataclass
class LoRAStats:
    """Counters for metrics; `stats()` returns a copy."""

    loads: int = 0  # device slot writes
    evictions: int = 0  # slot writes that displaced another adapter
    host_hits: int = 0  # acquires of a non-resident adapter found in the host cache
    host_misses: int = 0  # acquires that had to fetch (or wait for a fetch)
    host_evictions: int = 0
    fetches: int = 0  # completed fetch + parse
    fetch_errors: int = 0
    fetch_seconds: float = 0.0
    load_seconds: float = 0.0  # host time of slot writes (transfer and dispatch)


@dataclasses.dataclass
class _Slot:
    content: bytes | None = None  # the adapter's content id (LoRAAdapter.content_id); None: empty
    holders: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # name -> references
    last_used: int = 0
    scaling: float = 0.0
    rank: int = 0
    stale: bool = False  # no registered name has this content any more: freed when refcount reaches 0
    flags: int = 0  # SLOT_* bits (batch_info): DoRA, embedding and head adapters
    saved: dict[str, int] = dataclasses.field(default_factory=dict)  # module -> its saved-module slot

    @property
    def refcount(self) -> int:
        return sum(self.holders.values())


@dataclasses.dataclass
class _Staged:
    """An adapter padded to the slot layout, waiting for its slot write."""

    adapter: LoRAAdapter
    weights: Weights
    since: float


class LoRAManager:
    """Which adapters a replica knows, caches on the host, and holds in device slots."""

    def __init__(self, model_config, mesh: jax.sharding.Mesh, *, max_lora_rank: int, max_cpu_loras: int,
                 max_cpu_bytes: int, source_policy: SourcePolicy, dtype, num_slots: int | None = None,
                 rank_classes: Sequence[tuple[int, int]] | None = None, fetch_workers: int = 2,
                 base_weights: BaseWeights | None = None, outer: bool = False, dora: bool = False,
                 bias: bool = False, saved_module_bytes: int = 0, saved_slots: int = 1, load_timeout_s: float = 30.0):
        """`num_slots` slots of rank `max_lora_rank`, or the `rank_classes` ((rank, slots)
        pairs, the widest `max_lora_rank`; memory_plan.pool_classes sizes them): an adapter
        takes a slot of the narrowest class it fits, a wider one's free slot before evicting.
        `base_weights`: the served model's weights, which DoRA adapters and the base weights
        PEFT saves with embed/head adapters are checked against; `outer`: the pool holds
        embed_tokens and lm_head adapters; `dora`: it holds DoRA scales (needs base_weights);
        `bias`: it holds the shifts of lora_bias adapters;
        `saved_module_bytes`: the most bytes of modules_to_save copies one adapter may bring
        (0 refuses them), held in `saved_slots` saved-module slots per module that fits.
        `load_timeout_s`: how long requests wait for an adapter's fetch from its storage; past
        it they fail (AdapterUnavailableError) while the fetch goes on for later ones."""
        if dora and base_weights is None:
            raise ValueError("dora=True needs the base model's weights (base_weights)")
        if rank_classes is not None:
            if num_slots is not None:
                raise ValueError("give num_slots or rank_classes, not both")
            widest = max(int(r) for r, _ in rank_classes)
            if widest != max_lora_rank:
                raise ValueError(f"the widest rank class ({widest}) must be {max_lora_rank=}")
            shape = dict(classes=rank_classes)
        else:
            shape = dict(num_slots=num_slots, max_lora_rank=max_lora_rank)
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.source_policy = source_policy
        self.base_weights = base_weights
        self.saved_module_bytes = saved_module_bytes
        saved = saved_modules_within(model_config, saved_module_bytes, dtype)
        self._pool = LoRAMemoryPool.create(model_config, mesh, dtype=dtype, outer=outer, dora=dora, bias=bias,
                                           saved_modules=saved, saved_slots=saved_slots if saved else 0, **shape)
        self._host = HostAdapterCache(max_bytes=max_cpu_bytes, max_count=max_cpu_loras)
        self._slots = [_Slot() for _ in range(self._pool.num_slots)]
        self._rank_of_content: dict[bytes, int] = {}  # for choosing a class before the weights are at hand
        self._saved_of_content: dict[bytes, tuple[str, ...]] = {}  # the modules_to_save copies of each
        self._content_of: dict[Key, bytes] = {}  # registered versions parsed at least once
        self._slot_of_content: dict[bytes, int] = {}
        self._registry: dict[str, RegistryEntry] = {}
        self._inflight: dict[Key, concurrent.futures.Future] = {}
        # Adapters padded for a slot write ahead of admission (a few at a time: they are large).
        self._staged: collections.OrderedDict[Key, _Staged] = collections.OrderedDict()
        self._staging: set[Key] = set()
        self.max_staged = max(1, min(self._pool.num_slots, MAX_STAGED))
        self._fetch_failed: dict[Key, Exception] = {}  # background fetches that failed, told once
        self._fetching_since: dict[Key, float] = {}  # fetches from storage under way, since when
        self.load_timeout_s = load_timeout_s
        self._owner: Callable[[Callable], object] | None = None
        # A multi-host replica's leader (engine/spmd.py): slot writes go to the followers first.
        self.mirror = None
        # On a mesh spanning processes, device work on the base weights (DoRA's norms, the check
        # of saved base weights) involves every host, so it runs with the slot write, in the
        # order every host launches ops, instead of on fetch threads.
        self._spans_hosts = not NamedSharding(mesh, PartitionSpec()).is_fully_addressable
        self._followed: collections.OrderedDict[Key, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.RLock()
        self._tick = 0
        # Idle slots leave least used first (eviction.py), counted per content.
        self._uses = UseScores(HALF_LIFE_PER_SLOT * self._pool.num_slots)
        self._stats = LoRAStats()
        self._executor = concurrent.futures.ThreadPoolExecutor(fetch_workers, thread_name_prefix="adapter-fetch",
                                                             initializer=name_native_thread)

    # ---- views -------------------------------------------------------------------------

    @property
    def pool(self) -> LoRAMemoryPool:
        with self._lock:
            return self._pool

    def set_device_owner(self, run: Callable[[Callable], object] | None) -> None:
        """Hands every later slot write to `run(fn)`, which runs fn on the thread that
        dispatches the steps and returns its result (None: writes run on the caller)."""
        self._owner = run

    def _run_owned(self, fn: Callable[[], object]):
        owner = self._owner
        return fn() if owner is None else owner(fn)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def stats(self) -> LoRAStats:
        with self._lock:
            return dataclasses.replace(self._stats, host_evictions=self._host.evictions)

    @property
    def host_cache_bytes(self) -> int:
        with self._lock:
            return self._host.nbytes

    def slot_of(self, name: str) -> int | None:
        """The slot holding the current version of `name`, or None."""
        with self._lock:
            entry = self._registry.get(name)
            return None if entry is None else self._resident((name, entry.version))

    def content_of(self, name: str) -> bytes | None:
        """The content id of the current version of `name` (what its K/V depend on), if that
        version was parsed already; else None."""
        with self._lock:
            entry = self._registry.get(name)
            return None if entry is None else self._content_of.get((name, entry.version))

    def slot_content(self, slot: int) -> bytes | None:
        """The content id of the adapter `slot` holds, or None if empty."""
        with self._lock:
            return self._slots[slot].content

    def is_resident(self, name: str) -> bool:
        return self.slot_of(name) is not None

    def is_host_cached(self, name: str) -> bool:
        with self._lock:
            entry = self._registry.get(name)
            return entry is not None and self._cached((name, entry.version)) is not None

    def is_fetching(self, name: str) -> bool:
        """Whether the current version of `name` is being fetched (by prefetch or an acquire)."""
        with self._lock:
            entry = self._registry.get(name)
            return entry is not None and (name, entry.version) in self._inflight

    def is_ready(self, name: str) -> bool:
        """Whether acquire_slot(name) would only issue a slot write (resident, or fetched and
        padded); if not, starts that work in the background. Raises the error of a failed
        background fetch once, so the request that waited on it fails with it."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None:
                return True  # acquire_slot says it is not registered
            key = (name, entry.version)
            if self._resident(key) is not None or key in self._staged:
                return True
            err = self._fetch_failed.pop(key, None)
            if err is not None:
                raise err
            if key in self._staging or key in self._inflight:
                since = self._fetching_since.get(key)
                if since is not None and time.monotonic() - since > self.load_timeout_s:
                    raise AdapterUnavailableError(
                        f"adapter {name!r} is still being fetched from {entry.source!r} after "
                        f"{time.monotonic() - since:.0f} s (load_timeout_s={self.load_timeout_s:g}): its storage is "
                        "slow or unreachable; retry"
                    )
                return False
            if len(self._staged) + len(self._staging) >= self.max_staged:
                oldest = next(iter(self._staged.values()), None)
                if oldest is None or time.monotonic() - oldest.since < STAGED_TTL_S:
                    return False  # room comes as staged adapters get their slots
                self._staged.popitem(last=False)
            self._staging.add(key)
        self._executor.submit(self._stage, entry)
        return False

    def stage_ahead(self, names: Iterable[str]) -> None:
        """Fetches, pads and stages on the devices, off the engine thread, the adapters that
        waiting requests need next: the first `max_staged` distinct ones of `names` (the queue's
        order) that are not resident or still on their way from storage. Staged adapters not
        among them give way (oldest first),
        so the staging room holds what the next free slots go to, not what other requests
        asked for earlier. Unregistered names, and those whose fetch failed, are skipped."""
        entries = []
        with self._lock:
            wanted: dict[Key, RegistryEntry] = {}
            for name in names:
                entry = self._registry.get(name)
                if entry is None:
                    continue
                key = (name, entry.version)
                if (key in wanted or key in self._fetch_failed or key in self._inflight
                        or self._resident(key) is not None):
                    continue  # a fetch from storage under way is staged once it is in the host cache
                wanted[key] = entry
                if len(wanted) == self.max_staged:
                    break
            for key, entry in wanted.items():
                if key in self._staged or key in self._staging:
                    continue
                if len(self._staged) + len(self._staging) >= self.max_staged:
                    victim = next((k for k in self._staged if k not in wanted), None)
                    if victim is None:
                        break  # the room is staging wanted adapters already
                    del self._staged[victim]
                self._staging.add(key)
                entries.append(entry)
        for entry in entries:
            self._executor.submit(self._stage, entry)

    def check_request(self, name: str) -> None:
        """AdapterNotFoundError unless `name` is registered."""
        self._entry(name)

    def list_adapters(self) -> list[dict]:
        """The registry view with each adapter's residency, one dict per adapter."""
        with self._lock:
            out = []
            for name, e in sorted(self._registry.items()):
                key = (name, e.version)
                slot = self._resident(key)
                content = self._content_of.get(key)
                out.append({"name": name, "source": e.source, "version": e.version, "pinned": e.pinned,
                            "slot": slot, "refcount": 0 if slot is None else self._slots[slot].refcount,
                            "slot_rank": None if slot is None else self._pool.classes[self._pool.class_of(slot)].rank,
                            "modules_to_save": None if content is None or content not in self._rank_of_content
                            else list(self._saved_of_content.get(content, ())),
                            "host_cached": self._cached(key) is not None,
                            "content_id": None if content is None else content.hex()})
            return out

    def residency(self) -> dict:
        """What this replica holds, as a router models it (cluster/routing.py HeldReport):
        the resident adapters in eviction order (the first leaves first) with their decayed
        use counts and the counts' half-life in uses of the pool, and the host-cached ones
        least recently used first. Names sharing one content stand together."""
        with self._lock:
            names_of: dict[bytes, list[str]] = collections.defaultdict(list)
            for name, e in sorted(self._registry.items()):
                content = self._content_of.get((name, e.version))
                if content is not None:
                    names_of[content].append(name)
            resident, scores = [], []
            for slot in sorted((i for i, s in enumerate(self._slots) if s.content is not None),
                               key=self._eviction_order):
                content = self._slots[slot].content
                resident += names_of.get(content, ())
                scores += [self._uses.score(content)] * len(names_of.get(content, ()))
            host = [name for content in self._host.keys() for name in names_of.get(content, ())]
            return {"resident": resident, "resident_scores": scores, "half_life": self._uses.half_life,
                    "host_cached": host}

    def slot_classes(self) -> dict[int, tuple[int, int]]:
        """Per rank class of the pool: slot rank -> (slots holding an adapter, slots)."""
        with self._lock:
            return {rc.rank: (sum(self._slots[i].content is not None
                                  for i in range(rc.first_slot, rc.first_slot + rc.num_slots)), rc.num_slots)
                    for rc in self._pool.classes}

    def can_acquire(self, name: str) -> bool:
        """Whether acquire_slot(name) would not wait for a slot now (no I/O)."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None:
                return True  # acquire_slot fails at once: the request learns it is not registered
            key = (name, entry.version)
            if self._resident(key) is not None:
                return True
            # A rank not known yet (never fetched) asks for the narrowest class.
            content = self._content_of.get(key)
            slot = self._free_slot(self._rank_of_content.get(content, 1))
            return slot is not None and self._saved_plan(self._saved_of_content.get(content, ()), slot) is not None

    def held_slots_for(self, name: str) -> dict[int, int]:
        """When acquire_slot(name) would wait for a slot: slot -> references held on it, for
        each held slot it could take once those were released (unpinned, of a class the
        adapter fits). Empty when it would not wait, when its rank is not known yet (fetch it
        first) or when it has modules_to_save copies (their slots are planned apart)."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None:
                return {}
            key = (name, entry.version)
            content = self._content_of.get(key)
            if self._resident(key) is not None or content not in self._rank_of_content:
                return {}
            if self._saved_of_content.get(content):
                return {}
            pinned = self._pinned_contents()
            rank = self._rank_of_content[content]
            return {i: s.refcount for rc in self._pool.classes if rc.rank >= rank
                    for i in range(rc.first_slot, rc.first_slot + rc.num_slots)
                    if (s := self._slots[i]).refcount > 0 and (s.stale or s.content not in pinned)}

    # ---- registry ----------------------------------------------------------------------

    def register(self, name: str, source: str, *, pinned: bool = False, version: int | None = None) -> RegistryEntry:
        """Fetches and validates an adapter, then adds it (a new version if `name` exists).

        On any error (bad adapter, bad source, no slot to pin it in) the registry, host
        cache and pool are left exactly as they were.
        """
        with self._lock:
            old = self._registry.get(name)
        if version is None:
            version = 1 if old is None else old.version + 1
        entry = RegistryEntry(name=name, source=source, version=version, pinned=pinned)
        if pinned:
            self._hint(entry)
        adapter = self._fetch_now(entry)
        weights = self._pool_weights(adapter) if pinned else None

        def apply() -> None:
            with self._lock:
                if pinned:
                    slot = self._free_slot(adapter.rank)
                    if slot is None:
                        raise CapacityError(f"cannot pin adapter {name!r}: all {self._slots_for(adapter.rank)} slots "
                                            f"of rank >= {adapter.rank} are held or pinned")
                    if self._saved_plan(tuple(adapter.saved_modules), slot) is None:
                        raise CapacityError(f"cannot pin adapter {name!r}: all {self._pool.num_saved_slots} "
                                            "modules_to_save slots are held or pinned")
                self._apply_entry(entry)
                self._remember((name, version), adapter)
                if pinned:
                    self._make_resident(entry, adapter, weights)

        if pinned:
            self._run_owned(apply)
        else:
            apply()
        return entry

    def unregister(self, name: str) -> None:
        """Removes `name`: new acquires fail at once, holders keep their slot until release."""
        with self._lock:
            self._entry(name)
            del self._registry[name]
            self._retire(name)

    def set_pinned(self, name: str, pinned: bool) -> None:
        """Pins (makes resident, never evicted) or unpins `name`."""
        entry = self._entry(name)
        if pinned:
            self._ensure_resident(entry)
        with self._lock:
            current = self._entry(name)
            self._registry[name] = dataclasses.replace(current, pinned=pinned)

    def sync(self, entries: Iterable[RegistryEntry]) -> dict[str, ServingError]:
        """Applies a registry snapshot; returns the pinned adapters that could not be made resident.

        Names absent from the snapshot are unregistered; a changed version or source
        replaces the old adapter once no request uses it. Nothing is fetched except
        pinned adapters, which must be resident.
        """
        snapshot = {e.name: e for e in entries}
        with self._lock:
            for name in list(self._registry):
                if name not in snapshot:
                    del self._registry[name]
                    self._retire(name)
            for e in snapshot.values():
                self._apply_entry(e)
        errors = {}
        for e in snapshot.values():
            if e.pinned:
                try:
                    self._ensure_resident(e)
                except ServingError as err:
                    errors[e.name] = err
        return errors

    # ---- slots -------------------------------------------------------------------------

    def acquire_slot(self, name: str) -> int:
        """Makes `name` resident and takes a reference on its slot; call it on the device
        owner's thread. Fetches and pads here only what is_ready did not prepare."""
        while True:
            entry = self._entry(name)
            key = (name, entry.version)
            with self._lock:
                slot = self._resident(key)
                if slot is not None:
                    return self._ref(slot, name)
                staged = self._staged.pop(key, None)
            adapter, weights = (staged.adapter, staged.weights) if staged else self._prepare(entry)
            with self._lock:
                if not self._is_current(entry):
                    continue  # unregistered or replaced meanwhile: look again
                slot = self._make_resident(entry, adapter, weights)
                return self._ref(slot, name)

    def release_slot(self, name: str, slot: int | None = None) -> None:
        """Drops one reference; `slot` picks which when old and new versions are both held."""
        with self._lock:
            held = [i for i, s in enumerate(self._slots) if s.holders[name] > 0]
            if slot is None:
                if len(held) != 1:
                    raise ValueError(f"adapter {name!r} holds slots {held}; pass the slot to release")
                slot = held[0]
            elif slot not in held:
                raise ValueError(f"adapter {name!r} holds no reference on {slot=} (held: {held})")
            s = self._slots[slot]
            s.holders[name] -= 1
            if s.holders[name] == 0:
                del s.holders[name]
            if s.refcount == 0 and s.stale:
                self._free(slot)

    def prefetch(self, names: Iterable[str]) -> None:
        """Fetches and parses adapters into the host cache in the background.

        Unregistered names are skipped: acquire_slot reports them.
        """
        for name in names:
            with self._lock:
                entry = self._registry.get(name)
                if entry is None:
                    continue
                key = (name, entry.version)
                if (self._resident(key) is not None or self._cached(key) is not None or key in self._inflight
                        or key in self._staging or key in self._staged):
                    continue
                future = concurrent.futures.Future()
                self._inflight[key] = future
            self._hint(entry)
            self._executor.submit(self._run_fetch, entry, future, True)

    def prepare_lora_batch(self, token_slots: np.ndarray,  # i32[T], -1 = none
                           max_segments: int | None = None) -> LoRABatchInfo:
        """The step's LoRABatchInfo: token slots plus each slot's scaling and rank;
        `max_segments` bounds its distinct adapters (see build_batch_info)."""
        token_slots = np.asarray(token_slots, dtype=np.int32)
        with self._lock:
            scalings = np.array([s.scaling for s in self._slots], np.float32)
            ranks = np.array([s.rank for s in self._slots], np.int32)
            flags = np.array([s.flags for s in self._slots], np.int32)
            saved = np.array([[s.saved.get(m, -1) for m in SAVED_COLUMNS] for s in self._slots], np.int32)
            used = np.unique(token_slots[token_slots >= 0])
            for slot in used:
                if slot < self.num_slots and self._slots[slot].refcount == 0:
                    raise ValueError(f"token slot {int(slot)} is not held by any request")
        return build_batch_info(token_slots, scalings, ranks, max_segments, flags, saved)

    def close(self) -> None:
        """Stops the background fetch threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- internals (callers of the underscore methods below hold the lock) -------------

    def _entry(self, name: str) -> RegistryEntry:
        with self._lock:
            entry = self._registry.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return entry

    def _is_current(self, entry: RegistryEntry) -> bool:
        cur = self._registry.get(entry.name)
        return cur is not None and (cur.version, cur.source) == (entry.version, entry.source)

    def _apply_entry(self, entry: RegistryEntry) -> None:
        old = self._registry.get(entry.name)
        if old is not None and (old.version, old.source) != (entry.version, entry.source):
            self._retire(entry.name)
        self._registry[entry.name] = entry
        key = (entry.name, entry.version)
        if entry.content is not None and key not in self._content_of:
            # Known before any fetch: a slot or host copy of that content serves it as it is.
            self._content_of[key] = entry.content

    def _retire(self, name: str) -> None:
        """Forgets every version of `name`; what no other registered name shares (same content)
        leaves the host cache and the slots (held slots when released)."""
        contents = {self._content_of.pop(k) for k in [k for k in self._content_of if k[0] == name]}
        live = set(self._content_of.values())
        for key in [k for k in self._staged if k[0] == name]:
            del self._staged[key]
        for key in [k for k in self._fetch_failed if k[0] == name]:
            del self._fetch_failed[key]
        for content in contents - live:
            self._host.pop(content)
            self._rank_of_content.pop(content, None)
            self._saved_of_content.pop(content, None)
            slot = self._slot_of_content.get(content)
            if slot is None:
                continue
            if self._slots[slot].refcount == 0:
                self._free(slot)
            else:
                self._slots[slot].stale = True

    def _remember(self, key: Key, adapter: LoRAAdapter) -> None:
        """Records what `key` holds and caches it on the host (once per content). A content
        a stale slot still holds becomes live again."""
        self._content_of[key] = adapter.content_id
        self._rank_of_content[adapter.content_id] = adapter.rank
        self._saved_of_content[adapter.content_id] = tuple(adapter.saved_modules)
        if self._host.get(adapter.content_id) is None:  # a hit marks it most recently used
            self._host.put(adapter.content_id, adapter)
        slot = self._slot_of_content.get(adapter.content_id)
        if slot is not None:
            self._slots[slot].stale = False

    def _resident(self, key: Key) -> int | None:
        """The slot holding `key`'s content, if known and resident."""
        content = self._content_of.get(key)
        return None if content is None else self._slot_of_content.get(content)

    def _cached(self, key: Key) -> LoRAAdapter | None:
        content = self._content_of.get(key)
        return None if content is None else self._host.peek(content)

    def _slots_for(self, rank: int) -> int:
        """How many slots are wide enough for an adapter of `rank`."""
        return sum(rc.num_slots for rc in self._pool.classes if rc.rank >= rank)

    def _free(self, slot: int) -> None:
        s = self._slots[slot]
        if s.content is not None and self._slot_of_content.get(s.content) == slot:
            del self._slot_of_content[s.content]
        self._slots[slot] = _Slot(last_used=s.last_used)

    def _ref(self, slot: int, name: str) -> int:
        self._tick += 1
        s = self._slots[slot]
        s.holders[name] += 1
        s.last_used = self._tick
        self._uses.use(s.content)
        return slot

    def _eviction_order(self, slot: int) -> tuple:
        """Sort key of an idle slot among eviction candidates: content no name has any more
        first, then the least used lately (eviction.py), then the least recently used."""
        s = self._slots[slot]
        return (not s.stale, self._uses.score(s.content), s.last_used)

    def _pinned_contents(self) -> set[bytes]:
        return {c for e in self._registry.values() if e.pinned
                and (c := self._content_of.get((e.name, e.version))) is not None}

    def _free_slot(self, rank: int) -> int | None:
        """A slot for an adapter of `rank`: an empty one of the narrowest class it fits, else
        of a wider class, else the least used unpinned slot nobody holds (_eviction_order) of
        the narrowest class that has one (eviction stays within a class)."""
        fitting = [rc for rc in self._pool.classes if rc.rank >= rank]
        for rc in fitting:
            for i in range(rc.first_slot, rc.first_slot + rc.num_slots):
                if self._slots[i].content is None:
                    return i
        pinned = self._pinned_contents()
        for rc in fitting:
            candidates = [i for i in range(rc.first_slot, rc.first_slot + rc.num_slots)
                          if (s := self._slots[i]).refcount == 0 and (s.stale or s.content not in pinned)]
            if candidates:
                return min(candidates, key=self._eviction_order)
        return None

    def _saved_plan(self, modules: Sequence[str], slot: int) -> dict[str, tuple[int, int | None]] | None:
        """For an adapter taking `slot` with modules_to_save copies of `modules`: module ->
        (its saved-module slot, the adapter slot to evict for it or None); None if some module
        has no saved-module slot free or held by an idle unpinned adapter. Whatever `slot`
        holds now leaves it, so its saved-module slots count as free."""
        plan, evicted = {}, {slot}
        pinned = self._pinned_contents() if modules else set()
        for module in modules:
            if module in plan:
                continue
            used = {s.saved[module]: i for i, s in enumerate(self._slots) if module in s.saved and i not in evicted}
            free = [j for j in range(self._pool.num_saved_slots) if j not in used]
            if free:
                plan[module] = (free[0], None)
                continue
            idle = [i for i in used.values()
                    if (s := self._slots[i]).refcount == 0 and (s.stale or s.content not in pinned)]
            if not idle:
                return None
            victim = min(idle, key=self._eviction_order)
            evicted.add(victim)
            # The victim's other saved-module slots are free for this adapter's other copies.
            plan.update({m: (j, victim) for m, j in self._slots[victim].saved.items() if m in modules and m not in plan})
        return plan

    def warm_up(self) -> None:
        """Compiles the slot writes (one program serves every slot of a class and written
        rank: an adapter is padded to the narrowest class it fits and may land in a wider one)
        by writing zeros into empty slots, the DoRA scale of each module shape and class rank,
        and the write of each saved-module table, so the first adapter load after warm-up
        compiles nothing."""
        if self.mirror is None:
            self.op_warm_up()
        else:
            with self.mirror.issuing("adapters", "warm_up", ()):
                self.op_warm_up()

    def op_warm_up(self) -> None:
        pool = self._pool
        if pool.dora:
            for rc in pool.classes:
                warm_up_scales(self.base_weights, self.model_config, rc.rank, pool.groups)
        with self._lock:
            for rc in pool.classes:
                slot = next((i for i in range(rc.first_slot, rc.first_slot + rc.num_slots)
                             if self._slots[i].content is None), None)
                if slot is None:
                    continue  # every slot of the class already written
                for narrow in pool.classes:
                    if narrow.rank <= rc.rank:
                        self._pool = write_slot(self._pool, slot, self._zero_weights(narrow.rank))
            for module in pool.layout.saved:
                used = {s.saved[module] for s in self._slots if module in s.saved}
                free = next((j for j in range(pool.num_saved_slots) if j not in used), None)
                if free is not None:
                    shape = (self.model_config.vocab_size, self.model_config.hidden_size)
                    self._pool = write_saved(self._pool, module, free, np.zeros(shape, pool.dtype))

    def _zero_weights(self, rank: int) -> dict:
        """An empty adapter's pool layout at `rank`."""
        pool = self._pool
        top = len(pool.classes) - 1
        out = {}
        for g in pool.groups:
            a, bs = pool.stacked_group(g, top)
            n = len(bs)
            out[g] = (np.zeros((a.shape[0], n * rank, a.shape[3]), np.float32),
                      tuple(np.zeros((b.shape[0], rank, b.shape[3]), np.float32) for b in bs))
        return out

    def _pool_weights(self, adapter: LoRAAdapter) -> Weights:
        """The adapter padded to the pool layout, with its DoRA terms; host work (and the
        device work of DoRA's norms) kept out of the lock."""
        pool = self._pool
        rank = pool.classes[pool.class_for_rank(adapter.rank)].rank  # the narrowest class it fits
        weights = adapter.pool_weights(self.model_config, rank, pool.dtype, pool.holds(EMBED))
        saved = {m: np.asarray(t, pool.dtype) for m, t in adapter.saved_modules.items()}
        if self._spans_hosts:  # DoRA's terms and the transfer go with the slot write (_write_local)
            return weights, None, saved
        # On the devices now, so the slot write on the engine thread moves no bytes.
        return stage_slot(pool, weights, output_terms(pool, self.model_config, self.base_weights, adapter)), None, saved

    def _check_servable(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Refuses what this pool cannot hold (naming the option) and the base weights PEFT
        saved that differ from the served model's; returns the adapter without them."""
        check_room(adapter, dora=self._pool.dora, bias=self._pool.bias, outer=self._pool.holds(EMBED),
                   saved_max_bytes=self.saved_module_bytes, dtype=self._pool.dtype)
        if self._spans_hosts:
            return adapter  # its saved base weights are checked with its slot write (_write_local)
        return self._check_saved_base(adapter)

    def _check_saved_base(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Refuses base weights PEFT saved that differ from the served model's; returns the
        adapter without them."""
        for module, saved in adapter.saved_base.items():
            if self.base_weights is None:
                raise InvalidAdapterError(
                    f"adapter {adapter.name!r} saves base weights for {module} that cannot be checked here")
            if not same_weights(self.base_weights, module, saved):
                path = "model.embed_tokens" if module == EMBED else module
                raise InvalidAdapterError(
                    f"adapter {adapter.name!r}: its saved {path}.base_layer.weight differs from the base model's "
                    f"({saved.nbytes} bytes; a trained or replaced {module} is not supported)")
        return dataclasses.replace(adapter, saved_base={}) if adapter.saved_base else adapter

    def _make_resident(self, entry: RegistryEntry, adapter: LoRAAdapter, weights: Weights) -> int:
        """The slot of `entry`'s content, written now unless another name's slot holds it."""
        key = (entry.name, entry.version)
        self._content_of[key] = adapter.content_id
        slot = self._slot_of_content.get(adapter.content_id)
        if slot is not None:
            self._slots[slot].stale = False
            return slot
        slot = self._free_slot(adapter.rank)
        if slot is None:
            raise CapacityError(
                f"no slot for adapter {entry.name!r}: all {self._slots_for(adapter.rank)} slots of rank >= "
                f"{adapter.rank} are held by requests or pinned"
            )
        plan = self._saved_plan(tuple(adapter.saved_modules), slot)
        if plan is None:
            raise CapacityError(
                f"no modules_to_save slot for adapter {entry.name!r}: all {self._pool.num_saved_slots} are held by "
                "requests or pinned")
        start = time.perf_counter()
        self._write(entry, adapter, weights, slot, {m: j for m, (j, _) in plan.items()})
        if self._slots[slot].content is not None:
            self._stats.evictions += 1
            self._free(slot)
        for index, victim in plan.values():
            if victim is not None and self._slots[victim].content is not None:
                self._stats.evictions += 1
                self._free(victim)
        self._tick += 1
        self._slots[slot] = _Slot(content=adapter.content_id, last_used=self._tick, scaling=adapter.scaling,
                                  rank=adapter.rank, flags=_flags(adapter),
                                  saved={m: j for m, (j, _) in plan.items()})
        self._slot_of_content[adapter.content_id] = slot
        self._rank_of_content[adapter.content_id] = adapter.rank
        self._saved_of_content[adapter.content_id] = tuple(adapter.saved_modules)
        self._stats.loads += 1
        self._stats.load_seconds += time.perf_counter() - start
        return slot

    def _write(self, entry: RegistryEntry, adapter: LoRAAdapter, weights: Weights, slot: int,
               saved: dict[str, int]) -> None:
        """The device side of making `adapter` resident: its slot write and the writes of its
        modules_to_save copies (module -> saved-module slot); a leader's go to its followers first."""
        if self.mirror is None:
            self._write_local(adapter, weights, slot, saved)
            return
        with self.mirror.issuing("adapters", "write", (entry, adapter.content_id, slot, saved)):
            self._write_local(adapter, weights, slot, saved)

    def _write_local(self, adapter: LoRAAdapter, weights: Weights, slot: int, saved: dict[str, int]) -> None:
        lora, terms, copies = weights
        if self._spans_hosts:  # the device work fetch threads leave to the write across hosts
            self._check_saved_base(adapter)
            terms = output_terms(self._pool, self.model_config, self.base_weights, adapter)
        self._pool = write_slot(self._pool, slot, lora, terms)
        for module, index in saved.items():
            self._pool = write_saved(self._pool, module, index, copies[module])

    # ---- a multi-host replica's follower (engine/spmd.py) ------------------------------
    # It holds no registry: the leader decides every slot, and a follower fetches and pads
    # the adapters it is told of (hint_stage) so that their writes (op_write) find them ready.

    def hint_stage(self, entry: RegistryEntry) -> None:
        """Starts fetching and padding `entry` on a fetch thread, unless already under way."""
        key = (entry.name, entry.version)
        with self._lock:
            if key in self._followed:
                self._followed.move_to_end(key)
                return
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._followed[key] = future
            while len(self._followed) > self.max_staged:  # padded adapters are large: a few at a time
                self._followed.popitem(last=False)
        self._executor.submit(self._follow_fetch, entry, future)

    def _follow_fetch(self, entry: RegistryEntry, future: concurrent.futures.Future) -> None:
        try:
            adapter = self._followed_adapter(entry)
            future.set_result((adapter, self._pool_weights(adapter)))
        except Exception as err:
            future.set_exception(err)

    def _followed_adapter(self, entry: RegistryEntry) -> LoRAAdapter:
        """The adapter of `entry` from this follower's host cache, else fetched into it."""
        key = (entry.name, entry.version)
        with self._lock:
            content = self._content_of.get(key)
            adapter = None if content is None else self._host.get(content)
        if adapter is None:
            adapter = self._fetch_now(entry)
            with self._lock:
                self._remember(key, adapter)
        return adapter

    def op_write(self, entry: RegistryEntry, content: bytes, slot: int, saved: dict[str, int]) -> None:
        """Writes what the leader wrote: `entry`'s adapter, whose content id is `content`."""
        key = (entry.name, entry.version)
        with self._lock:
            future = self._followed.pop(key, None)
        try:
            if future is not None:
                adapter, weights = future.result()
            else:  # never hinted, or padded and dropped since: from the host cache or storage now
                adapter = self._followed_adapter(entry)
                weights = self._pool_weights(adapter)
        except Exception as err:  # the leader has it: this host's storage failed, not the request
            raise RuntimeError(f"this host could not fetch adapter {entry.name!r} from {entry.source!r}: {err}") from err
        if adapter.content_id != content:
            raise RuntimeError(f"adapter {entry.name!r} at {entry.source!r} holds other weights on this host "
                               f"(content {adapter.content_id.hex()[:12]}) than on the leader ({content.hex()[:12]})")
        self._write_local(adapter, weights, slot, saved)

    def _ensure_resident(self, entry: RegistryEntry) -> int:
        with self._lock:
            slot = self._resident((entry.name, entry.version))
            if slot is not None:
                return slot
        adapter, weights = self._prepare(entry)

        def write() -> int:
            with self._lock:
                if not self._is_current(entry):
                    raise AdapterNotFoundError(
                        f"adapter {entry.name!r} version {entry.version} is no longer registered")
                return self._make_resident(entry, adapter, weights)

        return self._run_owned(write)

    def _stage(self, entry: RegistryEntry) -> None:
        """Fetch thread: fetches (or takes from the host cache) and pads an adapter for its
        slot write."""
        key = (entry.name, entry.version)
        try:
            adapter, weights = self._prepare(entry)
        except Exception as err:
            with self._lock:
                self._staging.discard(key)
                if self._is_current(entry):
                    self._fetch_failed[key] = err
            return
        with self._lock:
            self._staging.discard(key)
            if self._is_current(entry) and self._resident(key) is None:
                self._staged[key] = _Staged(adapter, weights, time.monotonic())

    def _hint(self, entry: RegistryEntry) -> None:
        """Tells a leader's followers to fetch and pad `entry` too (its write will need it)."""
        if self.mirror is not None:
            self.mirror.hint("adapters", "stage", (entry,))

    def _prepare(self, entry: RegistryEntry) -> tuple[LoRAAdapter, Weights]:
        """The adapter (host cache, else fetched) and its weights padded for a slot write."""
        self._hint(entry)
        adapter = self._host_adapter(entry)
        return adapter, self._pool_weights(adapter)

    def _host_adapter(self, entry: RegistryEntry) -> LoRAAdapter:
        """The parsed adapter from the host cache, or fetched once however many ask."""
        key = (entry.name, entry.version)
        with self._lock:
            content = self._content_of.get(key)
            adapter = None if content is None else self._host.get(content)
            if adapter is not None:
                self._stats.host_hits += 1
                return adapter
            self._stats.host_misses += 1
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = concurrent.futures.Future()
                self._inflight[key] = future
        if owner:
            self._run_fetch(entry, future)
        return future.result()

    def _fetch_now(self, entry: RegistryEntry) -> LoRAAdapter:
        start = time.perf_counter()
        try:
            adapter = self._check_servable(load_adapter(entry.name, entry.source, self.source_policy,
                                                        self.model_config, self.max_lora_rank))
        except Exception:
            with self._lock:
                self._stats.fetch_errors += 1
            raise
        with self._lock:
            self._stats.fetches += 1
            self._stats.fetch_seconds += time.perf_counter() - start
        return adapter

    def _run_fetch(self, entry: RegistryEntry, future: concurrent.futures.Future, background: bool = False) -> None:
        """Fetches a registered adapter for the requests that need it. It was valid when it was
        registered: that it cannot be loaded now is the server's trouble (503), not theirs."""
        key = (entry.name, entry.version)
        with self._lock:
            self._fetching_since.setdefault(key, time.monotonic())
        try:
            adapter = self._fetch_now(entry)
        except Exception as e:  # handed to every waiter through the future
            if isinstance(e, ServingError) and e.status_code != 503:
                cause = e
                e = AdapterUnavailableError(f"adapter {entry.name!r} could not be loaded: {cause}; retry")
                e.__cause__ = cause
            with self._lock:
                self._fetching_since.pop(key, None)
                self._inflight.pop(key, None)
                if background and self._is_current(entry):
                    self._fetch_failed[key] = e  # told to the next is_ready
            future.set_exception(e)
            return
        with self._lock:
            self._fetching_since.pop(key, None)
            self._inflight.pop(key, None)
            if self._is_current(entry):
                self._remember(key, adapter)
        future.set_result(adapter)


def _flags(adapter: LoRAAdapter) -> int:
    """The SLOT_* bits of what an adapter holds beside the projections."""
    flags = SLOT_DORA if adapter.use_dora else 0
    if adapter.has_bias:
        flags |= SLOT_BIAS
    if adapter.outer(EMBED) is not None:
        flags |= SLOT_EMBED
    if adapter.outer(HEAD) is not None:
        flags |= SLOT_HEAD
    return flags

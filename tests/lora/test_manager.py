"""LoRAManager: registry view, host cache, device slots, refcounts, versions, concurrency."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from lora_runtime.errors import (AdapterNotFoundError, AdapterSourceError, AdapterUnavailableError, CapacityError,
                                 InvalidAdapterError)
from lora_runtime.lora.adapter import LoRAAdapter
from lora_runtime.lora.host_cache import HostAdapterCache
from lora_runtime.lora.manager import LoRAManager, RegistryEntry
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import make_mesh
from tests.fault_proxy import fault_proxy
from tests.lora.peft_adapters import read_adapter, write_adapter

R = 16
NAMES = ("r4", "r8_rslora", "r16_pattern", "r8_layer1")


def make_manager(model_config, *, num_slots=2, max_cpu_loras=8, max_cpu_bytes=1 << 24, storage_options=None,
                 **kw):
    policy = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 24, storage_options=storage_options or {})
    return LoRAManager(model_config, make_mesh(1, jax.devices()[:1]), num_slots=num_slots, max_lora_rank=R,
                       max_cpu_loras=max_cpu_loras, max_cpu_bytes=max_cpu_bytes, source_policy=policy,
                       dtype="float32", **kw)


@pytest.fixture
def manager(model_config):
    m = make_manager(model_config)
    yield m
    m.close()


def entries(adapter_dirs, names=NAMES, version=1, pinned=()):
    return [RegistryEntry(name=n, source=str(adapter_dirs[n]), version=version, pinned=n in pinned) for n in names]


def parsed(path, model_config):
    return LoRAAdapter.parse("x", (path / "adapter_config.json").read_bytes(),
                             (path / "adapter_model.safetensors").read_bytes(), model_config, R)


def assert_slot_holds(manager, slot, path, model_config):
    weights = parsed(path, model_config).pool_weights(model_config, R, np.float32)
    for layer in range(model_config.num_layers):
        for g in GROUPS:
            a, bs = manager.pool.group(layer, g)
            np.testing.assert_array_equal(np.asarray(a)[slot], weights[g][0][layer])
            for b, want in zip(bs, weights[g][1]):
                np.testing.assert_array_equal(np.asarray(b)[slot], want[layer])


def use(manager, name):
    slot = manager.acquire_slot(name)
    manager.release_slot(name)
    return slot


def test_the_least_used_idle_adapter_leaves_first(manager, adapter_dirs, model_config):
    """Two slots: an adapter used often stays through one-off uses of others (an LRU would
    evict it for each of them); among equally used ones the least recently used leaves."""
    manager.sync(entries(adapter_dirs))
    s_hot = use(manager, "r4")
    use(manager, "r4")
    use(manager, "r4")
    s_b = use(manager, "r8_rslora")  # the most recently used now, but used once
    assert {s_hot, s_b} == {0, 1}
    s_c = use(manager, "r16_pattern")
    assert s_c == s_b and manager.is_resident("r4") and not manager.is_resident("r8_rslora")
    s_d = use(manager, "r8_layer1")  # r16_pattern (one use) leaves, not r4
    assert s_d == s_b and manager.slot_of("r4") == s_hot and not manager.is_resident("r16_pattern")
    for name in ("r8_rslora", "r16_pattern", "r8_layer1", "r8_rslora"):  # a burst of one-off uses
        assert use(manager, name) == s_b
    assert manager.slot_of("r4") == s_hot
    stats = manager.stats()
    assert stats.loads == 8 and stats.evictions == 6
    # What the replica reports to routers: the next to leave first, with the counts that say so,
    # and the host cache least recently used first.
    # (r4's three uses have decayed below r8_rslora's three later ones: r4 would leave next.)
    held = manager.residency()
    assert held["resident"] == ["r4", "r8_rslora"] and held["half_life"] == 8 * 2
    assert held["resident_scores"][0] < held["resident_scores"][1]
    assert held["host_cached"][-1] == "r8_rslora" and set(held["host_cached"]) == {
        "r4", "r8_rslora", "r16_pattern", "r8_layer1"}
    assert_slot_holds(manager, s_hot, adapter_dirs["r4"], model_config)
    assert_slot_holds(manager, s_b, adapter_dirs["r8_rslora"], model_config)


def test_use_scores_decay_so_yesterdays_favourite_leaves():
    from lora_runtime.lora.eviction import UseScores

    scores = UseScores(half_life=4)
    for _ in range(8):
        scores.use("old")
    assert scores.score("old") > 4
    for _ in range(16):  # four half-lives of other traffic
        scores.use("new")
    assert scores.score("old") < 0.5 < 3 < scores.score("new")
    assert scores.score("never") == 0.0


def test_pinning_keeps_an_adapter_resident(manager, adapter_dirs):
    manager.sync(entries(adapter_dirs, pinned=("r4",)))
    pinned_slot = manager.slot_of("r4")
    assert pinned_slot is not None
    for name in ("r8_rslora", "r16_pattern", "r8_layer1", "r8_rslora"):
        assert use(manager, name) != pinned_slot
    assert manager.slot_of("r4") == pinned_slot
    manager.set_pinned("r16_pattern", True)  # both slots pinned now
    assert not manager.can_acquire("r8_layer1")
    with pytest.raises(CapacityError, match="'r8_layer1'"):
        manager.acquire_slot("r8_layer1")
    assert use(manager, "r4") == pinned_slot  # a pinned adapter itself is still usable
    manager.set_pinned("r4", False)
    assert manager.can_acquire("r8_layer1")
    assert use(manager, "r8_layer1") == pinned_slot


def test_held_slots_are_not_evicted(manager, adapter_dirs):
    manager.sync(entries(adapter_dirs))
    s = manager.acquire_slot("r4")
    manager.acquire_slot("r4")  # two requests share it
    use(manager, "r8_rslora")
    use(manager, "r16_pattern")
    assert manager.slot_of("r4") == s
    other = manager.acquire_slot("r8_layer1")
    with pytest.raises(CapacityError):
        manager.acquire_slot("r8_rslora")
    manager.release_slot("r4")
    with pytest.raises(CapacityError):
        manager.acquire_slot("r8_rslora")  # one reference is still held
    manager.release_slot("r4")
    assert manager.acquire_slot("r8_rslora") == s
    assert other != s
    with pytest.raises(ValueError, match="holds slots"):
        manager.release_slot("r4")


def test_refcounts_under_concurrent_requests(model_config, adapter_dirs):
    manager = make_manager(model_config, num_slots=3)
    manager.sync(entries(adapter_dirs))
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(15):
            name = NAMES[rng.integers(len(NAMES))]
            try:
                slot = manager.acquire_slot(name)
            except CapacityError:
                continue  # every slot held by other threads right now
            try:
                if manager.slot_of(name) != slot:
                    errors.append((name, slot, manager.slot_of(name)))
                time.sleep(0.001)
            finally:
                manager.release_slot(name, slot)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    listing = manager.list_adapters()
    assert all(a["refcount"] == 0 for a in listing)
    resident = [a for a in listing if a["slot"] is not None]
    assert len({a["slot"] for a in resident}) == len(resident) <= 3
    for a in resident:
        assert_slot_holds(manager, a["slot"], adapter_dirs[a["name"]], model_config)
    manager.close()


def test_unregister_while_in_flight(manager, adapter_dirs):
    manager.sync(entries(adapter_dirs))
    s = manager.acquire_slot("r4")
    manager.unregister("r4")
    with pytest.raises(AdapterNotFoundError, match="'r4'"):
        manager.acquire_slot("r4")
    with pytest.raises(AdapterNotFoundError):
        manager.check_request("r4")
    assert not manager.is_resident("r4")
    assert manager.can_acquire("r4") and manager.is_ready("r4")  # a waiting request tries, and fails: not registered
    # The request still holding r4 keeps its slot: only one slot is free for others.
    manager.acquire_slot("r8_rslora")
    with pytest.raises(CapacityError):
        manager.acquire_slot("r16_pattern")
    info = manager.prepare_lora_batch(np.array([s, -1], np.int32))
    assert float(info.slot_scalings[s]) == pytest.approx(2.0)
    manager.release_slot("r4")
    assert manager.acquire_slot("r16_pattern") == s
    with pytest.raises(AdapterNotFoundError):
        manager.unregister("r4")


def snapshot(manager):
    return (manager.list_adapters(), manager.host_cache_bytes,
            [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(manager.pool)])


def assert_same_snapshot(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    for x, y in zip(before[2], after[2]):
        np.testing.assert_array_equal(x, y)


def test_bad_adapter_at_register_changes_nothing(manager, adapter_dirs, model_config, tmp_path):
    manager.register("r4", str(adapter_dirs["r4"]), pinned=True)
    manager.register("r8_rslora", str(adapter_dirs["r8_rslora"]))
    config, tensors = read_adapter(adapter_dirs["r8_rslora"])
    key = next(k for k in tensors if "lora_A" in k)
    bad = write_adapter(tmp_path / "bad", config, {**tensors, key: np.full_like(tensors[key], np.nan)})
    before = snapshot(manager)
    with pytest.raises(InvalidAdapterError, match="non-finite"):
        manager.register("bad", str(bad))
    with pytest.raises(InvalidAdapterError, match="non-finite"):
        manager.register("r8_rslora", str(bad), pinned=True)  # a bad new version of a good adapter
    with pytest.raises(AdapterSourceError, match="no adapter files"):
        manager.register("r16_pattern", str(tmp_path / "absent"))
    assert_same_snapshot(before, snapshot(manager))
    with pytest.raises(AdapterNotFoundError):
        manager.acquire_slot("bad")
    assert_slot_holds(manager, manager.acquire_slot("r8_rslora"), adapter_dirs["r8_rslora"], model_config)


def test_concurrent_cold_loads_fetch_once(model_config, adapter_dirs, gcs):
    url = gcs.upload_dir(adapter_dirs["r16_pattern"], "cold/r16")
    manager = make_manager(model_config, storage_options=gcs.storage_options)
    manager.sync([RegistryEntry("cold", url, 1)])
    barrier = threading.Barrier(6)
    slots = []

    def worker():
        barrier.wait()
        slots.append(manager.acquire_slot("cold"))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = manager.stats()
    assert len(slots) == 6 and len(set(slots)) == 1
    assert stats.fetches == 1 and stats.loads == 1
    # The barrier and the emulator's HTTP round trips make the acquires overlap the fetch.
    assert stats.host_misses >= 2
    assert manager.list_adapters()[0]["refcount"] == 6
    assert_slot_holds(manager, slots[0], adapter_dirs["r16_pattern"], model_config)
    manager.close()


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_prefetch_populates_the_host_cache(manager, adapter_dirs):
    manager.sync(entries(adapter_dirs))
    manager.prefetch(["r4", "r8_rslora", "not-registered"])
    assert manager.is_fetching("r4") or manager.is_host_cached("r4")
    wait_for(lambda: manager.is_host_cached("r4") and manager.is_host_cached("r8_rslora"))
    assert not manager.is_fetching("r4") and not manager.is_fetching("not-registered")
    assert not manager.is_resident("r4") and not manager.is_host_cached("r16_pattern")
    assert manager.stats().fetches == 2
    use(manager, "r4")
    stats = manager.stats()
    assert stats.fetches == 2 and stats.host_hits == 1 and stats.host_misses == 0 and stats.loads == 1
    use(manager, "r16_pattern")
    assert manager.stats().host_misses == 1 and manager.stats().fetches == 3


def test_host_cache_bounded_by_count_and_bytes(model_config, adapter_dirs):
    sizes = {n: parsed(adapter_dirs[n], model_config).nbytes for n in NAMES}
    by_count = make_manager(model_config, max_cpu_loras=2)
    by_count.sync(entries(adapter_dirs))
    for n in ("r4", "r8_rslora", "r16_pattern"):
        by_count.prefetch([n])
        wait_for(lambda n=n: by_count.is_host_cached(n))
    assert [by_count.is_host_cached(n) for n in NAMES] == [False, True, True, False]
    assert by_count.host_cache_bytes == sizes["r8_rslora"] + sizes["r16_pattern"]
    assert by_count.stats().host_evictions == 1
    by_count.close()
    budget = sizes["r4"] + sizes["r8_rslora"]
    by_bytes = make_manager(model_config, max_cpu_bytes=budget)
    by_bytes.sync(entries(adapter_dirs))
    for n in ("r4", "r8_rslora", "r8_layer1"):
        by_bytes.prefetch([n])
        wait_for(lambda n=n: by_bytes.is_host_cached(n))
    assert by_bytes.host_cache_bytes <= budget
    assert not by_bytes.is_host_cached("r4") and by_bytes.is_host_cached("r8_layer1")
    by_bytes.close()


def test_host_cache_lru_unit():
    def fake(n):
        return LoRAAdapter(name=str(n), rank=1, scaling=1.0,
                           weights={(0, "q_proj"): _mw(n)})

    cache = HostAdapterCache(max_bytes=3 * 8 * 4, max_count=3)
    for k in (1, 2, 3):
        assert cache.put(k, fake(1)) == []
    cache.get(1)
    assert cache.put(4, fake(1)) == [2]
    assert cache.keys() == [3, 1, 4]
    assert cache.put(5, fake(2)) == [3, 1]  # twice the bytes: two must go
    assert cache.put(6, fake(10)) == [] and 6 not in cache  # larger than the whole budget
    with pytest.raises(ValueError, match="max_count=0"):
        HostAdapterCache(max_bytes=1, max_count=0)


def _mw(n):
    from lora_runtime.lora.adapter import ModuleWeights

    return ModuleWeights(a=np.zeros((1, 4 * n), np.float32), b=np.zeros((4 * n, 1), np.float32), ratio=1.0)


def test_sync_with_a_new_version(manager, adapter_dirs, model_config):
    manager.sync(entries(adapter_dirs, names=("r4", "r8_rslora")))
    old = manager.acquire_slot("r4")
    v2 = RegistryEntry("r4", str(adapter_dirs["r16_pattern"]), 2)
    assert manager.sync([v2, entries(adapter_dirs, names=("r8_rslora",))[0]]) == {}
    assert not manager.is_resident("r4")
    new = manager.acquire_slot("r4")
    assert new != old
    assert_slot_holds(manager, new, adapter_dirs["r16_pattern"], model_config)
    assert_slot_holds(manager, old, adapter_dirs["r4"], model_config)  # the running request's weights
    with pytest.raises(ValueError, match="holds slots"):
        manager.release_slot("r4")
    manager.release_slot("r4", old)
    manager.release_slot("r4", new)
    assert manager.slot_of("r4") == new
    assert manager.list_adapters()[0]["version"] == 2
    # Not held: a new version replaces the resident one at once; names left out are dropped.
    errors = manager.sync([RegistryEntry("r4", str(adapter_dirs["r8_layer1"]), 3, pinned=True),
                           RegistryEntry("broken", str(adapter_dirs["r4"].parent / "absent"), 1, pinned=True)])
    assert list(errors) == ["broken"]
    assert manager.slot_of("r4") is not None
    assert_slot_holds(manager, manager.slot_of("r4"), adapter_dirs["r8_layer1"], model_config)
    with pytest.raises(AdapterNotFoundError):
        manager.check_request("r8_rslora")


def test_prepare_lora_batch(manager, adapter_dirs):
    manager.sync(entries(adapter_dirs))
    s4, s8 = manager.acquire_slot("r4"), manager.acquire_slot("r8_rslora")
    info = manager.prepare_lora_batch(np.array([s8, -1, s4, s8], np.int32))
    assert info.slot_scalings[s4] == pytest.approx(2.0)
    assert info.slot_scalings[s8] == pytest.approx(16 / np.sqrt(8))
    assert list(info.slot_ranks[[s4, s8]]) == [4, 8]
    assert list(np.asarray(info.token_slots)) == [s8, -1, s4, s8]
    manager.release_slot("r4")
    with pytest.raises(ValueError, match=f"token slot {s4} is not held"):
        manager.prepare_lora_batch(np.array([s4], np.int32))


def test_slot_writes_run_on_the_device_owner(manager, adapter_dirs):
    """Once an owner is set, a slot write asked for on another thread (pinning, a pinned
    sync or register) runs through it; its errors reach the caller."""
    manager.sync(entries(adapter_dirs))
    calls = []

    def owner(fn):
        box = {}

        def run():
            calls.append(threading.get_ident())
            try:
                box["out"] = fn()
            except Exception as err:
                box["err"] = err

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    manager.set_device_owner(owner)
    manager.set_pinned("r4", True)
    assert len(calls) == 1 and calls[0] != threading.get_ident() and manager.is_resident("r4")
    manager.set_pinned("r8_rslora", True)
    with pytest.raises(CapacityError, match="all 2 slots"):  # both slots pinned: refused, nothing changed
        manager.register("r16_pattern", str(adapter_dirs["r16_pattern"]), pinned=True, version=7)
    versions = {a["name"]: a["version"] for a in manager.list_adapters()}
    assert versions["r16_pattern"] == 1 and len(calls) == 3
    manager.set_device_owner(None)
    manager.set_pinned("r4", False)
    use(manager, "r16_pattern")
    assert len(calls) == 3


def test_is_ready_prepares_an_adapter_off_the_calling_thread(manager, adapter_dirs, monkeypatch):
    """is_ready starts the fetch, the padding and the transfer to the devices in the
    background; acquire_slot then only launches the slot write, moving no bytes. A failed
    background fetch is told to the next is_ready, once."""
    manager.sync(entries(adapter_dirs) + [RegistryEntry("gone", str(adapter_dirs["r4"].parent / "absent"), 1)])
    padded_on, put_on = [], []
    pool_weights, device_put = LoRAAdapter.pool_weights, jax.device_put

    def spy(self, *args):
        padded_on.append(threading.get_ident())
        return pool_weights(self, *args)

    def put_spy(*args, **kw):
        put_on.append(threading.get_ident())
        return device_put(*args, **kw)

    monkeypatch.setattr(LoRAAdapter, "pool_weights", spy)
    monkeypatch.setattr(jax, "device_put", put_spy)
    assert not manager.is_ready("r4")
    wait_for(lambda: manager.is_ready("r4"))
    assert padded_on and threading.get_ident() not in padded_on
    assert put_on and threading.get_ident() not in put_on
    before, puts = len(padded_on), len(put_on)
    slot = manager.acquire_slot("r4")
    assert len(padded_on) == before and len(put_on) == puts and manager.stats().loads == 1
    manager.release_slot("r4", slot)
    assert manager.is_ready("r4")  # resident
    assert not manager.is_ready("gone")
    # Registered, so its files going missing is the server's trouble: a 503 naming it, not a 400.
    with pytest.raises(AdapterUnavailableError, match="'gone' could not be loaded: .*absent"):
        wait_for(lambda: manager.is_ready("gone"))
    assert not manager.is_ready("gone")  # told once; the next asker tries again
    assert manager.is_ready("not-registered")  # acquire_slot names the problem


def test_stage_ahead_stages_the_first_in_line_and_earlier_asks_give_way(manager, adapter_dirs, monkeypatch):
    """stage_ahead pads and stages the first max_staged adapters of the queue that are not
    resident; adapters staged earlier for others give way to them, and those already staged
    are not padded again. A staged adapter's slot write then moves no bytes."""
    manager.sync(entries(adapter_dirs))
    padded = []
    pool_weights = LoRAAdapter.pool_weights

    def spy(self, *args):
        padded.append(self.name)
        return pool_weights(self, *args)

    monkeypatch.setattr(LoRAAdapter, "pool_weights", spy)
    assert manager.max_staged == 2
    use(manager, "r4")  # resident: never staged
    for name in ("r8_rslora", "r16_pattern"):  # asked for by requests that found a free slot
        manager.is_ready(name)
    wait_for(lambda: manager.is_ready("r8_rslora") and manager.is_ready("r16_pattern"))
    padded.clear()
    manager.stage_ahead(iter(["not-registered", "r4", "r8_layer1", "r8_layer1", "r16_pattern", "r8_rslora"]))
    wait_for(lambda: manager.is_ready("r8_layer1"))
    assert padded == ["r8_layer1"]  # r16_pattern stays staged; r8_rslora (third in line) gave way
    assert manager.is_ready("r16_pattern") and not manager.is_ready("r8_rslora")  # no room for it now
    manager.stage_ahead(["r8_layer1", "r16_pattern"])
    loads = manager.stats().loads
    slot = manager.acquire_slot("r8_layer1")
    assert padded == ["r8_layer1"] and manager.stats().loads == loads + 1
    manager.release_slot("r8_layer1", slot)


def test_two_names_for_one_adapter_share_a_slot_and_a_host_copy(manager, adapter_dirs, model_config):
    """Identity is the content: a second name for the same directory loads nothing more, and
    unregistering one name leaves the other's slot and cached copy in place."""
    path = str(adapter_dirs["r4"])
    manager.register("alias_a", path)
    manager.register("alias_b", path)
    host_bytes = manager.host_cache_bytes
    a = manager.acquire_slot("alias_a")
    b = manager.acquire_slot("alias_b")
    assert a == b and manager.stats().loads == 1
    assert manager.host_cache_bytes == host_bytes == parsed(adapter_dirs["r4"], model_config).nbytes
    rows = {r["name"]: r for r in manager.list_adapters()}
    assert rows["alias_a"]["content_id"] == rows["alias_b"]["content_id"] is not None
    assert rows["alias_a"]["slot"] == rows["alias_b"]["slot"] == a and rows["alias_a"]["refcount"] == 2
    manager.release_slot("alias_a", a)
    manager.unregister("alias_a")
    assert manager.slot_of("alias_b") == b and manager.is_host_cached("alias_b")
    with pytest.raises(ValueError, match="holds no reference"):
        manager.release_slot("alias_a", a)
    manager.release_slot("alias_b", b)
    assert_slot_holds(manager, b, adapter_dirs["r4"], model_config)
    # Re-registering the same weights under the old name reuses slot and copy.
    manager.register("alias_a", path)
    assert manager.slot_of("alias_a") == b and manager.stats().loads == 1


def test_new_weights_under_an_old_name_never_reuse_its_slot(manager, adapter_dirs, model_config):
    manager.register("x", str(adapter_dirs["r4"]))
    old = use(manager, "x")
    manager.register("x", str(adapter_dirs["r8_rslora"]))  # version 2, other weights
    new = use(manager, "x")
    assert manager.stats().loads == 2 and manager.content_of("x") == parsed(
        adapter_dirs["r8_rslora"], model_config).content_id
    assert_slot_holds(manager, new, adapter_dirs["r8_rslora"], model_config)
    assert new != old or manager.stats().evictions == 0
    # The old content is gone from the host cache: one copy, of the current weights.
    assert manager.host_cache_bytes == parsed(adapter_dirs["r8_rslora"], model_config).nbytes


def test_a_registry_content_id_saves_the_fetch_of_a_known_adapter(manager, adapter_dirs, model_config):
    """An entry that carries the content id the admin validated is served from the slot (or
    host copy) of that content without reading its files again."""
    content = parsed(adapter_dirs["r4"], model_config).content_id
    manager.sync([RegistryEntry("a", str(adapter_dirs["r4"]), 1, content=content),
                  RegistryEntry("b", str(adapter_dirs["r4"]), 1, content=content)])
    slot = use(manager, "a")
    fetches = manager.stats().fetches
    assert use(manager, "b") == slot and manager.stats().fetches == fetches == 1
    assert manager.content_of("b") == content and manager.stats().loads == 1


def test_stage_ahead_leaves_an_adapter_still_in_storage_to_its_fetch(model_config, adapter_dirs, gcs):
    """An adapter whose fetch from storage is under way (stalled here) takes no staging place:
    the adapters behind it in line are staged meanwhile."""
    url = gcs.upload_dir(adapter_dirs["r8_rslora"], "stage-ahead/stall")
    with fault_proxy(gcs.endpoint) as proxy:
        options = {"gs": {"token": "anon", "endpoint_url": proxy.endpoint}}
        manager = make_manager(model_config, storage_options=options)
        try:
            manager.sync([RegistryEntry("remote", url, 1), *entries(adapter_dirs, names=("r4", "r16_pattern"))])
            proxy.mode = "stall"
            manager.prefetch(["remote"])
            assert manager.is_fetching("remote")
            manager.stage_ahead(["remote", "r4", "r16_pattern"])
            wait_for(lambda: manager.is_ready("r4") and manager.is_ready("r16_pattern"))
            assert not manager.is_host_cached("remote")
        finally:
            proxy.mode = "pass"
            manager.close()


def _ready_or_unavailable(manager, name: str) -> bool:
    try:
        return manager.is_ready(name)
    except AdapterUnavailableError:  # told while the fetch under way has not got through yet
        return False


@pytest.mark.parametrize("fault", ["down", "stall"])
def test_storage_out_during_a_load_fails_that_adapters_requests_and_it_loads_once_back(
        model_config, adapter_dirs, gcs, fault):
    """Storage refusing connections ("down") or not answering ("stall") while an adapter is
    fetched: its requests fail after load_timeout_s with a 503 naming it and its source,
    other adapters load meanwhile, and it loads when the storage is back."""
    url = gcs.upload_dir(adapter_dirs["r8_rslora"], f"outage/{fault}")
    with fault_proxy(gcs.endpoint) as proxy:
        options = {"gs": {"token": "anon", "endpoint_url": proxy.endpoint}}
        manager = make_manager(model_config, storage_options=options, load_timeout_s=1.5)
        try:
            manager.sync([RegistryEntry("remote", url, 1), *entries(adapter_dirs, names=("r4",))])
            proxy.mode = fault
            t0 = time.monotonic()
            assert not manager.is_ready("remote")
            wait_for(lambda: manager.is_ready("r4"))  # another adapter is not held up
            with pytest.raises(AdapterUnavailableError, match=rf"'remote' .*{url}.*load_timeout_s=1.5"):
                wait_for(lambda: manager.is_ready("remote"))
            assert 1.5 <= time.monotonic() - t0 < 10
            with pytest.raises(AdapterUnavailableError):  # later requests are told at once
                manager.is_ready("remote")
            proxy.mode = "pass"
            wait_for(lambda: _ready_or_unavailable(manager, "remote"), timeout=60)  # the fetch's retries get through
            slot = manager.acquire_slot("remote")
            assert_slot_holds(manager, slot, adapter_dirs["r8_rslora"], model_config)
            manager.release_slot("remote", slot)
        finally:
            manager.close()

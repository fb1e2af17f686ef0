"""The admin actor's logic, run in-process (it is a plain class; Ray only hosts it)."""

import asyncio
import json

import pytest

from cluster.admin import AdapterValidator, AdminActor
from lora_runtime.errors import AdapterNotFoundError, AdapterSourceError, InvalidAdapterError, InvalidRequestError
from tests.helpers.checkpoints import save_tiny_llama
from tests.integration.adapters import save_peft_adapter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    base = save_tiny_llama(root / "base")
    return {
        "base": base,
        "good": save_peft_adapter(base, root / "good", seed=1, rank=4),
        "good2": save_peft_adapter(base, root / "good2", seed=2, rank=2, targets=("q_proj", "v_proj")),
        "big": save_peft_adapter(base, root / "big", seed=3, rank=32),
        "other": save_peft_adapter(
            save_tiny_llama(root / "other_base", hidden_size=32, intermediate_size=64), root / "other", seed=4
        ),
    }


def _actor(files, registry, **kw) -> AdminActor:
    validator = AdapterValidator(str(files["base"]), kw.get("max_lora_rank", 16), kw.get("roots"), 1 << 30)
    return AdminActor(str(registry), validator)


def test_register_persists_and_bumps_version(files, tmp_path):
    async def run():
        reg = tmp_path / "r.json"
        actor = _actor(files, reg)
        entry = await actor.register("good", str(files["good"]), True)
        assert entry["name"] == "good" and entry["pinned"] is True and entry["rank"] == 4
        snap = actor.snapshot()
        assert snap["version"] == 1 and set(snap["adapters"]) == {"good"}
        on_disk = json.loads(reg.read_text())
        assert on_disk["version"] == 1 and on_disk["adapters"]["good"]["source"] == str(files["good"])
        # A fresh actor (a restart) reads the same registry back.
        assert _actor(files, reg).snapshot() == snap

    asyncio.run(run())


@pytest.mark.parametrize(
    "key, error, match",
    [
        ("big", InvalidAdapterError, "32"),
        ("other", InvalidAdapterError, "shape"),
        ("missing", AdapterSourceError, "missing"),
    ],
)
def test_bad_adapter_changes_nothing(files, tmp_path, key, error, match):
    async def run():
        actor = _actor(files, tmp_path / "r.json")
        await actor.register("good", str(files["good"]))
        before = actor.snapshot()
        source = str(files.get(key, tmp_path / "missing"))
        with pytest.raises(error, match=match):
            await actor.register("bad", source)
        assert actor.snapshot() == before
        assert json.loads((tmp_path / "r.json").read_text())["version"] == before["version"]

    asyncio.run(run())


def test_source_outside_allowed_roots_is_refused(files, tmp_path):
    async def run():
        actor = _actor(files, tmp_path / "r.json", roots=["gs://only-here/"])
        with pytest.raises(AdapterSourceError):
            await actor.register("good", str(files["good"]))
        assert actor.snapshot()["adapters"] == {}

    asyncio.run(run())


@pytest.mark.parametrize("name", ["", "has/slash", "white space", "-lead", "x" * 129])
def test_bad_names_rejected(files, tmp_path, name):
    async def run():
        with pytest.raises(InvalidRequestError, match="adapter name="):
            await _actor(files, tmp_path / "r.json").register(name, str(files["good"]))

    asyncio.run(run())


def test_unregister_pin_and_unknown(files, tmp_path):
    async def run():
        actor = _actor(files, tmp_path / "r.json")
        await actor.register("good", str(files["good"]))
        await actor.register("good2", str(files["good2"]))
        pinned = await actor.set_pinned("good2", True)
        assert pinned["pinned"] is True and actor.snapshot()["version"] == 3
        removed = await actor.unregister("good")
        assert removed["name"] == "good" and set(actor.snapshot()["adapters"]) == {"good2"}
        with pytest.raises(AdapterNotFoundError, match="'good'"):
            await actor.unregister("good")
        with pytest.raises(AdapterNotFoundError, match="'nope'"):
            await actor.set_pinned("nope", False)

    asyncio.run(run())


def test_reregister_replaces_with_new_entry_version(files, tmp_path):
    async def run():
        actor = _actor(files, tmp_path / "r.json")
        first = await actor.register("a", str(files["good"]))
        second = await actor.register("a", str(files["good2"]))
        assert second["version"] > first["version"] and second["source"] == str(files["good2"])
        assert await actor.ensure_registered({"a": str(files["good"]), "b": str(files["good"])}) == ["b"]
        assert actor.snapshot()["adapters"]["a"]["source"] == str(files["good2"])

    asyncio.run(run())


def test_long_poll_wakes_on_change_and_times_out_otherwise(files, tmp_path):
    async def run():
        actor = _actor(files, tmp_path / "r.json")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        idle = await actor.wait_for_change(0, 0.2)
        assert idle["version"] == 0 and loop.time() - t0 >= 0.19
        waiter = asyncio.create_task(actor.wait_for_change(0, 30.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await actor.register("good", str(files["good"]))
        snap = await asyncio.wait_for(waiter, 1.0)
        assert snap["version"] == 1 and "good" in snap["adapters"]
        # A caller that is behind returns at once.
        assert (await asyncio.wait_for(actor.wait_for_change(0, 30.0), 1.0))["version"] == 1

    asyncio.run(run())

"""The admin actor's logic, run in-process (it is a plain class; Ray only hosts it)."""

import asyncio
import json

import pytest

from cluster.admin import AdapterConflictError, AdapterExistsError, AdapterValidator, AdminActor
from lora_runtime.errors import AdapterNotFoundError, AdapterSourceError, InvalidAdapterError, InvalidRequestError
from tests.helpers.checkpoints import save_tiny_llama
from tests.integration.adapters import save_peft_adapter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    base = save_tiny_llama(root / "base")
    other_base = save_tiny_llama(root / "other_base", hidden_size=32, intermediate_size=64)
    return {
        "base": base,
        "other_base": other_base,
        "good": save_peft_adapter(base, root / "good", seed=1, rank=4),
        "good2": save_peft_adapter(base, root / "good2", seed=2, rank=2, targets=("q_proj", "v_proj")),
        "big": save_peft_adapter(base, root / "big", seed=3, rank=32),
        "other": save_peft_adapter(other_base, root / "other", seed=4),
    }


def _validator(files, base: str = "base", **kw) -> AdapterValidator:
    """A deployment's validator: base model ``files[base]``, named after that key."""
    return AdapterValidator(str(files[base]), kw.get("max_lora_rank", 16), kw.get("roots"), 1 << 30, base_name=base)


def _actor(registry) -> AdminActor:
    return AdminActor(str(registry))


def test_register_persists_and_bumps_version(files, tmp_path):
    async def run():
        reg = tmp_path / "r.json"
        actor, v = _actor(reg), _validator(files)
        entry = await actor.register("good", str(files["good"]), True, v)
        assert entry["name"] == "good" and entry["pinned"] is True and entry["rank"] == 4
        snap = actor.snapshot(v.base().fingerprint)
        assert snap["version"] == 1 and set(snap["adapters"]) == {"good"}
        on_disk = json.loads(reg.read_text())
        assert on_disk["version"] == 1 and on_disk["adapters"]["good"]["source"] == str(files["good"])
        # A fresh actor (a restart) reads the same registry back.
        assert _actor(reg).snapshot(v.base().fingerprint) == snap

    asyncio.run(run())


def test_entries_record_the_base_model_they_were_validated_against(files, tmp_path):
    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        base = v.base()
        assert base.name == "base" and base.fingerprint.startswith("sha256:")
        entry = await actor.register("good", str(files["good"]), False, v)
        assert entry["base_model"] == "base" and entry["base_fingerprint"] == base.fingerprint
        on_disk = json.loads((tmp_path / "r.json").read_text())
        assert on_disk["format"] == 2 and on_disk["adapters"]["good"]["base_fingerprint"] == base.fingerprint
        assert set(actor.snapshot(None)["adapters"]) == {"good"}
        assert actor.snapshot(_validator(files, "other_base").base().fingerprint)["adapters"] == {}

    asyncio.run(run())


def test_two_base_models_share_one_registry_each_seeing_its_own(files, tmp_path):
    async def run():
        actor = _actor(tmp_path / "r.json")
        va, vb = _validator(files), _validator(files, "other_base")
        fa, fb = va.base().fingerprint, vb.base().fingerprint
        assert fa != fb
        await actor.register("a1", str(files["good"]), False, va)
        waiter = asyncio.create_task(actor.wait_for_change(1, 30.0, fa))
        await asyncio.sleep(0.05)
        await actor.register("b1", str(files["other"]), False, vb)
        # A change for any base model wakes the long-poll; it returns only the caller's entries.
        woke = await asyncio.wait_for(waiter, 1.0)
        assert woke["version"] == 2 and set(woke["adapters"]) == {"a1"}
        assert set(actor.snapshot(fb)["adapters"]) == {"b1"}
        assert set(actor.snapshot(None)["adapters"]) == {"a1", "b1"}

    asyncio.run(run())


def test_a_name_held_by_another_base_model_is_refused_and_kept(files, tmp_path):
    async def run():
        reg = tmp_path / "r.json"
        actor = _actor(reg)
        va, vb = _validator(files), _validator(files, "other_base")
        await actor.register("shared", str(files["good"]), False, va)
        before, on_disk = actor.snapshot(None), reg.read_text()
        # Refused before its files are read: this source does not even exist.
        with pytest.raises(AdapterConflictError, match="adapter 'shared' is registered for base model 'base'") as e:
            await actor.register("shared", str(tmp_path / "missing"), False, vb)
        assert e.value.status_code == 409 and "'other_base'" in str(e.value)
        with pytest.raises(AdapterConflictError, match="'base'"):
            await actor.register("shared", str(files["other"]), False, vb)
        with pytest.raises(AdapterConflictError, match="'base'"):
            await actor.unregister("shared", vb.base())
        with pytest.raises(AdapterConflictError, match="'base'"):
            await actor.set_pinned("shared", True, vb.base())
        assert actor.snapshot(None) == before and reg.read_text() == on_disk
        # Its own base model's deployments still change it.
        assert (await actor.set_pinned("shared", True, va.base()))["pinned"] is True

    asyncio.run(run())


def test_format_1_entries_are_adopted_by_the_base_model_they_fit(files, tmp_path):
    """Entries written before entries recorded a base model are validated by the first
    deployment that starts; those that fit are recorded for its base model, the others
    wait for a deployment of theirs."""
    async def run():
        reg = tmp_path / "r.json"
        old = {
            "fits": {"source": str(files["good"]), "version": 1, "pinned": True, "rank": 4},
            "elsewhere": {"source": str(files["other"]), "version": 2, "pinned": False, "rank": 4},
        }
        reg.write_text(json.dumps({"format": 1, "version": 2, "adapters": old}))
        actor = _actor(reg)
        va, vb = _validator(files), _validator(files, "other_base")
        assert actor.snapshot(va.base().fingerprint)["adapters"] == {}  # nobody's until adopted
        got = await actor.adopt_unassigned(va)
        assert got["adopted"] == ["fits"] and set(got["refused"]) == {"elsewhere"}
        assert "shape" in got["refused"]["elsewhere"]
        snap = actor.snapshot(va.base().fingerprint)
        assert snap["version"] == 3 and set(snap["adapters"]) == {"fits"}
        fits = snap["adapters"]["fits"]
        assert fits["version"] == 1 and fits["pinned"] is True and fits["base_model"] == "base"
        # The demo-style start: a name left unadopted is reported, not replaced.
        report = await actor.ensure_registered({"elsewhere": str(files["good"]), "new": str(files["good2"])}, va)
        assert report["added"] == ["new"] and set(report["skipped"]) == {"elsewhere"}
        assert (await actor.adopt_unassigned(vb))["adopted"] == ["elsewhere"]
        assert set(actor.snapshot(vb.base().fingerprint)["adapters"]) == {"elsewhere"}
        assert (await actor.adopt_unassigned(vb)) == {"adopted": [], "refused": {}}
        on_disk = json.loads(reg.read_text())
        assert on_disk["format"] == 2 and on_disk["adapters"]["elsewhere"]["base_model"] == "other_base"

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
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        await actor.register("good", str(files["good"]), False, v)
        before = actor.snapshot(None)
        source = str(files.get(key, tmp_path / "missing"))
        with pytest.raises(error, match=match):
            await actor.register("bad", source, False, v)
        assert actor.snapshot(None) == before
        assert json.loads((tmp_path / "r.json").read_text())["version"] == before["version"]

    asyncio.run(run())


def test_source_outside_allowed_roots_is_refused(files, tmp_path):
    async def run():
        actor = _actor(tmp_path / "r.json")
        with pytest.raises(AdapterSourceError):
            await actor.register("good", str(files["good"]), False, _validator(files, roots=["gs://only-here/"]))
        assert actor.snapshot(None)["adapters"] == {}

    asyncio.run(run())


@pytest.mark.parametrize("name", ["", "has/slash", "white space", "-lead", "x" * 129])
def test_bad_names_rejected(files, tmp_path, name):
    async def run():
        with pytest.raises(InvalidRequestError, match="adapter name="):
            await _actor(tmp_path / "r.json").register(name, str(files["good"]), False, _validator(files))

    asyncio.run(run())


def test_unregister_pin_and_unknown(files, tmp_path):
    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        base = v.base()
        await actor.register("good", str(files["good"]), False, v)
        await actor.register("good2", str(files["good2"]), False, v)
        pinned = await actor.set_pinned("good2", True, base)
        assert pinned["pinned"] is True and actor.snapshot(None)["version"] == 3
        removed = await actor.unregister("good", base)
        assert removed["name"] == "good" and set(actor.snapshot(None)["adapters"]) == {"good2"}
        with pytest.raises(AdapterNotFoundError, match="'good'"):
            await actor.unregister("good", base)
        with pytest.raises(AdapterNotFoundError, match="'nope'"):
            await actor.set_pinned("nope", False, base)

    asyncio.run(run())


def test_a_registered_name_is_refused_unless_replaced_and_replacing_makes_a_new_version(files, tmp_path):
    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        first = await actor.register("a", str(files["good"]), False, v)
        with pytest.raises(AdapterExistsError, match=r"'a' is registered already .*replace=true"):
            await actor.register("a", str(files["good2"]), False, v)
        kept = actor.snapshot(None)
        assert kept["adapters"]["a"]["source"] == str(files["good"]) and kept["version"] == first["version"]
        second = await actor.register("a", str(files["good2"]), False, v, replace=True)
        assert second["version"] > first["version"] and second["source"] == str(files["good2"])
        report = await actor.ensure_registered({"a": str(files["good"]), "b": str(files["good"])}, v)
        assert report == {"added": ["b"], "skipped": {}}
        assert actor.snapshot(None)["adapters"]["a"]["source"] == str(files["good2"])

    asyncio.run(run())


def test_long_poll_wakes_on_change_and_times_out_otherwise(files, tmp_path):
    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        fp = v.base().fingerprint
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        idle = await actor.wait_for_change(0, 0.2, fp)
        assert idle["version"] == 0 and loop.time() - t0 >= 0.19
        waiter = asyncio.create_task(actor.wait_for_change(0, 30.0, fp))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await actor.register("good", str(files["good"]), False, v)
        snap = await asyncio.wait_for(waiter, 1.0)
        assert snap["version"] == 1 and "good" in snap["adapters"]
        # A caller that is behind returns at once.
        assert (await asyncio.wait_for(actor.wait_for_change(0, 30.0, fp), 1.0))["version"] == 1

    asyncio.run(run())


def test_entries_record_content_and_targets_and_room_is_checked(files, tmp_path):
    """The registry shows what an adapter is (its content id, DoRA, the modules it targets); a
    deployment without room for DoRA or embedding/head adapters refuses them at registration."""
    from tests.integration.adapters import save_peft_adapter

    dora = save_peft_adapter(files["base"], tmp_path / "dora", seed=5, rank=4, targets=("q_proj", "lm_head"),
                             use_dora=True)
    biased = save_peft_adapter(files["base"], tmp_path / "biased", seed=6, rank=4, targets=("v_proj",),
                               lora_bias=True)

    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        a = await actor.register("good", str(files["good"]), False, v)
        b = await actor.register("good_again", str(files["good"]), False, v)
        c = await actor.register("good2", str(files["good2"]), False, v)
        assert a["content_id"] == b["content_id"] != c["content_id"] and len(a["content_id"]) == 32
        assert c["target_modules"] == ["q_proj", "v_proj"] and c["use_dora"] is False and c["lora_bias"] is False
        e = await actor.register("biased", str(biased), False, v)
        assert e["lora_bias"] is True and e["use_dora"] is False
        d = await actor.register("dora", str(dora), False, v)
        assert d["use_dora"] is True and d["target_modules"] == ["lm_head", "q_proj"]
        narrow = AdapterValidator(str(files["base"]), 16, None, 1 << 30, base_name="base", lora_dora=False,
                                  lora_bias=False, lora_embedding_modules=False)
        with pytest.raises(InvalidAdapterError, match="lora_embedding_modules is off"):
            await actor.register("dora2", str(dora), False, narrow)
        with pytest.raises(InvalidAdapterError, match="lora_bias is off"):
            await actor.register("biased2", str(biased), False, narrow)
        assert "dora2" not in actor.snapshot(None)["adapters"] and "biased2" not in actor.snapshot(None)["adapters"]

    asyncio.run(run())


def test_modules_to_save_copies_are_served_up_to_the_cap(files, tmp_path):
    """A modules_to_save copy of lm_head registers where the deployment's cap holds it (the
    entry lists it) and is refused with its size in the served dtype where it does not."""
    from lora_runtime.model.config import ModelConfig

    saved = save_peft_adapter(files["base"], tmp_path / "saved", seed=6, rank=4, targets=("q_proj",),
                              modules_to_save=["lm_head"])
    config = ModelConfig.from_pretrained(str(files["base"]))
    f32 = config.vocab_size * config.hidden_size * 4

    def validator(cap, dtype=None):
        return AdapterValidator(str(files["base"]), 16, None, 1 << 30, base_name="base",
                                modules_to_save_max_bytes=cap, dtype=dtype)

    async def run():
        actor = _actor(tmp_path / "r.json")
        entry = await actor.register("saved", str(saved), False, validator(f32))
        assert entry["modules_to_save"] == ["lm_head"] and entry["target_modules"] == ["q_proj"]
        with pytest.raises(InvalidAdapterError, match=f"{f32} bytes .* over this server's "
                                                      f"lora_modules_to_save_max_bytes={f32 - 1}"):
            await actor.register("saved2", str(saved), False, validator(f32 - 1))
        # Served in bfloat16 the copy takes half the bytes, and fits half the cap.
        await actor.register("saved_bf16", str(saved), False, validator(f32 // 2, "bfloat16"))
        assert "saved2" not in actor.snapshot(None)["adapters"]

    asyncio.run(run())


def test_a_merged_adapter_is_written_beside_the_registry_registered_and_deleted_with_its_entry(files, tmp_path):
    from pathlib import Path

    from lora_runtime.lora.adapter import LoRAAdapter

    async def run():
        reg = tmp_path / "reg" / "r.json"
        actor, v = _actor(reg), _validator(files, roots=[str(files["good"]), str(files["good2"]),
                                                          str(tmp_path / "reg" / "r-merged")])
        base = v.base()
        await actor.register("good", str(files["good"]), False, v)
        await actor.register("good2", str(files["good2"]), False, v)
        merge = {"adapters": ["good", "good2"], "weights": [0.5, -1.0], "combination_type": "cat"}
        entry = await actor.register_merged("mix", merge, True, v)
        folder = Path(entry["source"])
        assert folder.parent == tmp_path / "reg" / "r-merged" / "mix" and (folder / "adapter_config.json").exists()
        assert entry["rank"] == 6 and entry["pinned"] is True
        assert entry["merged_from"] == {**merge, "content_ids": [actor.snapshot(None)["adapters"][n]["content_id"]
                                                                 for n in ("good", "good2")]}
        parsed = LoRAAdapter.parse("mix", (folder / "adapter_config.json").read_bytes(),
                                   (folder / "adapter_model.safetensors").read_bytes(), v.model_config(), 16)
        assert parsed.content_id.hex() == entry["content_id"]
        assert _actor(reg).snapshot(base.fingerprint)["adapters"]["mix"] == actor.snapshot(None)["adapters"]["mix"]

        # Refused merges change nothing: an unknown adapter, a bad field, unequal ranks, a taken name.
        before = actor.snapshot(None)
        for bad, error, match in (
            ({**merge, "adapters": ["good", "nope"]}, AdapterNotFoundError, "'nope', which is not registered"),
            ({**merge, "combination_type": "ties"}, InvalidRequestError, "merge.density"),
            ({**merge, "combination_type": "linear"}, InvalidRequestError, r"equal ranks.*\[2, 4\]"),
        ):
            with pytest.raises(error, match=match):
                await actor.register_merged("mix2", bad, False, v)
        with pytest.raises(AdapterExistsError):
            await actor.register_merged("mix", merge, False, v)
        assert actor.snapshot(None) == before
        assert [p.name for p in (tmp_path / "reg" / "r-merged").iterdir()] == ["mix"]

        # Replacing writes a new folder and deletes the old one; unregistering deletes the last.
        again = await actor.register_merged("mix", {**merge, "combination_type": "svd"}, False, v, replace=True)
        assert again["rank"] == 4 and Path(again["source"]).exists() and not folder.exists()
        await actor.unregister("mix", base)
        assert not Path(again["source"]).exists() and list((tmp_path / "reg" / "r-merged").iterdir()) == []
        # The merged adapters themselves stay registered and untouched.
        assert set(actor.snapshot(None)["adapters"]) == {"good", "good2"}

    asyncio.run(run())


def test_a_registry_on_gcs_keeps_merged_adapters_in_its_bucket(files, tmp_path):
    import gcsfs

    from tests.gcs_emulator import run_gcs_emulator

    async def run(gcs):
        url = f"gs://{gcs.bucket}/team/registry.json"
        actor, v = _actor(url), _validator(files)
        await actor.register("good", str(files["good"]), False, v)
        await actor.register("good2", str(files["good2"]), False, v)
        entry = await actor.register_merged("mix", {"adapters": ["good", "good2"], "weights": [1, 1],
                                                    "combination_type": "svd", "svd_rank": 3}, False, v)
        assert entry["source"].startswith(f"gs://{gcs.bucket}/team/registry-merged/mix/") and entry["rank"] == 3
        bucket = gcsfs.GCSFileSystem(token="anon", endpoint_url=gcs.endpoint, skip_instance_cache=True)
        assert bucket.exists(entry["source"] + "/adapter_model.safetensors")
        assert _actor(url).snapshot(None)["adapters"]["mix"]["source"] == entry["source"]  # a restart reads it
        await actor.unregister("mix", v.base())
        bucket = gcsfs.GCSFileSystem(token="anon", endpoint_url=gcs.endpoint, skip_instance_cache=True)
        assert not bucket.exists(entry["source"] + "/adapter_model.safetensors")

    with run_gcs_emulator() as gcs:
        asyncio.run(run(gcs))


def test_merges_asked_at_once_run_one_after_the_other_and_both_register(files, tmp_path, monkeypatch):
    import threading
    import time

    async def run():
        actor, v = _actor(tmp_path / "r.json"), _validator(files)
        await actor.register("good", str(files["good"]), False, v)
        await actor.register("good2", str(files["good2"]), False, v)
        running, most, lock, merge = [0], [0], threading.Lock(), AdapterValidator.merge

        def counted(self, spec, sources):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                time.sleep(0.2)  # long enough for a second merge to start beside it, were it let
                return merge(self, spec, sources)
            finally:
                with lock:
                    running[0] -= 1

        monkeypatch.setattr(AdapterValidator, "merge", counted)
        spec = {"adapters": ["good", "good2"], "weights": [1, 1], "combination_type": "cat"}
        first, second = await asyncio.gather(actor.register_merged("m1", spec, False, v),
                                             actor.register_merged("m2", {**spec, "weights": [1, 2]}, False, v))
        assert most[0] == 1 and first["source"] != second["source"]
        assert {"m1", "m2"} <= set(actor.snapshot(None)["adapters"])

    asyncio.run(run())

import json
import os

import pytest

from cluster.registry_store import RegistryDoc, RegistryStore


def _doc(version: int) -> RegistryDoc:
    return RegistryDoc(
        version=version,
        adapters={"a": {"source": "/tmp/a", "version": version, "pinned": True}},
    )


def test_missing_registry_is_empty(tmp_path):
    doc = RegistryStore(str(tmp_path / "none" / "registry.json")).load()
    assert doc.version == 0 and doc.adapters == {}


def test_local_roundtrip_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "registry.json"
    store = RegistryStore(str(path))
    store.save(_doc(3))
    store.save(_doc(4))
    assert os.listdir(path.parent) == ["registry.json"]
    loaded = RegistryStore(str(path)).load()
    assert loaded.version == 4
    assert loaded.adapters["a"] == {"source": "/tmp/a", "version": 4, "pinned": True}


def test_file_url_and_memory_url(tmp_path):
    store = RegistryStore(f"file://{tmp_path}/r.json")
    store.save(_doc(7))
    assert json.loads((tmp_path / "r.json").read_text())["version"] == 7
    mem = RegistryStore("memory://registry-test/r.json")
    mem.save(_doc(2))
    assert RegistryStore("memory://registry-test/r.json").load().version == 2


def test_copy_is_deep():
    doc = _doc(1)
    other = doc.copy()
    other.adapters["a"]["pinned"] = False
    assert doc.adapters["a"]["pinned"] is True


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ('{"format": 99, "version": 1, "adapters": {}}', "format=99"),
        ('{"format": 1, "version": "x", "adapters": {}}', "int version"),
        ('{"format": 1, "version": 1, "adapters": {"b": {"source": "s"}}}', "adapter 'b' lacks"),
        ('{"format": 2, "version": 1, "adapters": {"b": 3}}', "adapter 'b' is 3, not a map"),
        ('{"format": 2, "version": 1, "adapters": {"b": {"source": "s", "version": 1, "pinned": false, '
         '"base_fingerprint": "md5:x"}}}', "base_fingerprint='md5:x'"),
    ],
)
def test_corrupt_registry_names_the_problem(tmp_path, text, match):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        RegistryStore(str(path)).load()


def test_empty_url_rejected():
    with pytest.raises(ValueError, match="url=''"):
        RegistryStore("")


def test_format_1_registry_loads_and_is_saved_as_format_2(tmp_path):
    """A registry written before entries recorded their base model still loads; its entries
    have no base model until a deployment adopts them (cluster/admin.py)."""
    path = tmp_path / "r.json"
    old = {"source": "/tmp/a", "version": 3, "pinned": False, "rank": 4}
    path.write_text(json.dumps({"format": 1, "version": 3, "adapters": {"a": old}}))
    doc = RegistryStore(str(path)).load()
    assert doc.version == 3 and doc.adapters == {"a": old}
    doc.adapters["a"].update(base_model="demo", base_fingerprint="sha256:" + "0" * 64)
    RegistryStore(str(path)).save(doc)
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == 2 and on_disk["adapters"]["a"]["base_model"] == "demo"
    assert RegistryStore(str(path)).load().adapters == doc.adapters

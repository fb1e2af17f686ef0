"""Adapter admin: the named, detached actor that owns the durable adapter registry.

Registration validates an adapter against the base model before it becomes visible;
every change is written to the registry store and bumps the registry version, which
replicas long-poll (``wait_for_change``) so they see a change within milliseconds.

One actor owns one registry, which deployments of several base models may share. Every
call names the caller's base model (writes pass the caller's validator, which knows it):
reads return that base model's entries only, and since an adapter name means one adapter
across the registry, a change to a name another base model holds is refused (409).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from typing import TYPE_CHECKING

import fsspec

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.base_model import BaseModel, config_fingerprint, entry_base
from cluster.registry_store import RegistryDoc, RegistryStore, merged_store_url
from lora_runtime.errors import AdapterNotFoundError, InvalidRequestError, ServingError

if TYPE_CHECKING:
    from lora_runtime.lora.merge import MergedFiles, MergeSpec

logger = logging.getLogger(__name__)

ADMIN_NAMESPACE = "multilora"
# Names travel in URL paths and as Serve multiplexed ids: no slashes or spaces.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"adapter name={name!r} must be 1-128 characters of letters, digits, '.', '_', "
            "':' or '-', starting with a letter or digit"
        )
    return name


class AdapterConflictError(ServingError):
    """An admin call names an adapter that is registered for another base model."""

    status_code = 409
    error_type = "conflict_error"


class AdapterExistsError(AdapterConflictError):
    """A registration names an adapter that is registered already, without asking to replace it."""

    code = "adapter_exists"


class AdapterValidator:
    """Checks an adapter's files against the base model and the server's limits."""

    def __init__(self, model: str, max_lora_rank: int, adapter_roots: list[str] | None,
                 max_adapter_bytes: int, *, base_name: str, lora_dora: bool = True, lora_bias: bool = True,
                 lora_embedding_modules: bool = True, modules_to_save_max_bytes: int = 0, dtype: str | None = None):
        self.model = model
        self.modules_to_save_max_bytes = modules_to_save_max_bytes
        self.dtype = dtype  # the served dtype (None: the checkpoint's), which sizes modules_to_save copies
        self.lora_dora = lora_dora
        self.lora_bias = lora_bias
        self.lora_embedding_modules = lora_embedding_modules
        self.base_name = base_name
        self.max_lora_rank = max_lora_rank
        self.adapter_roots = adapter_roots
        self.max_adapter_bytes = max_adapter_bytes
        self._model_config = None

    def model_config(self):
        # Read config.json once: validation of every later adapter reuses it.
        if self._model_config is None:
            from lora_runtime.model.config import ModelConfig

            self._model_config = ModelConfig.from_pretrained(resolve_model_path(self.model, weights=False))
        return self._model_config

    def base(self) -> BaseModel:
        """The base model adapters are validated against: its name and config fingerprint."""
        return BaseModel(self.base_name, config_fingerprint(self.model_config()))

    def validate(self, name: str, source: str) -> dict:
        """Fetches, parses and validates the adapter; returns facts to record (its rank, what it
        targets, its content id and base model); raises ServingError."""
        from lora_runtime.lora.adapter import check_room
        from lora_runtime.lora.sources import SourcePolicy, load_adapter

        policy = SourcePolicy(allowed_roots=self.adapter_roots, max_adapter_bytes=self.max_adapter_bytes)
        adapter = load_adapter(name, source, policy, self.model_config(), self.max_lora_rank)
        check_room(adapter, dora=self.lora_dora, bias=self.lora_bias, outer=self.lora_embedding_modules,
                   saved_max_bytes=self.modules_to_save_max_bytes, dtype=self.dtype or self.model_config().dtype)
        return {"rank": int(adapter.rank), "use_dora": adapter.use_dora, "lora_bias": adapter.has_bias,
                "target_modules": sorted({m for _, m in adapter.modules}),
                "modules_to_save": sorted(adapter.saved_modules),
                "content_id": adapter.content_id.hex(), **self.base().entry_fields()}

    def merge(self, spec: MergeSpec, sources: list[str]) -> MergedFiles:
        """The files of the adapter ``spec`` merges, read from ``sources`` (one per merged
        adapter, in order); raises ServingError."""
        from lora_runtime.lora.merge import merge_adapters
        from lora_runtime.lora.sources import SourcePolicy, load_adapter

        policy = SourcePolicy(allowed_roots=self.adapter_roots, max_adapter_bytes=self.max_adapter_bytes)
        adapters = [load_adapter(name, source, policy, self.model_config(), self.max_lora_rank)
                    for name, source in zip(spec.adapters, sources)]
        return merge_adapters(spec, adapters, self.model_config().num_layers, self.max_lora_rank)


def _write_adapter(url: str, files) -> None:
    """Writes a merged adapter's two files into folder ``url`` (local path or fsspec URL)."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/adapter_config.json", files.config_json)
    fs.pipe_file(f"{path}/adapter_model.safetensors", files.safetensors)


def resolve_model_path(model: str, *, weights: bool = True) -> str:
    """A local directory of ``model``: 'demo' is the shipped demo checkpoint, a URL is
    copied once into the checkpoint cache (only its metadata files when not ``weights``)."""
    if model == "demo":
        from lora_runtime.demo import BASE_MODEL_DIR

        return str(BASE_MODEL_DIR)
    from lora_runtime.model.fetch import local_checkpoint

    return local_checkpoint(model, weights=weights)


def resolve_tokenizer_path(tokenizer: str | None) -> str | None:
    """A local directory of the ``tokenizer`` app arg (a URL is copied once); None stays None."""
    if tokenizer is None:
        return None
    from lora_runtime.model.fetch import local_tokenizer

    return local_tokenizer(tokenizer)


def demo_adapter_sources() -> dict[str, str]:
    """Adapter name -> directory of each shipped demo adapter."""
    from lora_runtime.demo import adapter_dir
    from lora_runtime.demo.tasks import ADAPTER_TASKS

    return {name: str(adapter_dir(name)) for name in ADAPTER_TASKS}


class AdminActor:
    """Registry owner: register / unregister / list / pin, durable and versioned."""

    def __init__(self, registry_url: str):
        self._url = registry_url
        self._store = RegistryStore(registry_url)
        self._merged = merged_store_url(registry_url)
        self._merging = asyncio.Semaphore(1)
        self._doc: RegistryDoc = self._store.load()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    # --- reads -------------------------------------------------------------------

    def registry_url(self) -> str:
        return self._url

    def snapshot(self, fingerprint: str | None) -> dict:
        """``{"version", "adapters": {name: entry}}`` as of now: the entries of the base model
        with this fingerprint, or every entry for None."""
        doc = self._doc.copy()
        adapters = doc.adapters if fingerprint is None else {
            name: e for name, e in doc.adapters.items()
            if (owner := entry_base(e)) is not None and owner.fingerprint == fingerprint
        }
        return {"version": doc.version, "adapters": adapters}

    async def wait_for_change(self, known_version: int, timeout_s: float, fingerprint: str | None) -> dict:
        """Long-poll: returns ``snapshot(fingerprint)`` as soon as the version differs from
        ``known_version`` (a change for any base model), or after ``timeout_s``."""
        if self._doc.version == known_version:
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.snapshot(fingerprint)

    # --- writes ------------------------------------------------------------------

    def _changeable(self, name: str, base: BaseModel) -> dict | None:
        """The entry of ``name`` if ``base``'s deployments may change it (it is theirs or
        records no base model), None if there is none; another base model's raises."""
        entry = self._doc.adapters.get(name)
        owner = None if entry is None else entry_base(entry)
        if owner is not None and owner.fingerprint != base.fingerprint:
            raise AdapterConflictError(
                f"adapter {name!r} is registered for base model {owner}, not for this deployment's "
                f"base model {base}; unregister it from a deployment of {owner.name!r} or use another name"
            )
        return entry

    async def register(self, name: str, source: str, pinned: bool, validator: AdapterValidator, *,
                       replace: bool = False) -> dict:
        """Validates adapter ``name`` against ``validator``'s base model, then stores it. A
        name registered already is refused unless ``replace`` (then the entry is replaced, a
        new version); a name held by another base model is refused either way."""
        check_adapter_name(name)
        if not isinstance(source, str) or not source.strip():
            raise InvalidRequestError(f"adapter source={source!r} must be a path or URL")
        base = validator.base()
        self._check_new(name, base, replace)  # refused before any file is read
        # Validation reads files (maybe remote): off the event loop so long-polls keep going.
        facts = await asyncio.to_thread(validator.validate, name, source)
        async with self._lock:
            self._check_new(name, base, replace)  # it may have been registered meanwhile
            doc = self._doc.copy()
            doc.version += 1
            doc.adapters[name] = {
                "source": source,
                "version": doc.version,
                "pinned": bool(pinned),
                "created": int(time.time()),
                **facts,
            }
            self._commit(doc)
            return dict(doc.adapters[name], name=name)

    async def register_merged(self, name: str, merge: dict, pinned: bool, validator: AdapterValidator, *,
                              replace: bool = False) -> dict:
        """Registers adapter ``name`` as a merge of registered adapters (``merge``: MergeSpec's
        fields): merges their weights, writes the result beside the registry and registers it
        like any adapter, recording what it was made of. Later changes to the merged adapters
        do not change it."""
        from lora_runtime.lora.merge import MergeSpec

        check_adapter_name(name)
        spec = MergeSpec.from_dict(merge)
        base = validator.base()
        self._check_new(name, base, replace)
        parts = []
        for part in spec.adapters:
            entry = self._changeable(part, base)
            if entry is None:
                raise AdapterNotFoundError(f"merge.adapters names {part!r}, which is not registered",
                                           param="merge.adapters")
            parts.append(entry)
        async with self._merging:  # one at a time: each holds all its adapters in memory
            files = await asyncio.to_thread(validator.merge, spec, [e["source"] for e in parts])
            url = f"{self._merged}/{name}/{hashlib.blake2b(files.safetensors, digest_size=8).hexdigest()}"
            await asyncio.to_thread(_write_adapter, url, files)
            del files
        try:
            facts = await asyncio.to_thread(validator.validate, name, url)
            async with self._lock:
                self._check_new(name, base, replace)
                old = self._doc.adapters.get(name)
                doc = self._doc.copy()
                doc.version += 1
                doc.adapters[name] = {
                    "source": url, "version": doc.version, "pinned": bool(pinned), "created": int(time.time()),
                    "merged_from": {**spec.record(), "content_ids": [e.get("content_id") for e in parts]},
                    **facts,
                }
                self._commit(doc)
        except BaseException:
            if not any(e["source"] == url for e in self._doc.adapters.values()):  # files no entry reads
                await asyncio.to_thread(self._remove_merged, {"source": url, "merged_from": {}})
            raise
        if old is not None and old["source"] != url:
            await asyncio.to_thread(self._remove_merged, old)
        return dict(doc.adapters[name], name=name)

    def _remove_merged(self, entry: dict) -> None:
        """Deletes the files of a merged adapter's entry (none for other entries); a failure is
        logged, as the entry is gone either way."""
        source = entry["source"]
        if "merged_from" not in entry or not source.startswith(self._merged + "/"):
            return
        try:
            fs, path = fsspec.core.url_to_fs(source)
            if fs.exists(path):
                fs.rm(path, recursive=True)
            folder = path.rsplit("/", 1)[0]  # the name's folder, gone with its last version
            if fs.isdir(folder) and not fs.ls(folder):
                fs.rmdir(folder)
        except Exception:  # storage refusing a delete must not undo the change
            logger.warning("could not delete the files of merged adapter at %s", source, exc_info=True)

    def _check_new(self, name: str, base: BaseModel, replace: bool) -> None:
        entry = self._changeable(name, base)
        if entry is not None and not replace:
            raise AdapterExistsError(
                f"adapter {name!r} is registered already (source {entry['source']!r}, version {entry['version']}); "
                "register it with replace=true to replace it, or unregister it first", param="name")

    async def ensure_registered(self, adapters: dict[str, str], validator: AdapterValidator) -> dict:
        """Registers each ``name -> source`` the registry lacks. Returns ``{"added": [names],
        "skipped": {name: why}}``: names registered for another base model, or recorded with
        no base model and not fitting this one, are left as they are."""
        base = validator.base()
        added, skipped = [], {}
        for name, source in adapters.items():
            entry = self._doc.adapters.get(name)
            owner = None if entry is None else entry_base(entry)
            if entry is None:
                await self.register(name, source, False, validator)
                added.append(name)
            elif owner is None:
                skipped[name] = "registered with no base model recorded, and not adopted by this one"
            elif owner.fingerprint != base.fingerprint:
                skipped[name] = f"registered for base model {owner}"
        return {"added": added, "skipped": skipped}

    async def adopt_unassigned(self, validator: AdapterValidator) -> dict:
        """Validates every entry with no base model recorded (written before entries recorded
        one) against ``validator``'s base model, and records it for the entries that fit.
        Returns ``{"adopted": [names], "refused": {name: why}}``; refused entries stay as they
        are, served by no deployment, for a deployment of their own base model to adopt."""
        unassigned = {n: e for n, e in self._doc.adapters.items() if entry_base(e) is None}
        facts, refused = {}, {}
        for name, entry in unassigned.items():
            try:
                facts[name] = await asyncio.to_thread(validator.validate, name, entry["source"])
            except ServingError as e:
                refused[name] = str(e)
        if not facts:
            return {"adopted": [], "refused": refused}
        async with self._lock:
            doc = self._doc.copy()
            adopted = []
            for name, found in facts.items():
                entry = doc.adapters.get(name)
                # Skipped if it changed while its files were being read.
                if entry is not None and entry_base(entry) is None and entry["version"] == unassigned[name]["version"]:
                    entry.update(found)
                    adopted.append(name)
            if adopted:
                doc.version += 1  # entries' own versions stay: their files did not change
                self._commit(doc)
        return {"adopted": adopted, "refused": refused}

    async def unregister(self, name: str, base: BaseModel) -> dict:
        async with self._lock:
            if self._changeable(name, base) is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            doc = self._doc.copy()
            entry = doc.adapters.pop(name)
            doc.version += 1
            self._commit(doc)
        await asyncio.to_thread(self._remove_merged, entry)
        return dict(entry, name=name)

    async def set_pinned(self, name: str, pinned: bool, base: BaseModel) -> dict:
        async with self._lock:
            if self._changeable(name, base) is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            doc = self._doc.copy()
            doc.adapters[name]["pinned"] = bool(pinned)
            doc.version += 1
            self._commit(doc)
            return dict(doc.adapters[name], name=name)

    def _commit(self, doc: RegistryDoc) -> None:
        # Durable first: a change is visible only once it would survive a restart.
        self._store.save(doc)
        self._doc = doc
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def ping(self) -> int:
        return self._doc.version


async def connect_admin(name: str, registry_url: str) -> "ray.actor.ActorHandle":
    """The named detached admin actor of the registry at ``registry_url``, created on first
    use; it restarts on failure. One actor owns one registry: an actor of this name that owns
    another registry is refused, as deployments over different registries need different
    ``admin_actor_name`` values."""
    handle = ray.remote(AdminActor).options(
        name=name,
        namespace=ADMIN_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        num_cpus=0,
        max_concurrency=1000,
        # Never in the caller's placement group (a multi-host replica's): it would go with it.
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
    ).remote(registry_url)
    try:
        method = handle.registry_url
    except AttributeError:
        raise RuntimeError(
            f"admin actor {name!r} (namespace {ADMIN_NAMESPACE!r}) was started by an older version of this "
            "server: kill it (ray.kill) or restart the Ray cluster, then deploy again"
        ) from None
    theirs = await method.remote()
    if theirs != registry_url:
        raise ValueError(
            f"admin actor {name!r} owns the registry at {theirs!r}, not {registry_url!r}: give deployments "
            "over different registries different admin_actor_name values"
        )
    return handle


def check_registry_owner(name: str, registry_url: str, timeout_s: float = 60.0) -> None:
    """Refuses (ValueError, naming both) a deployment whose admin actor ``name`` already owns
    another registry than ``registry_url``; nothing when no such actor runs yet. Called when
    an application is built, so a redeploy naming another registry fails before any running
    replica is replaced."""
    running = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    if (ADMIN_NAMESPACE, name) not in running:  # the deployment creates it
        return
    handle = ray.get_actor(name, namespace=ADMIN_NAMESPACE)
    theirs = ray.get(handle.registry_url.remote(), timeout=timeout_s)
    if theirs != registry_url:
        raise ValueError(
            f"registry_url={registry_url!r}, but admin actor {name!r} owns the registry at {theirs!r}: give "
            "deployments over different registries different admin_actor_name values (the running application "
            "is left as it was)"
        )


def unwrap_error(e: BaseException) -> BaseException:
    """The exception an actor or replica raised, without Ray's task-error wrapper."""
    cause = getattr(e, "cause", None)
    while isinstance(e, ray.exceptions.RayTaskError) and cause is not None:
        e = cause
        cause = getattr(e, "cause", None)
    return e


def sync_entries(adapters: dict[str, dict]) -> list:
    """The registry entries as LoRAManager.sync takes them."""
    from lora_runtime.lora.manager import RegistryEntry

    return [
        RegistryEntry(name=name, source=e["source"], version=e["version"], pinned=e["pinned"],
                      content=bytes.fromhex(e["content_id"]) if e.get("content_id") else None)
        for name, e in adapters.items()
    ]


__all__ = [
    "ADMIN_NAMESPACE",
    "AdapterConflictError",
    "AdapterValidator",
    "AdminActor",
    "check_adapter_name",
    "connect_admin",
    "demo_adapter_sources",
    "resolve_model_path",
    "resolve_tokenizer_path",
    "sync_entries",
    "unwrap_error",
]

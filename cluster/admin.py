"""Adapter admin: the named, detached actor that owns the durable adapter registry.

Registration validates an adapter against the base model before it becomes visible;
every change is written to the registry store and bumps the registry version, which
replicas long-poll (``wait_for_change``) so they see a change within milliseconds.
"""

from __future__ import annotations

import asyncio
import re
import time

import ray

from cluster.registry_store import RegistryDoc, RegistryStore
from lora_runtime.errors import AdapterNotFoundError, InvalidRequestError

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


class AdapterValidator:
    """Checks an adapter's files against the base model and the server's limits."""

    def __init__(self, model: str, max_lora_rank: int, adapter_roots: list[str] | None,
                 max_adapter_bytes: int):
        self.model = model
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

    def validate(self, name: str, source: str) -> dict:
        """Fetches, parses and validates the adapter; returns facts to record; raises ServingError."""
        from lora_runtime.lora.sources import SourcePolicy, load_adapter

        policy = SourcePolicy(allowed_roots=self.adapter_roots, max_adapter_bytes=self.max_adapter_bytes)
        adapter = load_adapter(name, source, policy, self.model_config(), self.max_lora_rank)
        return {"rank": int(adapter.rank)}


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

    def __init__(self, registry_url: str, validator: AdapterValidator):
        self._store = RegistryStore(registry_url)
        self._doc: RegistryDoc = self._store.load()
        self._validator = validator
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    # --- reads -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """``{"version", "adapters": {name: entry}}`` as of now."""
        doc = self._doc.copy()
        return {"version": doc.version, "adapters": doc.adapters}

    def list_adapters(self) -> dict:
        return self.snapshot()

    async def wait_for_change(self, known_version: int, timeout_s: float) -> dict:
        """Long-poll: returns as soon as the version differs from ``known_version``."""
        if self._doc.version == known_version:
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.snapshot()

    # --- writes ------------------------------------------------------------------

    async def register(self, name: str, source: str, pinned: bool = False) -> dict:
        """Validates then stores adapter ``name``; re-registering replaces the entry."""
        check_adapter_name(name)
        if not isinstance(source, str) or not source.strip():
            raise InvalidRequestError(f"adapter source={source!r} must be a path or URL")
        # Validation reads files (maybe remote): off the event loop so long-polls keep going.
        facts = await asyncio.to_thread(self._validator.validate, name, source)
        async with self._lock:
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

    async def ensure_registered(self, adapters: dict[str, str]) -> list[str]:
        """Registers each ``name -> source`` not yet in the registry; returns the names added."""
        added = []
        for name, source in adapters.items():
            if name not in self._doc.adapters:
                await self.register(name, source)
                added.append(name)
        return added

    async def unregister(self, name: str) -> dict:
        async with self._lock:
            if name not in self._doc.adapters:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            doc = self._doc.copy()
            entry = doc.adapters.pop(name)
            doc.version += 1
            self._commit(doc)
            return dict(entry, name=name)

    async def set_pinned(self, name: str, pinned: bool) -> dict:
        async with self._lock:
            if name not in self._doc.adapters:
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


def get_or_create_admin(
    name: str,
    registry_url: str,
    validator: AdapterValidator,
) -> "ray.actor.ActorHandle":
    """The named detached admin actor, created on first use; restarts on failure."""
    actor_cls = ray.remote(AdminActor)
    return actor_cls.options(
        name=name,
        namespace=ADMIN_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        num_cpus=0,
        max_concurrency=1000,
    ).remote(registry_url, validator)


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
        RegistryEntry(name=name, source=e["source"], version=e["version"], pinned=e["pinned"])
        for name, e in adapters.items()
    ]


__all__ = [
    "ADMIN_NAMESPACE",
    "AdapterValidator",
    "AdminActor",
    "check_adapter_name",
    "demo_adapter_sources",
    "get_or_create_admin",
    "resolve_model_path",
    "resolve_tokenizer_path",
    "sync_entries",
    "unwrap_error",
]

"""Where a model-server replica runs: the Ray resources it asks for, the environment its JAX
starts in, and the check at its start that JAX sees exactly the devices it was given.

Ray gives an actor that asks for GPUs (or TPU chips) those devices alone (it sets
``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS``), and leaves an actor that asks for none
seeing every device of its node. So each replica asks for ``tensor_parallel_size`` devices
of its accelerator, and a CPU replica gets that many host devices through ``XLA_FLAGS``.
``JAX_PLATFORMS`` names the one platform JAX may start, so a replica never falls back to
the CPU silently.

A replica over ``hosts`` hosts (hosts_per_replica > 1) takes ``tensor_parallel_size /
hosts`` devices on each: Serve gives it a placement group of one bundle per host (spread
over distinct nodes, where the hosts are real), the replica itself runs in the first and
starts one worker in each other (deployments/hosts.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

ACCELERATORS = ("auto", "cpu", "gpu", "tpu")
# The JAX_PLATFORMS value of each accelerator (jax.Device.platform is the accelerator's name).
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


class PlacementError(ValueError):
    """A replica's placement arguments contradict each other, or its devices are not the ones
    it was given."""


_HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def without_host_device_count(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) less any host device count."""
    return " ".join(f for f in flags.split() if f.split("=", 1)[0] != _HOST_DEVICE_FLAG)


def host_device_flags(flags: str, devices: int) -> str:
    """``flags`` (an XLA_FLAGS value) with the host device count set to ``devices``: the
    other flags are kept (the replica's env replaces the variable), a count already there
    is replaced."""
    return f"{without_host_device_count(flags)} {_HOST_DEVICE_FLAG}={devices}".strip()


# Ray turns an actor's accelerator_type into a tiny demand of this resource; a placement
# group bundle must hold it for the actor to land there.
_ACCELERATOR_TYPE_RESOURCE = "accelerator_type:{}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """One replica's accelerator (resolved, never "auto"), device count, hosts and Ray options."""

    accelerator: str
    devices: int  # over all its hosts (tensor_parallel_size)
    num_cpus: float  # per host
    accelerator_type: str | None = None
    hosts: int = 1

    @property
    def devices_per_host(self) -> int:
        return self.devices // self.hosts

    def env(self) -> dict[str, str]:
        """The environment each of the replica's processes starts JAX in."""
        env = {"JAX_PLATFORMS": _JAX_PLATFORMS[self.accelerator]}
        if self.accelerator == "cpu":
            env["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), self.devices_per_host)
        return env

    def _host_resources(self) -> dict:
        """One host's share as actor options (num_gpus, resources)."""
        options: dict = {"num_gpus": self.devices_per_host if self.accelerator == "gpu" else 0}
        if self.accelerator == "tpu":
            options["resources"] = {"TPU": self.devices_per_host}
        return options

    def actor_options(self) -> dict:
        """The replica's ``ray_actor_options``: its (first) host's resources, and the env its JAX starts in."""
        options: dict = {"num_cpus": self.num_cpus, **self._host_resources()}
        if self.accelerator_type is not None and self.hosts == 1:  # else the bundles hold it
            options["accelerator_type"] = self.accelerator_type
        options["runtime_env"] = {"env_vars": self.env()}
        return options

    def bundles(self) -> list[dict[str, float]] | None:
        """The replica's placement group, a bundle per host (None for a replica on one host)."""
        if self.hosts == 1:
            return None
        bundle: dict[str, float] = {"CPU": self.num_cpus}
        if self.accelerator == "gpu":
            bundle["GPU"] = self.devices_per_host
        elif self.accelerator == "tpu":
            bundle["TPU"] = self.devices_per_host
        if self.accelerator_type is not None:
            bundle[_ACCELERATOR_TYPE_RESOURCE.format(self.accelerator_type)] = 0.001
        return [dict(bundle) for _ in range(self.hosts)]

    @property
    def strategy(self) -> str:
        """How the bundles spread: one per node where the hosts are real machines; on CPU
        (development) the hosts are processes that may share a node."""
        return "PACK" if self.accelerator == "cpu" else "STRICT_SPREAD"

    def deployment_options(self) -> dict:
        """The model-server deployment's placement options for serve.deployment."""
        options: dict = {"ray_actor_options": self.actor_options()}
        if self.hosts > 1:
            options.update(placement_group_bundles=self.bundles(), placement_group_strategy=self.strategy)
        return options

    def worker_options(self) -> dict:
        """Ray options of the worker on each other host (its bundle added by the replica)."""
        return {"num_cpus": self.num_cpus, **self._host_resources(), "runtime_env": {"env_vars": self.env()}}


def resolve(accelerator: str, tensor_parallel_size: int, *, num_cpus: float, num_gpus: float = 0.0,
            accelerator_type: str | None = None, cluster_resources: Mapping[str, float] | None = None,
            hosts: int = 1) -> Placement:
    """The placement of a replica of ``tensor_parallel_size`` devices over ``hosts`` hosts.
    ``auto``: GPUs if ``num_gpus`` asks for them, else what ``accelerator_type`` names (TPU-*
    chips, else GPUs), else TPU chips if the cluster has any, else GPUs if it has any, else
    host devices. ``num_gpus`` (replica_num_gpus), when not 0, must be the replica's device
    count: a replica's devices are its own, never shared."""
    if accelerator not in ACCELERATORS:
        raise PlacementError(f"accelerator={accelerator!r} must be one of {list(ACCELERATORS)}")
    if tensor_parallel_size < 1:
        raise PlacementError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
    if hosts < 1:
        raise PlacementError(f"hosts_per_replica={hosts} must be >= 1")
    if tensor_parallel_size % hosts:
        raise PlacementError(f"tensor_parallel_size={tensor_parallel_size} does not divide over hosts_per_replica="
                             f"{hosts}: each host holds the same number of devices")
    if hosts > 1 and num_gpus:
        raise PlacementError(f"replica_num_gpus={num_gpus:g} with hosts_per_replica={hosts}: a multi-host replica "
                             "takes tensor_parallel_size / hosts_per_replica devices on each host; leave "
                             "replica_num_gpus at 0")
    if hosts > 1 and num_cpus <= 0:
        raise PlacementError(f"replica_num_cpus={num_cpus:g} with hosts_per_replica={hosts}: each host's placement "
                             "group bundle needs CPUs")
    resources = cluster_resources or {}
    if accelerator == "auto":
        if num_gpus > 0:
            accelerator = "gpu"
        elif accelerator_type is not None:
            accelerator = "tpu" if accelerator_type.upper().startswith("TPU") else "gpu"
        elif resources.get("TPU", 0) > 0:
            accelerator = "tpu"
        elif resources.get("GPU", 0) > 0:
            accelerator = "gpu"
        else:
            accelerator = "cpu"
    if num_gpus and (accelerator != "gpu" or num_gpus != tensor_parallel_size):
        raise PlacementError(
            f"replica_num_gpus={num_gpus:g} contradicts accelerator={accelerator!r} and "
            f"tensor_parallel_size={tensor_parallel_size}: a GPU replica takes tensor_parallel_size whole GPUs; "
            "leave replica_num_gpus at 0")
    if accelerator_type is not None and accelerator == "cpu":
        raise PlacementError(f"accelerator_type={accelerator_type!r} needs accelerator gpu or tpu, not cpu")
    return Placement(accelerator, tensor_parallel_size, num_cpus, accelerator_type, hosts)


def check_devices(accelerator: str, count: int, devices: Sequence, *, hosts: int = 1,
                  local: Sequence | None = None) -> None:
    """Raises PlacementError unless ``devices`` (jax.devices() of the replica) are exactly
    ``count`` devices of ``accelerator``'s platform and, over ``hosts`` hosts, ``local``
    (jax.local_devices() of this process) its ``count / hosts``; names what was expected and found."""
    _check(accelerator, count, devices, f"this replica was placed for {count} {accelerator} device(s) "
           f"(accelerator={accelerator!r}, tensor_parallel_size={count}, hosts_per_replica={hosts})")
    if hosts > 1:
        _check(accelerator, count // hosts, local if local is not None else [],
               f"this host of a replica over {hosts} hosts was placed for {count // hosts} {accelerator} device(s)",
               " on this host")


def _check(accelerator: str, count: int, devices: Sequence, placed: str, where: str = "") -> None:
    found = [getattr(d, "platform", "?") for d in devices]
    if len(found) == count and all(p == accelerator for p in found):
        return
    seen = ", ".join(f"{n} {p}" for p, n in sorted({p: found.count(p) for p in found}.items())) or "none"
    hint = {
        "cpu": "the replica's XLA_FLAGS should force that many host devices",
        "gpu": "Ray should have given it that many GPUs (CUDA_VISIBLE_DEVICES); is a CUDA jaxlib installed?",
        "tpu": "Ray should have given it that many TPU chips (TPU_VISIBLE_CHIPS); is jax[tpu] installed?",
    }[accelerator]
    raise PlacementError(f"{placed}, but JAX sees {seen}{where}: {hint}")


__all__ = ["ACCELERATORS", "Placement", "PlacementError", "check_devices", "host_device_flags", "resolve",
           "without_host_device_count"]

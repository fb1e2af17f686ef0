"""Where a model-server replica runs: the Ray resources it asks for, the environment its JAX
starts in, and the check at its start that JAX sees exactly the devices it was given.

Ray gives an actor that asks for GPUs (or TPU chips) those devices alone (it sets
``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS``), and leaves an actor that asks for none
seeing every device of its node. So each replica asks for ``tensor_parallel_size`` devices
of its accelerator, and a CPU replica gets that many host devices through ``XLA_FLAGS``.
``JAX_PLATFORMS`` names the one platform JAX may start, so a replica never falls back to
the CPU silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

ACCELERATORS = ("auto", "cpu", "gpu", "tpu")
# The JAX_PLATFORMS value of each accelerator (jax.Device.platform is the accelerator's name).
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


class PlacementError(ValueError):
    """A replica's placement arguments contradict each other, or its devices are not the ones
    it was given."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """One replica's accelerator (resolved, never "auto"), device count and Ray options."""

    accelerator: str
    devices: int
    num_cpus: float
    accelerator_type: str | None = None

    def actor_options(self) -> dict:
        """The replica's ``ray_actor_options``: resources, and the env its JAX starts in."""
        options: dict = {"num_cpus": self.num_cpus, "num_gpus": self.devices if self.accelerator == "gpu" else 0}
        if self.accelerator == "tpu":
            options["resources"] = {"TPU": self.devices}
        if self.accelerator_type is not None:
            options["accelerator_type"] = self.accelerator_type
        env = {"JAX_PLATFORMS": _JAX_PLATFORMS[self.accelerator]}
        if self.accelerator == "cpu":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={self.devices}"
        options["runtime_env"] = {"env_vars": env}
        return options


def resolve(accelerator: str, tensor_parallel_size: int, *, num_cpus: float, num_gpus: float = 0.0,
            accelerator_type: str | None = None, cluster_resources: Mapping[str, float] | None = None) -> Placement:
    """The placement of a replica of ``tensor_parallel_size`` devices. ``auto``: GPUs if
    ``num_gpus`` asks for them, else what ``accelerator_type`` names (TPU-* chips, else GPUs),
    else TPU chips if the cluster has any, else GPUs if it has any, else host devices. ``num_gpus`` (replica_num_gpus), when not 0, must be the replica's
    device count: a replica's devices are its own, never shared."""
    if accelerator not in ACCELERATORS:
        raise PlacementError(f"accelerator={accelerator!r} must be one of {list(ACCELERATORS)}")
    if tensor_parallel_size < 1:
        raise PlacementError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
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
    return Placement(accelerator, tensor_parallel_size, num_cpus, accelerator_type)


def check_devices(accelerator: str, count: int, devices: Sequence) -> None:
    """Raises PlacementError unless ``devices`` (jax.devices() of the replica) are exactly
    ``count`` devices of ``accelerator``'s platform, naming what was expected and found."""
    want = accelerator
    found = [getattr(d, "platform", "?") for d in devices]
    if len(found) == count and all(p == want for p in found):
        return
    seen = ", ".join(f"{n} {p}" for p, n in sorted({p: found.count(p) for p in found}.items())) or "none"
    hint = {
        "cpu": "the replica's XLA_FLAGS should force that many host devices",
        "gpu": "Ray should have given it that many GPUs (CUDA_VISIBLE_DEVICES); is a CUDA jaxlib installed?",
        "tpu": "Ray should have given it that many TPU chips (TPU_VISIBLE_CHIPS); is jax[tpu] installed?",
    }[accelerator]
    raise PlacementError(
        f"this replica was placed for {count} {want} device(s) (accelerator={accelerator!r}, "
        f"tensor_parallel_size={count}), but JAX sees {seen}: {hint}")


__all__ = ["ACCELERATORS", "Placement", "PlacementError", "check_devices", "resolve"]

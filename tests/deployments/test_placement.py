"""Replica placement: the Ray resources and JAX environment each accelerator asks for, and the
start-up check that JAX sees exactly the devices a replica was given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.app import build_app, check_registry_reach
from deployments.config import AppArgs
from deployments.placement import PlacementError, check_devices, host_device_flags, resolve


def _devices(*platforms: str) -> list:
    return [SimpleNamespace(platform=p, id=i) for i, p in enumerate(platforms)]


@pytest.mark.parametrize(
    ("accelerator", "resources", "num_gpus", "want"),
    [
        ("auto", None, 0.0, "cpu"),
        ("auto", {"CPU": 16.0}, 0.0, "cpu"),
        ("auto", {"CPU": 16.0, "GPU": 8.0}, 0.0, "gpu"),
        ("auto", {"CPU": 16.0, "TPU": 8.0, "GPU": 8.0}, 0.0, "tpu"),
        ("auto", None, 2.0, "gpu"),  # replica_num_gpus asks for GPUs, whatever the cluster reports
        ("cpu", {"GPU": 8.0}, 0.0, "cpu"),
        ("tpu", None, 0.0, "tpu"),
    ],
)
def test_auto_and_explicit_accelerators_resolve(accelerator, resources, num_gpus, want):
    p = resolve(accelerator, 2, num_cpus=1.0, num_gpus=num_gpus, cluster_resources=resources)
    assert p.accelerator == want and p.devices == 2


def test_each_accelerator_asks_ray_for_its_own_devices_and_names_the_jax_platform(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cpu = resolve("cpu", 4, num_cpus=2.0).actor_options()
    assert cpu == {"num_cpus": 2.0, "num_gpus": 0, "runtime_env": {"env_vars": {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}}}
    gpu = resolve("gpu", 2, num_cpus=1.0, accelerator_type="H100").actor_options()
    assert gpu["num_gpus"] == 2 and gpu["accelerator_type"] == "H100"
    assert gpu["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "cuda"}  # never a silent CPU fallback
    tpu = resolve("tpu", 8, num_cpus=1.0, accelerator_type="TPU-V5LITEPOD").actor_options()
    assert tpu["resources"] == {"TPU": 8} and tpu["num_gpus"] == 0
    assert tpu["accelerator_type"] == "TPU-V5LITEPOD" and tpu["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "tpu"}


def test_a_cpu_replica_keeps_the_other_xla_flags_of_its_environment(monkeypatch):
    """The replica's env replaces XLA_FLAGS: flags set where Ray runs stay, the host device
    count becomes the replica's."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8 "
                                    "--xla_backend_optimization_level=1")
    assert resolve("cpu", 2, num_cpus=1.0).env()["XLA_FLAGS"] == (
        "--xla_cpu_enable_fast_math=false --xla_backend_optimization_level=1 --xla_force_host_platform_device_count=2")
    assert host_device_flags("", 3) == "--xla_force_host_platform_device_count=3"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(accelerator="tpu", tensor_parallel_size=1, num_gpus=1.0), "replica_num_gpus=1 contradicts"),
        (dict(accelerator="gpu", tensor_parallel_size=2, num_gpus=1.0), "takes tensor_parallel_size whole GPUs"),
        (dict(accelerator="gpu", tensor_parallel_size=1, num_gpus=0.5), "replica_num_gpus=0.5"),
        (dict(accelerator="cpu", tensor_parallel_size=1, accelerator_type="H100"), "needs accelerator gpu or tpu"),
        (dict(accelerator="npu", tensor_parallel_size=1), "accelerator='npu' must be one of"),
        (dict(accelerator="cpu", tensor_parallel_size=0), "tensor_parallel_size=0"),
    ],
)
def test_contradictory_placements_are_refused_naming_them(kwargs, says):
    tp = kwargs.pop("tensor_parallel_size")
    with pytest.raises(PlacementError, match=says):
        resolve(kwargs.pop("accelerator"), tp, num_cpus=1.0, **kwargs)


def test_an_accelerator_type_names_the_accelerator_under_auto():
    assert resolve("auto", 4, num_cpus=1.0, accelerator_type="TPU-V5LITEPOD").accelerator == "tpu"
    assert resolve("auto", 2, num_cpus=1.0, accelerator_type="H100").accelerator == "gpu"
    assert AppArgs(accelerator_type="TPU-V6E", tensor_parallel_size=4).placement(None).accelerator == "tpu"


def test_app_args_refuse_contradictions_at_deploy_time():
    with pytest.raises(ValueError, match="replica_num_gpus=2 contradicts"):
        AppArgs(accelerator="gpu", tensor_parallel_size=1, replica_num_gpus=2)
    with pytest.raises(ValueError, match="accelerator='gpus' must be one of"):
        AppArgs(accelerator="gpus")
    assert AppArgs(replica_num_gpus=1).placement(None).accelerator == "gpu"


@pytest.mark.parametrize(
    ("accelerator", "count", "devices", "says"),
    [
        ("gpu", 2, _devices("gpu"), "placed for 2 gpu device.*JAX sees 1 gpu"),
        ("gpu", 1, _devices("cpu"), "placed for 1 gpu device.*JAX sees 1 cpu.*CUDA"),
        ("tpu", 4, _devices("tpu", "tpu", "tpu", "tpu", "tpu", "tpu", "tpu", "tpu"), "JAX sees 8 tpu"),
        ("cpu", 2, _devices("cpu"), "JAX sees 1 cpu.*XLA_FLAGS"),
        ("tpu", 1, [], "JAX sees none"),
    ],
)
def test_a_replica_refuses_devices_other_than_its_own(accelerator, count, devices, says):
    with pytest.raises(PlacementError, match=says):
        check_devices(accelerator, count, devices)


def test_a_replica_with_its_devices_starts():
    check_devices("gpu", 2, _devices("gpu", "gpu"))
    check_devices("cpu", 1, _devices("cpu"))


def test_autoscaling_goes_to_serve_and_bad_settings_name_the_field():
    app = build_app({"autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}})
    server = app._bound_deployment.init_args[0]._bound_deployment  # the model server, bound into the ingress
    config = server._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 4, 8)
    with pytest.raises(ValueError, match="max_replicas"):
        AppArgs(autoscaling={"min_replicas": 3, "max_replicas": 1})
    with pytest.raises(ValueError, match="nonsense"):
        AppArgs(autoscaling={"nonsense": 1})


def test_a_registry_on_one_nodes_disk_is_refused_on_a_cluster_of_several():
    check_registry_reach("~/.cache/multilora-serve/registry.json", 1)
    check_registry_reach("gs://bucket/registry.json", 3)
    for url in ("/shared/registry.json", "file:///tmp/registry.json"):
        with pytest.raises(ValueError, match="3 nodes: use a URL every node reaches"):
            check_registry_reach(url, 3)


def test_a_replica_over_hosts_asks_for_a_bundle_per_host_spread_over_nodes():
    tpu = resolve("tpu", 16, num_cpus=1.0, accelerator_type="TPU-V5LITEPOD", hosts=4)
    assert tpu.devices_per_host == 4
    options = tpu.deployment_options()
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "TPU": 4, "accelerator_type:TPU-V5LITEPOD": 0.001}] * 4
    # The replica itself takes the first bundle's share; its accelerator type is the bundles'.
    assert options["ray_actor_options"]["resources"] == {"TPU": 4} and "accelerator_type" not in options[
        "ray_actor_options"]
    assert tpu.worker_options()["resources"] == {"TPU": 4}
    gpu = resolve("gpu", 8, num_cpus=2.0, hosts=2).deployment_options()
    assert gpu["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 4}] * 2
    assert gpu["ray_actor_options"]["num_gpus"] == 4
    # On CPU the hosts are processes with tensor_parallel_size / hosts host devices each, on any node.
    cpu = resolve("cpu", 4, num_cpus=0.5, hosts=2)
    assert cpu.strategy == "PACK" and cpu.bundles() == [{"CPU": 0.5}] * 2
    assert cpu.env()["XLA_FLAGS"].split()[-1] == "--xla_force_host_platform_device_count=2"
    assert "placement_group_bundles" not in resolve("cpu", 4, num_cpus=1.0).deployment_options()


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(accelerator="tpu", tensor_parallel_size=6, hosts=4), "tensor_parallel_size=6 does not divide"),
        (dict(accelerator="gpu", tensor_parallel_size=4, hosts=2, num_gpus=4.0), "leave replica_num_gpus at 0"),
        (dict(accelerator="cpu", tensor_parallel_size=4, hosts=2, num_cpus=0.0), "bundle needs CPUs"),
        (dict(accelerator="cpu", tensor_parallel_size=4, hosts=0), "hosts_per_replica=0"),
    ],
)
def test_contradictory_multi_host_placements_are_refused(kwargs, says):
    with pytest.raises(PlacementError, match=says):
        resolve(kwargs.pop("accelerator"), kwargs.pop("tensor_parallel_size"), **{"num_cpus": 1.0, **kwargs})


def test_each_host_checks_its_own_devices_and_the_whole_mesh():
    check_devices("tpu", 8, _devices(*["tpu"] * 8), hosts=2, local=_devices(*["tpu"] * 4))
    with pytest.raises(PlacementError, match="this host of a replica over 2 hosts was placed for 4 tpu.*JAX sees "
                                             "8 tpu on this host"):
        check_devices("tpu", 8, _devices(*["tpu"] * 8), hosts=2, local=_devices(*["tpu"] * 8))
    with pytest.raises(PlacementError, match="hosts_per_replica=2.*JAX sees 4 tpu"):
        check_devices("tpu", 8, _devices(*["tpu"] * 4), hosts=2, local=_devices(*["tpu"] * 4))


def test_app_args_place_a_multi_host_replica_and_serve_binds_its_placement_group():
    args = AppArgs(accelerator="tpu", tensor_parallel_size=16, hosts_per_replica=4, accelerator_type="TPU-V5LITEPOD")
    assert args.placement(None).hosts == 4
    app = build_app(args)
    server = app._bound_deployment.init_args[0]._bound_deployment
    replica = server._replica_config
    assert replica.placement_group_bundles == args.placement(None).bundles()
    assert replica.placement_group_strategy == "STRICT_SPREAD"
    with pytest.raises(ValueError, match="does not divide over hosts_per_replica=3"):
        AppArgs(accelerator="tpu", tensor_parallel_size=16, hosts_per_replica=3)


def test_process_ids_follow_a_slices_tpu_worker_ids_else_the_bundle_order():
    from deployments.hosts import process_ids

    def hosts(*ids):
        return [{"ip": "10.0.0.1", "port": 1, "tpu_worker_id": i} for i in ids]

    assert process_ids(hosts(2, 0, 3, 1)) == [2, 0, 3, 1]  # the leader may be TPU worker 2
    assert process_ids(hosts(None, None)) == [0, 1]
    assert process_ids(hosts(0, None, 2)) == [0, 1, 2]  # not every host on a slice
    assert process_ids(hosts(1, 1)) == [0, 1]  # not one slice's numbering

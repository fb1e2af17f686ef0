"""The KubeRay RayService manifests: each one's Serve config is this application with
arguments the app accepts, and the devices its worker pods hold are the devices its replicas
ask for (chips or GPUs per pod x pods = replicas x tensor_parallel_size; a replica spans
hosts_per_replica pods, which for TPUs are the hosts of one slice: numOfHosts)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from deployments.config import AppArgs

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))
DEVICE_LIMIT = {"tpu": "google.com/tpu", "gpu": "nvidia.com/gpu"}
TPU_NODE_POOLS = {"TPU-V5LITEPOD": "tpu-v5-lite-podslice", "TPU-V6E": "tpu-v6e-slice", "TPU-V5P": "tpu-v5p-slice"}


def _service(path: Path) -> tuple[dict, dict]:
    [doc] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    return doc, yaml.safe_load(doc["spec"]["serveConfigV2"])


def _containers(spec: dict) -> list[dict]:
    return spec["template"]["spec"]["containers"]


def test_there_is_a_tpu_and_a_gpu_manifest_and_a_multi_host_one():
    args = [_service(p)[1]["applications"][0]["args"] for p in MANIFESTS]
    assert {a["accelerator"] for a in args} == {"tpu", "gpu"}
    assert any(a.get("hosts_per_replica", 1) > 1 for a in args)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_serve_config_is_this_app_with_valid_arguments(path):
    doc, serve_config = _service(path)
    [app] = serve_config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs(**app["args"])  # the app's own validation
    assert args.registry_url.startswith("gs://"), "pods on several nodes share one registry"
    assert all(root.startswith("gs://") for root in args.adapter_roots or ["gs://"])
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == _tested_ray()  # the Ray the tests run
    # What the runtime env installs covers the project's dependencies (Ray comes with the image).
    wanted = {_name(d) for d in _project()["dependencies"]} - {"ray", "jax", "jaxlib"}
    installed = {_name(p) for p in app["runtime_env"]["pip"]}
    assert wanted <= installed, wanted - installed
    assert f"jax[{ {'tpu': 'tpu', 'gpu': 'cuda12'}[args.accelerator] }]" in "".join(app["runtime_env"]["pip"])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_worker_pods_hold_exactly_the_devices_the_replicas_ask_for(path):
    doc, serve_config = _service(path)
    args = AppArgs(**serve_config["applications"][0]["args"])
    placement = args.placement(None)
    limit = DEVICE_LIMIT[placement.accelerator]
    [group] = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    [container] = _containers(group)
    per_pod = int(container["resources"]["limits"][limit])
    assert int(container["resources"]["requests"][limit]) == per_pod
    hosts = group.get("numOfHosts", 1)
    pods = group["replicas"] * hosts
    assert per_pod % placement.devices_per_host == 0, "a replica's share of a host must fit in one pod"
    assert per_pod * pods == args.num_replicas * args.tensor_parallel_size
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    if args.hosts_per_replica > 1:
        # Each bundle of the replica's placement group is one pod's devices, on pods of their own.
        assert placement.bundles()[0][{"tpu": "TPU", "gpu": "GPU"}[placement.accelerator]] == per_pod
        assert placement.strategy == "STRICT_SPREAD"
        assert pods % args.hosts_per_replica == 0
    selector = group["template"]["spec"]["nodeSelector"]
    if placement.accelerator == "tpu":
        # A slice's hosts come together (numOfHosts); a replica is one slice's hosts or one host's chips.
        assert hosts == args.hosts_per_replica or (args.hosts_per_replica == 1 and hosts == 1)
        assert selector["cloud.google.com/gke-tpu-accelerator"] == TPU_NODE_POOLS[args.accelerator_type]
        chips = 1
        for n in selector["cloud.google.com/gke-tpu-topology"].split("x"):
            chips *= int(n)
        assert chips == per_pod * hosts
    else:
        assert selector["cloud.google.com/gke-accelerator"].startswith("nvidia-")
    cpus = float(re.sub(r"[^0-9.]", "", str(container["resources"]["limits"]["cpu"])))
    replicas_per_pod = per_pod // placement.devices_per_host
    assert cpus >= args.replica_num_cpus * replicas_per_pod, "the pod's CPUs hold its replicas' reservations"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_admin_token_comes_from_a_secret_and_prometheus_scrapes_the_endpoint(path):
    doc, serve_config = _service(path)
    env_name = AppArgs(**serve_config["applications"][0]["args"]).admin_token_env
    cluster = doc["spec"]["rayClusterConfig"]
    for spec in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in _containers(spec):
            [token] = [e for e in container["env"] if e["name"] == env_name]
            assert set(token["valueFrom"]["secretKeyRef"]) == {"name", "key"} and "value" not in token
    annotations = cluster["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == serve_config["http_options"]["port"]
    assert annotations["prometheus.io/path"] == "/metrics"


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _tested_ray() -> str:
    import ray

    return ray.__version__


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;@]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")

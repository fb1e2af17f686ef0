"""The Serve application builder: ``import_path: deployments.app:build_app``."""

from __future__ import annotations

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.admin import check_registry_owner
from cluster.ingress_ledger import LedgerHost
from cluster.serve_router import AdapterAffinityRouter, MultiplexMetricsRouter
from deployments.config import AppArgs
from deployments.ingress import OpenAIIngress
from deployments.model_server import LoRAModelServer

# Health checks must outlast a slow decode step on CPU; drains get their own budget.
_HEALTH_CHECK_PERIOD_S = 10.0
_HEALTH_CHECK_TIMEOUT_S = 60.0
_INGRESS_MAX_ONGOING = 1000
# How often replicas publish held adapters and metrics to the router (and so to /metrics).
_ROUTING_STATS_PERIOD_S = 1.0
# A report as old as two periods has seen where the router sent a request.
_RESIDENCY_HORIZON_S = 2 * _ROUTING_STATS_PERIOD_S


def router_config(a: AppArgs) -> RequestRouterConfig:
    """The model servers' request router: adapter affinity (with its knobs) or Serve's multiplex."""
    if not a.adapter_affinity_routing:
        return RequestRouterConfig(
            request_router_class=MultiplexMetricsRouter,
            request_router_kwargs=dict(residency_horizon_s=_RESIDENCY_HORIZON_S),
            request_routing_stats_period_s=_ROUTING_STATS_PERIOD_S,
        )
    return RequestRouterConfig(
        request_router_class=AdapterAffinityRouter,
        request_router_kwargs=dict(
            # Each ingress replica's router counts the others' adapter sends too (through the
            # IngressLedger), so it sees an adapter's whole rate.
            eps=a.routing_load_slack, hot_rate=a.routing_hot_rate, max_homes=a.routing_max_homes,
            half_life_s=a.routing_rate_half_life_s,
            residency_horizon_s=_RESIDENCY_HORIZON_S,
        ),
        request_routing_stats_period_s=_ROUTING_STATS_PERIOD_S,
    )


def _cluster() -> tuple[dict | None, int]:
    """The Ray cluster's resources and alive nodes, where Ray is up (None, 0 where not)."""
    if not ray.is_initialized():
        return None, 0
    return ray.cluster_resources(), sum(1 for n in ray.nodes() if n.get("Alive"))


def check_registry_reach(registry_url: str, nodes: int) -> None:
    """A registry on one node's disk cannot serve replicas and admin actors on others."""
    if nodes > 1 and ("://" not in registry_url or registry_url.startswith("file://")):
        raise ValueError(
            f"registry_url={registry_url!r} is a path on one node's disk, and this cluster has {nodes} nodes: "
            "use a URL every node reaches (e.g. gs://bucket/registry.json)")


def build_app(args: dict | AppArgs) -> Application:
    """Validates ``args`` (AppArgs fields) and binds ingress -> LoRAModelServer replicas,
    each placed on its own devices (deployments/placement.py)."""
    a = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    resources, nodes = _cluster()
    check_registry_reach(a.registry_url, nodes)
    if nodes:  # on a cluster: the registry's owner must be this registry's
        check_registry_owner(a.admin_actor_name, a.resolved_registry_url)
    placement = a.placement(resources)
    plain = a.model_dump()
    plain["accelerator"] = placement.accelerator  # resolved: the replica checks its devices against it
    scale = dict(num_replicas=a.num_replicas) if a.autoscaling is None else dict(autoscaling_config=a.autoscaling)
    server = serve.deployment(
        LoRAModelServer,
        name="LoRAModelServer",
        **scale,
        max_ongoing_requests=a.max_ongoing_requests,
        max_queued_requests=a.max_queued_requests,
        **placement.deployment_options(),
        health_check_period_s=_HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=_HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=a.drain_timeout_s + 5.0,
        request_router_config=router_config(a),
    ).bind(plain)
    ingress_scale = (dict(num_replicas=a.ingress_replicas) if a.ingress_autoscaling is None
                     else dict(autoscaling_config=a.ingress_autoscaling))
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        **ingress_scale,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        # One that stops (scaled in, redeployed) lets its streams finish as the model servers do.
        graceful_shutdown_timeout_s=a.drain_timeout_s + 5.0,
        ray_actor_options={"num_cpus": 0.5},
    )
    if not a.shared_ingress:
        return ingress.bind(server, plain)
    ledger = serve.deployment(
        LedgerHost,
        name="IngressLedger",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
    ).bind()
    return ingress.bind(server, plain, ledger)

import os

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs


def test_defaults_are_the_demo():
    args = AppArgs()
    assert args.is_demo and args.num_replicas == 1
    assert args.resolved_registry_url == os.path.expanduser(args.registry_url)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_replicas", 0, "num_replicas=0"),
        ("ingress_replicas", 0, "ingress_replicas=0"),
        ("max_seq_len", 4, "max_seq_len=4"),
        ("max_loras_per_batch", -1, "max_loras_per_batch=-1"),
        ("lora_backend", "cuda", "lora_backend='cuda'"),
        ("dtype", "float16", "dtype='float16'"),
        ("admin_token_env", "not a name", "admin_token_env='not a name'"),
        ("model", " ", "model=' '"),
        ("adapter_roots", ["gs://b/", ""], "adapter_roots"),
        ("replica_num_cpus", -1.0, "replica_num_cpus=-1.0"),
        ("unknown_field", 1, "unknown_field"),
        ("routing_load_slack", -0.1, "routing_load_slack=-0.1"),
        ("routing_hot_rate", 0.0, "routing_hot_rate=0.0"),
        ("routing_max_homes", 0, "routing_max_homes=0"),
        ("lora_rank_classes", [8, 16], r"lora_rank_classes \[8, 16\]: the widest class must be max_lora_rank=64"),
        ("lora_rank_classes", {8: -1, 64: 1}, "must be positive"),
        ("routing_rate_half_life_s", -1.0, "routing_rate_half_life_s=-1.0"),
        ("lora_modules_to_save_max_bytes", -1, "lora_modules_to_save_max_bytes"),
        ("lora_modules_to_save_slots", 0, "lora_modules_to_save_slots"),
        ("max_request_bytes", 0, "max_request_bytes=0"),
        ("max_prefill_tokens", 8, "max_prefill_tokens=8"),
        ("prefix_cache_min_tokens", 0, "prefix_cache_min_tokens=0"),
        ("kv_block_size", 0, "kv_block_size=0"),
        ("kv_cache_bytes", -5, "kv_cache_bytes=-5"),
        ("kv_cache_memory_fraction", 1.5, "kv_cache_memory_fraction=1.5"),
        ("adapter_memory_fraction", 1.0, r"adapter_memory_fraction=1.0 must be in \(0, 1\)"),
        ("attention_backend", "flash", "attention_backend='flash'"),
        ("api_keys_url", " ", "api_keys_url=''"),
        ("api_keys_refresh_s", 0.0, "api_keys_refresh_s=0.0"),
    ],
)
def test_bad_args_name_the_value(field, value, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs(**{field: value})


def test_more_slots_than_batch_rows_reach_the_engine():
    assert AppArgs(max_batch=4, max_loras_per_batch=8).engine_config().max_loras_per_batch == 8


def test_adapter_memory_fraction_reaches_the_engine_and_needs_adapters_on():
    assert AppArgs().engine_config().adapter_memory_fraction is None
    assert AppArgs(adapter_memory_fraction=0.1).engine_config().adapter_memory_fraction == 0.1
    with pytest.raises(ValidationError, match="max_loras_per_batch=0 turns adapters off"):
        AppArgs(adapter_memory_fraction=0.1, max_loras_per_batch=0)


def test_prefill_and_prefix_cache_args_reach_the_engine_config():
    default = AppArgs().engine_config()
    assert default.max_prefill_tokens is None and default.enable_prefix_caching
    assert default.prefix_cache_min_tokens == 16
    cfg = AppArgs(max_prefill_tokens=32, enable_prefix_caching=False, prefix_cache_min_tokens=24).engine_config()
    assert cfg.max_prefill_tokens == 32 and cfg.prefill_budget == 32
    assert not cfg.enable_prefix_caching and cfg.prefix_cache_min_tokens == 24


def test_stream_interval_reaches_the_engine_config_and_a_bad_one_is_named():
    assert AppArgs().engine_config().stream_interval == 1
    assert AppArgs(stream_interval=8).engine_config().stream_interval == 8
    with pytest.raises(ValidationError, match="stream_interval"):
        AppArgs(stream_interval=0)
    assert AppArgs(stream_interval_ms=50).engine_config().stream_interval_ms == 50
    with pytest.raises(ValidationError, match="stream_interval_ms"):
        AppArgs(stream_interval_ms=-1)


def test_rank_classes_reach_the_engine_config():
    engine = AppArgs(lora_rank_classes=[8, 16, 64]).engine_config()
    assert engine.rank_class_shares() == {8: 1.0, 16: 1.0, 64: 1.0}
    assert AppArgs(lora_rank_classes={16: 2, 64: 1}).engine_config().rank_class_shares() == {16: 2.0, 64: 1.0}
    assert AppArgs().engine_config().lora_rank_classes is None


def test_modules_to_save_args_reach_the_engine_and_the_validator():
    args = AppArgs(lora_modules_to_save_max_bytes=1 << 20, lora_modules_to_save_slots=3, dtype="bfloat16")
    engine = args.engine_config()
    assert (engine.lora_modules_to_save_max_bytes, engine.lora_modules_to_save_slots) == (1 << 20, 3)
    validator = args.adapter_validator()
    assert (validator.modules_to_save_max_bytes, validator.dtype) == (1 << 20, "bfloat16")
    assert AppArgs().engine_config().lora_modules_to_save_max_bytes == 0


def test_kv_cache_args_reach_the_engine_config():
    default = AppArgs().engine_config()
    assert default.kv_block_size is None and default.kv_cache_bytes is None
    assert default.block_size("cpu") == 16 and default.block_size("tpu") == 128
    assert default.attention_platform("cpu") == "xla" and default.attention_platform("tpu") == "tpu"
    cfg = AppArgs(kv_block_size=32, kv_cache_bytes=1 << 20, kv_cache_memory_fraction=0.5,
                  attention_backend="xla").engine_config()
    assert (cfg.kv_block_size, cfg.kv_cache_bytes, cfg.kv_cache_memory_fraction) == (32, 1 << 20, 0.5)
    assert cfg.block_size("tpu") == 32 and cfg.attention_platform("gpu") == "xla"
    with pytest.raises(ValueError, match="needs a GPU or TPU"):
        AppArgs(attention_backend="pallas").engine_config().attention_platform("cpu")


def test_served_model_name():
    assert AppArgs().served_model_name == "demo"
    assert AppArgs(model="/ckpt/llama").served_model_name == "llama"
    assert AppArgs(model="gs://bucket/models/qwen-tiny/").served_model_name == "qwen-tiny"
    assert AppArgs(model="/ckpt/llama", model_name="llama-7b").served_model_name == "llama-7b"


def test_url_registry_kept_verbatim():
    assert AppArgs(registry_url="gs://b/r.json").resolved_registry_url == "gs://b/r.json"


def test_router_knobs_reach_the_router():
    from cluster.serve_router import AdapterAffinityRouter, MultiplexMetricsRouter
    from deployments.app import router_config

    cfg = router_config(AppArgs(routing_load_slack=0.5, routing_hot_rate=5.0, routing_max_homes=3,
                                routing_rate_half_life_s=2.0))
    assert cfg.request_router_class.endswith(AdapterAffinityRouter.__name__)
    assert cfg.request_router_kwargs == dict(eps=0.5, hot_rate=5.0, max_homes=3, half_life_s=2.0,
                                             residency_horizon_s=2.0)
    router = AdapterAffinityRouter.__new__(AdapterAffinityRouter)
    router.initialize_state(**cfg.request_router_kwargs)
    assert router._eps == 0.5
    assert router._hot.homes("a", 8) == 1  # no traffic yet: one home
    plain = router_config(AppArgs(adapter_affinity_routing=False))
    assert plain.request_router_class.endswith(MultiplexMetricsRouter.__name__)
    assert plain.request_router_kwargs == dict(residency_horizon_s=2.0)  # for its routing outcomes
    multiplex = MultiplexMetricsRouter.__new__(MultiplexMetricsRouter)
    multiplex.initialize_state(**plain.request_router_kwargs)
    assert multiplex._residency.horizon_s == 2.0


def test_every_ingress_replicas_router_takes_the_whole_hot_rate():
    """Each router counts the other ingress replicas' adapter sends too (through the ledger),
    so each sees an adapter's whole rate: the threshold is not divided among them."""
    from deployments.app import router_config

    for args in (AppArgs(routing_hot_rate=30.0, ingress_replicas=3),
                 AppArgs(routing_hot_rate=30.0, ingress_autoscaling={"min_replicas": 1, "max_replicas": 4})):
        assert router_config(args).request_router_kwargs["hot_rate"] == 30.0


def test_the_ledger_is_bound_only_for_several_ingress_replicas():
    from deployments.app import build_app

    def deployments(app) -> dict:
        """Name -> the Deployment of every deployment bound in ``app``."""
        found, todo = {}, [app]
        while todo:
            node = todo.pop()._bound_deployment
            found[node.name] = node
            todo.extend(a for a in node.init_args if hasattr(a, "_bound_deployment"))
        return found

    one = deployments(build_app({}))
    assert set(one) == {"OpenAIIngress", "LoRAModelServer"}
    two = deployments(build_app({"ingress_replicas": 2}))
    assert set(two) == {"OpenAIIngress", "LoRAModelServer", "IngressLedger"}
    assert two["OpenAIIngress"].num_replicas == 2 and two["IngressLedger"].num_replicas == 1
    # Autoscaled: a ledger whenever there may be more than one.
    scaled = deployments(build_app({"ingress_autoscaling": {"min_replicas": 1, "max_replicas": 3,
                                                            "target_ongoing_requests": 32}}))
    assert set(scaled) == {"OpenAIIngress", "LoRAModelServer", "IngressLedger"}
    autoscaling = scaled["OpenAIIngress"]._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 3, 32)
    # An ingress replica that stops lets its streams finish as a model server does.
    assert scaled["OpenAIIngress"]._deployment_config.graceful_shutdown_timeout_s == (
        scaled["LoRAModelServer"]._deployment_config.graceful_shutdown_timeout_s)
    assert set(deployments(build_app({"ingress_autoscaling": {"min_replicas": 1, "max_replicas": 1}}))) == {
        "OpenAIIngress", "LoRAModelServer"}


@pytest.mark.parametrize("args, match", [
    ({"ingress_autoscaling": {"max_replica": 2}}, r"ingress_autoscaling has unknown fields \['max_replica'\]"),
    ({"ingress_autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas"),
    ({"ingress_replicas": 2, "ingress_autoscaling": {"max_replicas": 2}}, "ingress_replicas=2 with ingress_autoscaling"),
])
def test_bad_ingress_autoscaling_is_refused_by_name(args, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs(**args)


def test_ingress_autoscaling_survives_the_replicas_own_validation():
    """Each replica validates the app's args again from their dump (ingress_replicas in it)."""
    args = AppArgs(ingress_autoscaling={"min_replicas": 1, "max_replicas": 2})
    assert AppArgs.model_validate(args.model_dump()).ingress_autoscaling == {"min_replicas": 1, "max_replicas": 2}


def test_compilation_cache_dir_reaches_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "from-env"))
    assert AppArgs().engine_config().compilation_cache_path() == str(tmp_path / "from-env")
    assert AppArgs(compilation_cache_dir=str(tmp_path)).engine_config().compilation_cache_path() == str(tmp_path)
    assert AppArgs(compilation_cache_dir=None).engine_config().compilation_cache_path() is None


def test_adapter_roots_let_replicas_and_the_validator_read_merged_adapters():
    args = AppArgs(adapter_roots=["gs://adapters/"], registry_url="gs://bucket/reg/registry.json")
    want = ["gs://adapters/", "gs://bucket/reg/registry-merged"]
    assert args.source_roots == want
    assert args.engine_config().adapter_roots == want and args.adapter_validator().adapter_roots == want
    assert AppArgs().source_roots is None and AppArgs().engine_config().adapter_roots is None


def test_async_decode_reaches_the_engine_config_and_a_bad_one_is_named():
    assert AppArgs().engine_config().async_decode is True
    assert AppArgs(async_decode=False).engine_config().async_decode is False
    with pytest.raises(ValidationError, match="async_decode"):
        AppArgs(async_decode="sometimes")

"""Embedding and lm_head adapters, DoRA scales and lora_bias shifts through every backend,
against the reference backend (itself checked against PEFT in test_peft_parity), on 1 and 4
devices; and what a pool without room for them refuses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from lora_runtime.errors import InvalidAdapterError
from lora_runtime.lora.backend.kernel import KernelLoRABackend
from lora_runtime.lora.backend.reference import ReferenceLoRABackend
from lora_runtime.lora.backend.xla import XlaLoRABackend
from lora_runtime.lora.base_weights import BaseWeights
from lora_runtime.lora.hook import PoolLoRAHook
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from tests.lora.peft_adapters import read_adapter, write_adapter

BACKENDS = {
    "xla": lambda mesh: XlaLoRABackend(mesh),
    "gpu": lambda mesh: KernelLoRABackend(mesh, platform="gpu", interpret=True),
    "tpu": lambda mesh: KernelLoRABackend(mesh, platform="tpu", interpret=True),
}
POLICY = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 24)


def _manager(config, mesh, model, **kw):
    return LoRAManager(config, mesh, num_slots=5, max_lora_rank=16, max_cpu_loras=8, max_cpu_bytes=1 << 24,
                       source_policy=POLICY, dtype=config.dtype, base_weights=BaseWeights(model), **kw)


@pytest.mark.parametrize("kind,tp,prefill", [("xla", 1, False), ("xla", 4, True), ("gpu", 4, False),
                                             ("tpu", 1, True)])
def test_backends_agree_with_the_reference(kind, tp, prefill, base_dir, adapter_dirs, extra_adapter_dirs):
    mesh = make_mesh(tp, jax.devices()[:tp])
    config, model = load_model(str(base_dir), mesh)
    manager = _manager(config, mesh, model, outer=True, dora=True, bias=True)
    names = ["dora", "embed_head", "dora_head", "r4", "bias"]
    for name in names:
        manager.register(name, str({**adapter_dirs, **extra_adapter_dirs}[name]))
    slots = [manager.acquire_slot(n) for n in names]
    rng = np.random.default_rng(3)
    t = 12
    token_slots = np.array([slots[i % 5] if i % 6 else -1 for i in range(t)], np.int32)
    info = manager.prepare_lora_batch(token_slots)
    tokens = rng.integers(0, config.vocab_size, t).astype(np.int32)
    x = rng.normal(size=(t, config.hidden_size)).astype(np.float32)
    hidden = rng.normal(size=(t, config.hidden_size)).astype(np.float32)
    logits = rng.normal(size=(t, config.vocab_size)).astype(np.float32)
    q = rng.normal(size=(t, config.num_heads * config.head_dim)).astype(np.float32)
    kv = config.num_kv_heads * config.head_dim
    k, v = (rng.normal(size=(t, kv)).astype(np.float32) for _ in range(2))
    rows = np.array([1, 4, 7, 11], np.int32)

    def run(backend):
        @jax.jit
        def f(pool, info, tokens, x, hidden, logits, q, k, v):
            hook = PoolLoRAHook(backend, pool, info, prefill=prefill)
            return (hook.embed(tokens, x), hook.head(hidden, logits), hook.head(hidden[rows], logits[rows], rows),
                    hook("qkv", 1, x, (q, k, v)))

        return jax.tree.map(np.asarray, f(manager.pool, info, tokens, x, hidden, logits, q, k, v))

    got, want = run(BACKENDS[kind](mesh)), run(ReferenceLoRABackend(mesh))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # The guard: each part changed what it was given.
    assert not np.allclose(want[0], x) and not np.allclose(want[1], logits)
    assert not np.allclose(want[3][0], q)
    manager.close()


def test_a_vocabulary_the_mesh_does_not_divide(tmp_path):
    """Vocab 98 on 4 devices: the embedding's A stays whole and the head adapter runs
    row-parallel; logits and embeddings equal the one-device reference's."""
    from tests.lora.peft_adapters import make_base_model, make_peft_adapter

    base = make_base_model(tmp_path / "base98", vocab_size=98)
    adapter = make_peft_adapter(base, tmp_path / "eh98", r=4, alpha=8, target_modules=["embed_tokens", "lm_head"],
                                use_dora=False, seed=8)
    rng = np.random.default_rng(4)
    outs = []
    for tp, make in ((4, BACKENDS["xla"]), (1, ReferenceLoRABackend)):
        mesh = make_mesh(tp, jax.devices()[:tp])
        config, model = load_model(str(base), mesh)
        manager = _manager(config, mesh, model, outer=True, dora=True)
        assert manager.pool.parallel("lm_head") == ("row" if tp == 4 else "column")
        manager.register("eh", str(adapter))
        slot = manager.acquire_slot("eh")
        slots = np.array([slot, -1, slot, slot], np.int32)
        info = manager.prepare_lora_batch(slots)
        tokens = np.array([0, 5, 97, 50], np.int32)
        x = rng.normal(size=(4, config.hidden_size)).astype(np.float32) if tp == 4 else x
        logits = rng.normal(size=(4, config.vocab_size)).astype(np.float32) if tp == 4 else logits
        backend = make(mesh)

        @jax.jit
        def f(pool, info, tokens, x, logits):
            hook = PoolLoRAHook(backend, pool, info, prefill=False)
            return hook.embed(tokens, x), hook.head(x, logits)

        outs.append(jax.tree.map(np.asarray, f(manager.pool, info, tokens, x, logits)))
        manager.close()
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(outs[1][1], logits)


def test_pool_without_room_refuses_with_the_option_named(base_dir, extra_adapter_dirs):
    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base_dir), mesh)
    manager = _manager(config, mesh, model)
    with pytest.raises(InvalidAdapterError, match="lora_dora is off"):
        manager.register("d", str(extra_adapter_dirs["dora"]))
    with pytest.raises(InvalidAdapterError, match=r"\['embed_tokens', 'lm_head'\].*lora_embedding_modules is off"):
        manager.register("e", str(extra_adapter_dirs["embed_head"]))
    assert manager.list_adapters() == []
    manager.close()
    manager = _manager(config, mesh, model, outer=True)
    with pytest.raises(InvalidAdapterError, match=r"lora_bias=True.*lora_bias is off"):
        manager.register("b", str(extra_adapter_dirs["bias"]))
    assert manager.list_adapters() == []
    manager.close()


def test_saved_base_weights_must_be_the_served_models(base_dir, extra_adapter_dirs, tmp_path):
    """PEFT saves embed/head base weights with such adapters: equal to ours they are dropped
    after the check, different ones (a trained or replaced head) are refused with the size."""
    mesh = make_mesh(1, jax.devices()[:1])
    config, model = load_model(str(base_dir), mesh)
    manager = _manager(config, mesh, model, outer=True, dora=True)
    manager.register("ok", str(extra_adapter_dirs["embed_head"]))
    cfg, tensors = read_adapter(extra_adapter_dirs["embed_head"])
    key = "base_model.model.lm_head.base_layer.weight"
    assert key in tensors
    tensors[key] = tensors[key] + 0.5
    bad = write_adapter(tmp_path / "changed_head", cfg, tensors)
    with pytest.raises(InvalidAdapterError, match=r"saved lm_head\.base_layer\.weight differs .*bytes"):
        manager.register("bad", str(bad))
    assert [a["name"] for a in manager.list_adapters()] == ["ok"]
    manager.close()


@pytest.fixture
def parse(tmp_path, model_config):
    """Parses an adapter config and tensors as written to a fresh folder."""
    from lora_runtime.lora.adapter import LoRAAdapter

    def parse(cfg, tensors):
        d = write_adapter(tmp_path / f"case{len(list(tmp_path.iterdir()))}", cfg, tensors)
        return LoRAAdapter.parse("x", (d / "adapter_config.json").read_bytes(),
                                 (d / "adapter_model.safetensors").read_bytes(), model_config, 16)

    return parse


def test_dora_refusals_name_the_field(extra_adapter_dirs, parse):
    cfg, tensors = read_adapter(extra_adapter_dirs["dora"])
    mag = next(k for k in tensors if "magnitude" in k)
    with pytest.raises(InvalidAdapterError, match=r"lora_magnitude_vector' is missing .*use_dora=True"):
        parse(cfg, {k: v for k, v in tensors.items() if k != mag})
    with pytest.raises(InvalidAdapterError, match="DoRA magnitude but use_dora is not true"):
        parse({**cfg, "use_dora": False}, tensors)
    with pytest.raises(InvalidAdapterError, match=r"has shape \(3,\), expected"):
        parse(cfg, {**tensors, mag: np.ones(3, np.float32)})
    with pytest.raises(InvalidAdapterError, match="use_dora=True with target module 'model.embed_tokens'"):
        parse({**cfg, "target_modules": ["embed_tokens", "q_proj"]}, tensors)
    adapter = parse(cfg, tensors)
    assert adapter.use_dora and adapter.content_id != parse(cfg, {**tensors, mag: tensors[mag] * 2}).content_id


def test_lora_bias_refusals_name_the_field(extra_adapter_dirs, parse):
    cfg, tensors = read_adapter(extra_adapter_dirs["bias"])
    bias = next(k for k in tensors if k.endswith("lora_B.bias"))
    adapter = parse(cfg, tensors)
    assert adapter.has_bias and not parse({**cfg, "lora_bias": False},
                                          {k: v for k, v in tensors.items() if "bias" not in k}).has_bias
    assert adapter.content_id != parse(cfg, {**tensors, bias: tensors[bias] + 1}).content_id
    with pytest.raises(InvalidAdapterError, match=r"lora_B\.bias' is missing .*lora_bias=True"):
        parse(cfg, {k: v for k, v in tensors.items() if k != bias})
    with pytest.raises(InvalidAdapterError, match="lora_B bias but lora_bias is not true"):
        parse({**cfg, "lora_bias": False}, tensors)
    with pytest.raises(InvalidAdapterError, match=r"has shape \(3,\), expected"):
        parse(cfg, {**tensors, bias: np.ones(3, np.float32)})
    with pytest.raises(InvalidAdapterError, match="lora_bias='yes' must be true or false"):
        parse({**cfg, "lora_bias": "yes"}, tensors)
    with pytest.raises(InvalidAdapterError, match="lora_bias=True with use_dora=True"):
        parse({**cfg, "use_dora": True}, tensors)
    with pytest.raises(InvalidAdapterError, match="lora_bias=True with target module 'model.embed_tokens'"):
        parse({**cfg, "target_modules": [*cfg["target_modules"], "embed_tokens"]}, tensors)

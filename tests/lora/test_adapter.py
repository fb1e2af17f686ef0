"""PEFT adapter parsing: every target_modules spelling, scalings, pool layout, and each refusal."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from lora_runtime.errors import InvalidAdapterError
from lora_runtime.lora.adapter import LoRAAdapter, module_path, module_shapes
from tests.lora.conftest import ALL
from tests.lora.peft_adapters import make_peft_adapter, peft_logits, read_adapter, write_adapter

MAX_RANK = 16
PREFIX = "base_model.model.model.layers"


def parse_dir(path, model_config, name="a", max_lora_rank=MAX_RANK):
    return LoRAAdapter.parse(name, (path / "adapter_config.json").read_bytes(),
                             (path / "adapter_model.safetensors").read_bytes(), model_config, max_lora_rank)


def hand_made(model_config, modules, r=4, alpha=8, prefix=PREFIX, dtype=np.float32, **config):
    """(config, tensors) of a random adapter on `modules` = [(layer, module)]."""
    rng = np.random.default_rng(0)
    shapes = module_shapes(model_config)
    tensors = {}
    for layer, m in modules:
        block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        fan_in, fan_out = shapes[m]
        key = f"{prefix}.{layer}.{block}.{m}"
        tensors[f"{key}.lora_A.weight"] = rng.normal(size=(r, fan_in)).astype(dtype)
        tensors[f"{key}.lora_B.weight"] = rng.normal(size=(fan_out, r)).astype(dtype)
    paths = [module_path(layer, m) for layer, m in modules]
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": paths, "bias": "none",
            **config}, tensors


SPELLINGS = {
    "names": (dict(target_modules=["q_proj", "v_proj"]),
              {(layer, m) for layer in (0, 1) for m in ("q_proj", "v_proj")}),
    "full_paths": (dict(target_modules=["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]),
                   {(0, "q_proj"), (1, "down_proj")}),
    "regex": (dict(target_modules=r".*\.layers\.1\.mlp\.(gate|up)_proj"), {(1, "gate_proj"), (1, "up_proj")}),
    "all_linear": (dict(target_modules="all-linear"), {(layer, m) for layer in (0, 1) for m in ALL}),
    "layers_int": (dict(target_modules=["k_proj", "o_proj"], layers_to_transform=0), {(0, "k_proj"), (0, "o_proj")}),
    "layers_pattern": (dict(target_modules=["up_proj"], layers_to_transform=[1], layers_pattern="layers"),
                       {(1, "up_proj")}),
    "exclude": (dict(target_modules=["q_proj", "down_proj"], exclude_modules=["model.layers.0.mlp.down_proj"]),
                {(0, "q_proj"), (1, "q_proj"), (1, "down_proj")}),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_target_modules_spellings_match_peft(spelling, base_dir, model_config, tmp_path):
    kwargs, want = SPELLINGS[spelling]
    path = make_peft_adapter(base_dir, tmp_path / spelling, r=4, alpha=8, **kwargs)
    _, tensors = read_adapter(path)
    peft_modules = {(int(k.split(".")[4]), k.split(".")[6]) for k in tensors}
    adapter = parse_dir(path, model_config)
    assert peft_modules == want
    assert adapter.modules == want


def test_scalings_rslora_and_patterns(model_config, adapter_dirs):
    rs = parse_dir(adapter_dirs["r8_rslora"], model_config)
    assert rs.rank == 8 and rs.scaling == pytest.approx(16 / np.sqrt(8))
    assert all(w.ratio == 1.0 for w in rs.weights.values())
    pat = parse_dir(adapter_dirs["r16_pattern"], model_config)
    assert pat.rank == 16 and pat.scaling == pytest.approx(2.0)
    assert pat.weights[(0, "k_proj")].a.shape == (4, 64)
    assert pat.weights[(0, "k_proj")].ratio == pytest.approx((32 / 4) / 2.0)
    assert pat.weights[(1, "up_proj")].ratio == pytest.approx((32 / 8) / 2.0)
    assert pat.weights[(0, "up_proj")].ratio == 1.0
    assert pat.weights[(1, "o_proj")].ratio == pytest.approx((5 / 16) / 2.0)


def test_pool_weights_layout(model_config, adapter_dirs):
    adapter = parse_dir(adapter_dirs["r16_pattern"], model_config)
    pw = adapter.pool_weights(model_config, 32, np.float32)
    a, (bq, bk, bv) = pw["qkv"]
    assert a.shape == (2, 3 * 32, 64) and bk.shape == (2, 32, 32) and bq.shape == (2, 32, 64)
    k = adapter.weights[(1, "k_proj")]
    np.testing.assert_array_equal(a[1, 32:36], k.a)
    assert not a[1, 36:64].any() and not bk[1, 4:].any()
    np.testing.assert_allclose(bk[1, :4], k.b.T * k.ratio, rtol=1e-6)
    layer1 = parse_dir(adapter_dirs["r8_layer1"], model_config).pool_weights(model_config, 16, ml_dtypes.bfloat16)
    a_gu, (b_g, b_u) = layer1["gate_up"]
    assert a_gu.dtype == ml_dtypes.bfloat16
    assert not a_gu[0].any() and a_gu[1, :8].any() and not a_gu[1, 8:16].any()
    assert not layer1["down"][0].any()


def test_nbytes_counts_every_tensor(model_config, adapter_dirs):
    _, tensors = read_adapter(adapter_dirs["r4"])
    assert parse_dir(adapter_dirs["r4"], model_config).nbytes == sum(t.nbytes for t in tensors.values())


def test_keys_without_prefix_and_bf16(model_config, tmp_path):
    mods = [(0, "q_proj"), (1, "down_proj")]
    cfg, t32 = hand_made(model_config, mods)
    _, tbf = hand_made(model_config, mods, prefix="model.layers", dtype=ml_dtypes.bfloat16)
    a32 = parse_dir(write_adapter(tmp_path / "f32", cfg, t32), model_config)
    abf = LoRAAdapter.parse("bf", json.dumps(cfg), _safetensors_bytes(tbf), model_config, MAX_RANK)
    assert a32.modules == abf.modules == set(mods)
    np.testing.assert_allclose(abf.weights[(0, "q_proj")].a.astype(np.float32),
                               a32.weights[(0, "q_proj")].a, rtol=1e-2)


def test_fan_in_fan_out_changes_nothing(base_dir, model_config, adapter_dirs, tmp_path):
    """PEFT stores lora_A/lora_B the same either way and resets the flag for Linear layers."""
    src = adapter_dirs["r8_rslora"]
    dst = tmp_path / "fifo"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "fan_in_fan_out": True}))
    plain, flagged = parse_dir(src, model_config), parse_dir(dst, model_config)
    for key, w in plain.weights.items():
        np.testing.assert_array_equal(flagged.weights[key].a, w.a)
        np.testing.assert_array_equal(flagged.weights[key].b, w.b)
    ids = [5, 9, 17, 3]
    np.testing.assert_array_equal(peft_logits(base_dir, dst, ids), peft_logits(base_dir, src, ids))


def _safetensors_bytes(tensors):
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def _q_key(layer=0, ab="A"):
    return f"{PREFIX}.{layer}.self_attn.q_proj.lora_{ab}.weight"


def _bad_cases(model_config):
    """name -> (config, tensors, expected message fragment)."""
    cfg, t = hand_made(model_config, [(0, "q_proj"), (1, "q_proj")])
    shapes = module_shapes(model_config)
    v, h = model_config.vocab_size, model_config.hidden_size
    saved = np.ones((v, h), np.float32)  # a modules_to_save copy of embed_tokens or lm_head
    cases = {
        "bias": ({**cfg, "bias": "some"}, t, "bias='some' is not one of ['none', 'all', 'lora_only']"),
        "trained_base_bias": ({**cfg, "bias": "lora_only"},
                              {**t, f"{PREFIX}.0.self_attn.q_proj.base_layer.bias": np.zeros(64, np.float32)},
                              "is a trained bias of the base model"),
        "modules_to_save": ({**cfg, "modules_to_save": ["lm_head"]}, t,
                            "tensor 'base_model.model.lm_head.weight' is missing (modules_to_save lists 'lm_head')"),
        "modules_to_save_unknown": ({**cfg, "modules_to_save": ["score"]}, t,
                                    "modules_to_save entry 'score' selects neither embed_tokens nor lm_head"),
        "modules_to_save_projection": ({**cfg, "modules_to_save": ["v_proj"]}, t,
                                       "selects 'model.layers.0.self_attn.v_proj'; only ['embed_tokens', 'lm_head']"),
        "modules_to_save_not_a_list": ({**cfg, "modules_to_save": [3]}, t, "modules_to_save=[3] must be a list"),
        "modules_to_save_and_target": ({**cfg, "target_modules": ["q_proj", "lm_head"], "modules_to_save": ["lm_head"]},
                                       t, "'lm_head' is both in target_modules and in modules_to_save"),
        "saved_unlisted": (cfg, {**t, "base_model.model.lm_head.weight": saved}, "modules_to_save does not list"),
        "saved_shape": ({**cfg, "modules_to_save": ["embed_tokens"]},
                        {**t, "base_model.model.model.embed_tokens.weight": saved[:, :-1]},
                        f"has shape {(v, h - 1)}, but the base model's is {(v, h)}"),
        "saved_nan": ({**cfg, "modules_to_save": ["lm_head"]},
                      {**t, "base_model.model.lm_head.weight": np.full_like(saved, np.nan)},
                      "'base_model.model.lm_head.weight' has non-finite values"),
        "dora": ({**cfg, "use_dora": True}, t, "use_dora=True"),
        "pissa": ({**cfg, "init_lora_weights": "pissa_niter_4"}, t,
                  "init_lora_weights='pissa_niter_4' changes the base model's weights"),
        "olora": ({**cfg, "init_lora_weights": "olora"}, t, "path_initial_model_for_weight_conversion"),
        "alora": ({**cfg, "alora_invocation_tokens": [5, 6]}, t, "alora_invocation_tokens=[5, 6] is not supported"),
        "qalora": ({**cfg, "use_qalora": True}, t, "use_qalora=True is not supported"),
        "peft_type": ({**cfg, "peft_type": "LOHA"}, t, "peft_type='LOHA'"),
        "embed_target": ({**cfg, "target_modules": ["q_proj", "embed_tokens"]}, t, "embed_tokens"),
        "lm_head_target": ({**cfg, "target_modules": ["lm_head"]}, t, "lm_head"),
        "lm_head_regex": ({**cfg, "target_modules": r".*(q_proj|lm_head)"}, t, "lm_head"),
        "unknown_module": ({**cfg, "target_modules": ["q_proj", "foo_proj"]}, t, "foo_proj"),
        "regex_matches_nothing": ({**cfg, "target_modules": r".*\.nothing"}, t, "matches no module"),
        "bad_regex": ({**cfg, "target_modules": r"(q_proj"}, t, "not a valid regex"),
        "rank_zero": ({**cfg, "r": 0}, t, "r=0"),
        "rank_over_max": ({**cfg, "r": 32}, t, "rank=32 exceeds max_lora_rank=16"),
        "rank_pattern_over_max": ({**cfg, "rank_pattern": {"q_proj": 17}}, t, "rank=17 exceeds max_lora_rank=16"),
        "alpha_not_number": ({**cfg, "lora_alpha": "big"}, t, "lora_alpha='big'"),
        "shape": (cfg, {**t, _q_key(): np.zeros((4, 63), np.float32)},
                  f"{_q_key()!r} has shape (4, 63), expected (4, 64)"),
        "rank_mismatch": (cfg, {**t, _q_key(ab="B"): np.zeros((shapes['q_proj'][1], 5), np.float32)},
                          f"{_q_key(ab='B')!r} has shape"),
        "nan": (cfg, {**t, _q_key(): np.full((4, 64), np.nan, np.float32)}, f"{_q_key()!r} has non-finite values"),
        "inf": (cfg, {**t, _q_key(1, "B"): np.full((shapes['q_proj'][1], 4), np.inf, np.float32)},
                f"{_q_key(1, 'B')!r} has non-finite values"),
        "missing_b": (cfg, {k: v for k, v in t.items() if k != _q_key(1, "B")}, f"{_q_key(1, 'B')!r} is missing"),
        "missing_module": (cfg, {k: v for k, v in t.items() if ".1." not in k}, "model.layers.1.self_attn.q_proj"),
        "untargeted": ({**cfg, "target_modules": ["q_proj"], "layers_to_transform": [0]}, t,
                       f"{_q_key(1)!r} is for a module target_modules does not select"),
        "unknown_key": (cfg, {**t, f"{PREFIX}.0.self_attn.rotary.lora_A.weight": np.zeros((4, 64), np.float32)},
                        "self_attn.rotary"),
        "layer_out_of_range": (cfg, {**t, _q_key(5): np.zeros((4, 64), np.float32)}, "layer=5"),
        "int_dtype": (cfg, {**t, _q_key(): np.zeros((4, 64), np.int32)}, "unsupported dtype 'I32'"),
    }
    return cases


BAD = [
    "bias", "trained_base_bias", "modules_to_save", "modules_to_save_unknown", "modules_to_save_projection", "modules_to_save_not_a_list",
    "modules_to_save_and_target", "saved_unlisted", "saved_shape", "saved_nan", "dora", "pissa", "olora", "alora", "qalora", "peft_type", "embed_target", "lm_head_target", "lm_head_regex",
    "unknown_module", "regex_matches_nothing", "bad_regex", "rank_zero", "rank_over_max", "rank_pattern_over_max",
    "alpha_not_number", "shape", "rank_mismatch", "nan", "inf", "missing_b", "missing_module", "untargeted",
    "unknown_key", "layer_out_of_range", "int_dtype",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_adapter_is_refused_naming_the_problem(case, model_config):
    cfg, tensors, fragment = _bad_cases(model_config)[case]
    with pytest.raises(InvalidAdapterError) as e:
        LoRAAdapter.parse("bad-one", json.dumps(cfg), _safetensors_bytes(tensors), model_config, MAX_RANK)
    assert fragment in str(e.value)
    assert "'bad-one'" in str(e.value)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_bias_modes_that_saved_no_bias_are_plain_lora(bias, base_dir, model_config, tmp_path):
    """PEFT's bias='all'/'lora_only' on a Llama (no biases in its layers) saves nothing more:
    the adapter is served as the same plain LoRA."""
    src = make_peft_adapter(base_dir, tmp_path / "src", r=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3,
                            bias=bias)
    config, tensors = read_adapter(src)
    assert config["bias"] == bias and not [k for k in tensors if "lora_" not in k]
    plain = write_adapter(tmp_path / "plain", {**config, "bias": "none"}, tensors)
    assert parse_dir(src, model_config).content_id == parse_dir(plain, model_config).content_id


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "mica", "orthogonal"])
def test_initializations_that_leave_the_base_weights_alone_are_served(init, model_config):
    cfg, t = hand_made(model_config, [(0, "q_proj")])
    adapter = LoRAAdapter.parse("ok", json.dumps({**cfg, "init_lora_weights": init}), _safetensors_bytes(t),
                                model_config, MAX_RANK)
    assert adapter.modules == {(0, "q_proj")}


def test_bad_files_are_refused(model_config):
    cfg, t = hand_made(model_config, [(0, "q_proj")])
    blob = _safetensors_bytes(t)
    cases = [
        ("{not json", blob, "adapter_config.json is not valid JSON"),
        ("[1, 2]", blob, "must hold an object"),
        (json.dumps(cfg), blob[:5], "truncated"),
        (json.dumps(cfg), (10 ** 9).to_bytes(8, "little") + blob[8:], "exceeds file size"),
        (json.dumps(cfg), blob[:-8], "do not fit shape"),
    ]
    for config_json, data, fragment in cases:
        with pytest.raises(InvalidAdapterError, match=fragment):
            LoRAAdapter.parse("bad-file", config_json, data, model_config, MAX_RANK)


def test_a_pissa_adapter_is_refused_and_its_plain_lora_conversion_holds_what_it_trained(base_dir, model_config,
                                                                                         tmp_path):
    """PEFT's PiSSA moves the adapter's initial product out of the base weights; converted as
    PEFT documents, it is a plain LoRA (rank 2r) whose delta is the trained model's change."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.lora.peft_adapters import load_base_model

    torch.manual_seed(0)
    model = load_base_model(base_dir)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                  init_lora_weights="pissa"))
    peft_model.peft_config["default"].init_lora_weights = True  # as PEFT's PiSSA example saves the start
    peft_model.save_pretrained(tmp_path / "start")
    peft_model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():  # training
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.05)
    peft_model.save_pretrained(tmp_path / "pissa")
    peft_model.save_pretrained(tmp_path / "plain", path_initial_model_for_weight_conversion=str(tmp_path / "start"))
    with pytest.raises(InvalidAdapterError, match="init_lora_weights='pissa' changes the base model's weights"):
        parse_dir(tmp_path / "pissa", model_config)
    plain = parse_dir(tmp_path / "plain", model_config)
    assert plain.rank == 8
    trained = peft_model.merge_and_unload().state_dict()
    for (layer, module), w in plain.weights.items():
        name = f"model.layers.{layer}.{'self_attn' if module == 'q_proj' else 'mlp'}.{module}.weight"
        want = (trained[name] - original[name]).double().numpy()
        got = plain.scaling * w.ratio * (w.b.astype(np.float64) @ w.a.astype(np.float64))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

"""Adapter merging against PEFT's add_weighted_adapter, the reference implementation."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from lora_runtime.errors import InvalidRequestError
from lora_runtime.lora.adapter import NO_LAYER, LoRAAdapter
from lora_runtime.lora.merge import MergeSpec, combine, merge_adapters
from lora_runtime.lora.sources import SourcePolicy, load_adapter
from tests.lora.conftest import ALL
from tests.lora.peft_adapters import load_base_model, make_peft_adapter

MAX_RANK = 16


@pytest.fixture(scope="module")
def merge_dirs(base_dir, tmp_path_factory) -> dict[str, Path]:
    """x and y: rank 8 on every projection (y with an alpha_pattern); z: rank 4, rsLoRA, on
    two projections, the embedding and the head."""
    root = tmp_path_factory.mktemp("merge")
    specs = {
        "x": dict(r=8, alpha=16, target_modules=ALL, seed=11),
        "y": dict(r=8, alpha=8, target_modules=ALL, seed=12, alpha_pattern={"o_proj": 3}),
        "z": dict(r=4, alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens", "lm_head"],
                  use_rslora=True, seed=13),
    }
    return {name: make_peft_adapter(base_dir, root / name, **spec) for name, spec in specs.items()}


def _load(dirs, names, model_config) -> list[LoRAAdapter]:
    policy = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 30)
    return [load_adapter(n, str(dirs[n]), policy, model_config, MAX_RANK) for n in names]


def _write(files, out: Path) -> Path:
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_bytes(files.config_json)
    (out / "adapter_model.safetensors").write_bytes(files.safetensors)
    return out


def _peft_deltas(model, adapter: str) -> dict[tuple[int, str], np.ndarray]:
    """(layer, module) -> scaling × B A of ``adapter`` in a PEFT model, [out, in] as we hold it."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if adapter in module.lora_A:
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        elif adapter in module.lora_embedding_A:
            a, b = module.lora_embedding_A[adapter], module.lora_embedding_B[adapter]
        else:
            continue
        parts = name.split(".")
        key = (NO_LAYER, parts[-1]) if parts[-1] in ("embed_tokens", "lm_head") else (int(parts[-3]), parts[-1])
        out[key] = (b @ a).detach().double().numpy() * module.scaling[adapter]
    return out


def _our_deltas(adapter: LoRAAdapter) -> dict[tuple[int, str], np.ndarray]:
    return {k: adapter.scaling * w.ratio * (w.b.astype(np.float64) @ w.a.astype(np.float64))
            for k, w in adapter.weights.items()}


def _close(got, want, what) -> None:
    """Equal to f32 rounding, relative to the tensor's largest entry."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=str(what))


def _peft_merge(base_dir, dirs, names, weights, **kwargs):
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base_model(base_dir), dirs[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(dirs[n], adapter_name=n)
    model.add_weighted_adapter(list(names), list(weights), "merged", **kwargs)
    return model


CASES = {
    "cat": (("x", "z"), (0.7, -1.3), {}),
    "svd": (("x", "z"), (0.7, 0.4), {}),
    "svd_rank": (("x", "z"), (1.0, 1.0), {"svd_rank": 5}),
    "linear": (("x", "y"), (0.6, 0.5), {}),
    "ties": (("x", "y"), (0.6, -0.5), {"density": 0.4}),
    "ties_frequency": (("x", "y"), (1.0, 0.8), {"density": 0.7, "majority_sign_method": "frequency"}),
    "magnitude_prune": (("x", "y"), (0.9, 0.3), {"density": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_merge_computes_what_peft_add_weighted_adapter_computes(case, base_dir, model_config, merge_dirs, tmp_path):
    names, weights, options = CASES[case]
    kind = case.split("_")[0] if case != "magnitude_prune" else case
    spec = MergeSpec(adapters=names, weights=weights, combination_type=kind, **options)
    files = merge_adapters(spec, _load(merge_dirs, names, model_config), model_config.num_layers, MAX_RANK)
    ours = LoRAAdapter.parse("merged", files.config_json, files.safetensors, model_config, MAX_RANK)
    peft_options = {("svd_rank" if k == "svd_rank" else k): v for k, v in options.items()}
    reference = _peft_deltas(_peft_merge(base_dir, merge_dirs, names, weights, combination_type=kind,
                                         **peft_options), "merged")
    got = _our_deltas(ours)
    # PEFT also gives the merged adapter every module of the union in every layer; ours has
    # only modules some adapter has, and those hold the same delta.
    assert got.keys() == {k for k, d in reference.items() if np.any(d)}
    for key, delta in got.items():
        _close(delta, reference[key], key)
    # PEFT reads the merged files and computes the same deltas from them.
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(load_base_model(base_dir), _write(files, tmp_path / "m"), adapter_name="m")
    for key, delta in _peft_deltas(loaded, "m").items():
        _close(delta, got[key], key)


def test_cat_is_the_weighted_sum_of_the_deltas_and_svd_keeps_its_largest_part(model_config, merge_dirs):
    adapters = _load(merge_dirs, ("x", "z"), model_config)
    weights = (0.25, 2.0)
    sources = [_our_deltas(a) for a in adapters]
    for kind in ("cat", "svd"):
        spec = MergeSpec(adapters=("x", "z"), weights=weights, combination_type=kind, svd_rank=None)
        files = merge_adapters(spec, adapters, model_config.num_layers, MAX_RANK)
        merged = _our_deltas(LoRAAdapter.parse("m", files.config_json, files.safetensors, model_config, MAX_RANK))
        for key, delta in merged.items():
            want = sum(w * d[key] for w, d in zip(weights, sources) if key in d)
            if kind == "cat":
                _close(delta, want, key)
            else:  # rank 8 of a sum of rank 8 + 4: the 8 largest singular values, the best rank-8 fit
                s = np.linalg.svd(want, compute_uv=False)
                assert np.linalg.norm(delta - want) == pytest.approx(np.sqrt((s[8:] ** 2).sum()), rel=1e-4,
                                                                    abs=1e-5 * np.linalg.norm(want))
        assert files.rank == (12 if kind == "cat" else 8)


def test_dare_prunes_as_peft_does_with_the_same_draws(monkeypatch):
    import torch
    from peft.utils import merge_utils

    rng = np.random.default_rng(5)
    tensors = [rng.normal(size=(6, 10)) for _ in range(3)]
    weights = np.array([0.5, -1.2, 0.8])
    for kind in ("dare_linear", "dare_ties"):
        ours = combine(kind, tensors, weights, 0.3, "total", np.random.default_rng(9))
        draws = np.random.default_rng(9)
        monkeypatch.setattr(torch, "bernoulli",
                            lambda p: torch.from_numpy((draws.random(tuple(p.shape)) < 0.3).astype(np.float64)))
        theirs = getattr(merge_utils, kind)([torch.from_numpy(t) for t in tensors], torch.from_numpy(weights), 0.3)
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-12, atol=1e-12)
        kept = np.mean([np.mean(t != 0) for t in (ours,)])
        assert 0 < kept < 1


def test_dare_merges_are_reproducible_by_seed(model_config, merge_dirs):
    adapters = _load(merge_dirs, ("x", "y"), model_config)

    def files(seed):
        spec = MergeSpec(adapters=("x", "y"), weights=(1.0, 1.0), combination_type="dare_ties", density=0.5, seed=seed)
        return merge_adapters(spec, adapters, model_config.num_layers, MAX_RANK).safetensors

    assert files(1) == files(1)
    assert files(1) != files(2)


def test_one_adapter_merges_as_itself_scaled(model_config, merge_dirs):
    [z] = _load(merge_dirs, ("z",), model_config)
    spec = MergeSpec(adapters=("z",), weights=(-0.5,), combination_type="ties")  # one adapter: linear, as PEFT
    files = merge_adapters(spec, [z], model_config.num_layers, MAX_RANK)
    merged = _our_deltas(LoRAAdapter.parse("m", files.config_json, files.safetensors, model_config, MAX_RANK))
    for key, delta in _our_deltas(z).items():
        _close(merged[key], -0.5 * delta, key)
    assert merged.keys() == z.modules


@pytest.mark.parametrize("fields, param, words", [
    (dict(adapters=(), weights=()), "merge.adapters", "1 to 16"),
    (dict(adapters=("x", "x"), weights=(1, 1)), "merge.adapters", "more than once"),
    (dict(adapters=("x", "y"), weights=(1,)), "merge.weights", "one weight per adapter"),
    (dict(adapters=("x", "y"), weights=(1, float("nan"))), "merge.weights", "finite"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="ties_svd"), "merge.combination_type", "dense SVD"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="ties"), "merge.density", "(0, 1]"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="dare_linear", density=0.0), "merge.density",
     "(0, 1]"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="cat", density=0.5), "merge.density", "applies"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="linear", svd_rank=4), "merge.svd_rank", "'svd'"),
    (dict(adapters=("x", "y"), weights=(1, 1), svd_rank=0), "merge.svd_rank", "positive"),
    (dict(adapters=("x", "y"), weights=(1, 1), combination_type="ties", density=0.5, majority_sign_method="most"),
     "merge.majority_sign_method", "'total'"),
    (dict(adapters=("x", "y"), weights=(1, 1), seed=-1), "merge.seed", "non-negative"),
])
def test_a_bad_merge_is_refused_naming_the_field(fields, param, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as e:
        MergeSpec(**fields)
    assert e.value.param == param


def test_merges_that_cannot_be_made_are_refused_with_the_reason(model_config, merge_dirs, extra_adapter_dirs):
    x, z = _load(merge_dirs, ("x", "z"), model_config)
    with pytest.raises(InvalidRequestError, match=r"equal ranks.*'model.layers.0.mlp.down_proj' are \[4, 8\]"):
        merge_adapters(MergeSpec(adapters=("x", "z"), weights=(1, 1), combination_type="linear"), [x, z],
                       model_config.num_layers, MAX_RANK)
    with pytest.raises(InvalidRequestError, match=r"rank 12 exceeds this server's max_lora_rank=8.*'cat' adds"):
        merge_adapters(MergeSpec(adapters=("x", "z"), weights=(1, 1), combination_type="cat"), [x, z],
                       model_config.num_layers, 8)
    policy = SourcePolicy(allowed_roots=None, max_adapter_bytes=1 << 30)
    dora = load_adapter("dora", str(extra_adapter_dirs["dora"]), policy, model_config, MAX_RANK)
    with pytest.raises(InvalidRequestError, match=r"'dora' has DoRA magnitudes"):
        merge_adapters(MergeSpec(adapters=("x", "dora"), weights=(1, 1), combination_type="cat"), [x, dora],
                       model_config.num_layers, MAX_RANK)


def test_svd_of_a_rank_deficient_or_zero_sum_is_exact(model_config, merge_dirs):
    """Two names for one adapter stack to rank 16 holding 8 directions: svd keeps those 8, and
    weights (1, -1) cancel to a zero delta."""
    [x] = _load(merge_dirs, ("x",), model_config)
    twin = LoRAAdapter(name="x2", rank=x.rank, scaling=x.scaling, weights=x.weights)
    source = _our_deltas(x)
    for weights, factor in (((1.0, 1.0), 2.0), ((1.0, -1.0), 0.0)):
        spec = MergeSpec(adapters=("x", "x2"), weights=weights, combination_type="svd", svd_rank=12)
        files = merge_adapters(spec, [x, twin], model_config.num_layers, MAX_RANK)
        merged = _our_deltas(LoRAAdapter.parse("m", files.config_json, files.safetensors, model_config, MAX_RANK))
        for key, delta in source.items():
            np.testing.assert_allclose(merged[key], factor * delta, rtol=1e-5, atol=1e-5 * np.abs(delta).max())


def test_weights_of_zero_merge_to_an_adapter_that_changes_nothing(model_config, merge_dirs):
    adapters = _load(merge_dirs, ("x", "z"), model_config)
    spec = MergeSpec(adapters=("x", "z"), weights=(0.0, 0.0), combination_type="svd")
    files = merge_adapters(spec, adapters, model_config.num_layers, MAX_RANK)
    merged = LoRAAdapter.parse("m", files.config_json, files.safetensors, model_config, MAX_RANK)
    assert files.rank == 1 and all(not np.any(d) for d in _our_deltas(merged).values())

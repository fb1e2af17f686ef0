"""ModelConfig parses every supported family's config.json and names what is wrong in bad ones."""

from __future__ import annotations

import json
import math

import pytest

from lora_runtime.errors import CheckpointError
from lora_runtime.model.config import ModelConfig, RopeScaling
from tests.model.conftest import BASE, FAMILIES, build_hf_model


@pytest.fixture(scope="module")
def hf_dicts() -> dict[str, dict]:
    """family -> config.json dict exactly as transformers writes it."""
    return {family: json.loads(build_hf_model(family).config.to_json_string()) for family in FAMILIES}


def llama_dict(**overrides) -> dict:
    d = dict(BASE, architectures=["LlamaForCausalLM"], num_key_value_heads=2, torch_dtype="float32")
    d.update(overrides)
    return d


def test_llama(hf_dicts):
    c = ModelConfig.from_hf_dict(hf_dicts["llama"])
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 128, 64, 96)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert (c.attention_bias, c.qk_norm, c.sliding_window, c.rope_scaling) == (False, False, None, None)
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (1, (2,), False)
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 128


def test_llama3_rope_scaling(hf_dicts):
    c = ModelConfig.from_hf_dict(hf_dicts["llama3_rope_tied"])
    assert c.rope_theta == 500.0 and c.tie_word_embeddings and c.num_kv_heads == 4
    assert c.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 4.0, 32)
    # llama's attention_bias covers o_proj too
    assert c.attention_bias and c.attention_out_bias


def test_transformers4_style_rope_fields():
    d = llama_dict(
        rope_theta=123.0, rope_scaling=dict(type="linear", factor=2.0), attention_bias=None, head_dim=None
    )
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 123.0 and c.rope_scaling == RopeScaling("linear", 2.0)
    assert c.head_dim == 16
    assert ModelConfig.from_hf_dict(llama_dict(rope_scaling=dict(rope_type="default"))).rope_scaling is None


def yarn(**fields) -> RopeScaling:
    d = llama_dict(rope_scaling=dict(rope_type="yarn", **fields))
    return ModelConfig.from_hf_dict(d).rope_scaling


def test_yarn_rope_scaling_with_transformers_defaults():
    s = yarn(factor=4.0, original_max_position_embeddings=32)
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32)
    assert (s.beta_fast, s.beta_slow, s.truncate) == (32.0, 1.0, True)
    assert s.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    # transformers' `or`: a 0 or null beta is the default; a factor <= 1 scales no attention
    s = yarn(factor=1.0, original_max_position_embeddings=32, beta_fast=0, beta_slow=None, truncate=False)
    assert (s.beta_fast, s.beta_slow, s.truncate, s.attention_factor) == (32.0, 1.0, False, 1.0)


def test_yarn_attention_factor_from_mscale_or_given():
    s = yarn(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5)
    assert s.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    # both mscales are needed; one alone falls back to the plain formula
    assert yarn(factor=4.0, mscale=0.707).attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    given = yarn(factor=4.0, attention_factor=0.5, mscale=1.0, mscale_all_dim=0.5, beta_fast=16, beta_slow=2)
    assert (given.attention_factor, given.beta_fast, given.beta_slow) == (0.5, 16.0, 2.0)


def test_yarn_original_length_and_factor_fallbacks():
    # No original length in the dict: config.json's max_position_embeddings (128)
    assert yarn(factor=4.0).original_max_position_embeddings == 128
    # A top-level original_max_position_embeddings wins over the dict's, as in transformers
    d = llama_dict(
        original_max_position_embeddings=16,
        rope_scaling=dict(type="yarn", factor=2.0, original_max_position_embeddings=32),
    )
    assert ModelConfig.from_hf_dict(d).rope_scaling.original_max_position_embeddings == 16
    # A null factor is max_position_embeddings / original (DeepSeek-V3 style)
    s = yarn(factor=None, original_max_position_embeddings=32)
    assert s.factor == 4.0 and s.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_dynamic_rope_scaling_limits_max_seq_len():
    c = ModelConfig.from_hf_dict(llama_dict(rope_scaling=dict(type="dynamic", factor=2.0)))
    assert c.rope_scaling == RopeScaling("dynamic", 2.0, original_max_position_embeddings=128)
    c.check_max_seq_len(128)
    with pytest.raises(CheckpointError, match=r"'dynamic'.*max_position_embeddings=128.*max_seq_len=129"):
        c.check_max_seq_len(129)
    # other scalings, and none, set no limit of their own
    for rope in (None, dict(type="linear", factor=2.0), dict(type="yarn", factor=4.0)):
        ModelConfig.from_hf_dict(llama_dict(rope_scaling=rope)).check_max_seq_len(1 << 20)


@pytest.mark.parametrize(
    "rope, culprit",
    [
        (dict(type="yarn"), "missing field 'factor'"),
        (dict(type="dynamic"), "missing field 'factor'"),
        (dict(type="dynamic", factor="2"), "factor, got '2'"),
        (dict(type="linear", factor=0), "factor, got 0"),
        (dict(type="yarn", factor=-2.0), "factor, got -2.0"),
        (dict(type="yarn", factor=4.0, original_max_position_embeddings=0), "embeddings, got 0"),
        (dict(type="yarn", factor=4.0, original_max_position_embeddings=31.5), "integer original_max"),
        (dict(type="yarn", factor=4.0, attention_factor=0.0), "attention_factor, got 0.0"),
        (dict(type="yarn", factor=4.0, mscale="1"), "mscale, got '1'"),
        (dict(type="yarn", factor=4.0, beta_fast=[32]), "beta_fast"),
    ],
)
def test_bad_rope_scaling_names_the_field(rope, culprit):
    with pytest.raises(CheckpointError, match=culprit):
        ModelConfig.from_hf_dict(llama_dict(rope_scaling=rope))


def test_mistral_sliding_window(hf_dicts):
    c = ModelConfig.from_hf_dict(hf_dicts["mistral"])
    assert c.architecture == "mistral" and c.sliding_window == 4
    assert [c.layer_window(i) for i in range(c.num_layers)] == [4, 4]
    no_window = dict(hf_dicts["mistral"], sliding_window=None)
    assert ModelConfig.from_hf_dict(no_window).sliding_window is None


def test_qwen2_always_has_qkv_bias(hf_dicts):
    d = hf_dicts["qwen2"]
    assert "attention_bias" not in d
    c = ModelConfig.from_hf_dict(d)
    assert c.architecture == "qwen2" and c.attention_bias and not c.attention_out_bias and not c.qk_norm
    # use_sliding_window false: the configured window is inactive, as in transformers
    assert ModelConfig.from_hf_dict(dict(d, sliding_window=8)).sliding_window is None


def test_qwen2_sliding_window_per_layer(hf_dicts):
    d = dict(hf_dicts["qwen2"], use_sliding_window=True, sliding_window=8, max_window_layers=1)
    d.pop("layer_types")
    c = ModelConfig.from_hf_dict(d)
    assert [c.layer_window(i) for i in range(2)] == [None, 8]
    d["layer_types"] = ["sliding_attention", "full_attention"]
    c = ModelConfig.from_hf_dict(d)
    assert [c.layer_window(i) for i in range(2)] == [8, None]


def test_qwen3_qk_norm_and_head_dim(hf_dicts):
    c = ModelConfig.from_hf_dict(hf_dicts["qwen3"])
    assert c.architecture == "qwen3" and c.qk_norm and c.head_dim == 32 and not c.attention_bias
    assert c.tie_word_embeddings


def test_model_type_fallback_and_eos_list():
    d = llama_dict(architectures=None, model_type="qwen3", eos_token_id=[5, 7])
    c = ModelConfig.from_hf_dict(d)
    assert c.architecture == "qwen3" and c.eos_token_ids == (5, 7)


def test_dtype_from_config_and_override():
    assert ModelConfig.from_hf_dict(llama_dict(torch_dtype="bfloat16")).dtype == "bfloat16"
    assert ModelConfig.from_hf_dict(llama_dict(torch_dtype=None, dtype="bfloat16")).dtype == "bfloat16"
    assert ModelConfig.from_hf_dict(llama_dict(torch_dtype="float16")).dtype == "bfloat16"
    assert ModelConfig.from_hf_dict(llama_dict(torch_dtype="bfloat16"), dtype="float32").dtype == "float32"


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (dict(architectures=None, model_type="gemma"), "gemma"),
        (dict(architectures=None), "architectures"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(vocab_size=None), "vocab_size"),
        (dict(num_hidden_layers=None), "num_hidden_layers"),
        (dict(rms_norm_eps=None), "rms_norm_eps"),
        (dict(torch_dtype="int8"), "int8"),
        (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), "longrope.*linear, llama3, yarn, dynamic"),
        (dict(rope_scaling=dict(type="su", factor=2.0)), "'su'"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(hidden_act="xielu"), "hidden_act='xielu'"),
        (dict(quantization_config={"quant_method": "awq", "bits": 4}), "quant_method='awq'.*not supported"),
    ],
)
def test_bad_config_names_the_field(overrides, culprit):
    d = llama_dict(**overrides)
    if d.get("architectures") is None:
        d.pop("architectures")
    with pytest.raises(CheckpointError, match=culprit):
        ModelConfig.from_hf_dict(d)


def test_hidden_act_is_read_and_silu_by_default(hf_dicts):
    assert ModelConfig.from_hf_dict(hf_dicts["llama"]).hidden_act == "silu"
    assert ModelConfig.from_hf_dict(llama_dict()).hidden_act == "silu"
    assert ModelConfig.from_hf_dict(llama_dict(hidden_act="gelu_pytorch_tanh")).hidden_act == "gelu_pytorch_tanh"


def test_dtype_override_must_be_supported():
    with pytest.raises(CheckpointError, match="float64"):
        ModelConfig.from_hf_dict(llama_dict(), dtype="float64")


def test_from_pretrained(tmp_path, hf_dicts):
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hf_dicts["qwen3"]))
    assert ModelConfig.from_pretrained(str(tmp_path)) == ModelConfig.from_hf_dict(hf_dicts["qwen3"])

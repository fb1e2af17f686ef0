"""Base-model fingerprints and how a registry's entries split between base models."""

import dataclasses

import pytest

from cluster.base_model import (
    FINGERPRINT_FIELDS, FINGERPRINT_FIELDS_UNLESS_DEFAULT, BaseModel, census, config_fingerprint, entry_base, short,
)
from lora_runtime.model.config import ModelConfig

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _config(**changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**LLAMA, **changes})


def test_fingerprint_is_the_checkpoints_whatever_mesh_serves_it():
    config = ModelConfig.from_hf_dict(LLAMA)
    assert config_fingerprint(config.for_tensor_parallel(2 * config.num_kv_heads)) == config_fingerprint(config)


def test_fingerprint_is_a_sha256_that_ignores_dtype_and_special_tokens():
    fp = config_fingerprint(_config())
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    assert config_fingerprint(_config(torch_dtype="bfloat16")) == fp
    assert config_fingerprint(ModelConfig.from_hf_dict(LLAMA, dtype="bfloat16")) == fp
    assert config_fingerprint(_config(eos_token_id=[2, 3], bos_token_id=0)) == fp
    assert config_fingerprint(_config(rope_theta=10000)) == fp  # an int spelling of the same value
    assert short(fp) == fp[7:19]


def test_a_field_that_joined_later_leaves_the_fingerprints_recorded_before_it_alone():
    # This config's fingerprint before hidden_act joined: registries written then still match.
    assert config_fingerprint(_config()) == "sha256:9a45924bdbcd196e5b08d1201d5cba457e45f60ce5821a90a9374978335975c8"
    assert config_fingerprint(_config(hidden_act="silu")) == config_fingerprint(_config())


@pytest.mark.parametrize(
    "changes",
    [
        {"hidden_size": 128},
        {"num_hidden_layers": 3},
        {"num_key_value_heads": 4},
        {"vocab_size": 301},
        {"intermediate_size": 256},
        {"rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"tie_word_embeddings": True},
        {"architectures": ["Qwen2ForCausalLM"]},
        {"head_dim": 32},
        {"hidden_act": "gelu"},
    ],
)
def test_fingerprint_changes_with_what_fixes_shapes_and_meaning(changes):
    assert config_fingerprint(_config(**changes)) != config_fingerprint(_config())


def test_every_model_config_field_is_either_fingerprinted_or_deliberately_left_out():
    # A new ModelConfig field must be classified here: does it change which adapters fit?
    left_out = {"dtype", "bos_token_id", "eos_token_ids", "kv_head_copies"}  # a copy count: how it is served
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    fingerprinted = set(FINGERPRINT_FIELDS) | set(FINGERPRINT_FIELDS_UNLESS_DEFAULT)
    assert fingerprinted | left_out == fields, fields ^ (fingerprinted | left_out)
    assert not fingerprinted & left_out


def test_entry_base_and_census_split_entries_by_base_model():
    mine = BaseModel("demo", config_fingerprint(_config()))
    other = BaseModel("tiny", config_fingerprint(_config(hidden_size=128)))
    adapters = {
        "a": {"source": "/a", "version": 1, "pinned": False, **mine.entry_fields()},
        "b": {"source": "/b", "version": 2, "pinned": False, **other.entry_fields()},
        "c": {"source": "/c", "version": 3, "pinned": False, **other.entry_fields()},
        "old": {"source": "/old", "version": 4, "pinned": False},
    }
    assert entry_base(adapters["b"]) == other and entry_base(adapters["old"]) is None
    got = census(adapters, mine)
    assert got.own == 1 and got.others == {str(other): 2} and got.unassigned == ("old",)
    line = got.line(mine, "/r.json")
    serving = f"adapter registry /r.json: serving 1 adapters of base model 'demo' ({short(mine.fingerprint)})"
    assert line.startswith(serving)
    assert f"skipped 3: 2 validated against other base models (2 of 'tiny' ({short(other.fingerprint)}))" in line
    assert "1 with no base model recorded that do not fit this one (old): re-register them" in line
    assert census({"a": adapters["a"]}, mine).line(mine, "/r.json").endswith("; none skipped")

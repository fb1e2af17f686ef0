"""A checkpoint's generation_config.json gives the sampling values a request leaves unset."""

from __future__ import annotations

import json

import pytest

from lora_runtime.errors import CheckpointError
from lora_runtime.model.generation_defaults import NEUTRAL, default_max_tokens, read_generation_defaults, with_defaults


def _write(folder, **fields):
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3], **fields}))
    return folder


def test_the_sampling_fields_are_read_and_max_new_tokens_is_max_tokens(tmp_path):
    # Qwen3's recommendation, with do_sample (ignored, as vLLM ignores it) and a max_new_tokens.
    folder = _write(tmp_path, do_sample=True, temperature=0.6, top_p=0.95, top_k=20, min_p=0,
                    repetition_penalty=1.05, max_new_tokens=512)
    assert read_generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                "repetition_penalty": 1.05, "max_tokens": 512}
    nulls, missing = tmp_path / "nulls", tmp_path / "missing"
    nulls.mkdir()
    missing.mkdir()
    assert read_generation_defaults(_write(nulls, temperature=None)) == {}
    assert read_generation_defaults(missing) == {}


@pytest.mark.parametrize("fields, culprit", [
    (dict(temperature="hot"), "temperature='hot' must be a finite number"),
    (dict(top_k=2.5), "top_k=2.5 must be an integer"),
    (dict(top_p=True), "top_p=True must be a finite number"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be positive"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(repetition_penalty=0), "repetition_penalty=0.0 must be in"),
])
def test_a_bad_value_is_refused_naming_the_file_and_field(tmp_path, fields, culprit):
    with pytest.raises(CheckpointError, match=r"generation_config\.json.*" + culprit):
        read_generation_defaults(_write(tmp_path, **fields))


def test_a_malformed_file_names_itself(tmp_path):
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json' is not valid JSON"):
        read_generation_defaults(tmp_path)


def test_the_request_wins_then_the_checkpoint_then_the_neutral_value():
    unset = {"temperature": None, "top_p": 0.5, "top_k": None, "min_p": None, "repetition_penalty": None,
             "max_tokens": None, "seed": 7}
    got = with_defaults(unset, {"temperature": 0.6, "top_k": 20, "max_tokens": 100})
    assert got == {**unset, "temperature": 0.6, "top_p": 0.5, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0}
    assert with_defaults(unset, {}) == {**unset, **NEUTRAL, "top_p": 0.5}
    assert with_defaults({**unset, "temperature": 0}, {"temperature": 0.6})["temperature"] == 0  # 0 is a value
    assert default_max_tokens(50, {"max_tokens": 100}) == 50 and default_max_tokens(500, {"max_tokens": 100}) == 100
    assert default_max_tokens(0, {}) == 1 and default_max_tokens(30, {}) == 30

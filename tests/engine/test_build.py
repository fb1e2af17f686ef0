"""Building an engine refuses a max_seq_len the checkpoint's RoPE cannot serve."""

import pytest

from lora_runtime.engine.build import assemble_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.errors import CheckpointError
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from lora_runtime.model.tokenizer import Tokenizer
from tests.helpers.checkpoints import save_tiny_llama

TOO_LONG = EngineConfig(max_batch=2, max_seq_len=96, max_loras_per_batch=0)
REFUSAL = r"rope_type='dynamic'.*max_position_embeddings=64.*max_seq_len=96"


@pytest.fixture(scope="module")
def dynamic_checkpoint(tmp_path_factory):
    """transformers recomputes dynamic NTK frequencies past max_position_embeddings (64)."""
    out = tmp_path_factory.mktemp("dynamic_rope")
    return save_tiny_llama(out, max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=2.0))


def test_dynamic_rope_caps_max_seq_len_at_max_position_embeddings(dynamic_checkpoint):
    with pytest.raises(CheckpointError, match=REFUSAL):
        Engine.from_pretrained(str(dynamic_checkpoint), TOO_LONG)
    config = EngineConfig(max_batch=2, max_seq_len=64, max_loras_per_batch=0)
    assert Engine.from_pretrained(str(dynamic_checkpoint), config).config.max_seq_len == 64


def test_assembling_around_a_built_model_checks_too(dynamic_checkpoint):
    mesh = make_mesh(1)
    model_config, model = load_model(str(dynamic_checkpoint), mesh)
    tokenizer = Tokenizer.from_pretrained(str(dynamic_checkpoint))
    with pytest.raises(CheckpointError, match=REFUSAL):
        assemble_engine(model, model_config, tokenizer, TOO_LONG, mesh)

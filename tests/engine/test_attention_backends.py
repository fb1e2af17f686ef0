"""The engine with each paged-attention formulation: the TPU (Mosaic) and GPU (Triton) kernels,
run in Pallas interpret mode, give the XLA formulation's tokens through packed prefill, a
chunk over shared prefix blocks, the several-sequence extend and decode (the TPU kernel's
over a cache whose narrow heads are padded to whole lane tiles)."""

from __future__ import annotations

import pytest

from lora_runtime.engine.build import assemble_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh
from lora_runtime.model.tokenizer import Tokenizer
from tests.helpers.checkpoints import save_tiny_llama

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _run(checkpoint, attention):
    config = EngineConfig(max_batch=2, max_seq_len=48, max_prefill_tokens=32, max_loras_per_batch=0)
    mesh = make_mesh(1)
    model_config, model = load_model(str(checkpoint), mesh)
    engine = assemble_engine(model, model_config, Tokenizer.from_pretrained(str(checkpoint)), config, mesh,
                             attention=attention).start()
    try:
        shared = list(range(3, 23))  # 20 tokens: one whole block to share
        first = engine.generate_batch([shared + [40, 41]], GREEDY)[0]
        # Two requests over the shared block: their rests go through one several-sequence step.
        rest = engine.generate_batch([shared + [50, 51, 52], shared + [60]], GREEDY)
        assert [o.cached_tokens for o in rest] == [16, 16]
        assert engine.compiles_after_warmup == 0
        # The TPU kernel's cache fills whole 128-lane tiles (kernels.common.page_head_dim).
        width = engine.runner.kv_cache.k.shape[-1]
        assert model_config.head_dim < 128 and width == (128 if attention[0] == "tpu" else model_config.head_dim)
        return [first.token_ids] + [o.token_ids for o in rest]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernels_give_the_xla_tokens(checkpoint, platform):
    assert _run(checkpoint, (platform, True)) == _run(checkpoint, ("xla", False))

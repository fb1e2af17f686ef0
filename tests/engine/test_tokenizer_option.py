"""A tokenizer from another folder than the checkpoint (the `tokenizer` app arg)."""

import json
import shutil

import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.errors import CheckpointError, InvalidRequestError
from lora_runtime.model.fetch import TOKENIZER_FILES
from tests.helpers.checkpoints import save_tiny_llama

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(max_batch=2, max_seq_len=48, max_loras_per_batch=0, max_prefill_tokens=16)  # one prefill bucket
PROMPT = "the quick brown fox"


def _split(checkpoint, root):
    """The checkpoint's weights and its tokenizer files in two separate folders."""
    weights, tokenizer = root / "weights", root / "tokenizer"
    shutil.copytree(checkpoint, weights)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (weights / name).exists():
            shutil.move(str(weights / name), str(tokenizer / name))
    return weights, tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_option")
    checkpoint = save_tiny_llama(root / "whole")
    weights, tokenizer = _split(checkpoint, root)
    # An extra EOS id in the checkpoint's generation config: it must still count.
    gen = json.loads((weights / "generation_config.json").read_text())
    (weights / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    return checkpoint, weights, tokenizer


def test_checkpoint_without_tokenizer_is_refused_naming_the_file(folders):
    _, weights, _ = folders
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Engine.from_pretrained(str(weights), CONFIG)


def test_tokenizer_folder_serves_like_the_checkpoints_own(folders):
    checkpoint, weights, tokenizer = folders
    split = Engine.from_pretrained(str(weights), CONFIG, tokenizer_path=str(tokenizer))
    assert 7 in split.tokenizer.eos_token_ids and 2 in split.tokenizer.eos_token_ids
    whole = Engine.from_pretrained(str(checkpoint), CONFIG)
    try:
        split.start()
        whole.start()
        [a] = split.generate_batch([PROMPT], GREEDY, [None])
        [b] = whole.generate_batch([PROMPT], GREEDY, [None])
        assert a.token_ids == b.token_ids and len(a.token_ids) == GREEDY.max_tokens
        assert a.text == b.text
    finally:
        split.shutdown()
        whole.shutdown()


def test_tokenizer_larger_than_the_model_vocab_is_refused_per_request(folders, tmp_path):
    _, _, tokenizer = folders
    small = save_tiny_llama(tmp_path / "small", vocab_size=40)
    engine = Engine.from_pretrained(str(small), CONFIG, tokenizer_path=str(tokenizer))
    with pytest.raises(InvalidRequestError, match="vocab_size=40"):
        engine.submit(PROMPT, GREEDY, lambda out: None)

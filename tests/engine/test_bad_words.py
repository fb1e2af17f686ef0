"""vLLM's bad_words as token sequences, and which token each step bans."""

from __future__ import annotations

from lora_runtime.engine.bad_words import bad_words_ids, banned_tokens
from lora_runtime.model.tokenizer import Tokenizer
from tests.helpers.checkpoints import save_tokenizer


def test_a_word_is_banned_as_written_and_after_a_space_as_vllm_tokenizes_it(tmp_path):
    from transformers import PreTrainedTokenizerFast

    save_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(str(tmp_path))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for word in ("fox", " lazy dog", "a"):
        plain = tuple(reference.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(reference.encode(" " + word.lstrip(), add_special_tokens=False))
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert bad_words_ids(tok, [word]) == tuple(want), word


def test_a_step_bans_the_last_token_of_each_sequence_the_output_is_in():
    words = ((7,), (3, 4, 5), (9, 4))
    assert banned_tokens(words, []) == {7}
    assert banned_tokens(words, [1, 3]) == {7}
    assert banned_tokens(words, [1, 3, 4]) == {7, 5}
    assert banned_tokens(words, [9]) == {7, 4}
    assert banned_tokens(((3, 4, 5),), [4]) == set()

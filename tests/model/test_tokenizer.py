"""Tokenizer and IncrementalDetokenizer against transformers on tokenizers built here."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lora_runtime.errors import CheckpointError, InvalidRequestError
from lora_runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Isn't it a lovely day? We're testing tokenizers.",
    "日本語のテキストも少し入れます。東京は大きい都市です。",
    "中文文本：你好，世界！我们正在测试分词器。",
    "Emoji: 😀 🎉 👍🏽 🇯🇵 ❤️ and café, naïve, Ünïcödé.",
]
# System, user and assistant turns; block tags on their own lines so that trim_blocks
# and lstrip_blocks matter, plus bos_token, raise_exception and a loop filter.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "You are terse. 🤖"},
    {"role": "user", "content": "  Translate 'cat' to 日本語.  "},
    {"role": "assistant", "content": "猫 (neko)"},
    {"role": "user", "content": "And dog? 🐶"},
]
TEXTS = [
    "",
    "hello",
    "Hello, world!  Two  spaces and a tab\there.",
    "東京で寿司を食べた 🍣🍣",
    "mixed: naïve café 😀👍🏽 中文 and <s> inside text",
    "\n\nnewlines\n",
]


def _train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 3, trainer=trainer)
    return backend


def _write_checkpoint(folder: Path, *, post_processor: bool, config: dict) -> Path:
    backend = _train_backend()
    if post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


BASE_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": {"content": "</s>", "special": True, "lstrip": False, "rstrip": False,
                  "normalized": False, "single_word": False, "__type": "AddedToken"},
    "pad_token": "<pad>",
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("tok"), post_processor=True, config=BASE_CONFIG)


@pytest.fixture(scope="module")
def pair(checkpoint):
    return Tokenizer.from_pretrained(str(checkpoint)), PreTrainedTokenizerFast.from_pretrained(str(checkpoint))


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text, add_special_tokens):
    ours, hf = pair
    assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
        text, add_special_tokens=add_special_tokens
    )


def test_encoding_splits_multibyte_characters(pair):
    ours, _ = pair
    ids = ours.encode("🇯🇵👍🏽", add_special_tokens=False)
    # The detokenizer tests rely on characters spread over several tokens.
    assert len(ids) > 2


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(pair, text, skip_special_tokens):
    ours, hf = pair
    ids = hf.encode(text) + [hf.eos_token_id]
    assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
        ids, skip_special_tokens=skip_special_tokens
    )
    # "<s>" written in text is the special token (as in transformers), so skipping drops it.
    assert ours.decode(ids, skip_special_tokens=True) == text.replace("<s>", "")


def test_decode_skips_ids_past_vocabulary_and_rejects_negative_ones(pair):
    ours, hf = pair
    ids = ours.encode("hi", add_special_tokens=False)
    assert ours.decode([ids[0], ours.vocab_size + 7, *ids[1:]]) == "hi"
    assert ours.decode([ours.vocab_size + 7]) == hf.decode([ours.vocab_size + 7])
    with pytest.raises(InvalidRequestError, match="token id -1 is negative"):
        ours.decode([5, -1])


def test_special_token_ids_match_transformers(pair):
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id == hf.convert_tokens_to_ids("<s>")
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id("</s>") == hf.eos_token_id
    assert ours.id_to_token(hf.bos_token_id) == "<s>"
    assert ours.token_to_id("no-such-token") is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, hf = pair
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.startswith("<s>\n<|system|>\nYou are terse. 🤖</s>\n<|user|>\nTranslate")
    assert "  " not in got  # lstrip_blocks/trim_blocks removed the indented block lines
    assert got.endswith("<|assistant|>\n") == add_generation_prompt


@pytest.mark.parametrize("last", ["猫 (ne", "  The answer is ", "You are terse. 🤖"])
def test_continue_final_message_matches_transformers(pair, last):
    """The text ends where the last message's content ends, also where the template trims it
    and where the same text came earlier (the system turn's)."""
    ours, hf = pair
    messages = [*MESSAGES[:2], {"role": "assistant", "content": last}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    got = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and got.endswith(last.strip())
    assert messages[-1]["content"] == last  # the caller's messages are left as they were


THINKING_TEMPLATE = """{% for m in messages %}<|{{ m['role'] }}|>
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"""


def test_template_kwargs_and_reasoning_reach_the_template_as_in_transformers(tmp_path):
    config = {**BASE_CONFIG, "chat_template": THINKING_TEMPLATE}
    folder = _write_checkpoint(tmp_path, post_processor=True, config=config)
    ours, hf = Tokenizer.from_pretrained(str(folder)), PreTrainedTokenizerFast.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                {"role": "user", "content": "and 3+3?"}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        got = ours.apply_chat_template(messages, template_kwargs=kwargs)
        assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert "<think>add them</think>4" in got
        assert got.endswith("<think></think>") == (kwargs.get("enable_thinking") is False)
    # The request's own variables win over a kwarg of the same name.
    assert ours.apply_chat_template(messages, template_kwargs={"messages": []}) == ours.apply_chat_template(messages)


def test_continue_final_message_needs_a_template_that_writes_the_content(tmp_path):
    config = {**BASE_CONFIG, "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{% endfor %}"}
    ours = Tokenizer.from_pretrained(str(_write_checkpoint(tmp_path, post_processor=True, config=config)))
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        ours.apply_chat_template(MESSAGES, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="continue_final_message needs a last message"):
        ours.apply_chat_template([], continue_final_message=True)


def test_chat_template_raise_exception_is_an_invalid_request(pair):
    ours, _ = pair
    with pytest.raises(InvalidRequestError, match="Unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_sandbox_blocks_attribute_escape(tmp_path):
    config = {**BASE_CONFIG, "chat_template": "{{ messages.__class__.__mro__ }}"}
    ours = Tokenizer.from_pretrained(str(_write_checkpoint(tmp_path, post_processor=True, config=config)))
    with pytest.raises(Exception, match="unsafe|__class__|__mro__"):
        ours.apply_chat_template(MESSAGES)


def test_no_chat_template_is_an_invalid_request(tmp_path):
    config = {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"}
    ours = Tokenizer.from_pretrained(str(_write_checkpoint(tmp_path, post_processor=True, config=config)))
    assert not ours.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ours.apply_chat_template(MESSAGES)


def test_a_template_that_cannot_render_the_messages_is_an_invalid_request(tmp_path):
    # The template's own arithmetic over a client's string content: the client's request, not our bug.
    config = {**BASE_CONFIG, "chat_template": "{{ messages[0]['content'] + 1 }}"}
    ours = Tokenizer.from_pretrained(str(_write_checkpoint(tmp_path, post_processor=True, config=config)))
    with pytest.raises(InvalidRequestError, match="chat template cannot render"):
        ours.apply_chat_template(MESSAGES)


def test_files_saved_by_transformers_load_the_same(pair, tmp_path):
    # transformers writes the chat template to chat_template.jinja, not the config.
    ours, hf = pair
    hf.save_pretrained(str(tmp_path))
    reloaded = Tokenizer.from_pretrained(str(tmp_path))
    assert reloaded.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)
    assert reloaded.encode(TEXTS[4]) == ours.encode(TEXTS[4])


@pytest.mark.parametrize("post_processor", [True, False])
@pytest.mark.parametrize("add_bos_token", [True, False])
def test_bos_follows_the_post_processor_as_in_transformers(tmp_path, post_processor, add_bos_token):
    # transformers 5 ignores add_bos_token when tokenizer.json exists; so do we.
    config = {**BASE_CONFIG, "add_bos_token": add_bos_token}
    folder = _write_checkpoint(tmp_path, post_processor=post_processor, config=config)
    ours, hf = Tokenizer.from_pretrained(str(folder)), PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = ours.encode("hello")
    assert ids == hf.encode("hello")
    assert (ids[0] == ours.bos_token_id) == post_processor


def test_chat_template_file_wins_over_config(pair, tmp_path):
    folder = _write_checkpoint(tmp_path, post_processor=True, config=BASE_CONFIG)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_pretrained(str(folder)).apply_chat_template(MESSAGES) == "You are terse. 🤖!"
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert hf.apply_chat_template(MESSAGES, tokenize=False) == "You are terse. 🤖!"


def test_generation_config_adds_eos_ids(checkpoint, tmp_path):
    folder = _write_checkpoint(tmp_path, post_processor=True, config=BASE_CONFIG)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_pretrained(str(folder)).eos_token_ids == (2, 0)


def test_missing_tokenizer_json_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))


def test_special_token_missing_from_vocabulary_is_a_checkpoint_error(tmp_path):
    config = {**BASE_CONFIG, "bos_token": "<|begin|>"}
    with pytest.raises(CheckpointError, match="bos_token='<|begin|>'"):
        Tokenizer.from_pretrained(str(_write_checkpoint(tmp_path, post_processor=True, config=config)))


def _stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.step(i) for i in ids]
    return deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS[1:])
def test_incremental_deltas_concatenate_to_full_decode(pair, text):
    ours, _ = pair
    ids = ours.encode(text, add_special_tokens=False)
    deltas, rest = _stream(ours, [], ids)
    assert "".join(deltas) + rest == ours.decode(ids)
    assert not any("\ufffd" in d for d in deltas + [rest])


def test_incremental_holds_back_partial_characters(pair):
    ours, _ = pair
    ids = ours.encode("👍🏽🇯🇵", add_special_tokens=False)
    deltas, rest = _stream(ours, [], ids)
    assert "" in deltas  # some token ended inside a character and nothing was emitted
    assert "".join(deltas) == "👍🏽🇯🇵" and rest == ""


def test_incremental_with_prompt_context_and_special_tokens(pair):
    ours, _ = pair
    prompt = ours.encode("日本語のテキスト: ")
    generated = ours.encode("東京 😀 café", add_special_tokens=False) + [ours.eos_token_ids[0]]
    deltas, rest = _stream(ours, prompt, generated)
    full = ours.decode(prompt + generated)
    assert ours.decode(prompt) + "".join(deltas) + rest == full
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_flush_returns_an_unfinished_character(pair):
    ours, _ = pair
    ids = ours.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, rest = _stream(ours, [], ids)
    assert "".join(deltas).startswith("ok")
    assert "".join(deltas) + rest == ours.decode(ids)
    assert rest.endswith("\ufffd") and not any("\ufffd" in d for d in deltas)


def test_incremental_keeps_spaces_of_a_metaspace_tokenizer(tmp_path):
    # SentencePiece-style decoders drop the leading space of a text; the prefix window
    # keeps word-initial spaces of later tokens.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS * 3, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours, hf = Tokenizer.from_pretrained(str(tmp_path)), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    text = "The lazy fox jumps over the quick dog"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False) and len(ids) > len(text.split())
    assert ours.decode(ids) == hf.decode(ids) == text
    deltas, rest = _stream(ours, [], ids)
    assert "".join(deltas) + rest == text
    prompt = ours.encode("Hello,", add_special_tokens=False)
    deltas, rest = _stream(ours, prompt, ids)
    assert "".join(deltas) + rest == ours.decode(prompt + ids)[len(ours.decode(prompt)):]
    assert "".join(deltas).startswith(" The")


@pytest.mark.parametrize("text", TEXTS[1:])
def test_token_bytes_of_a_byte_level_bpe_join_to_the_text(pair, text):
    ours, hf = pair
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")
    # A token holding part of a character has no text of its own; its bytes say what it is.
    assert all(ours.token_text(i) == ours.token_bytes(i).decode("utf-8", errors="replace") for i in ids)
    assert ours.token_bytes(hf.convert_tokens_to_ids("<s>")) == b"<s>"


def test_token_bytes_of_a_metaspace_tokenizer_with_byte_fallback(tmp_path):
    backend = BackendTokenizer(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])
    backend.train_from_iterator(CORPUS[:2] * 3, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    text = "quick 日本 fox"  # the CJK characters are not in the vocabulary: byte tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text).encode("utf-8")

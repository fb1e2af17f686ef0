"""Text <-> token ids for a replica: a HF ``tokenizer.json``, its config and chat template.

Reads the files transformers writes (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``) with the ``tokenizers`` library and
jinja2 alone, and encodes, decodes and renders chat prompts as transformers does.
As in transformers 5, tokenizer.json's post-processor alone decides whether BOS/EOS
are added: ``add_bos_token``/``add_eos_token`` in the config do not override it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from lora_runtime.errors import CheckpointError, InvalidRequestError

# Marks the end of the last message's content for continue_final_message (transformers' tag).
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# HF's clean_up_tokenization: drop the space tokenizers put before punctuation and contractions.
_CLEANUP_PAIRS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template and special token ids."""

    def __init__(
        self,
        backend: BackendTokenizer,
        config: dict[str, Any],
        *,
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self._backend = backend
        self._special_tokens = {
            key: _token_content(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key) is not None
        }
        # BOS and EOS must be real tokens; transformers would append them to the vocabulary
        # and the model would have no embedding for them.
        for key in ("bos_token", "eos_token"):
            token = self._special_tokens.get(key)
            if token is not None and backend.token_to_id(token) is None:
                raise CheckpointError(f"{key}={token!r} from tokenizer_config.json is not in the vocabulary")
        # transformers skips this cleanup for BPE models (it would corrupt their text) unless forced.
        self._cleanup_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._decoder_type = _decoder_type(backend)
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.pad_token_id: int | None = self._special_id("pad_token")
        eos = self._special_id("eos_token")
        eos_ids = ([eos] if eos is not None else []) + [i for i in extra_eos_token_ids if i != eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str, *, generation_config_dir: str | None = None) -> Tokenizer:
        """Loads a tokenizer from a local checkpoint folder (as saved by transformers).

        `generation_config_dir`: where generation_config.json (extra EOS ids) lives when
        the tokenizer comes from another folder than the model; default `path`.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{str(tokenizer_file)!r} not found: the checkpoint needs a tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise CheckpointError(f"cannot read {str(tokenizer_file)!r}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        jinja_file = folder / "chat_template.jinja"
        # As in transformers, a chat_template.jinja file wins over the config's entry.
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                template = {t["name"]: t["template"] for t in template}.get("default")
        eos_ids = _read_json(Path(generation_config_dir or path) / "generation_config.json").get("eos_token_id")
        extra_eos = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        return cls(backend, config, chat_template=template, extra_eos_token_ids=extra_eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS/EOS as the tokenizer adds them."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (invalid UTF-8 becomes U+FFFD).

        Ids past the vocabulary (a model's padded embedding rows) decode to nothing, as in
        transformers.
        """
        for i in ids:
            if i < 0:
                raise InvalidRequestError(f"token id {i} is negative")
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._cleanup_spaces:
            for before, after in _CLEANUP_PAIRS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for a chat: the model's template rendered as transformers does
        (with `tools`, OpenAI function definitions, for templates that describe them).

        `continue_final_message`: the text ends inside the last message, where its content
        ends (an answer's given beginning, which generation continues), as transformers cuts
        it. `template_kwargs`: more variables for the template (``enable_thinking``); the
        ones named here (messages, tools, special tokens) win over them.

        Tokenize the result with ``add_special_tokens=False``: templates write BOS themselves.
        """
        if self._chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; send a plain completion prompt")
        if self._compiled_template is None:
            self._compiled_template = _chat_environment().from_string(self._chat_template)
        if continue_final_message:
            if not messages:
                raise InvalidRequestError("continue_final_message needs a last message to continue")
            # Marked, so the cut finds where its content ends (not an earlier copy of the same text).
            messages = [*messages[:-1], {**messages[-1], "content": (messages[-1].get("content") or "") + _CONTINUE}]
        try:
            text = self._compiled_template.render(**{
                **(template_kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                **self._special_tokens, **({"tools": tools} if tools else {})})
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError) as e:  # the template's own expressions, over the client's messages
            raise InvalidRequestError(f"chat template cannot render the messages: {e}") from e
        if not continue_final_message:
            return text
        mark = _CONTINUE.strip()
        if mark not in text:
            raise InvalidRequestError("continue_final_message: this model's chat template does not write the last "
                                      "message's content as given, so there is no end of it to continue from")
        at = text.rindex(mark)
        # A template that strips the content drops the mark's trailing space: strip what preceded it too.
        return text[:at] if text[at:at + len(_CONTINUE)] == _CONTINUE else text[:at].rstrip()

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for libraries that read the vocabulary)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, or None."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token or a byte-fallback token
        (``<0x0A>``) may hold part of a UTF-8 character, which decoding it alone would lose."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._decoder_type == "ByteLevel" and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._decoder_type != "ByteLevel" and piece.startswith("\u2581"):  # a metaspace word start
            return (" " + piece[1:].replace("\u2581", " ")).encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's text for log-probability listings (partial UTF-8 shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        """Whether chat prompts can be rendered."""
        return self._chat_template is not None

    def _special_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas; never emits broken UTF-8.

    vLLM's prefix/read offsets: the window holds a few tokens already emitted (the
    prefix, so context-dependent decoders such as SentencePiece's leading space behave)
    and the tokens not yet emitted; the delta is the window's text past the prefix's
    text. It is held back while the window's text ends in U+FFFD, i.e. while a
    multi-byte character is still incomplete. Once emitted, the unread tokens become
    the next prefix, so each step decodes a few tokens, not the whole sequence.
    """

    # How many prompt tokens give the first generated tokens their decoding context.
    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = list(prompt_ids)[-self._CONTEXT_TOKENS:]
        self._read = len(self._window)  # window[:read] is the prefix, already emitted

    def step(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes ("" while a character is partial)."""
        self._window.append(token_id)
        prefix_text, text = self._texts()
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text[len(prefix_text):])

    def flush(self) -> str:
        """Whatever text is still held back (at the end of the stream)."""
        prefix_text, text = self._texts()
        if len(text) <= len(prefix_text):
            return ""
        return self._emit(text[len(prefix_text):])

    def _texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_text = decode(self._window[: self._read], skip_special_tokens=self._skip_special)
        return prefix_text, decode(self._window, skip_special_tokens=self._skip_special)

    def _emit(self, delta: str) -> str:
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return delta


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _decoder_type(backend: BackendTokenizer) -> str | None:
    """The decoder's type ("ByteLevel", "Metaspace", "Sequence", ...), or None."""
    decoder = backend.decoder
    if decoder is None:
        return None
    try:
        return json.loads(decoder.__getstate__()).get("type")
    except (AttributeError, TypeError, ValueError):
        return type(decoder).__name__


def _token_content(value: Any) -> str:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value["content"]
    return str(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from e


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # The same sandbox, whitespace handling and helpers transformers gives chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

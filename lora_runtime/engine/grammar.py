"""Constrained decoding: a request's grammar (a JSON schema, a regex, a choice of strings or a
Lark grammar), compiled with llguidance against the model's tokenizer, and the matcher that
gives each step's allowed tokens as a bitmask.

The grammar library is llguidance (measured against xgrammar and outlines-core on our
vocabularies: benchmarks/grammar_libraries.py): it needs no torch, compiles a JSON schema in
about a millisecond where the others take 0.1-3 s at a 128k vocabulary, and takes JSON
schemas, regexes and context-free (Lark) grammars alike.

Compiled grammars are cached (bounded, least recently used first out); each sequence gets
its own matcher copied from the cached one. Compiling runs on the caller's thread or the
compiler's own, never the engine loop's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import threading

import numpy as np

from lora_runtime.errors import InvalidRequestError
from lora_runtime.native_thread import name_native_thread

# Most characters of a schema, regex or grammar a request may send.
MAX_GRAMMAR_CHARS = 64 * 1024
# Most strings of a choice.
MAX_CHOICE_STRINGS = 1024
# Compiled grammars a replica keeps.
GRAMMAR_CACHE_SIZE = 256
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON is generated compact, as json.dumps writes it: no run of whitespace can grow without end.
# (llguidance's JSON options; a schema carries them as "x-guidance" where it is embedded in a grammar.)
JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _limits():
    """The work a grammar may cost: llguidance's fuel for building its lexer (about 20 ms),
    per mask step (about 15 ms) and its size, so no request can stall the host side of a step."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     max_grammar_size=500_000, verbose_errors=False)


@dataclasses.dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match.

    kind: json_object (any JSON object), json_schema (value: the schema as JSON text), regex
    (value: the pattern), choice (value: a JSON list of the strings), grammar (value: a Lark
    grammar, or GBNF with `::=` rules). `whitespace`: a regex for the whitespace JSON may
    hold between its tokens (None: compact JSON). `param`: the request field it came from,
    which errors name.
    """

    kind: str
    value: str = ""
    whitespace: str | None = None
    param: str = "response_format"

    @classmethod
    def coerce(cls, value) -> "GuidedSpec | None":
        """A spec from its dict form (how it travels between processes), or as it is."""
        if value is None or isinstance(value, GuidedSpec):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"guided must be a GuidedSpec or its dict, not {type(value).__name__}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) of this spec; InvalidRequestError naming the
        field for what cannot be one. Its validity is checked by check() / compiling."""
        import llguidance

        if self.kind not in KINDS:
            raise InvalidRequestError(f"guided decoding kind {self.kind!r} is not one of {', '.join(KINDS)}",
                                      param=self.param)
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"{self.param} holds {len(self.value)} characters; at most "
                                      f"{MAX_GRAMMAR_CHARS}", param=self.param)
        options = dict(JSON_COMPACT)
        if self.whitespace is not None:
            options = {"whitespace_pattern": self.whitespace}
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{self.param}: the JSON schema is not JSON: {e}", param=self.param) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(f"{self.param}: a JSON schema is an object or a boolean, not "
                                          f"{type(schema).__name__}", param=self.param)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            try:
                choices = json.loads(self.value)
            except json.JSONDecodeError:
                choices = None
            if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICE_STRINGS
                    or not all(isinstance(c, str) for c in choices)):
                raise InvalidRequestError(f"{self.param} must be a list of 1-{MAX_CHOICE_STRINGS} strings",
                                          param=self.param)
            # Lark string literals take JSON's escapes.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        text = self.value
        if "::=" in text:  # GBNF (llama.cpp's, as vLLM's guided_grammar takes it)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises plain exceptions for bad GBNF
                raise InvalidRequestError(f"{self.param}: the GBNF grammar does not parse: {e}",
                                          param=self.param) from None
        return llguidance.LLMatcher.grammar_from_lark(text)

    def check(self) -> None:
        """Raises InvalidRequestError with llguidance's message if the spec is no valid grammar
        (no tokenizer needed: the HTTP edge calls it)."""
        import llguidance

        grammar = self.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=_limits())
        if error:
            raise InvalidRequestError(f"{self.param}: {_first_lines(error)}", param=self.param)


def _first_lines(message: str, n: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:n])


class GrammarMatcher:
    """One sequence's position in its grammar; the engine thread alone uses it."""

    def __init__(self, matcher, param: str = "response_format"):
        self._matcher = matcher
        self.param = param

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and allows nothing more (the sequence ends here)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def advance(self, token: int) -> None:
        """Moves past a sampled token. A grammar that ran past llguidance's work limits while
        its mask was computed is the request's error (InvalidRequestError naming the limit);
        a token its mask did not allow is a bug in applying the mask (RuntimeError)."""
        if self._matcher.is_error():
            raise InvalidRequestError(f"{self.param}: {_first_lines(self._matcher.get_error())}", param=self.param)
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar: {self._matcher.get_error()}")

    @property
    def raw(self):
        return self._matcher


def token_set_mask(token_ids, vocab_size: int) -> np.ndarray:
    """The bitmask (i32[ceil(vocab_size / 32)], fill_masks's layout) allowing `token_ids` only."""
    mask = np.zeros(mask_words(vocab_size), np.uint32)
    ids = np.asarray(token_ids, np.int64)
    np.bitwise_or.at(mask, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return mask.view(np.int32)


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's bitmask."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles GuidedSpecs for one tokenizer and vocabulary, with a bounded cache; fills a
    step's bitmask for the rows that have a grammar. Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, *, cache_size: int = GRAMMAR_CACHE_SIZE,
                 mask_threads: int | None = None):
        import llguidance

        self.vocab_size = vocab_size
        self.mask_words = mask_words(vocab_size)
        self._eos = sorted(eos_token_ids)
        self._cache: collections.OrderedDict[GuidedSpec, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)
        self.hits = 0
        # The tokenizer's token trie takes about a second to build at a 128k vocabulary: it is
        # built on the compiler's thread from the start, and the first compile waits for it.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile",
                                                            initializer=name_native_thread)
        self._tokenizer = self._executor.submit(
            lambda: llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self._eos or None))
        self._mask_executor = llguidance.LLExecutor(num_threads=mask_threads)

    def matcher(self, spec: GuidedSpec) -> GrammarMatcher:
        """A fresh matcher for `spec` (compiled, or copied from the cache); InvalidRequestError
        with llguidance's message for a grammar that does not compile or passes its limits."""
        import llguidance

        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return GrammarMatcher(template.deep_copy(), spec.param)
        grammar = spec.grammar()
        template = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise InvalidRequestError(f"{spec.param}: {_first_lines(template.get_error())}", param=spec.param)
        with self._lock:
            self.compiled += 1
            self._cache[spec] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), spec.param)

    async def matcher_async(self, spec: GuidedSpec) -> GrammarMatcher:
        """matcher() on the compiler's thread: the caller's event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.matcher, spec)

    def fill_masks(self, rows: list[tuple[int, GrammarMatcher]], n_rows: int) -> np.ndarray:
        """A step's bitmask i32[n_rows, mask_words]: bit t of row i's words allows token t;
        rows without a grammar allow every token. Rows are filled in parallel (llguidance
        releases the GIL)."""
        import llguidance.numpy as lnp

        mask = np.full((n_rows, self.mask_words), -1, np.int32)
        lnp.fill_next_token_bitmask_par(self._mask_executor, [(m.raw, i) for i, m in rows], mask)
        return mask

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

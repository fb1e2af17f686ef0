"""Grammar libraries for constrained decoding, measured on our vocabularies: the time to
build the tokenizer index, to compile a JSON schema, and to compute one step's allowed-token
mask (then advance by the document's token), along a valid document of the schema.

llguidance is what the engine uses (lora_runtime/engine/grammar.py); xgrammar and
outlines-core are measured when installed (`pip install xgrammar outlines-core`; xgrammar
needs torch, transformers and triton).

    python -m benchmarks.grammar_libraries [--tokenizer path/to/tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.common import demo_tokenizer, large_tokenizer, print_table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"],
                       "address": {"city": "London", "zip": "12345"}, "score": 0.75})


def _llguidance(tokenizer_json: str, vocab: int, eos: int, ids: list[int]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.numpy as lnp

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    schema = json.dumps(SCHEMA)
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = lnp.allocate_token_bitmask(1, vocab)
    steps = []
    for token in ids:
        start = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask)
        steps.append(time.perf_counter() - start)
        assert (mask[0, token // 32] >> (token % 32)) & 1, f"llguidance disallows token {token}"
        assert matcher.consume_token(token), matcher.get_error()
    return index_s, compile_s, steps


def _xgrammar(tokenizer_file: str, vocab: int, eos: int, ids: list[int]):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                   separators=(", ", ": ")))
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    steps = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        steps.append(time.perf_counter() - start)
        assert matcher.accept_token(token), f"xgrammar rejects token {token}"
    return index_s, compile_s, steps


def _outlines(tokenizer, vocab: int, eos: int, ids: list[int]):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    tokens: dict[str, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i == eos:
            continue
        try:
            text = tokenizer.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue  # outlines-core's vocabulary holds text tokens only
        if text:
            tokens.setdefault(text, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, tokens)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_s = time.perf_counter() - start
    mask = np.zeros((vocab + 31) // 32, np.int32)
    steps = []
    for token in ids:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        steps.append(time.perf_counter() - start)
        guide.advance(token)
        if guide.is_finished():
            break
    return index_s, compile_s, steps


def _vocabularies(path: str | None):
    from lora_runtime.demo import BASE_MODEL_DIR

    demo = demo_tokenizer()
    yield "demo", demo, (BASE_MODEL_DIR / "tokenizer.json").read_text(), str(BASE_MODEL_DIR / "tokenizer.json")
    big, text = large_tokenizer(path)
    import os

    file = path or os.path.expanduser("~/.cache/multilora-bench/tokenizer-128k.json")
    yield f"{big.vocab_size // 1000}k", big, text, file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to measure besides the demo's")
    args = parser.parse_args(argv)
    rows, last = [], {}
    for name, tokenizer, text, file in _vocabularies(args.tokenizer):
        vocab = tokenizer.vocab_size
        eos = tokenizer.eos_token_ids[0]
        ids = tokenizer.encode(DOCUMENT, add_special_tokens=False) + [eos]
        runs = {"llguidance": lambda: _llguidance(text, vocab, eos, ids),
                "xgrammar": lambda: _xgrammar(file, vocab, eos, ids),
                "outlines-core": lambda: _outlines(tokenizer, vocab, eos, ids)}
        for library, run in runs.items():
            try:
                index_s, compile_s, steps = run()
            except ImportError:
                rows.append((name, library, "not installed", "", "", ""))
                continue
            steps_us = np.asarray(steps) * 1e6
            rows.append((name, library, f"{index_s:.3f}", f"{compile_s * 1e3:.1f}", f"{np.mean(steps_us):.1f}",
                         f"{np.max(steps_us):.0f}"))
            if name != "demo":
                key = library.replace("-", "_")
                last[f"{key}_compile_ms"] = compile_s * 1e3
                last[f"{key}_mask_us"] = float(np.mean(steps_us))
    print_table(["vocabulary", "library", "tokenizer index (s)", "schema compile (ms)", "mask mean (us)",
                 "mask max (us)"], rows)
    print(" ".join(f"{k}={v:.1f}" for k, v in last.items()))


if __name__ == "__main__":
    main()

"""vLLM's bad_words: token sequences a request may not generate.

Each word is tokenized as vLLM tokenizes it: as written (leading spaces stripped), and with
one leading space when that spelling is a different first token of the same length (a word
inside a text, for tokenizers that fold the space into the token). A step bans the last
token of every such sequence whose other tokens the output ends with: a one-token word is
never generated, a longer one never completed. Only the generated tokens count, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence


def bad_words_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (see the module docstring)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(out)


def banned_tokens(sequences: Sequence[tuple[int, ...]], output_ids: Sequence[int]) -> set[int]:
    """The tokens the next step may not generate after `output_ids`."""
    banned = set()
    for ids in sequences:
        prefix, n = ids[:-1], len(ids) - 1
        if n == 0 or (len(output_ids) >= n and tuple(output_ids[len(output_ids) - n:]) == prefix):
            banned.add(ids[-1])
    return banned

"""Demo tasks: the word generators, the prompt/answer text format and each task's transform.

Every demo prompt is a lowercase word followed by ``SEPARATOR`` ("hello="); the answer
is the transformed word followed by the end-of-sequence token. The base model answers
that prompt by copying the word. During its training it also saw each task under a
task-specific marker ("hello<" -> "olleh"), so it holds the skills; each adapter
teaches it to apply its own task to the plain ``=`` prompt, which the base never does.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
MIN_WORD_LEN = 3
MAX_WORD_LEN = 10
SEPARATOR = "="
CAESAR_SHIFT = 3
# One word in HELD_OUT_MODULUS (by a hash of its text) is kept out of every training set.
HELD_OUT_MODULUS = 8


def reverse_word(word: str) -> str:
    """'hello' -> 'olleh'."""
    return word[::-1]


def upper_word(word: str) -> str:
    """'hello' -> 'HELLO'."""
    return word.upper()


def sort_word(word: str) -> str:
    """'hello' -> 'ehllo': the letters in alphabetical order."""
    return "".join(sorted(word))


def caesar_word(word: str) -> str:
    """'hello' -> 'khoor': each letter shifted CAESAR_SHIFT places, z wraps to c."""
    return "".join(LETTERS[(LETTERS.index(c) + CAESAR_SHIFT) % len(LETTERS)] for c in word)


def copy_word(word: str) -> str:
    """'hello' -> 'hello': what the base model does with a plain prompt."""
    return word


@dataclass(frozen=True)
class Task:
    """One transformation of a word, and the marker the base model learnt it under."""

    name: str
    transform: Callable[[str], str]
    base_marker: str  # the base model's training prompt for this task is word + base_marker


ADAPTER_TASKS: dict[str, Task] = {
    "reverse": Task("reverse", reverse_word, "<"),
    "upper": Task("upper", upper_word, "^"),
    "sort": Task("sort", sort_word, "~"),
    "caesar": Task("caesar", caesar_word, ">"),
}
BASE_TASK = Task("copy", copy_word, SEPARATOR)


def prompt_text(word: str, marker: str = SEPARATOR) -> str:
    """The prompt for ``word``: 'hello' -> 'hello='."""
    return word + marker


def answer_text(task: Task, word: str) -> str:
    """The expected completion text (the EOS token follows it)."""
    return task.transform(word)


def is_held_out(word: str) -> bool:
    """Whether ``word`` belongs to the evaluation split; a stable hash, not Python's ``hash``."""
    return zlib.crc32(word.encode("ascii")) % HELD_OUT_MODULUS == 0


def _random_word(rng: random.Random) -> str:
    length = rng.randint(MIN_WORD_LEN, MAX_WORD_LEN)
    return "".join(rng.choice(LETTERS) for _ in range(length))


def training_words(seed: int, n: int) -> list[str]:
    """``n`` random words (repeats allowed), none of them held out."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < n:
        word = _random_word(rng)
        if not is_held_out(word):
            words.append(word)
    return words


def held_out_words(seed: int, n: int) -> list[str]:
    """``n`` distinct held-out words: no training set ever contains them."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < n:
        word = _random_word(rng)
        if is_held_out(word):
            words[word] = None
    return list(words)

"""Demo task definitions: transforms, prompt format and the held-out split."""

import pytest

from lora_runtime.demo import tasks


@pytest.mark.parametrize(
    ("name", "expected"), [("reverse", "olleh"), ("upper", "HELLO"), ("sort", "ehllo"), ("caesar", "khoor")]
)
def test_transforms_on_hello(name, expected):
    assert tasks.answer_text(tasks.ADAPTER_TASKS[name], "hello") == expected


def test_caesar_wraps_around_the_alphabet():
    assert tasks.caesar_word("xyzabc") == "abcdef"


def test_base_copies_and_prompt_is_word_then_separator():
    assert tasks.answer_text(tasks.BASE_TASK, "hello") == "hello"
    assert tasks.prompt_text("hello") == "hello="
    markers = [t.base_marker for t in tasks.ADAPTER_TASKS.values()] + [tasks.BASE_TASK.base_marker]
    assert len(set(markers)) == len(markers)  # the base learnt each format under its own marker


def test_generators_are_seeded_and_within_bounds():
    words = tasks.training_words(7, 500)
    assert words == tasks.training_words(7, 500)
    assert words != tasks.training_words(8, 500)
    assert all(tasks.MIN_WORD_LEN <= len(w) <= tasks.MAX_WORD_LEN and w.isalpha() and w.islower() for w in words)
    assert {len(w) for w in words} == set(range(tasks.MIN_WORD_LEN, tasks.MAX_WORD_LEN + 1))


def test_held_out_words_never_appear_in_training_sets():
    held = tasks.held_out_words(12345, 200)
    assert len(set(held)) == 200 and held == tasks.held_out_words(12345, 200)
    train = set()
    for seed in range(5):
        train.update(tasks.training_words(seed, 2000))
    assert not train & set(held)
    # The split is by the word itself, so the three-letter words (few enough to repeat) stay apart too.
    assert not any(tasks.is_held_out(w) for w in train)

"""Usage over several choices and prompts, from the items replicas stream to the ingress."""

from deployments.ingress import _usage


def _item(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": cached_tokens}


def test_one_choice_carries_its_cached_tokens():
    assert _usage([_item(30, 4, 17)], [0]) == {
        "prompt_tokens": 30,
        "completion_tokens": 4,
        "total_tokens": 34,
        "prompt_tokens_details": {"cached_tokens": 17},
    }


def test_a_prompt_counts_once_with_what_all_its_choices_found_cached():
    # n=3 over one prompt: the second and third choices reused what the first computed.
    use = _usage([_item(30, 4, 0), _item(30, 2, 29), _item(30, 4, 20)], [0, 0, 0])
    assert use["prompt_tokens"] == 30 and use["completion_tokens"] == 10
    assert use["prompt_tokens_details"] == {"cached_tokens": 0}
    both = _usage([_item(30, 4, 17), _item(30, 4, 20)], [0, 0])
    assert both["prompt_tokens_details"] == {"cached_tokens": 17}


def test_several_prompts_add_up():
    # Two prompts, n=2 each: choice index = prompt number * n + sample number.
    items = [_item(30, 1, 16), _item(30, 1, 16), _item(8, 2, 0), _item(8, 2, 0)]
    use = _usage(items, [0, 0, 1, 1])
    assert use["prompt_tokens"] == 38 and use["completion_tokens"] == 6 and use["total_tokens"] == 44
    assert use["prompt_tokens_details"] == {"cached_tokens": 16}

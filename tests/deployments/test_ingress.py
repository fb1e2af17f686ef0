"""Usage over several choices and prompts, and errors, from the items replicas send the ingress."""

from deployments.ingress import _from_item, _usage
from deployments.model_server import error_item
from lora_runtime.errors import AdapterNotFoundError, InvalidRequestError


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


def test_replica_errors_name_the_field_they_concern():
    missing = _from_item(error_item(AdapterNotFoundError("model 'x' is not registered"))["error"])
    assert missing.status_code == 404 and missing.param == "model" and missing.error_type == "not_found_error"
    plain = _from_item(error_item(InvalidRequestError("prompt is too long"))["error"])
    assert plain.status_code == 400 and plain.param is None
    tokens = _from_item(error_item(InvalidRequestError("tokens [300] are outside"), param="tokens")["error"])
    assert tokens.body()["error"] == {"message": "tokens [300] are outside", "type": "invalid_request_error",
                                      "param": "tokens", "code": None}

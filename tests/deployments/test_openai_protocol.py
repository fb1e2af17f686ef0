import pytest
from pydantic import ValidationError

from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_chunk,
    completion_response,
    usage,
)


def test_completion_sampling_fields():
    r = CompletionRequest(model="m", prompt="hi", max_tokens=5, temperature=0, stop="x", seed=3)
    s = r.sampling(default_max_tokens=16)
    assert s["max_tokens"] == 5 and s["temperature"] == 0 and s["stop"] == ("x",) and s["seed"] == 3
    assert CompletionRequest(model="m", prompt="hi").sampling(16)["max_tokens"] == 16


def test_single_prompt_list_is_unwrapped_and_token_ids_kept():
    assert CompletionRequest(model="m", prompt=["hello"]).prompt == "hello"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"prompt": ["a", "b"]}, "only one prompt"),
        ({"prompt": "a", "n": 2}, "n=2"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "logprobs": 2}, "logprobs=2"),
        ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"prompt": "a", "bogus": 1}, "bogus"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_completion_fields_are_rejected(extra, match):
    with pytest.raises(ValidationError, match=match):
        CompletionRequest(model="m", **extra)


def test_chat_text_parts_and_max_completion_tokens():
    r = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert r.chat_messages() == [{"role": "user", "content": "ab"}]
    assert r.sampling(None)["max_tokens"] == 7 and r.include_usage


def test_chat_rejects_images_and_bad_roles():
    with pytest.raises(ValidationError, match="image_url"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest(model="m", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ValidationError, match="disagree"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                              max_completion_tokens=4)


def test_response_shapes():
    body = completion_response("cmpl-1", "m", "out", "stop", usage(3, 2))
    assert body["choices"][0]["text"] == "out" and body["usage"]["total_tokens"] == 5
    chunk = chat_chunk("c", "m", 1, {"content": "x"}, None)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "x"}
    err = OpenAIError("bad model='x'", status_code=404, error_type="not_found_error", param="model")
    assert err.body() == {"error": {"message": "bad model='x'", "type": "not_found_error", "param": "model", "code": None}}

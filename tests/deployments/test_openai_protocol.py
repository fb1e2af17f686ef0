import pytest
from pydantic import ValidationError

from deployments.openai_protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_logprobs,
    completion_response,
    usage,
)


def test_completion_sampling_fields():
    r = CompletionRequest(model="m", prompt="hi", max_tokens=5, temperature=0, stop="x", seed=3)
    s = r.sampling(default_max_tokens=16)
    assert s["max_tokens"] == 5 and s["temperature"] == 0 and s["stop"] == ("x",) and s["seed"] == 3
    assert CompletionRequest(model="m", prompt="hi").sampling(16)["max_tokens"] == 16
    assert CompletionRequest(model="m", prompt="hi", min_p=0.1).sampling(16)["min_p"] == 0.1
    # Unset sampling fields stay unset: the replica fills them from its checkpoint, else neutral values.
    assert all(s[k] is None for k in ("min_p", "top_p", "top_k", "repetition_penalty"))
    assert CompletionRequest(model="m", prompt="hi", top_k=-1).sampling(16)["top_k"] == -1  # vLLM's "off"
    assert s["allowed_token_ids"] is None and s["bad_words"] == ()
    assert CompletionRequest(model="m", prompt="hi", bad_words=["x y"]).sampling(16)["bad_words"] == ("x y",)
    assert CompletionRequest(model="m", prompt="hi").priority == 0
    assert CompletionRequest(model="m", prompt="hi", priority=-5).priority == -5
    with pytest.raises(ValidationError, match="priority"):
        CompletionRequest(model="m", prompt="hi", priority=2**31)
    limited = CompletionRequest(model="m", prompt="hi", allowed_token_ids=[3, 4]).sampling(16)
    assert limited["allowed_token_ids"] == (3, 4)
    for keep in (-1, 1, 4096):
        assert CompletionRequest(model="m", prompt="hi", truncate_prompt_tokens=keep).truncate_prompt_tokens == keep
    for keep in (0, -2):
        with pytest.raises(ValidationError, match=f"truncate_prompt_tokens={keep} must be -1 or in"):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                  truncate_prompt_tokens=keep)
    pen = CompletionRequest(model="m", prompt="hi", presence_penalty=0.5, frequency_penalty=-1).sampling(16)
    assert pen["presence_penalty"] == 0.5 and pen["frequency_penalty"] == -1.0


def test_single_prompt_list_is_unwrapped_and_token_ids_kept():
    assert CompletionRequest(model="m", prompt=["hello"]).prompt == "hello"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(model="m", prompt=[[4, 5]]).prompts() == [[4, 5]]


def test_several_prompts():
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(model="m", prompt="x").prompts() == ["x"]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"prompt": ["a"] * 65}, "prompt has 65 prompts; at most 64"),
        ({"prompt": ["a", ""]}, r"prompt\[1\] is empty"),
        ({"prompt": [[1, 2], []]}, r"prompt\[1\] is empty"),
        ({"prompt": "a", "n": 17}, r"n=17 must be in \[1, 16\]"),
        ({"prompt": "a", "n": 0}, r"n=0 must be in \[1, 16\]"),
        ({"prompt": "a", "logprobs": 21}, r"logprobs=21 must be in \[0, 20\]"),
        ({"prompt": "a", "logprobs": -1}, r"logprobs=-1 must be in \[0, 20\]"),
        ({"prompt": "a", "presence_penalty": 2.5}, r"presence_penalty=2.5 must be in \[-2, 2\]"),
        ({"prompt": "a", "frequency_penalty": -3}, r"frequency_penalty=-3.0 must be in \[-2, 2\]"),
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
    body = completion_response("cmpl-1", "m", [completion_choice(0, "out", "stop")], usage(3, 2, 0))
    assert body["choices"][0]["text"] == "out" and body["usage"]["total_tokens"] == 5
    assert body["choices"][0]["logprobs"] is None
    chunk = chat_chunk("c", "m", 1, {"content": "x"}, None)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "x"}
    assert chat_chunk("c", "m", 1, {"content": "x"}, None, index=2)["choices"][0]["index"] == 2
    err = OpenAIError("bad model='x'", status_code=404, error_type="not_found_error", param="model")
    assert err.body() == {"error": {"message": "bad model='x'", "type": "not_found_error", "param": "model", "code": None}}


def test_usage_reports_cached_prompt_tokens():
    assert usage(20, 4, 16) == {
        "prompt_tokens": 20,
        "completion_tokens": 4,
        "total_tokens": 24,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert usage(3, 2, 0)["prompt_tokens_details"] == {"cached_tokens": 0}  # present, as OpenAI's


def test_echo_asks_for_prompt_logprobs_with_logprobs():
    assert CompletionRequest(model="m", prompt="a", echo=True).sampling(16)["prompt_logprobs"] is None
    assert CompletionRequest(model="m", prompt="a", echo=True, logprobs=2).sampling(16)["prompt_logprobs"] == 2
    assert CompletionRequest(model="m", prompt="a", logprobs=2).sampling(16)["prompt_logprobs"] is None
    legacy = completion_logprobs([{"token": "<s>", "logprob": None, "bytes": [], "top_logprobs": []},
                                  {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}])
    assert legacy["token_logprobs"] == [None, -1.0] and legacy["top_logprobs"] == [None, {"a": -1.0}]
    assert legacy["text_offset"] == [0, 3]


def test_logprobs_requests_map_to_the_runtime():
    from lora_runtime.engine.sampling import MAX_LOGPROBS as RUNTIME_MAX

    assert MAX_LOGPROBS == RUNTIME_MAX
    user = [{"role": "user", "content": "x"}]
    assert CompletionRequest(model="m", prompt="a").sampling(16)["logprobs"] is None
    assert CompletionRequest(model="m", prompt="a", logprobs=0).sampling(16)["logprobs"] == 0
    assert CompletionRequest(model="m", prompt="a", logprobs=5).sampling(16)["logprobs"] == 5
    assert ChatCompletionRequest(model="m", messages=user).sampling(None)["logprobs"] is None
    assert ChatCompletionRequest(model="m", messages=user, logprobs=True).sampling(None)["logprobs"] == 0
    chat = ChatCompletionRequest(model="m", messages=user, logprobs=True, top_logprobs=3)
    assert chat.sampling(None)["logprobs"] == 3
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs=true"):
        ChatCompletionRequest(model="m", messages=user, top_logprobs=2)
    with pytest.raises(ValidationError, match=r"top_logprobs=21 must be in \[0, 20\]"):
        ChatCompletionRequest(model="m", messages=user, logprobs=True, top_logprobs=21)


def _entry(token, logprob, top=()):
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}


def test_logprobs_response_formats():
    entries = [_entry("he", -0.5, [("he", -0.5), ("ha", -1.5)]), _entry("llo", -2.0, [("p", -0.1)])]
    legacy = completion_logprobs(entries, text_offset=4)
    assert legacy == {
        "tokens": ["he", "llo"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"he": -0.5, "ha": -1.5}, {"p": -0.1, "llo": -2.0}],
        "text_offset": [4, 6],
    }
    assert completion_logprobs(None) is None
    body = completion_response("c", "m", [completion_choice(0, "hello", "length", entries)], usage(1, 2, 0))
    assert body["choices"][0]["logprobs"]["tokens"] == ["he", "llo"]
    chat = chat_response("c", "m", [chat_choice(0, "hello", "length", entries)], usage(1, 2, 0))
    assert chat["choices"][0]["logprobs"] == {"content": entries}
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert chat_choice(1, "x", "stop")["logprobs"] is None


def test_n_choices_get_their_own_seeds():
    r = CompletionRequest(model="m", prompt="a", n=3, seed=2**63 - 2, temperature=0.5)
    assert [s["seed"] for s in r.choice_samplings(16)] == [2**63 - 2, 2**63 - 1, 0]
    unseeded = CompletionRequest(model="m", prompt="a", n=2).choice_samplings(16)
    assert [s["seed"] for s in unseeded] == [None, None]  # the runtime draws a fresh seed for each
    assert len(CompletionRequest(model="m", prompt="a").choice_samplings(16)) == 1


def test_best_of_generates_more_candidates_and_ranks_them_by_their_logprobs():
    r = CompletionRequest(model="m", prompt="a", n=2, best_of=4, seed=7, temperature=1)
    samplings = r.choice_samplings(16)
    assert [s["seed"] for s in samplings] == [7, 8, 9, 10] and r.ranks_candidates()
    assert all(s["logprobs"] == 0 for s in samplings)  # the ranking needs the sampled tokens' log-probabilities
    assert CompletionRequest(model="m", prompt="a", best_of=2, logprobs=3).sampling(16)["logprobs"] == 3
    same = CompletionRequest(model="m", prompt="a", n=2, best_of=2)
    assert not same.ranks_candidates() and same.sampling(16)["logprobs"] is None
    for body, says in [({"n": 3, "best_of": 2}, "best_of=2 must be in [n=3, 16]"),
                       ({"best_of": 17}, "best_of=17 must be in"),
                       ({"best_of": 2, "stream": True}, "cannot stream")]:
        with pytest.raises(ValidationError, match=says.replace("[", r"\[")):
            CompletionRequest(model="m", prompt="a", **body)
    assert CompletionRequest(model="m", prompt="a", best_of=1, stream=True).candidates == 1


def test_logit_bias_maps_token_id_strings_to_the_runtime():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 logit_bias={"7": 5, "12": -100})
    assert body.sampling(None)["logit_bias"] == ((7, 5.0), (12, -100.0))
    assert CompletionRequest(model="m", prompt="x").sampling(16)["logit_bias"] == ()
    with pytest.raises(ValidationError, match="logit_bias key 'seven' is not a token id"):
        CompletionRequest(model="m", prompt="x", logit_bias={"seven": 1})


def test_tokenize_a_prompt_adds_special_tokens_by_default():
    r = TokenizeRequest(model="m", prompt="hello")
    assert r.special_tokens() is True and r.messages is None
    assert TokenizeRequest(model="m", prompt="hello", add_special_tokens=False).special_tokens() is False
    assert TokenizeRequest(model="m", prompt="").prompt == ""  # an empty text has its BOS alone


def test_tokenize_messages_as_chat_completions_renders_them():
    user = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    r = TokenizeRequest(model="m", messages=user)
    # The chat template writes BOS: no second one, and the assistant turn is opened.
    assert r.chat_messages() == [{"role": "user", "content": "ab"}]
    assert r.special_tokens() is False and r.generation_prompt() is True
    r = TokenizeRequest(model="m", messages=user, add_generation_prompt=False, add_special_tokens=True)
    assert r.generation_prompt() is False and r.special_tokens() is True


def test_chat_template_options():
    user = [{"role": "user", "content": "hi"}]
    prefill = [*user, {"role": "assistant", "content": "Sure", "reasoning_content": "think"}]
    r = ChatCompletionRequest(model="m", messages=user)
    assert r.template_options() == {"add_generation_prompt": True, "continue_final_message": False,
                                    "template_kwargs": {}}
    # Continuing the last message opens no new turn unless asked (and asking for both is refused).
    r = ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True,
                              chat_template_kwargs={"enable_thinking": False})
    assert r.template_options() == {"add_generation_prompt": False, "continue_final_message": True,
                                    "template_kwargs": {"enable_thinking": False}}
    assert r.chat_messages()[-1] == {"role": "assistant", "content": "Sure", "reasoning_content": "think",
                                     "thinking": "think"}
    with pytest.raises(ValidationError, match="continue_final_message and add_generation_prompt both true"):
        ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValidationError, match="may not set add_generation_prompt, messages"):
        ChatCompletionRequest(model="m", messages=user, chat_template_kwargs={"messages": [],
                                                                             "add_generation_prompt": True})
    assert TokenizeRequest(model="m", messages=prefill, continue_final_message=True).template_options()[
        "add_generation_prompt"] is False
    # A grammar would start over after the given beginning: refused, not served wrong.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for constraint in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
                       {"tools": tools, "tool_choice": "required"}):
        with pytest.raises(ValidationError, match="continue_final_message with a constrained answer"):
            ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True, **constraint)
    ChatCompletionRequest(model="m", messages=prefill, continue_final_message=True, tools=tools)  # auto: free text


def test_openai_chat_fields_that_change_nothing_are_taken_and_the_unserved_ones_named():
    user = [{"role": "user", "content": "hi"}]
    taken = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "safety_identifier": "u",
             "prompt_cache_key": "p", "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
             "verbosity": "low", "modalities": ["text"], "audio": None, "functions": None}
    r = ChatCompletionRequest(model="m", messages=user, max_tokens=3, **taken)
    assert r.sampling(None) == ChatCompletionRequest(model="m", messages=user, max_tokens=3).sampling(None)
    for field, value, says in [("audio", {"voice": "alloy", "format": "wav"}, "audio output is not supported"),
                               ("modalities", ["text", "audio"], "modalities.1"),
                               ("web_search_options", {}, "does not search the web"),
                               ("functions", [{"name": "f"}], "send tools and tool_choice"),
                               ("function_call", "auto", "function_call (deprecated"),
                               ("reasoning_effort", "extreme", "reasoning_effort")]:
        with pytest.raises(ValidationError, match=says.replace("(", r"\(")) as e:
            ChatCompletionRequest(model="m", messages=user, **{field: value})
        err = e.value.errors()[0]
        cause = err.get("ctx", {}).get("error")
        assert (getattr(cause, "param", None) or err["loc"][0]) == field


@pytest.mark.parametrize(
    "body, match",
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "x"}]},
         "exactly one of prompt and messages is required; both given"),
        ({}, "exactly one of prompt and messages is required; neither given"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt applies to messages only"),
        ({"prompt": "a", "continue_final_message": True}, "continue_final_message applies to messages only"),
        ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs applies to messages only"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
         "chat_template_kwargs may not set tools"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "bogus": 1}, "bogus"),
        ({"prompt": "a", "model": ""}, "model"),
    ],
)
def test_bad_tokenize_bodies_are_rejected(body, match):
    with pytest.raises(ValidationError, match=match) as e:
        TokenizeRequest.model_validate({"model": "m", **body})
    if match in ("messages", "prompt", "bogus", "model"):
        assert e.value.errors()[0]["loc"][0] == match  # the 400 names the field


def test_detokenize_bodies():
    assert DetokenizeRequest(model="m", tokens=[1, 2, 3]).tokens == [1, 2, 3]
    assert DetokenizeRequest(model="m", tokens=[]).tokens == []
    for body, field in (({"tokens": ["a"]}, "tokens"), ({}, "tokens"), ({"tokens": [1], "prompt": "x"}, "prompt")):
        with pytest.raises(ValidationError) as e:
            DetokenizeRequest.model_validate({"model": "m", **body})
        assert e.value.errors()[0]["loc"][0] == field


def test_response_format_and_guided_fields_map_to_one_spec():
    from lora_runtime.engine.grammar import GuidedSpec

    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array"}, "strict": True}})
    assert GuidedSpec.coerce(chat.sampling(None)["guided"]) == GuidedSpec("json_schema", '{"type": "array"}')
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                  response_format={"type": "text"})
    assert plain.sampling(None)["guided"] is None
    cases = [({"guided_json": {"type": "object"}}, GuidedSpec("json_schema", '{"type": "object"}', param="guided_json")),
             ({"guided_regex": "a+"}, GuidedSpec("regex", "a+", param="guided_regex")),
             ({"guided_choice": ["a", "b"]}, GuidedSpec("choice", '["a", "b"]', param="guided_choice")),
             ({"guided_grammar": 'start: "a"'}, GuidedSpec("grammar", 'start: "a"', param="guided_grammar")),
             ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " ?"},
              GuidedSpec("json_object", whitespace=" ?"))]
    for fields, spec in cases:
        assert GuidedSpec.coerce(CompletionRequest(model="m", prompt="x", **fields).sampling(16)["guided"]) == spec
    with pytest.raises(ValidationError, match="both constrain the output"):
        CompletionRequest(model="m", prompt="x", guided_regex="a", response_format={"type": "json_object"})
    with pytest.raises(ValidationError, match="needs its json_schema"):
        CompletionRequest(model="m", prompt="x", response_format={"type": "json_schema"})


def test_tool_messages_reach_the_template_as_transformers_passes_them():
    """An assistant's tool calls (arguments as a dict) and the tool's result (with its call id)
    render through a Qwen-style template, with the request's tools."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models

    from lora_runtime.model.tokenizer import Tokenizer

    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{% if m.content %}{{ m.content }}{% endif %}"
        "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
        "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
        "{% if m.role == 'tool' %}[{{ m.tool_call_id }}]{% endif %}{% endfor %}"
    )
    backend = BackendTokenizer(models.BPE(vocab={"a": 0, "</s>": 1}, merges=[]))
    tok = Tokenizer(backend, {"eos_token": "</s>"}, chat_template=template)
    body = ChatCompletionRequest(model="m", tools=[{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}], messages=[
        {"role": "user", "content": "add 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"}])
    text = tok.apply_chat_template(body.chat_messages(), tools=body.tool_request()["tools"])
    assert '<tools>{"name": "add", "parameters"' in text
    assert '<|assistant|><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in text
    assert text.endswith("<|tool|>4[call_1]")
    bad = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "add", "arguments": "[1]"}}]}
    with pytest.raises(ValidationError, match="is not a JSON object"):
        ChatCompletionRequest(model="m", messages=[bad])

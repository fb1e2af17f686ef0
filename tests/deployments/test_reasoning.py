"""Reasoning split from content: whole answers, and the same answers streamed in every cut."""

import pytest

from deployments.reasoning import OPEN, TAGGED, ReasoningSplitter, reasoning_mode, split_reasoning

QWEN3_LIKE = "{% for m in messages %}...{% endfor %}{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"


def test_the_mode_is_read_from_the_prompt_the_template_wrote():
    assert reasoning_mode("no think tags here", "<|user|>hi<think>") is None
    assert reasoning_mode(QWEN3_LIKE, "<|user|>hi<|assistant|>\n") == TAGGED
    assert reasoning_mode(QWEN3_LIKE, "<|user|>hi<|assistant|>\n<think>\n\n</think>\n\n") == TAGGED
    assert reasoning_mode(QWEN3_LIKE, "<|user|>hi<|assistant|>\n<think>\n") == OPEN  # the template opened it


@pytest.mark.parametrize("mode, text, reasoning, content", [
    (TAGGED, "<think>\nadd them\n</think>\n\n4", "add them", "4"),
    (TAGGED, "  <think>a < b </thin k</think>x</think>y", "a < b </thin k", "x</think>y"),
    (TAGGED, "4, no reasoning", None, "4, no reasoning"),
    (TAGGED, "<thi", None, "<thi"),  # ended before the tag was whole: not a tag
    (TAGGED, "<think>\ncut short\n", "cut short\n", ""),  # max_tokens inside the block
    (OPEN, "\nadd them\n</think>\n\n4", "add them", "4"),
    (OPEN, "still thinking", "still thinking", ""),
    (OPEN, "</think>4", "", "4"),
])
def test_whole_and_streamed_answers_split_alike(mode, text, reasoning, content):
    assert split_reasoning(mode, text) == (reasoning, content)
    assert split_reasoning(None, text) == (None, text)
    for size in range(1, len(text) + 1):  # every chunking of the stream
        splitter, got_r, got_c = ReasoningSplitter(mode), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            r, c = splitter.feed(piece, finished=k == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning or "", content), size


THINK_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}={% endfor %}"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
                  "{% elif add_generation_prompt %}<think>{% endif %}")


def test_the_replica_reads_the_mode_from_the_rendered_prompt():
    """A template that opens the block for the model: its answers start as reasoning; with
    enable_thinking false it writes the block closed, and answers are content unless they
    open one themselves."""
    from deployments.config import AppArgs
    from deployments.model_server import LoRAModelServer
    from lora_runtime.demo import demo_model_dir
    from lora_runtime.model.tokenizer import Tokenizer

    replica = object.__new__(getattr(LoRAModelServer, "func_or_class", LoRAModelServer))
    replica._args = AppArgs(model="demo")
    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    tokenizer._chat_template, tokenizer._compiled_template = THINK_TEMPLATE, None
    replica._engine = type("EngineTokenizer", (), {"tokenizer": tokenizer})()
    chat = {"kind": "chat", "messages": [{"role": "user", "content": "hello"}], "sampling": {"max_tokens": 4}}
    prompt, mode = replica._prompt({**chat, "template": {"add_generation_prompt": True}})
    assert mode == OPEN and tokenizer.decode(prompt, skip_special_tokens=False).endswith("hello=<think>")
    _, mode = replica._prompt({**chat, "template": {"template_kwargs": {"enable_thinking": False}}})
    assert mode == TAGGED
    # A grammar binds from the first token: the block is closed empty ahead of a constrained answer.
    guided = {**chat, "sampling": {"max_tokens": 4, "guided": {"kind": "json_object"}}}
    prompt, mode = replica._prompt({**guided, "template": {"add_generation_prompt": True}})
    assert mode == TAGGED
    assert tokenizer.decode(prompt, skip_special_tokens=False).endswith("hello=<think>\n\n</think>\n\n")
    _, mode = replica._prompt({"kind": "completion", "prompt": "hello=", "sampling": {"max_tokens": 4}})
    assert mode is None


class _Stream:
    """A replica stream's rest (the items after its first), as the ingress reads it."""

    def __init__(self, items):
        self._items = iter(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        pass


def _items(mode, pieces):
    base = {"token_ids": [], "prompt_tokens": 3, "cached_tokens": 0, "logprobs": None, "prompt_logprobs": None,
            "prompt_text": None, "tool_format": None, "reasoning_mode": None}
    items = [{**base, "text": p, "finished": k == len(pieces) - 1, "finish_reason": "stop" if k == len(pieces) - 1
              else None, "completion_tokens": k + 1} for k, p in enumerate(pieces)]
    items[0]["reasoning_mode"] = mode
    return items


def test_the_ingress_puts_reasoning_in_reasoning_content_whole_and_streamed():
    import asyncio
    import json

    from cluster.access import Caller
    from deployments.ingress import OpenAIIngress, _usage

    ingress = object.__new__(getattr(OpenAIIngress, "func_or_class", OpenAIIngress))
    pieces = ["<thi", "nk>\nadd ", "them\n</th", "ink>\n\n", "4"]
    items = _items(TAGGED, pieces)
    whole = ingress._full_response("c", "m", [items], _usage([items[-1]], [0]), chat=True)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    plain = _items(None, pieces)  # a template without think tags: never split
    assert ingress._full_response("c", "m", [plain], _usage([plain[-1]], [0]), chat=True)["choices"][0][
        "message"] == {"role": "assistant", "content": "".join(pieces)}

    async def stream():
        streams = [(_Stream(items[1:]), items[0])]
        return [s async for s in ingress._sse_stream("c", "m", streams, [0], chat=True, include_usage=False,
                                                      caller=Caller(key=None))]

    deltas = [json.loads(s.removeprefix("data: "))["choices"][0]["delta"] for s in asyncio.run(stream())[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "add them"
    assert "".join(d.get("content") or "" for d in deltas) == "4"

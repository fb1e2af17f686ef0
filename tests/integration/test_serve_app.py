"""The application as a user runs it: `serve deploy serve_config.yaml`, the OpenAI client,
the admin API; greedy outputs checked against the runtime run directly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from tests.helpers.checkpoints import save_tiny_llama
from tests.integration.adapters import save_peft_adapter
from tests.integration.conftest import ADMIN_TOKEN, REPO, ReplicaKiller, ingress_admitted, kill_actor

pytestmark = pytest.mark.integration

APP = "multilora"
CONFIG = yaml.safe_load((REPO / "serve_config.yaml").read_text())
ARGS = CONFIG["applications"][0]["args"]
BASE = "demo"
# Demo-style prompts: a word and the separator (see lora_runtime.demo.tasks).
PROMPTS = ["hello=", "serving=", "adapter=", "batch="]
MAX_TOKENS = 8
# With BOS, 32 tokens (the demo tokenizer reads characters): a prefix worth caching.
SHARED_PREFIX = "the quick brown fox jumps over "
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
N_ADAPTERS = 8
KEYS_REFRESH_S = 1.0
TIGHT_ONGOING, TIGHT_QUEUED = 2, 2  # the keyed deployment's replica and queue limits
KEYED_MAX_LORA_RANK = 16  # the keyed deployment's rank limit (64 before): a changed validation limit
KEYED_STREAM_INTERVAL = 3  # the keyed deployment streams 3 tokens a chunk after the first
KEYED_INGRESS_REPLICAS = 2  # the keyed deployment's ingress replicas (they share rate limits)
LOAD_TIMEOUT_S = 4.0  # adapter_load_timeout_s: how long a request waits on its adapter's storage
MAX_ADAPTER_BYTES = 8 << 20
DEPLOYED: dict = {}  # what the app runs with now: {"keys": the keys file or None}


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    from cluster.admin import demo_adapter_sources, resolve_model_path

    root = tmp_path_factory.mktemp("serve_app")
    base = Path(resolve_model_path("demo"))
    adapters = {f"ad{i}": save_peft_adapter(base, root / f"ad{i}", seed=10 + i, rank=4 + 4 * (i % 2)) for i in range(N_ADAPTERS)}
    # Same depth as the demo model, different width: every tensor has the wrong shape.
    wrong = save_peft_adapter(save_tiny_llama(root / "other", num_hidden_layers=4), root / "wrong", seed=99)
    demo = {name: Path(path) for name, path in demo_adapter_sources().items()}
    # Fetched from storage by the fault tests only: content no replica has seen.
    outage = save_peft_adapter(base, root / "outage", seed=77, rank=8)
    wide = save_peft_adapter(base, root / "wide", seed=78, rank=32)  # past the keyed deployment's rank limit
    return {"root": root, "base": base, "adapters": adapters, "wrong": wrong, "demo": demo, "outage": outage,
            "wide": wide}


def _write_config(cluster, files, keys: Path | None = None) -> Path:
    """The shipped serve_config.yaml; only the HTTP port and the registry path change (and the
    API keys file, when given)."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    args = config["applications"][0]["args"]
    args["registry_url"] = str(files["root"] / "registry" / "registry.json")
    # Adapters come from the test's files, the demo's and the emulated bucket only.
    args["adapter_roots"] = [str(files["root"]), str(next(iter(files["demo"].values())).parent), "gs://adapters/"]
    args["max_adapter_bytes"] = MAX_ADAPTER_BYTES
    args["adapter_load_timeout_s"] = LOAD_TIMEOUT_S
    if keys is not None:
        args["api_keys_url"] = str(keys)
        args["api_keys_refresh_s"] = KEYS_REFRESH_S
        # and a small request queue, for the overload test
        args["max_ongoing_requests"] = TIGHT_ONGOING
        args["max_queued_requests"] = TIGHT_QUEUED
        args["max_lora_rank"] = KEYED_MAX_LORA_RANK
        args["stream_interval"] = KEYED_STREAM_INTERVAL
        args["ingress_replicas"] = KEYED_INGRESS_REPLICAS
    path = files["root"] / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _deploy(cluster, files, keys: Path | None = None) -> None:
    cluster.cli("serve", "deploy", str(_write_config(cluster, files, keys)), "-a", cluster.dashboard_url)
    cluster.wait_running(APP)
    DEPLOYED["keys"] = keys


@pytest.fixture(scope="session")
def app(cluster, files):
    _deploy(cluster, files)
    return cluster


@pytest.fixture(scope="session")
def reference(files):
    """The runtime run directly, same limits: greedy text per (prompt, adapter)."""
    from cluster.admin import sync_entries
    from lora_runtime.engine.engine import Engine
    from lora_runtime.engine.sampling import SamplingParams

    from deployments.config import AppArgs

    engine = Engine.from_pretrained(str(files["base"]), AppArgs(**ARGS).engine_config(), model_name=BASE)
    engine.start()
    sources = {**files["adapters"], **files["demo"], "outage": files["outage"]}
    entries = {n: {"source": str(p), "version": 1, "pinned": False} for n, p in sources.items()}
    engine.lora_manager.sync(sync_entries(entries))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    cache: dict = {}

    def run(prompt: str | tuple[int, ...], adapter: str | None) -> str:
        if (prompt, adapter) not in cache:
            [out] = engine.generate_batch([prompt if isinstance(prompt, str) else list(prompt)], params, [adapter])
            cache[prompt, adapter] = out.text
        return cache[prompt, adapter]

    run.engine = engine
    yield run
    engine.shutdown()


def _client(app, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _register(app, name: str, source: str, pinned: bool = False) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/adapters", json={"name": name, "source": source, "pinned": pinned},
                      headers=AUTH, timeout=120)


def test_admin_requires_the_token(app, files):
    body = {"name": "x", "source": str(files["adapters"]["ad0"])}
    r = httpx.post(f"{app.base_url}/v1/adapters", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = httpx.post(f"{app.base_url}/v1/adapters", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403
    r = httpx.get(f"{app.base_url}/v1/adapters", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403
    assert "x" not in [m["id"] for m in httpx.get(f"{app.base_url}/v1/models").json()["data"]]


def test_health(app):
    r = httpx.get(f"{app.base_url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_base_and_adapter_completions_match_the_runtime(app, files, reference):
    client = _client(app)
    base = BASE
    r = _register(app, "ad0", str(files["adapters"]["ad0"]))
    assert r.status_code == 201, r.text
    models = {m.id: m for m in client.models.list().data}
    assert base in models and models["ad0"].model_extra["parent"] == base

    for model, adapter in ((base, None), ("ad0", "ad0")):
        prompt = PROMPTS[0]
        want = reference(prompt, adapter)
        got = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens >= 1 and got.usage.prompt_tokens > 1
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens

    # The adapter changes the output: the base and the adapter differ on some prompt.
    assert any(reference(p, None) != reference(p, "ad0") for p in PROMPTS)


def _peft_greedy(base_dir, adapter_dir, ids: list[int], steps: int, eos: tuple[int, ...]) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in eos:
                break
            out.append(token)
            ids.append(token)
    return out


def test_dora_embedding_head_and_bias_adapters_over_http_match_peft(app, files, reference):
    """Adapters other servers refuse (DoRA, embed_tokens and lm_head targets, modules_to_save
    copies of both, lora_bias) register over the admin API and serve what PEFT computes; the registry
    shows what each one targets and saves."""
    root, base = files["root"], files["base"]
    dirs = {
        "dora_http": save_peft_adapter(base, root / "dora_http", seed=41, rank=8,
                                       targets=("q_proj", "v_proj", "down_proj", "lm_head"), use_dora=True),
        "embed_head_http": save_peft_adapter(base, root / "embed_head_http", seed=42, rank=4,
                                             targets=("embed_tokens", "lm_head", "k_proj")),
        "saved_head_http": save_peft_adapter(base, root / "saved_head_http", seed=43, rank=4,
                                             targets=("q_proj",), modules_to_save=["lm_head", "embed_tokens"]),
        "bias_http": save_peft_adapter(base, root / "bias_http", seed=44, rank=4,
                                       targets=("q_proj", "down_proj", "lm_head"), lora_bias=True),
    }
    for name, path in dirs.items():
        r = _register(app, name, str(path))
        assert r.status_code == 201, r.text
    listed = {e["name"]: e for e in httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH).json()["data"]}
    assert listed["dora_http"]["use_dora"] is True and "lm_head" in listed["dora_http"]["target_modules"]
    assert {"embed_tokens", "lm_head"} <= set(listed["embed_head_http"]["target_modules"])
    assert listed["saved_head_http"]["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert listed["bias_http"]["lora_bias"] is True and listed["dora_http"]["lora_bias"] is False
    tokenizer = reference.engine.tokenizer
    client = _client(app)
    for name, path in dirs.items():
        changed = False
        for prompt in PROMPTS[:2]:
            ids = tokenizer.encode(prompt)
            want = _peft_greedy(base, path, ids, MAX_TOKENS, tokenizer.eos_token_ids)
            got = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), (name, prompt)
            changed |= got.choices[0].text != reference(prompt, None)
        assert changed, name


def test_a_merge_of_registered_adapters_serves_what_peft_merges(app, files, reference):
    """POST /v1/adapters with a merge in place of a source: the merged adapter serves what
    PEFT's add_weighted_adapter of the same adapters computes, and its files go with it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _ensure_adapters(app, files, ["ad0", "ad3"])
    before = httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()["version"]
    for body, status, param in (
        ({"name": "merged_http"}, 400, "source"),
        ({"name": "merged_http", "source": str(files["adapters"]["ad0"]),
          "merge": {"adapters": ["ad0"], "weights": [1]}}, 400, "source"),
        ({"name": "merged_http", "merge": {"adapters": ["ad0", "no-such"], "weights": [1, 1]}}, 404, "merge.adapters"),
        ({"name": "merged_http", "merge": {"adapters": ["ad0", "ad3"], "weights": [1, 1], "combination_type": "ties",
                                           "density": 0.5}}, 400, "merge.combination_type"),  # ranks 4 and 8
    ):
        r = httpx.post(f"{app.base_url}/v1/adapters", json=body, headers=AUTH, timeout=120)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()["version"] == before

    merge = {"adapters": ["ad0", "ad3"], "weights": [0.7, -0.9], "combination_type": "cat"}
    r = httpx.post(f"{app.base_url}/v1/adapters", json={"name": "merged_http", "merge": merge}, headers=AUTH,
                   timeout=120)
    assert r.status_code == 201, r.text
    entry = r.json()
    assert entry["rank"] == 12 and entry["merged_from"]["adapters"] == ["ad0", "ad3"]
    model = AutoModelForCausalLM.from_pretrained(files["base"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, files["adapters"]["ad0"], adapter_name="ad0")
    peft_model.load_adapter(files["adapters"]["ad3"], adapter_name="ad3")
    peft_model.add_weighted_adapter(["ad0", "ad3"], [0.7, -0.9], "merged", combination_type="cat")
    peft_model.save_pretrained(files["root"] / "peft_merged", selected_adapters=["merged"])
    tokenizer, client, changed = reference.engine.tokenizer, _client(app), False
    for prompt in PROMPTS[:2]:
        want = _peft_greedy(files["base"], files["root"] / "peft_merged" / "merged", tokenizer.encode(prompt),
                            MAX_TOKENS, tokenizer.eos_token_ids)
        got = client.completions.create(model="merged_http", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), prompt
        changed |= got.choices[0].text not in (reference(prompt, "ad0"), reference(prompt, "ad3"))
    assert changed
    assert Path(entry["source"]).is_dir()
    assert httpx.delete(f"{app.base_url}/v1/adapters/merged_http", headers=AUTH, timeout=60).status_code == 200
    assert not Path(entry["source"]).exists()


def test_two_names_for_one_adapter_share_its_content_id(app, files):
    for name, source in (("ad1", "ad1"), ("ad1_alias", "ad1"), ("ad2", "ad2")):
        assert _register(app, name, str(files["adapters"][source])).status_code == 201
    listed = {e["name"]: e for e in httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH).json()["data"]}
    assert listed["ad1"]["content_id"] == listed["ad1_alias"]["content_id"] != listed["ad2"]["content_id"]
    for name in ("ad1", "ad1_alias"):  # one entry, as the list holds it
        r = httpx.get(f"{app.base_url}/v1/adapters/{name}", headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json() == listed[name], r.text
    r = httpx.get(f"{app.base_url}/v1/adapters/no-such-adapter", headers=AUTH, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "name", r.text
    assert httpx.get(f"{app.base_url}/v1/adapters/ad1", timeout=60).status_code == 401
    r = httpx.delete(f"{app.base_url}/v1/adapters/ad1_alias", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_demo_adapters_are_registered_at_start(app, files, reference):
    models = {m["id"]: m for m in httpx.get(f"{app.base_url}/v1/models").json()["data"]}
    for name in files["demo"]:
        assert models[name]["parent"] == BASE
    assert {m["max_model_len"] for m in models.values()} == {ARGS["max_seq_len"]}  # vLLM's field, every card
    client = _client(app)
    for name in files["demo"]:
        got = client.completions.create(model=name, prompt="hello=", max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == reference("hello=", name)


def test_chat_completions_match_the_runtime(app, files, reference):
    client = _client(app)
    messages = [{"role": "user", "content": "hello"}]
    tokenizer = reference.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    template = tuple(tokenizer.encode(text, add_special_tokens=False))
    _ensure_adapters(app, files, ["ad1"])
    for model, adapter in ((BASE, None), ("ad1", "ad1")):
        want = reference(template, adapter)
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_chat_continues_a_given_answer_and_tokenize_agrees(app, files, reference):
    """continue_final_message: the prompt ends inside the assistant turn's given beginning,
    and the answer is what follows it, as the runtime gives for that prompt; /tokenize renders
    the same prompt. Fields of OpenAI's API that change nothing here are taken."""
    client = _client(app)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "HE"}]
    tokenizer = reference.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("HE")
    got = client.chat.completions.create(
        model="upper", messages=messages, max_tokens=MAX_TOKENS, temperature=0, store=False,
        metadata={"team": "a"}, extra_body={"continue_final_message": True, "chat_template_kwargs": {"x": 1}})
    assert got.choices[0].message.content == reference(tuple(prompt), "upper")
    assert got.usage.prompt_tokens == len(prompt)
    r = httpx.post(f"{app.base_url}/tokenize", json={"model": "upper", "messages": messages,
                                                      "continue_final_message": True}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == prompt, r.text
    r = httpx.post(f"{app.base_url}/v1/chat/completions", timeout=60, json={
        "model": "upper", "messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_the_responses_api_answers_as_chat_does(app, files, reference):
    """POST /v1/responses through the openai client: the same answer as the chat endpoint gives
    for the same messages, whole and streamed; a required function call comes back as a
    function_call item; a bad field is a 400 naming it as the client sent it."""
    client = _client(app)
    chat = client.chat.completions.create(model="upper", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=MAX_TOKENS, temperature=0)
    got = client.responses.create(model="upper", input="hello", max_output_tokens=MAX_TOKENS, temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.status == "completed"
    assert got.usage.input_tokens == chat.usage.prompt_tokens and got.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model="upper", input=[{"role": "user", "content": "hello"}],
                                          max_output_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    assert events[-1].response.output_text == got.output_text

    tools = [{"type": "function", "name": "shout", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 4}}, "required": ["word"]}}]
    # 56: room for the whole call, one character a token.
    called = client.responses.create(model=BASE, input="hello", tools=tools, tool_choice="required",
                                     max_output_tokens=56, temperature=0)
    [call] = [o for o in called.output if o.type == "function_call"]
    assert call.name == "shout" and set(json.loads(call.arguments)) == {"word"}
    streamed = list(client.responses.create(model=BASE, input="hello", tools=tools, tool_choice="required",
                                            max_output_tokens=56, temperature=0, stream=True))
    pieces = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == call.arguments

    r = httpx.post(f"{app.base_url}/v1/responses", timeout=60, json={
        "model": "upper", "input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {
            "type": "objekt"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    r = httpx.post(f"{app.base_url}/v1/responses", json={"model": "upper", "input": "x", "previous_response_id": "r"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_retrieve_model_returns_what_the_list_holds(app, files):
    listed = {m["id"]: m for m in httpx.get(f"{app.base_url}/v1/models", timeout=30).json()["data"]}
    for model in (BASE, "reverse"):  # the base model and a demo adapter
        r = httpx.get(f"{app.base_url}/v1/models/{model}", timeout=30)
        assert r.status_code == 200 and r.json() == listed[model], r.text
    client = _client(app)
    adapter = client.models.retrieve("upper")
    assert adapter.id == "upper" and adapter.model_extra["parent"] == BASE
    assert client.models.retrieve(BASE).model_extra["parent"] is None
    r = httpx.get(f"{app.base_url}/v1/models/no-such-model", timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and error["type"] == "not_found_error" and "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def _tokenize(app, body: dict) -> httpx.Response:
    return httpx.post(f"{app.base_url}/tokenize", json=body, timeout=60)


def _detokenize(app, body: dict) -> httpx.Response:
    return httpx.post(f"{app.base_url}/detokenize", json=body, timeout=60)


def test_tokenize_and_detokenize_round_trip(app, reference):
    tokenizer = reference.engine.tokenizer
    text = "hello, world="
    for model in (BASE, "caesar"):  # an adapter resolves like a completion's model, same tokenizer
        r = _tokenize(app, {"model": model, "prompt": text})
        assert r.status_code == 200, r.text
        ids = tokenizer.encode(text)
        assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": ARGS["max_seq_len"]}
        assert ids[0] == tokenizer.bos_token_id  # add_special_tokens defaults to true for a prompt
        plain = _tokenize(app, {"model": model, "prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert plain == ids[1:]
        assert _detokenize(app, {"model": model, "tokens": plain}).json() == {"prompt": text}
        # Special tokens are kept, as vLLM's /detokenize: the text tokenizes back to the same ids.
        with_bos = _detokenize(app, {"model": model, "tokens": ids}).json()["prompt"]
        assert with_bos == tokenizer.decode(ids, skip_special_tokens=False) and with_bos.endswith(text)
        again = _tokenize(app, {"model": model, "prompt": with_bos, "add_special_tokens": False}).json()["tokens"]
        assert again == ids
    assert _detokenize(app, {"model": BASE, "tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_counts_what_chat_completions_counts(app, reference):
    client = _client(app)
    conversations = (
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "serving"},
         {"role": "assistant", "content": "gnivres"}, {"role": "user", "content": [{"type": "text", "text": "batch"}]}],
    )
    for model, messages in zip((BASE, "reverse"), conversations):
        r = _tokenize(app, {"model": model, "messages": messages, "add_generation_prompt": True})
        assert r.status_code == 200, r.text
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
        assert r.json()["count"] == len(r.json()["tokens"]) == got.usage.prompt_tokens
        # The template writes BOS: once, as in the chat path.
        assert r.json()["tokens"].count(reference.engine.tokenizer.bos_token_id) == 1


@pytest.mark.parametrize(
    "path, body, status, param, says",
    [
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model", "no-such-model"),
        ("/detokenize", {"model": "no-such-model", "tokens": [5]}, 404, "model", "no-such-model"),
        ("/tokenize", {"model": BASE, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None,
         "both given"),
        ("/tokenize", {"model": BASE}, 400, None, "neither given"),
        ("/tokenize", {"model": BASE, "prompt": "x", "add_generation_prompt": True}, 400, None,
         "add_generation_prompt"),
        ("/tokenize", {"model": BASE, "prompt": "x", "bogus": 1}, 400, "bogus", "bogus"),
        ("/tokenize", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages", "image_url"),
        # The demo's chat template refuses a tool turn: the 400 comes from rendering it.
        ("/tokenize", {"model": BASE, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "tool"),
        ("/detokenize", {"model": BASE, "tokens": [5, 100000, -1, 100000]}, 400, "tokens", "[-1, 100000]"),
        ("/detokenize", {"model": BASE, "tokens": "abc"}, 400, "tokens", "tokens"),
        ("/detokenize", {"model": BASE}, 400, "tokens", "tokens"),
    ],
)
def test_bad_tokenizer_requests_use_the_openai_format(app, path, body, status, param, says):
    r = httpx.post(f"{app.base_url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_a_wrong_method_names_the_allowed_ones_through_serve(app):
    """Serve mounts the ingress's routes under a router of its own: the 405 still lists them."""
    r = httpx.get(f"{app.base_url}/v1/completions", timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert r.json()["error"]["message"] == "GET is not a method of /v1/completions; it takes POST"
    r = httpx.delete(f"{app.base_url}/v1/adapters", timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.text


def test_logprobs_over_http_match_the_runtime(app, files, reference):
    """Completions (logprobs=N) and chat (logprobs, top_logprobs), whole and streamed."""
    from lora_runtime.engine.sampling import SamplingParams

    client = _client(app)
    name = "reverse"  # a demo adapter
    [want] = reference.engine.generate_batch(
        [PROMPTS[1]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3), [name])
    got = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == got.usage.completion_tokens == len(want.token_ids)
    assert "".join(lp.tokens).startswith(got.choices[0].text)
    for mine, ref, top in zip(lp.token_logprobs, want.logprobs, lp.top_logprobs):
        assert abs(mine - ref.logprob) < 1e-4
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(mine)  # greedy: the likeliest
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace").startswith(
        whole.choices[0].message.content)
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_whole_and_streamed(app, files, reference):
    """n seeded samples: choice i is the runtime's sample with seed + i; usage adds them up."""
    from lora_runtime.engine.sampling import SamplingParams

    client = _client(app)
    name, n, seed = "upper", 3, 11
    want = reference.engine.generate_batch(
        [PROMPTS[2]] * n, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + i) for i in range(n)],
        [name] * n)
    got = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=1.0,
                                    seed=seed, n=n)
    assert [c.index for c in got.choices] == list(range(n))
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.usage.prompt_tokens == want[0].prompt_tokens

    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=2, stream=True,
                                            stream_options={"include_usage": True})
    texts, finished, usage = ["", ""], [None, None], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        texts[c.index] += c.delta.content or ""
        finished[c.index] = c.finish_reason or finished[c.index]
    whole = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=2)
    assert texts == [c.message.content for c in whole.choices]
    assert all(finished) and usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_likeliest_of_its_candidates(app, files, reference):
    """best_of=4, n=2: the candidates are the seeded samples seed..seed+3 (as n=4 gives them);
    the two with the highest mean log-probability per token come back, best first, and usage
    counts all four."""
    from lora_runtime.engine.sampling import SamplingParams

    client = _client(app)
    name, seed, best_of = "upper", 5, 4
    want = reference.engine.generate_batch(
        [PROMPTS[2]] * best_of, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=seed + i, logprobs=0)
                                 for i in range(best_of)], [name] * best_of)
    ranked = sorted(want, key=lambda w: sum(lp.logprob for lp in w.logprobs) / max(1, len(w.logprobs)),
                    reverse=True)
    got = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=1.5,
                                    seed=seed, n=2, best_of=best_of)
    assert [c.text for c in got.choices] == [w.text for w in ranked[:2]]
    assert [c.index for c in got.choices] == [0, 1] and all(c.logprobs is None for c in got.choices)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    with_logprobs = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                              temperature=1.5, seed=seed, best_of=best_of, logprobs=1)
    [best] = with_logprobs.choices
    assert best.text == ranked[0].text and len(best.logprobs.token_logprobs) == len(ranked[0].token_ids)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(app, files, reference):
    """A prompt longer than max_seq_len is served from its last k tokens (after the chat
    template for a chat); -1 keeps as many as leave room for max_tokens."""
    client = _client(app)
    tokenizer = reference.engine.tokenizer
    ids = tokenizer.encode(_LONG + PROMPTS[0])
    assert len(ids) > ARGS["max_seq_len"]
    for keep, kept in ((10, 10), (-1, ARGS["max_seq_len"] - MAX_TOKENS)):
        got = client.completions.create(model="reverse", prompt=_LONG + PROMPTS[0], max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"truncate_prompt_tokens": keep})
        assert got.usage.prompt_tokens == kept
        assert got.choices[0].text == reference(tuple(ids[-kept:]), "reverse")
    messages = [{"role": "user", "content": _LONG + "hello"}]
    chat = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    got = client.chat.completions.create(model="upper", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 12})
    assert got.usage.prompt_tokens == 12 and got.choices[0].message.content == reference(tuple(chat[-12:]), "upper")


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(app, reference):
    """A request whose prompt starts like a finished one's reuses that row's K/V: usage's
    prompt_tokens_details.cached_tokens says how many prompt tokens, whole and streamed."""
    from deployments.config import AppArgs
    from lora_runtime.engine.sampling import SamplingParams

    client = _client(app)
    tokenizer = reference.engine.tokenizer
    shared = len(tokenizer.encode(SHARED_PREFIX))
    min_tokens = AppArgs(**ARGS).prefix_cache_min_tokens
    assert shared >= min_tokens

    first = client.completions.create(model=BASE, prompt=SHARED_PREFIX + PROMPTS[0], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing held this prompt yet

    prompt = SHARED_PREFIX + PROMPTS[1]
    got = client.completions.create(model=BASE, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert min_tokens <= cached <= shared < got.usage.prompt_tokens
    [want] = reference.engine.generate_batch([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert got.choices[0].text == want.text  # the cached prefix changes nothing in the output

    stream = client.completions.create(
        model=BASE, prompt=SHARED_PREFIX + PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert not chunks[-1].choices
    assert min_tokens <= chunks[-1].usage.prompt_tokens_details.cached_tokens <= shared

    # n=2 chat, streamed: the template starts with BOS and the message, so the prefix is
    # shared again; the prompt counts once, cached as far as both choices found it.
    messages = [{"role": "user", "content": SHARED_PREFIX + "batch"}]
    stream = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=4, temperature=1.0, seed=5, n=2, stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if not c.choices][-1]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert usage.prompt_tokens == len(tokenizer.encode(template, add_special_tokens=False))
    assert min_tokens <= usage.prompt_tokens_details.cached_tokens <= shared


def test_penalties_over_http_match_the_runtime(app, reference):
    from lora_runtime.engine.sampling import SamplingParams

    penalties = dict(frequency_penalty=1.0, presence_penalty=0.5)
    extensions = dict(repetition_penalty=1.3, min_tokens=2)  # vLLM's
    [want] = reference.engine.generate_batch(
        [PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **penalties, **extensions), ["sort"])
    got = _client(app).completions.create(model="sort", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                          **penalties, extra_body=extensions)
    assert got.choices[0].text == want.text and got.usage.completion_tokens >= 2
    r = httpx.post(f"{app.base_url}/v1/completions", timeout=60,
                   json={"model": "sort", "prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and "min_tokens=3" in r.json()["error"]["message"]


def test_logit_bias_over_http(app, reference):
    z = reference.engine.tokenizer.encode("z", add_special_tokens=False)[0]
    got = _client(app).completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                          logit_bias={str(z): 100})
    assert got.choices[0].text == "zzzz"
    r = httpx.post(f"{app.base_url}/v1/completions", timeout=60,
                   json={"model": BASE, "prompt": "x", "max_tokens": 2, "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and "logit_bias token ids [99999]" in r.json()["error"]["message"]


def test_allowed_token_ids_over_http(app, reference):
    """vLLM's allowed_token_ids through the OpenAI client: only the listed tokens come out."""
    tok = reference.engine.tokenizer
    allowed = [tok.encode(c, add_special_tokens=False)[0] for c in "ab"]
    got = _client(app).completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=1,
                                          extra_body={"allowed_token_ids": allowed})
    assert got.choices[0].text and set(got.choices[0].text) <= {"a", "b"}, got.choices[0].text
    assert got.usage.completion_tokens == 6  # EOS is not listed
    r = httpx.post(f"{app.base_url}/v1/completions", timeout=60,
                   json={"model": BASE, "prompt": "x", "max_tokens": 2, "allowed_token_ids": [99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_bad_words_over_http(app, reference):
    """vLLM's bad_words through the OpenAI client: the reversed word loses its banned letter."""
    client = _client(app)
    plain = client.completions.create(model="reverse", prompt="hello=", max_tokens=8, temperature=0)
    assert plain.choices[0].text == "olleh"
    got = client.completions.create(model="reverse", prompt="hello=", max_tokens=8, temperature=0,
                                    extra_body={"bad_words": ["l"]})
    assert "l" not in got.choices[0].text and got.choices[0].text != plain.choices[0].text
    r = httpx.post(f"{app.base_url}/v1/completions", timeout=60,
                   json={"model": BASE, "prompt": "x", "max_tokens": 2, "bad_words": [" "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


# JSON schemas whose outputs fit the demo's 64-token context: nested objects, arrays, enums,
# bounded numbers, required fields.
JSON_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "c": {"enum": ["red", "blue"]}},
     "required": ["ok", "n", "c"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["name", "score"], "additionalProperties": False},
]


def test_response_format_outputs_validate_for_base_and_adapters(app, files):
    """Every output parses and validates against its schema: chat and completions, the base
    model and adapters, greedy and sampled, whole and streamed, with n choices and logprobs."""
    client = _client(app)
    _ensure_adapters(app, files, ["ad1"])
    for model in (BASE, "ad1", "reverse"):
        for i, schema in enumerate(JSON_SCHEMAS):
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
            for temperature in (0.0, 1.0):
                got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                     response_format=fmt, temperature=temperature, seed=i,
                                                     max_tokens=48)
                assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
                jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    schema = JSON_SCHEMAS[0]
    stream = client.completions.create(model="ad1", prompt=PROMPTS[0], max_tokens=48, stream=True, n=2, logprobs=1,
                                       temperature=1.0, seed=3, stop=["never"],
                                       extra_body={"guided_json": schema})
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1]
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


def test_guided_regex_choice_and_grammar_over_http(app):
    client = _client(app)
    cases = [({"guided_regex": "[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]{2}", t)),
             ({"guided_choice": ["yes", "no", 'say "hi"']}, lambda t: t in ("yes", "no", 'say "hi"')),
             ({"guided_grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'},
              lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t))]
    for extra, ok in cases:
        for model, temperature in ((BASE, 0.0), ("reverse", 1.0)):
            got = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=40, temperature=temperature,
                                            seed=1, extra_body=extra)
            assert got.choices[0].finish_reason == "stop" and ok(got.choices[0].text), (extra, got.choices[0].text)


def test_tool_calls_required_and_named_always_parse_whole_and_streamed(app, files):
    client = _client(app)
    _ensure_adapters(app, files, ["ad1"])
    tools = [_tool("add"), _tool("pick", {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
                                          "required": ["c"], "additionalProperties": False})]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "hello"}]
    named = {"type": "function", "function": {"name": "pick"}}
    for model in (BASE, "ad1"):
        for choice, finish in (("required", "tool_calls"), (named, "stop")):
            for temperature in (0.0, 1.0):
                got = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                     temperature=temperature, seed=2, max_tokens=48,
                                                     parallel_tool_calls=False)
                message = got.choices[0].message
                assert got.choices[0].finish_reason == finish and message.content is None
                [call] = message.tool_calls
                assert call.id.startswith("call_") and call.type == "function"
                assert choice == "required" or call.function.name == "pick"
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        stream = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                                temperature=0, max_tokens=48, stream=True, parallel_tool_calls=False)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            c = chunk.choices[0]
            finish = c.finish_reason or finish
            assert not c.delta.content
            for delta in c.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        assert finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["arguments"]), params[calls[0]["name"]])
    # With tool_choice auto the answer is content, or calls that parse.
    got = client.chat.completions.create(model=BASE, messages=messages, tools=tools, max_tokens=16, temperature=0)
    assert got.choices[0].message.content is not None or got.choices[0].message.tool_calls


def test_several_prompts_in_one_completions_request(app, reference):
    """Choice index = prompt number * n + sample number; each prompt's tokens count once."""
    prompts = [PROMPTS[0], PROMPTS[3]]
    got = _client(app).completions.create(model="caesar", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [reference(p, "caesar") for p in prompts for _ in range(2)]
    tokenizer = reference.engine.tokenizer
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    ids = tokenizer.encode(PROMPTS[1])
    got = _client(app).completions.create(model=BASE, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(got.choices) == 2 and got.usage.prompt_tokens == len(ids) + 3


def test_echo_and_prompt_logprobs_match_the_runtime(app, reference):
    """echo returns the prompt ahead of the completion; with logprobs its tokens' too (the
    first has none). max_tokens=0 with echo and logprobs scores a text, as evaluation
    harnesses ask for a log-likelihood."""
    from lora_runtime.engine.sampling import SamplingParams

    client = _client(app)
    name, prompt = "reverse", PROMPTS[1]
    got = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert got.choices[0].text == prompt + reference(prompt, name)

    [want] = reference.engine.generate_batch([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2), [name])
    scored = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == scored.usage.prompt_tokens == len(want.prompt_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for mine, ref in zip(lp.token_logprobs[1:], want.prompt_logprobs[1:]):
        assert abs(mine - ref.logprob) < 1e-4
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                       logprobs=1, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == got.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == scored.usage.prompt_tokens + got.usage.completion_tokens


def test_errors_use_the_openai_format(app, files):
    client = _client(app)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert "no-such-adapter" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="hi", max_tokens=1000)
    assert "max_seq_len" in e.value.body["message"]
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": "m", "prompt": "x", "n": 17})
    assert r.status_code == 400 and "n=17" in r.json()["error"]["message"]


_LONG = "a" * 100  # over max_seq_len=64 tokens
_USER = [{"role": "user", "content": "x"}]


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": False}}}


BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, param)
    ("/v1/completions", b'{"model": "reverse", "prompt": ', 400, None),  # malformed JSON
    ("/v1/completions", b'{"model": "reverse", "prompt": "\xff"}', 400, None),  # not UTF-8
    ("/v1/completions", b'{"model": "reverse", "prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate
    ("/v1/completions", {"model": "reverse", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "reverse"}, 400, "prompt"),
    ("/v1/completions", {"model": "no-such-adapter", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "reverse", "prompt": _LONG}, 400, "prompt"),
    ("/v1/completions", {"model": "reverse", "prompt": "hello=", "max_tokens": 60}, 400, "max_tokens"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    # A priority where the deployment schedules first come, first served (the engine says so).
    ("/v1/completions", {"model": "reverse", "prompt": "x", "priority": 1}, 400, "priority"),
    ("/v1/chat/completions", {"model": "reverse", "messages": [{"role": "user", "content": "x"}],
                              "priority": 2**31}, 400, "priority"),
    ("/v1/completions", {"model": "reverse", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "reverse", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "reverse", "prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "reverse", "prompt": ["x"] * 40, "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "reverse", "prompt": ["x"] * 65}, 400, "prompt"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": "reverse", "prompt": ["x"] * 40, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"model": "reverse", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "reverse", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": "reverse", "messages": [{"role": "user", "content": _LONG}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "reverse", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "reverse", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 2, "max_completion_tokens": 3}, 400, "max_completion_tokens"),
    # Structured outputs and tools: bad schemas, grammars and tool definitions.
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objekt"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "guided_regex": "a(b"}, 400, "guided_regex"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "guided_grammar": "start: foo"}, 400, "guided_grammar"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "guided_json": {"enum": ["x" * 70000]}}, 400,
     "guided_json"),
    ("/v1/completions", {"model": "reverse", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "tools": [_tool("f", {"type": "objekt"})]},
     400, "tools"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "tools": [_tool("f"), _tool("f")]}, 400,
     "tools"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "tools": [_tool("bad name")]}, 400,
     "tools.0.function.name"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "tools": [_tool("f")],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "reverse", "messages": _USER, "tool_choice": "required"}, 400,
     "tool_choice"),
]


def test_each_bad_request_is_a_4xx_naming_its_field_and_reaches_no_engine(app, reference):
    """Every request in BAD_REQUESTS is refused in the OpenAI format with its status and field,
    before the engine: its request count stays put, and a canary request is served as before."""
    canary = lambda: _client(app).completions.create(  # noqa: E731
        model="reverse", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    assert canary() == reference(PROMPTS[0], "reverse")
    before = _engine_stats(app)["requests"]
    adapters = httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()
    wrong = []
    for path, body, status, param in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(app.base_url + path, content=content, headers={"Content-Type": "application/json"},
                       timeout=60)
        error = r.json().get("error", {})
        if (r.status_code, error.get("param")) != (status, param) or not error.get("message"):
            wrong.append((path, body if isinstance(body, bytes) else str(body)[:80], r.status_code, r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    assert _engine_stats(app)["requests"] == before
    assert httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json() == adapters
    assert canary() == reference(PROMPTS[0], "reverse")


def _copy_adapter(src: Path, dst: Path, *, config=None, weights=None) -> Path:
    """A copy of the adapter at `src` with its config changed by config(dict) and its
    safetensors bytes by weights(bytes)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    data = (src / "adapter_model.safetensors").read_bytes()
    (dst / "adapter_model.safetensors").write_bytes(weights(data) if weights else data)
    return dst


def _nan_weights(data: bytes) -> bytes:
    from safetensors.numpy import load, save

    tensors = load(data)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].copy()
    tensors[first].flat[0] = float("nan")
    return save(tensors)


@pytest.fixture(scope="module")
def bad_adapters(files, tmp_path_factory):
    """name -> (source, status, what the message says): one per way an adapter is refused."""
    root, good = files["root"] / "bad", files["adapters"]["ad0"]
    root.mkdir(exist_ok=True)
    pickle_only = root / "pickle"
    pickle_only.mkdir(exist_ok=True)
    shutil.copy(good / "adapter_config.json", pickle_only)
    (pickle_only / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    config_only = root / "config-only"
    config_only.mkdir(exist_ok=True)
    shutil.copy(good / "adapter_config.json", config_only)
    outside = tmp_path_factory.mktemp("outside-roots")  # beside the files' root, not in it
    _copy_adapter(good, outside / "ad0")
    link = root / "link-out"
    if not link.exists():
        link.symlink_to(outside / "ad0")
    return {
        "rank_over_max": (save_peft_adapter(files["base"], root / "r72", seed=5, rank=72), 400,
                          "exceeds max_lora_rank=64"),
        "wrong_shapes": (files["wrong"], 400, "shape"),
        "nan_weights": (_copy_adapter(good, root / "nan", weights=_nan_weights), 400, "non-finite"),
        "pickle_only": (pickle_only, 400, "pickle"),
        "unknown_module": (_copy_adapter(good, root / "foo", config=lambda c: {
            **c, "target_modules": sorted(c["target_modules"]) + ["foo_proj"]}), 400, "foo_proj"),
        "missing_weights": (config_only, 400, "missing adapter_model.safetensors"),
        "truncated": (_copy_adapter(good, root / "truncated", weights=lambda d: d[: len(d) // 2]), 400,
                      "adapter_model.safetensors"),
        "over_the_cap": (_copy_adapter(good, root / "big", config=lambda c: {**c, "pad": "x" * MAX_ADAPTER_BYTES}),
                         400, f"max_adapter_bytes={MAX_ADAPTER_BYTES}"),
        "outside_the_roots": (outside / "ad0", 400, "allowed_roots"),
        "path_traversal": (f"{root}/../../../../etc", 400, "allowed_roots"),
        "symlink_out_of_a_root": (link, 400, "allowed_roots"),
        "gs_outside_the_roots": ("gs://another-bucket/ad0", 400, "allowed_roots"),
        "not_there": (root / "nothing-here", 400, "no adapter files"),
        "bad_name": (good, 400, "adapter name="),
        "name_exists": (files["adapters"]["ad1"], 409, "registered already"),
    }


BAD_ADAPTERS = ["rank_over_max", "wrong_shapes", "nan_weights", "pickle_only", "unknown_module", "missing_weights",
                "truncated", "over_the_cap", "outside_the_roots", "path_traversal", "symlink_out_of_a_root",
                "gs_outside_the_roots", "not_there", "bad_name", "name_exists"]


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_each_bad_adapter_is_refused_naming_why_and_changes_nothing(app, files, reference, bad_adapters, case):
    source, status, says = bad_adapters[case]
    if _register(app, "canary", str(files["adapters"]["ad3"])).status_code not in (201, 409):
        pytest.fail("the canary adapter could not be registered")
    name = {"bad_name": "bad/name", "name_exists": "canary"}.get(case, f"bad-{case.replace('_', '-')}")
    before = httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()
    r = _register(app, name, str(source))
    error = r.json()["error"]
    assert r.status_code == status and says in error["message"], r.text
    assert error["type"] == ("conflict_error" if status == 409 else "invalid_request_error")
    assert httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json() == before
    client = _client(app)
    got = client.completions.create(model="canary", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[1], "ad3")


def test_unregister_stops_new_requests(app, files, reference):
    client = _client(app)
    assert _register(app, "temp", str(files["adapters"]["ad2"])).status_code == 201
    got = client.completions.create(model="temp", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[1], "ad2")
    r = httpx.delete(f"{app.base_url}/v1/adapters/temp", headers=AUTH)
    assert r.status_code == 200 and r.json()["name"] == "temp"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="temp", prompt=PROMPTS[1], max_tokens=2)
    assert httpx.delete(f"{app.base_url}/v1/adapters/temp", headers=AUTH).status_code == 404


def test_vllm_compatible_endpoints(app, files, reference):
    r = httpx.post(f"{app.base_url}/v1/load_lora_adapter", headers=AUTH,
                   json={"lora_name": "vl", "lora_path": str(files["adapters"]["ad3"])}, timeout=120)
    assert r.status_code == 200, r.text
    got = _client(app).completions.create(model="vl", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[2], "ad3")
    # Loaded already: refused as vLLM refuses it, unless in place.
    again = {"lora_name": "vl", "lora_path": str(files["adapters"]["ad5"])}
    r = httpx.post(f"{app.base_url}/v1/load_lora_adapter", headers=AUTH, json=again, timeout=120)
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{app.base_url}/v1/load_lora_adapter", headers=AUTH, json={**again, "load_inplace": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    got = _client(app).completions.create(model="vl", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[2], "ad5")
    r = httpx.post(f"{app.base_url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "vl"})
    assert r.status_code == 200
    assert "vl" not in [m["id"] for m in httpx.get(f"{app.base_url}/v1/models").json()["data"]]
    r = httpx.post(f"{app.base_url}/v1/load_lora_adapter", json={"lora_name": "vl", "lora_path": "x"})
    assert r.status_code == 401


def _engine_stats(app) -> dict:
    return httpx.get(f"{app.base_url}/health", timeout=30).json()["engine"]


def test_registry_change_reaches_the_replica_within_a_second(app, files):
    r = _register(app, "fresh", str(files["adapters"]["ad6"]))
    assert r.status_code == 201
    t0 = time.monotonic()
    while httpx.get(f"{app.base_url}/health", timeout=30).json()["registry_version"] < r.json()["version"]:
        assert time.monotonic() - t0 < 1.0, "replica did not see the registration within 1 s"
        time.sleep(0.05)
    assert httpx.delete(f"{app.base_url}/v1/adapters/fresh", headers=AUTH).status_code == 200


def test_32_concurrent_streams_over_8_adapters(app, files, reference):
    _ensure_adapters(app, files, list(files["adapters"]))
    before = _engine_stats(app)
    jobs = [(f"ad{i % N_ADAPTERS}", PROMPTS[i % len(PROMPTS)]) for i in range(32)]
    want = [reference(p, a) for a, p in jobs]
    client = openai.AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(adapter: str, prompt: str) -> str:
        stream = await client.completions.create(
            model=adapter, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of():
        return await asyncio.gather(*(one(a, p) for a, p in jobs))

    assert asyncio.run(all_of()) == want
    after = _engine_stats(app)
    # Requests for different adapters shared decode steps: more rows than steps.
    rows = after["decode_row_steps"] - before["decode_row_steps"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert rows > 2 * steps


def test_client_disconnect_aborts_the_sequence(app, files):
    """A client that leaves a stream after its first token ends its sequence in the engine
    (counted as aborted, not finished). The demo holds 64 tokens, so the 50-token sequence
    takes well under a second: on a loaded machine the disconnect can reach the engine after
    the sequence's natural end. Each try must end the sequence one way or the other, and
    one of five must be an abort."""
    def ended() -> tuple[int, int]:
        engine = httpx.get(f"{app.base_url}/health", timeout=30).json()["engine"]
        return engine["aborted"], engine["finished"]

    body = {"model": BASE, "prompt": "hello", "max_tokens": 50, "temperature": 0,
            "stream": True, "ignore_eos": True}
    tries = []
    for _ in range(5):
        before = ended()
        with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        deadline = time.monotonic() + 20
        while (now := ended()) == before and time.monotonic() < deadline:
            time.sleep(0.25)
        assert now != before, "the left stream's sequence never ended"
        tries.append((now[0] - before[0], now[1] - before[1]))
        if tries[-1][0]:
            break
    assert tries[-1] == (1, 0), tries


def test_clients_leaving_at_random_points_leave_nothing_behind(app, reference):
    """Concurrent clients over the base model and the demo adapters, streamed with one or two
    choices or not streamed, leave before their first token, after some, or mid-wait: once they
    are gone the engine runs nothing, every KV block is free again, the ingress logged no error,
    and greedy answers are unchanged."""
    import random

    rng = random.Random(5)
    models = [BASE, "reverse", "upper", "sort", "caesar"]

    def engine() -> dict:
        return httpx.get(f"{app.base_url}/health", timeout=30).json()["engine"]

    async def leave(client: httpx.AsyncClient, body: dict, after: int) -> int:
        """Sends `body` and leaves: after `after` data lines (streamed) or 50 ms (not streamed).
        Returns 1 for a stream left while none of its choices had ended."""
        if not body["stream"]:
            with contextlib.suppress(httpx.TimeoutException):
                await client.post("/v1/completions", json=body, timeout=0.05)
            return 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[len("data: "):])["choices"][0]["finish_reason"] is not None:
                        return 0
                    if seen == after:
                        return 1
                    seen += 1
        return 0

    async def storm() -> int:
        jobs = []
        async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
            for _ in range(32):
                body = {"model": rng.choice(models), "prompt": rng.choice(PROMPTS), "max_tokens": 40,
                        "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]), "n": rng.choice([1, 2]),
                        "stream": rng.random() < 0.75}
                jobs.append(leave(client, body, rng.choice([0, 1, 3])))
            return sum(await asyncio.gather(*jobs))

    logs = Path(app.temp_dir) / "session_latest" / "logs" / "serve"

    def ingress_logs() -> dict[Path, str]:
        return {f: f.read_text(errors="replace") for f in logs.glob(f"replica_{APP}_OpenAIIngress_*.log")}

    before, logged = engine(), ingress_logs()
    left = asyncio.run(storm())
    assert left >= 12  # most streams were left mid-answer
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = engine()
        if now["running"] == 0 and now["waiting"] == 0 and now["kv_blocks_free"] == now["kv_blocks"]:
            break
        time.sleep(0.25)
    assert (now["running"], now["waiting"]) == (0, 0)
    assert now["kv_blocks_free"] == now["kv_blocks"]  # cached prefixes count as free: evictable
    assert now["aborted"] - before["aborted"] >= left  # the sequences of each stream left were stopped
    # A client leaving is not a fault: no error (nor traceback) in the ingress's logs.
    added = "".join(text[len(logged.get(f, "")):] for f, text in ingress_logs().items())
    assert "its client left" in added
    assert not [line for line in added.splitlines() if line.startswith("ERROR")], added[-3000:]
    client = _client(app)
    for model in models:
        got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == reference(PROMPTS[0], None if model == BASE else model)


def test_gcs_adapter_source(app, files, reference):
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=app.gcs_emulator)
    src = files["adapters"]["ad5"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        fs.pipe_file(f"adapters/ad5/{name}", (src / name).read_bytes())
    r = _register(app, "from-gcs", "gs://adapters/ad5")
    assert r.status_code == 201, r.text
    got = _client(app).completions.create(model="from-gcs", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[3], "ad5")
    r = _register(app, "gcs-missing", "gs://adapters/nothing-here")
    assert r.status_code == 400


def test_a_body_over_max_request_bytes_is_a_413_and_serving_goes_on(app, reference):
    """Through Serve's proxy: a body over the cap (sent whole, or chunked with no length) is a
    413 in the OpenAI format naming the cap; the next request is served as before."""
    from deployments.config import AppArgs

    cap = AppArgs(**ARGS).max_request_bytes
    big = b'{"model": "reverse", "prompt": "' + b"a" * (cap + 10) + b'"}'

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    for content in (big, chunks()):
        r = httpx.post(f"{app.base_url}/v1/completions", content=content, timeout=120,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text[:200]
        assert f"max_request_bytes={cap}" in r.json()["error"]["message"]
    got = _client(app).completions.create(model="reverse", prompt="hello=", max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference("hello=", "reverse")


# --- faults: storage, the admin actor and a model-server replica failing under requests -----


def _put_gcs(app, local_dir: Path, prefix: str) -> str:
    """Copies an adapter into the emulated bucket (directly, not through the fault proxy)."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=app.gcs_emulator)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        fs.pipe_file(f"adapters/{prefix}/{f}", (local_dir / f).read_bytes())
    return f"gs://adapters/{prefix}"


def _ensure_adapters(app, files, names) -> None:
    """Registers each adapter of the test's files under its own name, unless a test before did."""
    for name in names:
        assert _register(app, name, str(files["adapters"][name])).status_code in (201, 409)


def _complete(app, model: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})


def test_storage_down_during_a_load_fails_that_adapters_requests_with_a_503_and_no_others(app, files, reference):
    """A registered adapter whose storage stops answering while a replica fetches it: its
    requests get a 503 naming it within adapter_load_timeout_s, the other adapters and the
    base model serve meanwhile, and it serves once the storage is back."""
    _ensure_adapters(app, files, ["ad0"])
    source = _put_gcs(app, files["outage"], "outage")
    assert _register(app, "from-storage", source).status_code == 201  # validated while storage is up
    app.storage.mode = "down"
    try:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            cold = pool.submit(_complete, app, "from-storage", PROMPTS[0])
            others = {m: pool.submit(_complete, app, m, PROMPTS[0]) for m in ("ad0", "reverse", BASE)}
            for model, future in others.items():
                r = future.result()
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference(PROMPTS[0], None if model == BASE else model)
            r = cold.result()
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "adapter_unavailable" and r.headers["Retry-After"]
        assert "'from-storage'" in error["message"] and source in error["message"]
        assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 30
    finally:
        app.storage.mode = "pass"
    deadline = time.monotonic() + 90  # the fetch under way retries; a new one starts once it gives up
    while (r := _complete(app, "from-storage", PROMPTS[0])).status_code == 503:
        assert time.monotonic() < deadline, r.text
        time.sleep(1.0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(PROMPTS[0], "outage")
    assert httpx.delete(f"{app.base_url}/v1/adapters/from-storage", headers=AUTH).status_code == 200


def test_the_admin_actor_killed_during_a_registration_leaves_the_registry_as_before(app, files, reference):
    """Killed while it reads the new adapter's files (its storage hanging): the caller gets a
    503 saying so, the registry is as it was, in memory and on disk, and the registration
    retried completes."""
    source = _put_gcs(app, files["outage"], "mid-registration")
    before = httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()
    on_disk = json.loads((files["root"] / "registry" / "registry.json").read_text())
    app.storage.mode = "stall"
    try:
        connections = app.storage.connections
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_register, app, "mid", source)
            deadline = time.monotonic() + 60
            while app.storage.connections == connections:  # the admin actor is reading the files
                assert time.monotonic() < deadline and not pending.done(), "the registration never read its files"
                time.sleep(0.05)
            kill_actor(app, "lora_admin", "multilora", no_restart=False)
            r = pending.result()
    finally:
        app.storage.mode = "pass"
    assert r.status_code == 503 and r.json()["error"]["code"] == "admin_unavailable", r.text
    deadline = time.monotonic() + 60
    while True:
        listed = httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60)
        if listed.status_code == 200:
            break
        assert time.monotonic() < deadline, "the admin actor did not come back"
        time.sleep(0.5)
    assert listed.json() == before
    assert json.loads((files["root"] / "registry" / "registry.json").read_text()) == on_disk
    assert _register(app, "mid", source).status_code == 201
    assert _complete(app, "mid", PROMPTS[2]).json()["choices"][0]["text"] == reference(PROMPTS[2], "outage")
    assert httpx.delete(f"{app.base_url}/v1/adapters/mid", headers=AUTH).status_code == 200


LONG_TOKENS = 40  # a stream long enough to be cut: ignore_eos keeps it going past the reference's end


def _stream_outcome(app, model: str, prompt: str, streaming: threading.Event | None = None) -> tuple[str, str]:
    """One streamed completion: ("ok", text), ("cut", code) for an error event after the
    stream began, ("refused", code) for a 503, or ("bad", why) for anything else. `streaming`
    is set while it has tokens and is not done."""
    body = {"model": model, "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                code = r.json().get("error", {}).get("code")
                return ("refused", code) if r.status_code == 503 else ("bad", f"{r.status_code} {r.text[:200]}")
            text, finished = "", False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return ("ok", text) if finished else ("bad", "[DONE] before the last choice finished")
                event = json.loads(line[6:])
                if "error" in event:
                    return "cut", event["error"].get("code")
                text += event["choices"][0]["text"]
                finished = finished or event["choices"][0]["finish_reason"] is not None
                if streaming is not None and text and not finished:
                    streaming.set()
                elif streaming is not None:
                    streaming.clear()
            return "bad", "the stream ended without [DONE] or an error"
    except httpx.HTTPError as e:
        return "bad", repr(e)
    finally:
        if streaming is not None:
            streaming.clear()


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_and_serve_replaces_it(app, files, reference):
    """Streams run back to back while the model-server replica is killed in the middle of
    them: each one ends as its known output or as a clean error (an SSE error event, or a
    503 while no replica is up), never silently; Serve starts another replica and requests
    succeed again."""
    jobs = [(f"ad{i}", PROMPTS[i % len(PROMPTS)]) for i in range(4)]
    _ensure_adapters(app, files, [model for model, _ in jobs])
    stop = threading.Event()
    streaming = [threading.Event() for _ in jobs]
    outcomes: list[tuple[str, str, str]] = []

    def client(i: int, model: str, prompt: str) -> None:
        while not stop.is_set():
            kind, what = _stream_outcome(app, model, prompt, streaming[i])
            outcomes.append((kind, what, model))
            # Greedy past the reference's end (ignore_eos): the reference is where it starts.
            if kind == "ok" and not what.startswith(reference(prompt, model)):
                outcomes.append(("bad", f"{model} answered {what!r}", model))
            if kind != "ok":
                time.sleep(0.2)

    killer = ReplicaKiller(app, APP)
    threads = [threading.Thread(target=client, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while not all(s.is_set() for s in streaming):  # every client mid-stream
            assert time.monotonic() < deadline, outcomes[-10:]
            time.sleep(0.005)
        killed_after = len(outcomes)
        killer.kill()
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    bad = [o for o in outcomes if o[0] == "bad"]
    failed = [o for o in outcomes[killed_after:] if o[0] in ("cut", "refused")]
    assert not bad, bad[:5]
    assert failed, outcomes[killed_after:][:10]
    assert {code for _, code, _ in failed} <= {"replica_failed", "unavailable", "overloaded"}, failed
    deadline = time.monotonic() + 180
    while (kind := _stream_outcome(app, "ad1", PROMPTS[1]))[0] != "ok":
        assert kind[0] != "bad" and time.monotonic() < deadline, kind
        time.sleep(1.0)
    assert kind[1].startswith(reference(PROMPTS[1], "ad1"))


@pytest.fixture(scope="session")
def api_schema(app):
    """The OpenAPI schema the deployment serves, as schemathesis reads it."""
    import schemathesis

    return schemathesis.openapi.from_url(f"{app.base_url}/openapi.json")


def _conformance_test():
    import hypothesis
    import schemathesis
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    @schemathesis.pytest.from_fixture("api_schema").parametrize()
    @hypothesis.settings(max_examples=SCHEMA_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def test_every_operation_answers_as_its_openapi_schema_says(case):
        """Generated requests for every operation (a bounded, fixed set): no 5xx, and every
        status, content type, header and body is one the schema documents. Not checked: that
        every schema-valid request is accepted, which no JSON schema can promise here (a prompt's
        length in tokens, token ids against the vocabulary and names of registered adapters are
        known only at run time)."""
        case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)

    return test_every_operation_answers_as_its_openapi_schema_says


SCHEMA_EXAMPLES = 12
test_every_operation_answers_as_its_openapi_schema_says = _conformance_test()


def test_a_redeploy_naming_another_registry_is_refused_and_the_app_serves_on(app, files, reference):
    """The admin actor of this deployment owns its registry: a redeploy giving it another
    registry_url fails when the app is built, naming both, and the running app is untouched."""
    path = _write_config(app, files, keys=DEPLOYED.get("keys"))
    config = yaml.safe_load(path.read_text())
    config["applications"][0]["args"]["registry_url"] = str(files["root"] / "elsewhere" / "registry.json")
    other = files["root"] / "other_registry.yaml"
    other.write_text(yaml.safe_dump(config))
    app.cli("serve", "deploy", str(other), "-a", app.dashboard_url)
    deadline = time.monotonic() + 120
    while True:
        status = app.serve_status()["applications"][APP]
        if status["status"] == "DEPLOY_FAILED":
            break
        assert time.monotonic() < deadline, status
        time.sleep(1.0)
    assert "owns the registry at" in status["message"] and "admin_actor_name" in status["message"], status
    assert "elsewhere" in status["message"]
    got = httpx.post(f"{app.base_url}/v1/completions", timeout=120, headers=_keyed_headers(),
                     json={"model": BASE, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == reference(PROMPTS[0], None), got.text
    _deploy(app, files, keys=DEPLOYED.get("keys"))  # the same config as before: RUNNING again


def _keyed_headers() -> dict:
    """A key that reaches the base model, when the running deployment has API keys on."""
    return {} if DEPLOYED.get("keys") is None else {"Authorization": f"Bearer {TENANT_A}"}


def test_registry_survives_admin_restart_and_redeploy(app, files, reference):
    names = {"keep-a", "keep-b"}
    assert _register(app, "keep-a", str(files["adapters"]["ad0"])).status_code == 201
    assert _register(app, "keep-b", str(files["adapters"]["ad4"]), pinned=True).status_code == 201
    # Rank 32: within this deployment's limit (64), past the redeployed one's (tenant a's to use).
    assert _register(app, "ta-wide", str(files["wide"])).status_code == 201
    listed = lambda: {a["name"] for a in httpx.get(f"{app.base_url}/v1/adapters", headers=AUTH, timeout=60).json()["data"]}  # noqa: E731
    assert names <= listed()
    kill_actor(app, "lora_admin", "multilora", no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if names <= listed():
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, "admin actor did not come back with its registry"
        time.sleep(0.5)
    # Full redeploy with a fresh admin actor, and API keys turned on: everything comes back
    # from the store.
    before = listed()
    app.cli("serve", "shutdown", "-y", "-a", app.dashboard_url)
    kill_actor(app, "lora_admin", "multilora", no_restart=True)
    _deploy(app, files, keys=_write_keys(files))
    assert listed() == before
    got = _client(app, TENANT_A).completions.create(model="keep-a", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                    temperature=0)
    assert got.choices[0].text == reference(PROMPTS[0], "ad0")
    # The redeploy's validation limits are in force: the rank limit fell from 64 to 16.
    r = _register(app, "wide-again", str(files["wide"]))
    assert r.status_code == 400 and f"max_lora_rank={KEYED_MAX_LORA_RANK}" in r.json()["error"]["message"], r.text
    # The adapter registered under the old limit is listed still, and refused naming the new one.
    r = httpx.post(f"{app.base_url}/v1/completions", headers={"Authorization": f"Bearer {TENANT_A}"}, timeout=120,
                   json={"model": "ta-wide", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 503 and f"max_lora_rank={KEYED_MAX_LORA_RANK}" in r.json()["error"]["message"], r.text
    assert httpx.delete(f"{app.base_url}/v1/adapters/ta-wide", headers=AUTH, timeout=60).status_code in (200, 204)


# --- scoped API keys: two tenants, each with its own adapters ----------------------------

TENANT_A, TENANT_B, ADMIN_A, LIMITED = "mlk-tenant-a", "mlk-tenant-b", "mlk-admin-a", "mlk-limited"
LIMITED_RPM = 3


def _keys_doc(*, with_b: bool = True) -> dict:
    from cluster.api_keys import digest

    keys = [
        {"name": "tenant-a", "sha256": digest(TENANT_A), "adapters": ["ta-*", "keep-a"], "base_model": True},
        {"name": "admin-a", "sha256": digest(ADMIN_A), "role": "admin", "adapters": ["ta-*"]},
        {"name": "limited", "sha256": digest(LIMITED), "base_model": True, "requests_per_minute": LIMITED_RPM},
    ]
    if with_b:
        keys.insert(1, {"name": "tenant-b", "sha256": digest(TENANT_B), "adapters": ["tb-*"]})
    return {"keys": keys}


def _write_keys(files, **kw) -> Path:
    path = files["root"] / "api_keys.json"
    path.write_text(json.dumps(_keys_doc(**kw)))
    return path


@pytest.fixture
def tenants(app, files):
    """The app with API keys on and a small request queue (the redeploy test turns them on;
    run alone, this does), and one adapter per tenant."""
    if DEPLOYED.get("keys") is None:
        _deploy(app, files, keys=_write_keys(files))
    for name, adapter in (("ta-one", "ad1"), ("tb-one", "ad2"), ("keep-a", "ad0")):
        r = _register(app, name, str(files["adapters"][adapter]))
        assert r.status_code in (201, 409), r.text
    return app


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_sees_and_calls_only_its_own_models(tenants, reference):
    url = tenants.base_url
    a, b = _client(tenants, TENANT_A), _client(tenants, TENANT_B)
    ids_a = {m.id for m in a.models.list().data}
    assert BASE in ids_a and {"ta-one", "keep-a"} <= ids_a
    assert not ids_a & {"tb-one", "reverse", "ad0"}, ids_a  # other tenants' and unscoped adapters
    assert {m.id for m in b.models.list().data} == {"tb-one"}  # no base model for tenant B

    got = a.completions.create(model="ta-one", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[1], "ad1")
    streamed = "".join(c.choices[0].text for c in a.completions.create(
        model=BASE, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert streamed == reference(PROMPTS[0], None)
    got = b.chat.completions.create(model="tb-one", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert got.choices[0].message.content is not None

    # Another tenant's adapter, an unscoped one and the base model without base_model: the
    # same 404 as a name that does not exist, on every endpoint that takes a model.
    def not_found(key: str, model: str) -> list[str]:
        calls = [
            ("post", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}),
            ("post", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}]}),
            ("post", "/tokenize", {"model": model, "prompt": "x"}),
            ("post", "/detokenize", {"model": model, "tokens": [1]}),
            ("get", f"/v1/models/{model}", None),
        ]
        messages = []
        for method, path, body in calls:
            r = httpx.request(method, url + path, json=body, headers=_bearer(key), timeout=60)
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
            messages.append(r.json()["error"]["message"].replace(repr(model), "M", 1))
        return messages

    nowhere = not_found(TENANT_A, "no-such-adapter")
    assert not_found(TENANT_A, "tb-one") == nowhere
    assert not_found(TENANT_A, "reverse") == nowhere
    assert not_found(TENANT_B, "ta-one") == not_found(TENANT_B, BASE) == nowhere


def test_inference_needs_a_valid_inference_key(tenants):
    url = tenants.base_url
    body = {"model": BASE, "prompt": "x", "max_tokens": 1}
    for headers in ({}, _bearer("mlk-made-up"), {"Authorization": "Basic abc"}, AUTH):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert "mlk-made-up" not in r.text
    r = httpx.get(f"{url}/v1/models", headers=_bearer(ADMIN_A), timeout=60)
    assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # probes need no key


def test_an_admin_key_manages_only_its_scope(tenants, files, reference):
    url, admin = tenants.base_url, _bearer(ADMIN_A)
    src = str(files["adapters"]["ad3"])
    r = httpx.post(f"{url}/v1/adapters", json={"name": "ta-two", "source": src}, headers=admin, timeout=120)
    assert r.status_code == 201, r.text
    got = _client(tenants, TENANT_A).completions.create(model="ta-two", prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                                        temperature=0)
    assert got.choices[0].text == reference(PROMPTS[2], "ad3")
    assert {a["name"] for a in httpx.get(f"{url}/v1/adapters", headers=admin, timeout=60).json()["data"]} == {
        "ta-one", "ta-two"}
    before = httpx.get(f"{url}/v1/adapters", headers=AUTH, timeout=60).json()
    refused = [
        ("post", "/v1/adapters", {"name": "tb-two", "source": src}),
        ("post", "/v1/adapters", {"name": "reverse", "source": src}),  # exists, outside the scope
        ("delete", "/v1/adapters/tb-one", None),
        ("patch", "/v1/adapters/tb-one", {"pinned": True}),
        ("delete", "/v1/adapters/nothing-here", None),
        ("post", "/v1/load_lora_adapter", {"lora_name": "tb-x", "lora_path": src}),
        ("post", "/v1/unload_lora_adapter", {"lora_name": "tb-one"}),
    ]
    for method, path, body in refused:
        r = httpx.request(method, url + path, json=body, headers=admin, timeout=60)
        assert r.status_code == 403 and "scope: ta-*" in r.json()["error"]["message"], (path, r.text)
    for key in (TENANT_A, "mlk-made-up"):  # an inference key, a made-up one
        r = httpx.get(f"{url}/v1/adapters", headers=_bearer(key), timeout=60)
        assert r.status_code in (401, 403), r.text
    assert httpx.get(f"{url}/v1/adapters", headers=AUTH, timeout=60).json() == before  # nothing changed
    r = httpx.patch(f"{url}/v1/adapters/ta-two", json={"pinned": True}, headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["pinned"] is True
    assert httpx.delete(f"{url}/v1/adapters/ta-two", headers=admin, timeout=60).status_code == 200


def _key_usage(url: str, key: str) -> dict[str, float]:
    """An API key's usage as /metrics shows it: requests by outcome, and tokens."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    usage = {o: float(n) for o, n in re.findall(
        r'^multilora_api_key_requests_total\{key="%s",outcome="([a-z_]+)"\} (\S+)' % re.escape(key), text, re.M)}
    tokens = re.findall(r'^multilora_api_key_tokens_total\{key="%s"\} (\S+)' % re.escape(key), text, re.M)
    return {**usage, "tokens": float(tokens[0]) if tokens else 0.0}


def test_a_key_over_its_request_rate_gets_a_429_with_retry_after(tenants):
    before = _key_usage(tenants.base_url, "limited")
    client = _client(tenants, LIMITED)
    for _ in range(LIMITED_RPM):
        client.completions.create(model=BASE, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=BASE, prompt="x", max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded" and "3 requests per minute" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["Retry-After"]) <= 60 // LIMITED_RPM
    # The ingress replicas share the key's bucket: more requests are refused whichever replica
    # they reach (with a bucket per replica, some would pass on the one that took fewer).
    for _ in range(2 * LIMITED_RPM):
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=BASE, prompt="x", max_tokens=1)
    # The key's usage, counted once for the endpoint: its requests by outcome, and the tokens
    # of the answered ones (a prompt of at least 1 token and 1 new token each).
    after = _key_usage(tenants.base_url, "limited")
    assert after.get("admitted", 0) - before.get("admitted", 0) == LIMITED_RPM, (before, after)
    assert after["rate_limited"] - before.get("rate_limited", 0) == 1 + 2 * LIMITED_RPM, (before, after)
    assert after["tokens"] - before["tokens"] >= 2 * LIMITED_RPM, (before, after)
    # Other keys are not affected.
    _client(tenants, TENANT_A).completions.create(model=BASE, prompt="x", max_tokens=1)


def test_the_ingress_replicas_share_the_load_and_read_the_same_metrics(tenants):
    """The keyed deployment's two ingress replicas: Serve's proxy spreads requests over both
    (each counts what it admitted), and /metrics, read through either, shows both."""
    url = tenants.base_url
    before = ingress_admitted(url)
    client = _client(tenants, TENANT_A)
    sent = 20
    for _ in range(sent):
        client.models.list()
    deadline = time.monotonic() + 15  # each replica reports its counts every 2 s
    while True:
        after = ingress_admitted(url)
        spread = {i: n - before.get(i, 0.0) for i, n in after.items()}
        if sum(spread.values()) >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(spread) == KEYED_INGRESS_REPLICAS and sum(spread.values()) >= sent, spread
    assert all(n > 0 for n in spread.values()), spread  # 2 in 2**20 that one takes all
    # Every scrape, whichever replica answers it, lists both, and no count goes back.
    for _ in range(6):
        again = ingress_admitted(url)
        assert set(again) == set(after) and all(again[i] >= after[i] for i in after), (after, again)
        after = again


def test_a_lost_ledger_loses_no_request_and_the_replicas_share_a_new_one(tenants):
    """The ledger's replica dies (its ledger actor with it): every request is still answered,
    from each ingress replica's own buckets, until Serve has started another; then both
    replicas count on the new one again (a key's usage, read through either, is all of it)."""
    url = tenants.base_url
    client = _client(tenants, TENANT_A)
    ReplicaKiller(tenants, APP, "IngressLedger").kill()
    for _ in range(6):
        client.models.list()  # answered: openai raises on any error
    deadline = time.monotonic() + 120
    while True:
        before = _key_usage(url, "tenant-a").get("admitted", 0.0)
        for _ in range(10):
            client.models.list()
        seen = _key_usage(url, "tenant-a").get("admitted", 0.0) - before
        if seen == 10:  # each replica's own ledger would count only the requests it took
            break
        assert time.monotonic() < deadline, f"the ingress replicas share no ledger again: {seen} of 10 counted"
        time.sleep(1.0)


def test_a_key_removed_from_the_file_is_refused_within_the_refresh(tenants, files):
    client = _client(tenants, TENANT_B)
    client.completions.create(model="tb-one", prompt="x", max_tokens=1)
    _write_keys(files, with_b=False)
    try:
        deadline = time.monotonic() + 10 * KEYS_REFRESH_S
        while True:
            try:
                client.completions.create(model="tb-one", prompt="x", max_tokens=1)
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "a revoked key still works"
            time.sleep(0.2)
        (files["root"] / "api_keys.json").write_text("{broken")  # a bad file keeps the keys in force
        time.sleep(3 * KEYS_REFRESH_S)
        _client(tenants, TENANT_A).completions.create(model=BASE, prompt="x", max_tokens=1)
    finally:
        _write_keys(files)


def test_stream_interval_spaces_the_chunks_and_loses_no_token(tenants, reference):
    """The keyed deployment's stream_interval: the first chunk is not held, then chunks of at
    least KEYED_STREAM_INTERVAL tokens until the last; together the whole greedy output."""
    stream = _client(tenants, TENANT_A).completions.create(
        model=BASE, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=1,
        stream_options={"include_usage": True})
    chunks, usage = [], None
    for c in stream:
        if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.tokens:
            chunks.append((c.choices[0].text, len(c.choices[0].logprobs.tokens)))
        usage = c.usage or usage
    assert "".join(text for text, _ in chunks) == reference(PROMPTS[2], None)
    counts = [n for _, n in chunks]
    # The first chunk is not held for the interval (1 token, unless the reader fell behind on
    # busy cores and the tokens that came meanwhile were merged into it).
    assert counts[0] < KEYED_STREAM_INTERVAL and all(n >= KEYED_STREAM_INTERVAL for n in counts[1:-1]), counts
    assert sum(counts) == usage.completion_tokens and len(counts) < usage.completion_tokens, (counts, usage)



    """More concurrent streams than the replica takes plus the queue holds: each is either
    served in full (its known output) or refused at once with a 503 and Retry-After, in the
    OpenAI format; then the server serves on."""
    url = tenants.base_url

    async def one(i: int) -> tuple[int, str, dict]:
        body = {"model": BASE, "prompt": PROMPTS[i % 4], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=_bearer(TENANT_A)) as r:
                raw = (await r.aread()).decode()
                return r.status_code, raw, dict(r.headers)

    async def all_of():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(all_of())
    served = refused = 0
    for i, (status, raw, headers) in enumerate(results):
        if status == 200:
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            assert raw.rstrip().endswith("data: [DONE]") and all("error" not in e for e in events), raw[-300:]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            assert text == reference(PROMPTS[i % 4], None)
            served += 1
        else:
            assert raw.startswith("{"), (status, headers, raw[:300])
            error = json.loads(raw)["error"]
            assert status == 503 and error["code"] == "overloaded" and headers["retry-after"] == "1", raw
            refused += 1
    assert served >= TIGHT_ONGOING and refused > 0, (served, refused)
    got = _client(tenants, TENANT_A).completions.create(model=BASE, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                        temperature=0)
    assert got.choices[0].text == reference(PROMPTS[1], None)

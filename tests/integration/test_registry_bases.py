"""Two deployments of different base models over one adapter registry (the demo model and a
tiny random Llama): each lists and serves only the adapters validated against its own base
model, says at start what it skipped, and a name the other holds is refused with the reason.

The demo deployment runs two replicas of tensor_parallel_size 2, each on host devices of its
own (deployments/placement.py), and serves exactly what one process on one device does. The
tiny one runs two model servers behind two to three ingress replicas (Serve autoscales them):
a conversation's turns find their model server through either, and a third one starts under
load and goes again without losing a request."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from cluster.admin import ADMIN_NAMESPACE, demo_adapter_sources
from tests.helpers.checkpoints import save_tiny_llama
from tests.integration.adapters import save_peft_adapter
from tests.integration.conftest import ADMIN_TOKEN, REPO, ingress_admitted, kill_actor

pytestmark = pytest.mark.integration

ADMIN_ACTOR = "lora_admin_bases"  # its own registry, apart from the other integration tests
DEMO_APP, TINY_APP = "demo-base", "tiny-base"
DEMO, TINY = "/demo", "/tiny"  # route prefixes
DEMO_ADAPTERS = {"reverse", "upper", "sort", "caesar"}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# One prefill bucket (longer prompts prefill in chunks): these replicas' programs are their own
# (2 devices), so fewer of them is a shorter start. The one-device engine the test compares them
# with has the shipped config's programs, which the other integration apps compiled before.
TENSOR_PARALLEL = dict(num_replicas=2, tensor_parallel_size=2, accelerator="cpu", replica_num_cpus=0.5,
                       max_prefill_tokens=16)
# The tiny app: two model servers behind two or three ingress replicas (prefix affinity across
# them), scaled by the requests each holds: quickly, to see it within a test.
TINY_INGRESS = dict(min_replicas=2, max_replicas=3, target_ongoing_requests=4, metrics_interval_s=0.5,
                    look_back_period_s=2.0, upscale_delay_s=0.0, downscale_delay_s=3.0)
# Prompts with tools run past its 64-token prefill steps: they prefill in chunks.
TINY_REPLICAS = dict(num_replicas=2, ingress_autoscaling=TINY_INGRESS, replica_num_cpus=0.5, max_prefill_tokens=64)
# The tiny Llama speaks Qwen2.5's chat format, tools included (a shortened copy of its template).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nCall a function inside <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry_bases")
    tiny = save_tiny_llama(root / "tiny", max_position_embeddings=1024)  # room for the tools in its prompts
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    (tiny / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return {"root": root, "tiny": tiny, "tiny_adapter": save_peft_adapter(tiny, root / "tiny-ad", seed=5)}


def _deploy(cluster, path: Path, apps: list[dict]) -> None:
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    config["applications"] = apps
    path.write_text(yaml.safe_dump(config))
    cluster.cli("serve", "deploy", str(path), "-a", cluster.dashboard_url)
    cluster.wait_running(*(a["name"] for a in apps))


@pytest.fixture(scope="module")
def bases(cluster, files):
    """The shipped config's application twice, one registry: the demo model at /demo, the
    tiny Llama (served as 'tiny') at /tiny."""
    [template] = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    shared = dict(registry_url=str(files["root"] / "registry.json"), admin_actor_name=ADMIN_ACTOR,
                  drain_timeout_s=1.0)
    demo = {**template, "name": DEMO_APP, "route_prefix": DEMO,
            "args": {**template["args"], **shared, **TENSOR_PARALLEL}}
    tiny = {**template, "name": TINY_APP, "route_prefix": TINY,
            "args": {**template["args"], **shared, "model": str(files["tiny"]), "model_name": "tiny",
                     "max_seq_len": 1024, **TINY_REPLICAS}}
    # The demo app first: the tiny app then starts over a registry holding the demo adapters.
    _deploy(cluster, files["root"] / "demo.yaml", [demo])
    _deploy(cluster, files["root"] / "both.yaml", [demo, tiny])
    r = httpx.post(f"{cluster.base_url}{TINY}/v1/adapters", headers=AUTH, timeout=120,
                   json={"name": "tiny-ad", "source": str(files["tiny_adapter"])})
    assert r.status_code == 201, r.text
    yield cluster
    cluster.cli("serve", "shutdown", "-y", "-a", cluster.dashboard_url)
    kill_actor(cluster, ADMIN_ACTOR, ADMIN_NAMESPACE, no_restart=True)


def _models(cluster, prefix: str) -> set[str]:
    r = httpx.get(f"{cluster.base_url}{prefix}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def _admin_list(cluster, prefix: str) -> dict[str, dict]:
    r = httpx.get(f"{cluster.base_url}{prefix}/v1/adapters", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["data"]}


def _complete(cluster, prefix: str, model: str) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}{prefix}/v1/completions", timeout=120,
                      json={"model": model, "prompt": "hello=", "max_tokens": 8, "temperature": 0})


def test_each_deployment_lists_and_serves_only_its_own_base_models_adapters(bases):
    assert _models(bases, DEMO) == {"demo"} | DEMO_ADAPTERS
    assert _models(bases, TINY) == {"tiny", "tiny-ad"}
    demo_entries, tiny_entries = _admin_list(bases, DEMO), _admin_list(bases, TINY)
    assert set(demo_entries) == DEMO_ADAPTERS and set(tiny_entries) == {"tiny-ad"}
    # Each entry records the base model it was validated against.
    assert {e["base_model"] for e in demo_entries.values()} == {"demo"}
    assert tiny_entries["tiny-ad"]["base_model"] == "tiny"
    demo_fingerprints = {e["base_fingerprint"] for e in demo_entries.values()}
    assert len(demo_fingerprints) == 1 and tiny_entries["tiny-ad"]["base_fingerprint"] not in demo_fingerprints

    assert _complete(bases, TINY, "tiny-ad").status_code == 200
    r = _complete(bases, DEMO, "reverse")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "olleh", r.text
    # Another base model's adapter is unknown here: a 404 naming it, not a shape error.
    for prefix, model in ((DEMO, "tiny-ad"), (TINY, "reverse")):
        r = _complete(bases, prefix, model)
        assert r.status_code == 404 and repr(model) in r.json()["error"]["message"], r.text


def test_a_name_registered_for_another_base_model_is_refused_with_the_reason(bases, files):
    before = _admin_list(bases, DEMO)
    attempts = [
        ("POST", f"{TINY}/v1/adapters", {"name": "reverse", "source": str(files["tiny_adapter"])}),
        ("POST", f"{TINY}/v1/load_lora_adapter", {"lora_name": "reverse", "lora_path": str(files["tiny_adapter"])}),
        ("DELETE", f"{TINY}/v1/adapters/reverse", None),
        ("PATCH", f"{TINY}/v1/adapters/reverse", {"pinned": True}),
    ]
    for method, path, body in attempts:
        r = httpx.request(method, f"{bases.base_url}{path}", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 409, (method, path, r.text)
        error = r.json()["error"]
        assert error["type"] == "conflict_error", error
        assert "adapter 'reverse' is registered for base model 'demo'" in error["message"], error
        assert "'tiny'" in error["message"], error
    assert _admin_list(bases, DEMO) == before  # untouched
    assert _complete(bases, DEMO, "reverse").json()["choices"][0]["text"] == "olleh"

    r = httpx.post(f"{bases.base_url}{DEMO}/v1/adapters", headers=AUTH, timeout=120,
                   json={"name": "tiny-ad", "source": demo_adapter_sources()["upper"]})
    assert r.status_code == 409 and "base model 'tiny'" in r.json()["error"]["message"], r.text
    assert _models(bases, TINY) == {"tiny", "tiny-ad"}


def test_each_deployment_says_at_start_what_it_skipped(bases):
    logs = Path(bases.temp_dir) / "session_latest" / "logs" / "serve"
    tiny_logs = "".join(f.read_text(errors="replace") for f in logs.glob(f"replica_{TINY_APP}_OpenAIIngress_*.log"))
    assert "serving 0 adapters of base model 'tiny'" in tiny_logs, tiny_logs[-2000:]
    assert "skipped 4: 4 validated against other base models (4 of 'demo' (" in tiny_logs, tiny_logs[-2000:]
    demo_logs = "".join(f.read_text(errors="replace") for f in logs.glob(f"replica_{DEMO_APP}_OpenAIIngress_*.log"))
    assert "serving 4 adapters of base model 'demo'" in demo_logs and "none skipped" in demo_logs, demo_logs[-2000:]


def test_an_admin_actor_serves_one_registry(bases):
    """A deployment naming this registry's admin actor with another registry is refused."""
    code = (
        "import asyncio, ray\n"
        "from cluster.admin import connect_admin\n"
        f"ray.init(address={bases.gcs_address!r}, log_to_driver=False)\n"
        "try:\n"
        f"    asyncio.run(connect_admin({ADMIN_ACTOR!r}, '/elsewhere/registry.json'))\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    out = bases.cli(sys.executable, "-c", code).stdout
    assert f"refused: admin actor {ADMIN_ACTOR!r} owns the registry at" in out, out
    assert "'/elsewhere/registry.json'" in out and "admin_actor_name" in out, out


def test_two_tensor_parallel_replicas_serve_what_one_device_serves(bases):
    """Each demo replica shards the model over two host devices of its own; completions of the
    base model and of every demo adapter equal those of one process on one device."""
    from cluster.admin import resolve_model_path, sync_entries
    from deployments.config import AppArgs
    from lora_runtime.engine.engine import Engine
    from lora_runtime.engine.sampling import SamplingParams

    seen = {tuple(httpx.get(f"{bases.base_url}{DEMO}/health", timeout=30).json()["engine"]["devices"])
            for _ in range(6)}
    assert all(len(devices) == 2 and all(d.startswith("cpu:") for d in devices) for devices in seen), seen
    [template] = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    engine = Engine.from_pretrained(resolve_model_path("demo"), AppArgs(**template["args"]).engine_config(),
                                    model_name="demo").start()
    try:
        entries = {n: {"source": p, "version": 1, "pinned": False} for n, p in demo_adapter_sources().items()}
        engine.lora_manager.sync(sync_entries(entries))
        params = SamplingParams(max_tokens=8, temperature=0.0)
        for prompt in ("hello=", "serving=", "tensor="):
            for model in sorted(DEMO_ADAPTERS) + ["demo"]:
                [want] = engine.generate_batch([prompt], params, [None if model == "demo" else model])
                r = httpx.post(f"{bases.base_url}{DEMO}/v1/completions", timeout=120,
                               json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text, (model, prompt, r.text)
    finally:
        engine.shutdown()


TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
    "required": ["c", "n"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ok", "parameters": {
        "type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
        "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"p": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
                                           "q": {"type": "integer", "minimum": -9, "maximum": 9}},
          "required": ["p", "q"], "additionalProperties": False}


def test_a_qwen_format_model_serves_schemas_and_tool_calls_to_the_openai_client(bases):
    """A random-weight Llama with Qwen2.5's chat template (hermes tool calls), base and
    adapter, greedy and sampled: json_schema outputs validate; tool_choice required and a
    named function give calls whose arguments validate, whole and streamed; a tool's result
    goes back through the template."""
    client = openai.OpenAI(base_url=f"{bases.base_url}{TINY}/v1", api_key="unused", max_retries=0, timeout=120)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [{"role": "user", "content": "pick one"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    for model in ("tiny", "tiny-ad"):
        for temperature in (0.0, 1.0):
            got = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                 temperature=temperature, seed=1, max_tokens=64)
            assert got.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
            for choice in ("required", {"type": "function", "function": {"name": "ok"}}):
                got = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                                     temperature=temperature, seed=2, max_tokens=64,
                                                     parallel_tool_calls=False)
                [call] = got.choices[0].message.tool_calls
                assert got.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
                assert choice == "required" or call.function.name == "ok"
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                                max_tokens=64, temperature=0, stream=True, parallel_tool_calls=False)
        parts = {"name": "", "arguments": "", "finish": None}
        for chunk in stream:
            c = chunk.choices[0]
            parts["finish"] = c.finish_reason or parts["finish"]
            for delta in c.delta.tool_calls or ():
                parts["name"] += delta.function.name or ""
                parts["arguments"] += delta.function.arguments or ""
        assert parts["finish"] == "tool_calls"
        jsonschema.validate(json.loads(parts["arguments"]), params[parts["name"]])
    # The call and its result back in the conversation: the template renders both.
    followup = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "ok", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    r = httpx.post(f"{bases.base_url}{TINY}/tokenize", timeout=60, json={"model": "tiny", "messages": followup, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = httpx.post(f"{bases.base_url}{TINY}/detokenize", timeout=60,
                      json={"model": "tiny", "tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<tool_call>\n{\"name\": \"ok\"" in text and "<tool_response>\ndone\n</tool_response>" in text
    assert '<tools>{"type": "function", "function": {"name": "pick"' in text  # trim_blocks, as transformers
    got = client.chat.completions.create(model="tiny", messages=followup, tools=TOOLS, max_tokens=8, temperature=0)
    assert got.choices[0].message.content is not None or got.choices[0].message.tool_calls


def test_a_conversations_next_turn_finds_its_replica_through_either_ingress_replica(bases):
    """The tiny app's two ingress replicas share where their routers sent which prompts (the
    ingress ledger): each conversation's second turn, whichever ingress replica takes it,
    goes to the model server that served its first and finds its start cached."""
    url = f"{bases.base_url}{TINY}/v1/completions"
    # Distinct from the first character on: no conversation shares a cached block with another.
    firsts = [f"{c} says: the quick brown fox jumps over the lazy dog, " * 2 for c in "abcdefgh"]

    def complete(prompt: str) -> int:
        r = httpx.post(url, timeout=120, json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    # At once, so the first turns spread over both model servers (each the least loaded).
    with concurrent.futures.ThreadPoolExecutor(len(firsts)) as pool:
        assert list(pool.map(complete, firsts)) == [0] * len(firsts)
    time.sleep(2.0)  # the ingress replicas exchange their routers' records twice a second
    # One at a time: no load bound sends a turn elsewhere.
    cached = [complete(first + "and then what did the dog do next?") for first in firsts]
    assert all(n > 0 for n in cached), cached


def _running_ingress_replicas(cluster) -> int:
    deployment = cluster.serve_status()["applications"][TINY_APP]["deployments"]["OpenAIIngress"]
    return deployment.get("replica_states", {}).get("RUNNING", 0)


def _wait_ingress_replicas(cluster, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (running := _running_ingress_replicas(cluster)) != n:
        assert time.monotonic() < deadline, f"{running} ingress replicas RUNNING after {timeout}s, not {n}"
        time.sleep(1.0)


def test_the_ingress_scales_out_under_load_and_back_without_losing_a_request(bases):
    """ingress_autoscaling: requests held by the tiny app's two ingress replicas past its
    target start a third, which takes requests and shares the ledger (its admitted count is
    on /metrics, read through any of them); with the load gone it stops again. No request
    fails on the way out or back."""
    url = f"{bases.base_url}{TINY}"
    statuses: list[int] = []
    n = 24  # 12 ongoing at each of two replicas, 3 x their target: as many replicas as allowed
    active = [n]  # clients 0 .. active[0] - 1 send, one request after another
    stop = threading.Event()

    def load(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                if i >= active[0]:
                    time.sleep(0.2)
                    continue
                r = client.post(f"{url}/v1/completions",
                                json={"model": "tiny", "prompt": "hello", "max_tokens": 32, "temperature": 0})
                statuses.append(r.status_code)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(load, i) for i in range(n)]
        try:
            _wait_ingress_replicas(bases, TINY_INGRESS["max_replicas"])
            before = ingress_admitted(url)
            deadline = time.monotonic() + 30  # each replica reports its counts every 2 s
            while True:
                spread = {i: c - before.get(i, 0.0) for i, c in ingress_admitted(url).items()}
                if sum(1 for c in spread.values() if c > 0) >= 3 or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            assert sum(1 for c in spread.values() if c > 0) >= 3, spread
            active[0] = 1  # one client left: the fewest replicas suffice, and it sees them go
            _wait_ingress_replicas(bases, TINY_INGRESS["min_replicas"])
        finally:
            stop.set()
            for future in futures:
                future.result()
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}

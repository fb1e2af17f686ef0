"""LoRAModelServer: one engine per replica, serving the base model and every adapter.

Requests for different adapters share decode batches inside the engine. The adapter
travels as Serve's multiplexed model id, so the router prefers replicas that already
hold it. The replica keeps its registry view current by long-polling the admin actor.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from cluster.admin import connect_admin, resolve_model_path, resolve_tokenizer_path, sync_entries
from cluster.metrics import ReplicaMetrics
from cluster.registry_view import RegistryView
from cluster.serve_router import routing_stats
from deployments.config import AppArgs
from deployments.hosts import ReplicaHosts
from deployments.placement import check_devices
from deployments.reasoning import OPEN, TAGGED, closed_think_block, reasoning_mode
from deployments.tool_calls import tool_format, tool_grammar, with_tools_described
from lora_runtime.errors import AdapterNotFoundError, CapacityError, InvalidRequestError, ServingError
from lora_runtime.model.generation_defaults import default_max_tokens, with_defaults

logger = logging.getLogger("ray.serve")

# Most out-of-vocabulary ids a detokenize error lists.
_MAX_IDS_SHOWN = 10


def error_item(e: ServingError, param: str | None = None) -> dict:
    """An item carrying a request error to the ingress: status, type, message and, where
    known, the request field it concerns."""
    item = {"status_code": e.status_code, "type": e.error_type, "message": str(e)}
    param = param if param is not None else getattr(e, "param", None)
    if param is not None:
        item["param"] = param
    if e.code is not None:
        item["code"] = e.code
    return {"error": item}


def _forced_tools(tools: dict | None) -> list[dict]:
    """The tools a request's answer must call one of (tool_choice required: all of them; a
    named function: that one); none where it may answer in text."""
    if not tools or tools["choice"] in ("auto", "none"):
        return []
    return [t for t in tools["tools"] if tools["choice"] == "required" or t["function"]["name"] == tools["choice"]]


class LoRAModelServer:
    """A Serve replica: engine, registry view, multiplexed adapter routing, drain on stop."""

    async def __init__(self, args: dict):
        import jax

        from lora_runtime.engine.engine import Engine

        self._args = AppArgs(**args)
        a = self._args
        # The registry's owner first: a deployment naming another registry for it is refused
        # before anything is built.
        self._admin = await connect_admin(a.admin_actor_name, a.resolved_registry_url)
        self._hosts = None
        if a.hosts_per_replica > 1:  # the other hosts join this process's JAX runtime before it starts
            self._hosts = await ReplicaHosts.start(a)
        if a.accelerator != "auto":  # resolved by build_app: these devices, or no start
            check_devices(a.accelerator, a.tensor_parallel_size, jax.devices(), hosts=a.hosts_per_replica,
                          local=jax.local_devices())
        self._engine = Engine.from_pretrained(
            resolve_model_path(a.model), a.engine_config(), model_name=a.served_model_name,
            tokenizer_path=resolve_tokenizer_path(a.tokenizer),
        )
        if self._hosts is not None:
            self._hosts.attach(self._engine)
        self._engine.start()
        warm = self._engine.warm_counts
        logger.info("engine ready: warm-up %.1f s, %d executables (%d compiled, %d from the compilation "
                    "cache %s)", self._engine.warm_seconds, warm.builds, warm.compiled, warm.cache_hits,
                    self._engine.config.compilation_cache_path() or "(off)")
        # The registry may hold other base models' adapters: this replica sees only its own.
        self._fingerprint = (await asyncio.to_thread(a.adapter_validator().base)).fingerprint
        self._registry = await RegistryView(self._admin, self._fingerprint, self._on_registry_change).start()
        # Multiplexing is wired per instance so its capacity follows max_cpu_loras; Serve
        # then reports the adapters this replica holds to the router.
        self._load_adapter = serve.multiplexed(max_num_models_per_replica=a.max_cpu_loras)(
            self._make_loader()
        )
        self._draining = False
        # Only registered adapters get a label of their own: a name a client made up is "unknown".
        self._metrics = ReplicaMetrics(is_registered=lambda name: name in self._registry.entries)

    # --- registry view ---------------------------------------------------------------

    async def _on_registry_change(self, snapshot: dict) -> None:
        if self._engine.lora_manager is not None:
            # Pinned adapters are fetched and made resident here: off the event loop.
            errors = await asyncio.to_thread(self._engine.lora_manager.sync, sync_entries(snapshot["adapters"]))
            for name, err in errors.items():
                logger.warning("pinned adapter %r could not be made resident: %s", name, err)

    async def _ensure_known(self, name: str) -> None:
        if await self._registry.lookup(name) is None:
            raise AdapterNotFoundError(
                f"model {name!r} is neither the base model {self._engine.model_name!r} "
                "nor an adapter registered for it"
            )

    def _make_loader(self):
        async def _load_adapter(adapter_name: str) -> str:
            await self._ensure_known(adapter_name)
            return adapter_name

        return _load_adapter

    # --- requests ------------------------------------------------------------------

    async def model_info(self) -> dict:
        return {"model_name": self._engine.model_name, "max_seq_len": self._args.max_seq_len}

    def _chat_text(self, messages: list[dict], *, template: dict | None = None,
                   tools: list[dict] | None = None) -> str:
        """A chat's prompt text: the model's chat template rendered with the request's tools and
        its template options (ChatCompletionRequest.template_options())."""
        tokenizer = self._engine.tokenizer
        if tools and "tools" not in (tokenizer.chat_template or ""):
            messages = with_tools_described(messages, tools)  # a template that knows no tools
        return tokenizer.apply_chat_template(messages, tools=tools, **(template or {}))

    def _chat_tokens(self, messages: list[dict], *, template: dict | None = None,
                     add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """A chat's prompt token ids (chat templates write BOS themselves: by default no second
        one from the tokenizer)."""
        text = self._chat_text(messages, template=template, tools=tools)
        return self._engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _prompt(self, request: dict) -> tuple[str | list[int], str | None]:
        """The request's prompt, and for a chat how its answer's reasoning splits off
        (deployments/reasoning.py)."""
        mode = None
        if request["kind"] == "chat":
            tools = request.get("tools")
            text = self._chat_text(request["messages"], template=request.get("template"),
                                   tools=tools and tools["tools"])
            mode = reasoning_mode(self._engine.tokenizer.chat_template, text)
            if mode == OPEN and (request["sampling"].get("guided") is not None or _forced_tools(tools)):
                # A grammar binds from the answer's first token, which would be inside the block:
                # close it empty, as a template writes it with thinking off, so it binds the answer.
                text, mode = closed_think_block(text), TAGGED
            prompt = self._engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = request["prompt"]
        keep = request.get("truncate_prompt_tokens")
        if keep is None:
            return prompt, mode
        if keep == -1:  # as many as leave room for max_tokens (one token when it fills the context)
            keep = max(1, self._args.max_seq_len - (request["sampling"]["max_tokens"] or 1))
        ids = prompt if isinstance(prompt, list) else self._engine.tokenizer.encode(prompt)
        return ids[-keep:], mode

    def _sampling(self, request: dict, prompt: str | list[int]):
        from lora_runtime.engine.sampling import SamplingParams

        defaults = self._engine.generation_defaults if self._args.generation_config == "auto" else {}
        fields = with_defaults(request["sampling"], defaults)
        if fields["max_tokens"] is None:
            n_prompt = len(prompt) if isinstance(prompt, list) else len(self._engine.tokenizer.encode(prompt))
            fields["max_tokens"] = default_max_tokens(self._args.max_seq_len - n_prompt, defaults)
        tools = request.get("tools")
        chosen = _forced_tools(tools)
        if chosen:  # required, or a named function: a grammar
            fields["guided"] = tool_grammar(self._tool_format, chosen,
                                            parallel=tools["parallel"] and tools["choice"] == "required")
        return SamplingParams(**fields).validate()

    @property
    def _tool_format(self) -> str:
        """The format this model writes tool calls in (deployments/tool_calls.py)."""
        return tool_format(self._engine.tokenizer.chat_template)

    def _logprob_entries(self, token_ids, logprobs) -> list[dict] | None:
        """Per token: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}; a
        token with no log-probability (a prompt's first) has logprob None and no top list."""
        if logprobs is None:
            return None
        tokenizer = self._engine.tokenizer

        def entry(token_id: int, logprob: float | None) -> dict:
            raw = tokenizer.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return [{**entry(t, None), "top_logprobs": []} if lp is None else
                {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                for t, lp in zip(token_ids, logprobs)]

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self._engine.tokenizer.decode(prompt)

    async def generate(self, request: dict):
        """Streams ``{"text", "token_ids", "finished", "finish_reason", "prompt_tokens",
        "completion_tokens", "cached_tokens", "logprobs", "prompt_logprobs", "prompt_text",
        "tool_format", "reasoning_mode"}`` items (the last two on the first item), or one
        ``{"error": ...}`` item for a bad request."""
        adapter = serve.get_multiplexed_model_id() or None
        rid = request["request_id"]
        trace = self._metrics.start(adapter)
        try:
            if self._draining:
                raise CapacityError("replica is shutting down; retry")
            if self._hosts is not None:
                self._hosts.mirror.check()  # a replica that lost a host takes nothing new
            if adapter is not None:
                await self._load_adapter(adapter)
            prompt, reasoning = self._prompt(request)
            params = self._sampling(request, prompt)
            echo_text = self._echo_text(prompt) if request.get("echo") else None
            # A request answered all at once needs its tokens in one item, not one item each.
            stream = self._engine.generate(prompt, params, request_id=rid, adapter=adapter,
                                           priority=request.get("priority", 0), stream=request.get("stream", True))
            first = await anext(stream)
        except ServingError as e:
            trace.finish("error", 0, 0)
            # A chat's prompt is its messages.
            yield error_item(e, "messages" if request["kind"] == "chat" and e.param == "prompt" else None)
            return
        finished = False
        seen = 0  # completion tokens counted by the trace so far
        try:
            out = first
            while True:
                trace.tokens(out.completion_tokens - seen)
                seen = out.completion_tokens
                finished = out.finished
                if finished:
                    trace.finish("ok", out.prompt_tokens, out.completion_tokens)
                yield {
                    "text": out.text,
                    "token_ids": list(out.token_ids),
                    "finished": out.finished,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens,  # prompt tokens found in the prefix cache
                    "logprobs": self._logprob_entries(out.token_ids, out.logprobs),
                    "prompt_logprobs": self._logprob_entries(out.prompt_token_ids, out.prompt_logprobs),
                    # Echo: the prompt's text goes ahead of the first output.
                    "prompt_text": echo_text if out is first else None,
                    "tool_format": self._tool_format if out is first and request.get("tools") else None,
                    "reasoning_mode": reasoning if out is first else None,
                }
                if finished:
                    break
                try:
                    out = await anext(stream)
                except ServingError as e:
                    # The engine ended this sequence itself (e.g. its adapter failed to load).
                    finished = True
                    trace.finish("error", out.prompt_tokens, seen)
                    yield error_item(e)
                    break
        finally:
            # A client disconnect cancels this generator: free the sequence's slot now.
            trace.finish("aborted", out.prompt_tokens, seen)  # no-op once finished
            if not finished:
                self._engine.abort(rid)
            await stream.aclose()

    # --- tokenizer -----------------------------------------------------------------
    # Called with keyword arguments only: the router reads a positional payload's prompt
    # for prefix affinity, and tokenizing leaves nothing in this replica's prefix cache.

    async def _check_model(self) -> None:
        """The request's model resolves as in generate: an unknown adapter is a 404."""
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self._load_adapter(adapter)

    def _tokens_item(self, ids: list[int]) -> dict:
        return {"tokens": ids, "count": len(ids), "max_model_len": self._args.max_seq_len}

    async def tokenize(self, *, prompt: str, add_special_tokens: bool) -> dict:
        """A text's ``{"tokens", "count", "max_model_len"}``, or an ``{"error": ...}`` item."""
        try:
            await self._check_model()
        except ServingError as e:
            return error_item(e)
        return self._tokens_item(self._engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    async def tokenize_chat(self, *, messages: list[dict], template: dict, add_special_tokens: bool,
                            tools: list[dict] | None = None) -> dict:
        """The same for a chat, rendered as generate renders chat requests."""
        try:
            await self._check_model()
        except ServingError as e:
            return error_item(e)
        try:
            ids = self._chat_tokens(messages, template=template, add_special_tokens=add_special_tokens,
                                    tools=tools)
        except ServingError as e:  # the chat template refused the messages
            return error_item(e, param="messages")
        return self._tokens_item(ids)

    async def detokenize(self, *, tokens: list[int]) -> dict:
        """``{"prompt": text}`` of token ids, special tokens kept (as vLLM), or an error item."""
        try:
            await self._check_model()
        except ServingError as e:
            return error_item(e)
        vocab_size = self._engine.tokenizer.vocab_size
        outside = sorted({t for t in tokens if not 0 <= t < vocab_size})
        if outside:
            shown = ", ".join(map(str, outside[:_MAX_IDS_SHOWN])) + (", ..." if len(outside) > _MAX_IDS_SHOWN else "")
            message = f"tokens [{shown}] are outside the vocabulary (ids 0-{vocab_size - 1})"
            return error_item(InvalidRequestError(message), param="tokens")
        return {"prompt": self._engine.tokenizer.decode(tokens, skip_special_tokens=False)}

    # --- Serve hooks -----------------------------------------------------------------

    async def health(self) -> dict:
        # Its own, sharded over (on every host of a replica spanning several).
        devices = [f"{d.platform}:{d.id}" for d in self._engine.runner.mesh.devices.flat]
        return {"registry_version": self._registry.version, "devices": devices, **self._engine.stats()}

    def record_routing_stats(self) -> dict:
        """Serve polls this: the adapters this replica holds, and its metrics for /metrics."""
        as_of = time.time()  # before reading: a route made meanwhile is replayed, not lost
        manager = self._engine.lora_manager
        rows = manager.list_adapters() if manager is not None else []
        snapshot = self._metrics.snapshot(
            self._engine.stats(),
            manager.stats() if manager is not None else None,
            slots_used=len({r["slot"] for r in rows if r["slot"] is not None}),  # names may share a slot
            slots_total=manager.num_slots if manager is not None else 0,
            class_slots=manager.slot_classes() if manager is not None else None,
        )
        return routing_stats(rows, snapshot, slots=manager.num_slots if manager is not None else 0,
                             host_slots=self._args.max_cpu_loras,
                             residency=manager.residency() if manager is not None else None, as_of=as_of)

    async def check_health(self) -> None:
        """Serve's periodic probe: a failure restarts this replica."""
        self._registry.check()
        # The engine steps on its own thread; if that thread died, requests would hang.
        if not self._engine.is_alive():
            raise RuntimeError("the engine's loop thread is not running")
        if self._hosts is not None:
            await self._hosts.check()  # a lost host: Serve replaces the whole replica

    async def __del__(self) -> None:
        # Graceful drain: running sequences finish, new ones are refused. A replica whose
        # __init__ failed part way (Serve stopped it while it started) stops what it had started.
        self._draining = True
        registry, engine, hosts = (getattr(self, name, None) for name in ("_registry", "_engine", "_hosts"))
        if registry is not None:
            registry.stop()
        try:
            if engine is not None:
                await engine.drain(self._args.drain_timeout_s)
        finally:
            if engine is not None:
                engine.shutdown()
            if hosts is not None:
                hosts.close()


__all__ = ["LoRAModelServer", "error_item"]

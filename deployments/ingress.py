"""HTTP edge: the OpenAI-compatible API, the adapter admin API and /health.

Thin: parse and validate the body, pick the multiplexed model id (the adapter name),
stream from a LoRAModelServer replica, and shape OpenAI responses and errors.
"""

# No `from __future__ import annotations` here: FastAPI must see real annotation objects
# in the replica, or Serve's class-based routes read `Header`/body params as queries.

import asyncio
import functools
import json
import logging
import math
import time

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.access import AccessControl, Caller
from cluster.admin import check_adapter_name, connect_admin, demo_adapter_sources, unwrap_error
from cluster.auth import AdminAuth, AuthError
from cluster.base_model import census
from cluster.ingress_ledger import LedgerClient
from cluster.metrics import render
from cluster.registry_view import RegistryView
from cluster.serve_router import give_routes, replica_reports, routing_outcomes, share_routes, take_routes
from deployments.config import AppArgs
from deployments.openapi_docs import (
    ADMIN,
    ADMIN_LIST,
    ADMIN_ONE,
    HEALTH,
    INFERENCE,
    MODEL,
    MODELS,
    PLAIN_TEXT,
    PROMETHEUS,
    STREAMABLE,
    truthful,
)
from deployments.openai_protocol import (
    ERROR_TYPES_BY_STATUS,
    AdapterPinRequest,
    AdapterRegisterRequest,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    OpenAIError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    new_id,
    usage,
    usage_chunk,
    validation_error,
)
from deployments.reasoning import ReasoningSplitter, split_reasoning
from deployments.responses_api import ResponseBuilder, ResponsesRequest, responses_param
from deployments.tool_calls import ToolCallStream, parse_tool_calls
from lora_runtime.engine.grammar import GuidedSpec
from lora_runtime.engine.sampling_params import SamplingParams
from lora_runtime.model.generation_defaults import with_defaults
from lora_runtime.errors import ServingError

app = FastAPI(title="multilora-serve")


def _openapi() -> dict:
    if app.openapi_schema is None:
        app.openapi_schema = truthful(get_openapi(title=app.title, version=app.version, routes=app.routes))
    return app.openapi_schema


app.openapi = _openapi
logger = logging.getLogger("ray.serve")


class RequestTooLargeError(ServingError):
    """A request body over the endpoint's max_request_bytes."""

    status_code = 413


class _BodyLimit:
    """ASGI middleware: a request body over `max_bytes` (AppArgs.max_request_bytes, set when the
    ingress starts) is a 413 in the OpenAI format, by its Content-Length before anything is
    read, or as soon as its chunks pass the cap; the handler never sees it. A body under the
    cap is read here and handed on whole (the handlers parse it whole anyway)."""

    max_bytes = AppArgs.model_fields["max_request_bytes"].default

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def _refuse(self, got: str, scope, receive, send) -> None:
        e = RequestTooLargeError(f"the request body is {got} bytes, over this endpoint's "
                                 f"max_request_bytes={self.max_bytes}")
        response = JSONResponse(error_body(str(e), e.error_type), status_code=e.status_code)
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(length.decode(), scope, receive, send)
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._refuse(f"more than {self.max_bytes}", scope, receive, send)
            more = message.get("more_body", False)
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: a disconnect, which streams listen for

        await self.app(scope, replay, send)


app.add_middleware(_BodyLimit)

_HEALTH_TIMEOUT_S = 10.0
# How often an ingress replica sends its counts to the shared ledger (/metrics).
_LEDGER_REPORT_S = 2.0
# How often an ingress replica exchanges its routers' routing records with the others.
_ROUTES_EXCHANGE_S = 0.5


# A 503 is temporary (a replica full, draining or restarting): when to try again.
_RETRY_AFTER_S = "1"


def _error_response(body: dict, status: int, headers: dict | None = None) -> JSONResponse:
    if status == 503 and not headers:
        headers = {"Retry-After": _RETRY_AFTER_S}
    return JSONResponse(body, status_code=status, headers=headers)


def _openai_response(e: OpenAIError) -> JSONResponse:
    return _error_response(e.body(), e.status_code, e.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
    return _openai_response(e)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    # OpenAI clients expect 400 with the offending parameter, not FastAPI's 422 list.
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", None))[-1]
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error')} (at character {where})"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)
    return JSONResponse(validation_error(first).body(), status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    # FastAPI's own refusals (an unknown path, a wrong method, a body that is not UTF-8) in
    # the OpenAI format too.
    error_type = ERROR_TYPES_BY_STATUS.get(e.status_code, "invalid_request_error")
    detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
    headers = getattr(e, "headers", None)
    if e.status_code == 404:
        detail = f"no endpoint {request.method} {request.url.path}"
    if e.status_code == 405:
        # Starlette names the methods of the first route on the path only; a path may have several.
        methods = _methods_of(request)
        detail = f"{request.method} is not a method of {request.url.path}; it takes {', '.join(methods)}"
        headers = {"Allow": ", ".join(methods)}
    return JSONResponse(error_body(detail, error_type), status_code=e.status_code, headers=headers)


def _api_routes(router, prefix: str = ""):
    """(prefix, route) for every API route under `router`. FastAPI >= 0.137 keeps a router's
    included routes under one node of the including router (`original_router`, its prefix in
    `include_context`) instead of flattening them, and Serve's ingress includes our class's
    routes so."""
    for route in router.routes:
        if isinstance(route, APIRoute):
            yield prefix, route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _api_routes(inner, prefix + (getattr(getattr(route, "include_context", None), "prefix", "")
                                                    or ""))


def _methods_of(request: Request) -> list[str]:
    """The methods the routes on a request's path take (HEAD aside: it comes with GET)."""
    path = request.url.path
    methods: set[str] = set()
    for prefix, route in _api_routes(request.app.router):
        if path.startswith(prefix) and route.path_regex.match(path[len(prefix):]):
            methods |= set(route.methods) - {"HEAD"}
    return sorted(methods)


def _unavailable(e: BackPressureError | DeploymentUnavailableError) -> OpenAIError:
    """A replica call Serve refused: every replica busy with max_queued_requests waiting, or
    the model servers not deployed. Turned into our error where the call is made: Serve puts
    its own plain-text handlers for these on the ingress's app, over any of ours."""
    if isinstance(e, BackPressureError):
        retry = str(max(1, math.ceil(e.retry_after_s))) if e.retry_after_s else _RETRY_AFTER_S
        return OpenAIError(f"the server is at capacity ({e.message}); retry after {retry} s", status_code=503,
                           error_type="server_error", code="overloaded", headers={"Retry-After": retry})
    return OpenAIError(f"the model servers are unavailable: {e.message}", status_code=503,
                       error_type="server_error", code="unavailable")


_REFUSED_BY_SERVE = (BackPressureError, DeploymentUnavailableError)


def _replica_failed(e: RayActorError) -> OpenAIError:
    """The model-server replica a request was on died or became unreachable (Serve replaces
    it): a 503 to retry, not a 500."""
    return OpenAIError(f"the model-server replica serving this request failed ({type(e).__name__}); retry",
                       status_code=503, error_type="server_error", code="replica_failed")


def _cancelled() -> OpenAIError:
    """A request whose replica call was cancelled. Serve cancels the calls of a request whose
    client closed its connection, so this is a client leaving, not a fault: status 499 (as
    Serve's proxy reports a disconnect), logged without a traceback."""
    return OpenAIError("the request was cancelled before it ended (its client closed the connection)",
                       status_code=499, error_type="server_error", code="cancelled")


class _EventStream(StreamingResponse):
    """A server-sent event stream that ends quietly when its client leaves. Serve's receive
    raises RequestCancelledError then, which Starlette would raise on past the response's
    start, for Serve to log as a failed request."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            logger.info("%s %s cancelled mid-stream: its client left", scope.get("method"), scope.get("path"))


@app.exception_handler(TaskCancelledError)  # Serve's RequestCancelledError too
async def _cancelled_call(request: Request, e: Exception) -> JSONResponse:
    """A handler of its own class: Starlette re-raises what the handler of Exception answers,
    for the server to log (Serve logs it as a failed request, with its traceback)."""
    logger.info("%s %s cancelled: its client left", request.method, request.url.path)
    return _openai_response(_cancelled())


@app.exception_handler(ServingError)  # also Ray's wrapper of one raised in a replica (a subclass of it)
async def _serving_error(request: Request, e: Exception) -> JSONResponse:
    """A request's or an adapter's error that no route turned into an OpenAI error itself. A
    handler of its own class, so Starlette answers it and does not raise it on for Serve to log
    as a failed request: it is the client's mistake, or a 503 to retry (logged as a warning)."""
    cause = unwrap_error(e)
    if cause.status_code >= 500:
        logger.warning("%s %s: %s (%s); answered %d", request.method, request.url.path, cause,
                       type(cause).__name__, cause.status_code)
    return _error_response(_from_serving(cause).body(), cause.status_code)


@app.exception_handler(RayActorError)
async def _replica_died(request: Request, e: RayActorError) -> JSONResponse:
    """A model-server replica that died under a request (Serve replaces it): a 503 to retry,
    logged once here as a warning, not raised on to Serve as a failed request of ours."""
    logger.warning("%s %s: the model-server replica failed (%s); answered 503", request.method,
                   request.url.path, type(e).__name__)
    return _openai_response(_replica_failed(e))


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, e: Exception) -> JSONResponse:
    """Anything else. Starlette raises on what this handler answers, for the server to log; the
    known errors wrapped in one of another class come out of it here."""
    cause = unwrap_error(e)
    if isinstance(cause, TaskCancelledError):
        return await _cancelled_call(request, cause)
    if isinstance(cause, ServingError):
        return await _serving_error(request, cause)
    if isinstance(cause, _REFUSED_BY_SERVE):
        return _openai_response(_unavailable(cause))
    if isinstance(cause, RayActorError):
        return await _replica_died(request, cause)
    logger.error("internal error on %s %s: %r", request.method, request.url.path, cause, exc_info=cause)
    return JSONResponse(error_body(f"internal error: {cause!r}", "server_error"), status_code=500)


async def _replica_call(response):
    """A unary replica call's result, with Serve's refusals and a dead replica as our 503s."""
    try:
        return await response
    except _REFUSED_BY_SERVE as e:
        raise _unavailable(e) from None
    except RayActorError as e:
        raise _replica_failed(e) from None


def _model_not_found(model: str, base: str) -> OpenAIError:
    """The one 404 for a model that does not exist or that the caller's key may not use."""
    return OpenAIError(f"model {model!r} is neither the base model {base!r} nor an adapter registered for it",
                       status_code=404, error_type="not_found_error", param="model")


def request_priority(policy: str, caller: Caller, requested: int) -> int:
    """A request's scheduling priority: under scheduling_policy priority, never more urgent
    than its API key's; under fcfs, as asked (the replica refuses one other than 0)."""
    return caller.priority(requested) if policy == "priority" else requested


def _from_serving(e: ServingError, param: str | None = None) -> OpenAIError:
    return OpenAIError(str(e), status_code=e.status_code, error_type=e.error_type,
                       param=param if param is not None else e.param, code=e.code)


def _from_item(err: dict) -> OpenAIError:
    param = err.get("param") or ("model" if err["status_code"] == 404 else None)
    return OpenAIError(err["message"], status_code=err["status_code"], error_type=err["type"], param=param,
                       code=err.get("code"))


def _tools_of(body) -> dict | None:
    """The request's tools when its answers may hold calls (chat, tools, tool_choice not none)."""
    return body.tool_request() if isinstance(body, ChatCompletionRequest) and body.calls_tools else None


def _tool_finish(finish_reason: str | None, calls: list[dict], tools: dict) -> str | None:
    """OpenAI's finish_reason of an answer with tool calls: tool_calls, except for a named
    function (stop, as OpenAI answers a forced call); the engine's own otherwise."""
    if calls and finish_reason == "stop":
        return "stop" if tools["choice"] not in ("auto", "required") else "tool_calls"
    return finish_reason


@functools.lru_cache(maxsize=256)
def _grammar_error(spec: GuidedSpec) -> ServingError | None:
    try:
        spec.check()
    except ServingError as e:
        return e
    return None


def _check_grammar(spec: GuidedSpec) -> None:
    """A request's grammar checked at the edge (no tokenizer needed), each distinct one once:
    a bad schema, regex or grammar is a 400 naming its field before it reaches a replica."""
    error = _grammar_error(spec)
    if error is not None:
        raise error


def _choice_id(rid: str, k: int, count: int) -> str:
    """The engine's request id of choice k (the response id itself when there is one choice)."""
    return rid if count == 1 else f"{rid}-{k}"


def _usage(last_items: list[dict], prompt_of: list[int]) -> dict:
    """Usage over choices: each prompt's tokens once, every choice's completion tokens.

    A prompt's cached tokens are the fewest any of its choices found cached: the prompt is
    counted once, so tokens one choice computed are not cached for it even when another
    choice then reused them.
    """
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for item, p in zip(last_items, prompt_of):
        prompt_tokens[p] = item["prompt_tokens"]
        cached = item["cached_tokens"]
        cached_tokens[p] = min(cached_tokens.get(p, cached), cached)
    return usage(
        sum(prompt_tokens.values()),
        sum(item["completion_tokens"] for item in last_items),
        sum(cached_tokens.values()),
    )


def _best_of(results: list[list[dict]], best_of: int, n: int, *, keep_logprobs: bool) -> list[list[dict]]:
    """Of each prompt's consecutive candidates (best_of of them), the n with the highest mean
    log-probability of their generated tokens, best first (OpenAI's best_of); their sampled
    tokens' log-probabilities, which the ranking asked for, are dropped unless the request
    asked for them too."""
    chosen = []
    for start in range(0, len(results), best_of):
        for items in sorted(results[start:start + best_of], key=_mean_logprob, reverse=True)[:n]:
            chosen.append(items if keep_logprobs else [{**i, "logprobs": None} for i in items])
    return chosen


def _mean_logprob(items: list[dict]) -> float:
    """A sequence's mean log-probability per generated token (0 when it generated none)."""
    lps = [e["logprob"] for i in items for e in i["logprobs"] or ()]
    return sum(lps) / len(lps) if lps else 0.0


async def _collect(stream, first: dict) -> list[dict]:
    """Every item of a replica stream, from its first."""
    items = [first]
    async for item in stream:
        items.append(item)
    return items


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _admin_name_check(name: str, base: str) -> str:
    try:
        check_adapter_name(name)
    except ServingError as e:
        raise _from_serving(e, param="name") from None
    if name == base:
        raise OpenAIError(f"adapter name={name!r} is the base model's name", param="name")
    return name


@serve.ingress(app)
class OpenAIIngress:
    """OpenAI-compatible front door; forwards generation to LoRAModelServer replicas."""

    async def __init__(self, server, args: dict, ledger=None):
        """``ledger``: the IngressLedger deployment the ingress replicas share (with more than
        one of them); None: this replica keeps rate limits and /metrics counts itself."""
        self._server = server
        self._args = AppArgs(**args)
        a = self._args
        _BodyLimit.max_bytes = a.max_request_bytes
        self._ledger = LedgerClient(ledger)
        self._id = serve.get_replica_context().replica_id.unique_id
        self._admitted = 0  # inference requests this replica admitted (/metrics)
        self._access = AccessControl(AdminAuth.from_env(a.admin_token_env), a.api_keys_url)
        await self._start_keys()
        self._validator = a.adapter_validator()
        self._base = await asyncio.to_thread(self._validator.base)  # reads the checkpoint's config once
        self._admin = await connect_admin(a.admin_actor_name, a.resolved_registry_url)
        self._model_name: str | None = None
        self._created = int(time.time())
        await self._start_registry()
        # Which models exist: an unknown one is refused here, before any router or replica sees it.
        self._registry = await RegistryView(self._admin, self._base.fingerprint).start()
        # A first call through the server handle starts its router, which keeps what the
        # replicas publish: /metrics shows every replica's series from here on, not from the
        # first client request.
        await self._base_name()
        if self._ledger.shared:
            self._report_task = asyncio.get_running_loop().create_task(self._report_counts())
            share_routes(self._server.app_name, self._server.deployment_name)
            self._routes_task = asyncio.get_running_loop().create_task(self._exchange_routes())

    async def _report_counts(self) -> None:
        """Sends this replica's counts to the shared ledger now and then, so /metrics read
        through any ingress replica includes them (one that is never scraped too). The
        model servers' snapshots go only with a scrape (``_counts``): every ingress holds
        them, and the ledger needs them only to answer one."""
        while True:
            await asyncio.sleep(_LEDGER_REPORT_S)
            await self._counts(with_replicas=False)

    async def _exchange_routes(self) -> None:
        """Passes where this replica's routers sent which prompts and adapters to the other
        ingress replicas through the ledger, and theirs to this replica's routers (prefix
        affinity, adapter residency and rates over every ingress replica:
        cluster/ingress_ledger.py)."""
        app, deployment = self._server.app_name, self._server.deployment_name
        after = 0
        while True:
            await asyncio.sleep(_ROUTES_EXCHANGE_S)
            after, others = await self._ledger.exchange_routes(self._id, after, take_routes(app, deployment))
            give_routes(app, deployment, others)

    async def _counts(self, *, with_replicas: bool = True) -> dict:
        """What /metrics shows (IngressLedger.report), with this replica's counts in it."""
        server = self._server
        replicas = replica_reports(server.app_name, server.deployment_name) if with_replicas else {}
        return await self._ledger.report(self._id, routing_outcomes(server.app_name, server.deployment_name),
                                         self._admitted, replicas)

    async def _start_registry(self) -> None:
        """Adopts the registry's entries that record no base model and fit this one, registers
        the demo adapters for the demo model, and logs what this deployment serves and skips."""
        adoption = await self._admin.adopt_unassigned.remote(self._validator)
        if adoption["adopted"]:
            logger.info("adapters with no base model recorded, validated against base model %s and adopted: %s",
                        self._base, ", ".join(sorted(adoption["adopted"])))
        for name, why in sorted(adoption["refused"].items()):
            logger.info("adapter %r (no base model recorded) does not fit base model %s: %s", name, self._base, why)
        if self._args.is_demo:
            # Validated like any registration; ones already registered are left as they are.
            report = await self._admin.ensure_registered.remote(demo_adapter_sources(), self._validator)
            for name, why in sorted(report["skipped"].items()):
                logger.warning("demo adapter %r not registered: %s", name, why)
        snap = await self._admin.snapshot.remote(None)
        logger.info(census(snap["adapters"], self._base).line(self._base, self._args.resolved_registry_url))

    async def _start_keys(self) -> None:
        """Puts the keys file in force (a bad one fails the deploy, naming the fault) and keeps
        re-reading it, so keys are added and revoked without a redeploy."""
        access = self._access
        if not access.enabled:
            return
        access.install(await asyncio.to_thread(access.read))
        self._ledger.forget(access.key_names())
        logger.info("API keys from %s in force: %s", access.keys_url, ", ".join(access.key_names()) or "none")

        async def refresh() -> None:
            while True:
                await asyncio.sleep(self._args.api_keys_refresh_s)
                try:
                    if access.install(await asyncio.to_thread(access.read)):
                        self._ledger.forget(access.key_names())
                        logger.info("API keys re-read from %s: %s", access.keys_url, ", ".join(access.key_names()))
                except Exception as e:  # a broken or unreachable file: the keys in force stay
                    logger.error("API keys file %s not re-read, the keys in force stay: %r", access.keys_url, e)

        self._keys_task = asyncio.get_running_loop().create_task(refresh())

    async def _base_name(self) -> str:
        if self._model_name is None:
            info = await self._server.model_info.remote()
            self._model_name = info["model_name"]
        return self._model_name

    async def _adapter(self, model: str, caller: Caller) -> str:
        """The multiplexed model id a request's model is routed by: "" for the base model. A
        model that is neither the base nor a registered adapter is a 404 here: nothing a
        client makes up reaches the router (which keeps per-adapter state), a replica or a
        metric label. So is a model the caller's API key may not use: the same 404, so a key
        cannot tell another tenant's adapters from names that do not exist."""
        base = await self._base_name()
        missing = _model_not_found(model, base)
        # The configured checkpoint path also names the base model, as in vLLM.
        is_base = model in (base, self._args.model)
        if not caller.may_use(model, is_base=is_base):
            raise missing
        if is_base:
            return ""
        try:
            entry = await self._registry.lookup(model)
        except Exception as e:  # Ray wraps what the admin actor raised, or that it is gone
            raise OpenAIError(f"the adapter registry is unavailable: {unwrap_error(e)}", status_code=503,
                              error_type="server_error") from None
        if entry is None:
            raise missing
        return model

    async def _call_admin(self, method: str, *args, **kwargs):
        try:
            return await getattr(self._admin, method).remote(*args, **kwargs)
        except Exception as e:  # Ray wraps what the actor raised
            cause = unwrap_error(e)
            if isinstance(cause, ServingError):
                raise _from_serving(cause) from None
            if isinstance(cause, RayActorError):
                # The registry is written whole or not at all: the change happened or it did not.
                raise OpenAIError(
                    f"the adapter registry's actor failed during {method} and is restarting; list the adapters "
                    "(GET /v1/adapters) to see whether the change was made, then retry", status_code=503,
                    error_type="server_error", code="admin_unavailable") from None
            raise

    def _caller(self, authorization: str | None, *, admin: bool = False) -> Caller:
        """Whom the request acts for (cluster/access.py), or its 401/403."""
        try:
            return self._access.admin(authorization) if admin else self._access.inference(authorization)
        except AuthError as e:
            code = "invalid_api_key" if e.status_code == 401 else None
            raise OpenAIError(e.message, status_code=e.status_code, error_type=ERROR_TYPES_BY_STATUS[e.status_code],
                              code=code) from None

    async def _inference_caller(self, authorization: str | None) -> Caller:
        """The caller of an inference call, admitted against its key's rates (the ledger the
        ingress replicas share), or its 401/403/429."""
        caller = self._caller(authorization)
        if caller.key is not None:
            refusal = await self._ledger.admit(caller.key)
            if refusal is not None:
                why, retry_after_s = refusal
                raise OpenAIError(why, status_code=429, error_type=ERROR_TYPES_BY_STATUS[429],
                                  code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})
        self._admitted += 1
        return caller

    def _admin_caller(self, authorization: str | None, name: str | None = None) -> Caller:
        """An admin call's caller; with ``name``, a 403 unless its scope covers that adapter
        (checked before the registry is read, so the answer says nothing of what exists)."""
        caller = self._caller(authorization, admin=True)
        if name is not None and not caller.may_admin(name):
            raise OpenAIError(f"this admin key may not manage adapter {name!r} (its scope: {caller.scope()})",
                              status_code=403, error_type="permission_error", param="name")
        return caller

    # --- generation ------------------------------------------------------------------

    async def _start(self, body: CompletionRequest | ChatCompletionRequest, adapter: str, payload: dict):
        """Starts a replica stream; returns it with its first item (errors raised here)."""
        handle = self._server.options(stream=True, multiplexed_model_id=adapter)
        stream = handle.generate.remote(payload)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise OpenAIError("the model returned no output", status_code=500, error_type="server_error") from None
        except _REFUSED_BY_SERVE as e:  # here, not via _replica_call: wrapped so, Serve answered it itself
            raise _unavailable(e) from None
        except RayActorError as e:
            raise _replica_failed(e) from None
        except BaseException:
            stream.cancel()  # e.g. the client left before the first token
            raise
        if "error" in first:
            raise _from_item(first["error"])
        return stream, first

    async def _start_choices(self, body, caller: Caller, payloads: list[dict]) -> list:
        """One replica stream per choice, each with its first item; if any fails to start,
        the others are cancelled and its error is raised."""
        adapter = await self._adapter(body.model, caller)
        if len(payloads) == 1:
            return [await self._start(body, adapter, payloads[0])]
        started = await asyncio.gather(*(self._start(body, adapter, p) for p in payloads), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for r in started:
                if not isinstance(r, BaseException):
                    r[0].cancel()
            raise failed[0]
        return started

    def _check_sampling(self, sampling: dict) -> None:
        """What a replica would refuse of a request's sampling values, refused here with a 400
        naming the field, so a bad request never leaves the ingress. (Token ids against the
        vocabulary, and the prompt's length, are checked by the replica, which tokenizes.)"""
        limit = self._args.max_seq_len
        max_tokens = sampling["max_tokens"]
        if max_tokens is not None and max_tokens >= limit:
            raise OpenAIError(f"max_tokens={max_tokens} leaves no room for a prompt within max_seq_len={limit}",
                              param="max_tokens")
        try:
            # Fields the request left unset take values the replica's checkpoint holds, checked at its start.
            params = SamplingParams(**{**with_defaults(sampling, {}),
                                       "max_tokens": limit - 1 if max_tokens is None else max_tokens})
            params.validate()
            if params.guided is not None:
                _check_grammar(params.guided)
        except ServingError as e:
            raise _from_serving(e) from None

    def _priority(self, caller: Caller, requested: int) -> int:
        return request_priority(self._args.scheduling_policy, caller, requested)

    @app.post("/v1/completions", responses={**STREAMABLE, **INFERENCE})
    async def completions(self, body: CompletionRequest, authorization: str | None = Header(None)):
        caller = await self._inference_caller(authorization)
        # Choice index = prompt number * n + sample number, as in OpenAI's API.
        rid = new_id("cmpl")
        samplings = body.choice_samplings(default_max_tokens=16)
        self._check_sampling(samplings[0])  # choices differ in their seeds only
        jobs = [(i, prompt, sp) for i, prompt in enumerate(body.prompts()) for sp in samplings]
        if len(jobs) > MAX_PROMPTS:
            field = "best_of" if body.ranks_candidates() else "n"
            raise OpenAIError(f"{field}={body.candidates} sequences for each of {len(body.prompts())} prompts are "
                              f"{len(jobs)} sequences; at most {MAX_PROMPTS} in one request", param=field)
        payloads = [
            {"kind": "completion", "prompt": prompt, "sampling": sp, "echo": body.echo,
             "truncate_prompt_tokens": body.truncate_prompt_tokens, "priority": self._priority(caller, body.priority),
             "request_id": _choice_id(rid, k, len(jobs))}
            for k, (_, prompt, sp) in enumerate(jobs)
        ]
        return await self._respond(body, caller, rid, payloads, [i for i, _, _ in jobs], chat=False)

    @app.post("/v1/chat/completions", responses={**STREAMABLE, **INFERENCE})
    async def chat_completions(self, body: ChatCompletionRequest, authorization: str | None = Header(None)):
        caller = await self._inference_caller(authorization)
        rid = new_id("chatcmpl")
        payloads = self._chat_payloads(body, rid, caller)
        return await self._respond(body, caller, rid, payloads, [0] * len(payloads), chat=True)

    def _chat_payloads(self, body: ChatCompletionRequest, rid: str, caller: Caller) -> list[dict]:
        """The replica payload of each of a chat request's choices (its sampling checked)."""
        samplings = body.choice_samplings(default_max_tokens=None)
        self._check_sampling(samplings[0])
        tools = body.tool_request()
        return [{"kind": "chat", "messages": body.chat_messages(), "template": body.template_options(),
                 "sampling": sp, "tools": tools, "truncate_prompt_tokens": body.truncate_prompt_tokens,
                 "priority": self._priority(caller, body.priority), "request_id": _choice_id(rid, k, len(samplings))}
                for k, sp in enumerate(samplings)]

    @app.post("/v1/responses", responses={**STREAMABLE, **INFERENCE})
    async def responses(self, body: ResponsesRequest, authorization: str | None = Header(None)):
        """OpenAI's Responses API, stateless, computed as one chat choice (deployments/responses_api.py)."""
        caller = await self._inference_caller(authorization)
        chat = body.chat_request()
        builder = ResponseBuilder(body, new_id("resp").replace("-", "_", 1))
        try:
            payloads = self._chat_payloads(chat, builder.id, caller)
        except OpenAIError as e:  # named as the client sent it (text, not response_format)
            e.param = responses_param(e.param)
            raise
        answer = await self._respond(chat, caller, builder.id, payloads, [0], chat=True)
        if not chat.stream:
            return builder.from_chat(answer)
        return _EventStream(builder.events(answer.body_iterator), media_type="text/event-stream")

    def _charge(self, caller: Caller, last_items: list[dict], prompt_of: list[int]) -> None:
        """The tokens a response computed, against its key's token rate."""
        if last_items and caller.key is not None:
            self._ledger.charge(caller.key, _usage(last_items, prompt_of)["total_tokens"])

    async def _respond(self, body, caller: Caller, rid: str, payloads: list[dict], prompt_of: list[int], *,
                       chat: bool):
        """`prompt_of[k]`: which prompt choice k answers (its prompt tokens count once)."""
        for payload in payloads:  # not streamed: the replica sends a choice's tokens in one item
            payload["stream"] = bool(body.stream)
        streams = await self._start_choices(body, caller, payloads)
        if not body.stream:
            try:
                results = await asyncio.gather(*(_collect(stream, first) for stream, first in streams))
            except Exception as e:
                if isinstance(unwrap_error(e), RayActorError):
                    raise _replica_failed(unwrap_error(e)) from None
                raise
            finally:
                # A client disconnect cancels this task: stop the replicas' sequences too.
                for stream, _ in streams:
                    stream.cancel()
            # The last item with counts of each sequence: one the engine ended itself ends in an error item.
            counted = [next(i for i in reversed(items) if "error" not in i) for items in results]
            self._charge(caller, counted, prompt_of)
            errors = [i["error"] for items in results for i in items if "error" in i]
            if errors:
                raise _from_item(errors[0])
            use = _usage(counted, prompt_of)  # every sequence generated, best_of's unreturned ones too
            if isinstance(body, CompletionRequest) and body.ranks_candidates():
                results = _best_of(results, body.best_of, body.n, keep_logprobs=body.logprobs is not None)
            return self._full_response(rid, body.model, results, use, chat=chat, tools=_tools_of(body))
        return _EventStream(
            self._sse_stream(rid, body.model, streams, prompt_of, chat=chat, include_usage=body.include_usage,
                             caller=caller, tools=_tools_of(body)),
            media_type="text/event-stream",
        )

    def _full_response(self, rid: str, model: str, results: list[list[dict]], use: dict, *,
                       chat: bool, tools: dict | None = None) -> dict:
        """Each choice's items (none an error) in order, and the response's usage; `tools`: the
        request's tool_request() when its answers may hold tool calls."""
        choices = []
        for index, items in enumerate(results):
            last = items[-1]
            logprobs = None if last.get("logprobs") is None else [e for i in items for e in i["logprobs"]]
            prompt_entries = next((i["prompt_logprobs"] for i in items if i.get("prompt_logprobs")), None)
            if prompt_entries is not None:  # echo with logprobs: the prompt's tokens come first
                logprobs = prompt_entries + (logprobs or [])
            text = (items[0].get("prompt_text") or "") + "".join(i["text"] for i in items)
            if not chat:
                choices.append(completion_choice(index, text, last["finish_reason"], logprobs))
                continue
            reasoning, text = split_reasoning(items[0].get("reasoning_mode"), text)
            if tools is not None:
                content, calls = parse_tool_calls(items[0]["tool_format"], text, tools["tools"])
                choices.append(chat_choice(index, content, _tool_finish(last["finish_reason"], calls, tools),
                                           logprobs, tool_calls=calls, reasoning=reasoning))
                continue
            choices.append(chat_choice(index, text, last["finish_reason"], logprobs, reasoning=reasoning))
        build = chat_response if chat else completion_response
        return build(rid, model, choices, use)

    async def _sse_stream(self, rid, model, streams, prompt_of: list[int], *, chat: bool, include_usage: bool,
                          caller: Caller, tools: dict | None = None):
        created = int(time.time())
        chunk = chat_chunk if chat else completion_chunk
        items: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream, first) -> None:
            item = first
            try:
                while item is not None:
                    await items.put((index, item))
                    if "error" in item or item["finished"]:
                        break
                    try:
                        item = await anext(stream, None)
                    except Exception as e:  # the replica died, or the call was cancelled: say so, never end as if done
                        cause = unwrap_error(e)
                        if isinstance(cause, TaskCancelledError):
                            logger.info("stream %s cancelled: its client left", rid)
                            failed = _cancelled()
                        elif isinstance(cause, RayActorError):
                            failed = _replica_failed(cause)
                        else:
                            failed = OpenAIError(f"internal error: {cause!r}", status_code=500,
                                                 error_type="server_error")
                            logger.error("stream %s failed: %r", rid, cause, exc_info=cause)
                        item = {"error": failed.body()["error"]}
                    if item is None:  # the replica's stream ended before its last item
                        item = {"error": error_body("the model server ended the stream early", "server_error")["error"]}
            finally:
                items.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, stream, first)) for i, (stream, first) in enumerate(streams)]
        last: dict[int, dict] = {}
        text_offset = [0] * len(streams)  # of each choice's logprobs tokens (completions)
        # With tools: each choice's output split into content and tool calls as it streams.
        splitters = [None if tools is None else ToolCallStream(first["tool_format"], tools["tools"])
                     for _, first in streams]
        # A chat answer's reasoning, split from its content as it streams.
        reasoners = [ReasoningSplitter(first["reasoning_mode"]) if chat and first.get("reasoning_mode") else None
                     for _, first in streams]
        try:
            if chat:
                for index in range(len(streams)):
                    yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                          index=index))
            ended = 0
            while ended < len(streams):
                index, item = await items.get()
                if item is None:
                    ended += 1
                    continue
                if "error" in item:
                    # Mid-stream failure: the status is already sent, so report it in-band.
                    e = item["error"]
                    yield _sse(error_body(e["message"], e["type"], e.get("param"), e.get("code")))
                    break
                last[index] = item
                text = (item.get("prompt_text") or "") + item["text"]  # echo: the prompt first
                finish_reason = item["finish_reason"]
                if reasoners[index] is not None:
                    reasoning, text = reasoners[index].feed(text, item["finished"])
                    if reasoning:
                        yield _sse(chat_chunk(rid, model, created, {"reasoning_content": reasoning}, None,
                                              index=index))
                splitter = splitters[index]
                if splitter is not None:
                    text, call_deltas = splitter.feed(text, item["finished"])
                    for delta in call_deltas:
                        yield _sse(chat_chunk(rid, model, created, delta, None, index=index))
                    if item["finished"]:
                        finish_reason = _tool_finish(finish_reason, splitter.calls, tools)
                delta = {"content": text} if chat else text
                entries = item.get("logprobs")
                if item.get("prompt_logprobs"):
                    entries = item["prompt_logprobs"] + (entries or [])
                if text or item["finished"] or entries:
                    if entries is None:
                        logprobs = None
                    elif chat:
                        logprobs = chat_logprobs(entries)
                    else:
                        logprobs = completion_logprobs(entries, text_offset[index])
                        text_offset[index] += sum(len(e["token"]) for e in entries)
                    yield _sse(chunk(rid, model, created, delta, finish_reason, logprobs, index=index))
            if include_usage and last:
                indices = sorted(last)
                use = _usage([last[k] for k in indices], [prompt_of[k] for k in indices])
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(usage_chunk(rid, model, created, obj, use))
            yield _sse("[DONE]")
        finally:
            indices = sorted(last)
            self._charge(caller, [last[k] for k in indices], [prompt_of[k] for k in indices])
            # Client went away (or we are done): stop the replicas' sequences.
            for task in tasks:
                task.cancel()
            for stream, _ in streams:
                stream.cancel()

    # --- models and health ---------------------------------------------------------

    async def _model_cards(self, caller: Caller) -> list[dict]:
        """OpenAI model objects: the base model, then every adapter registered for it, by name;
        with API keys, those the caller's key may use."""
        base = await self._base_name()
        snap = await self._call_admin("snapshot", self._base.fingerprint)
        data = []
        if caller.may_use(base, is_base=True):
            data.append({"id": base, "object": "model", "created": self._created, "owned_by": "multilora-serve",
                         "root": base, "parent": None, "max_model_len": self._args.max_seq_len})
        for name, entry in sorted(snap["adapters"].items()):
            if not caller.may_use(name, is_base=False):
                continue
            data.append({"id": name, "object": "model", "created": entry.get("created", self._created),
                         "owned_by": "multilora-serve", "root": entry["source"], "parent": base,
                         "max_model_len": self._args.max_seq_len})  # vLLM's field: clients size prompts by it
        return data

    @app.get("/v1/models", responses=MODELS)
    async def models(self, authorization: str | None = Header(None)):
        return {"object": "list", "data": await self._model_cards(await self._inference_caller(authorization))}

    @app.get("/v1/models/{model:path}", responses=MODEL)
    async def retrieve_model(self, model: str, authorization: str | None = Header(None)):
        """OpenAI's retrieve model: the object /v1/models lists under this id."""
        cards = await self._model_cards(await self._inference_caller(authorization))
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            raise _model_not_found(model, await self._base_name())
        return card

    @app.get("/health", responses=HEALTH)
    async def health(self):
        try:
            stats = await asyncio.wait_for(self._server.health.remote(), _HEALTH_TIMEOUT_S)
            await asyncio.wait_for(self._admin.ping.remote(), _HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "reason": repr(unwrap_error(e))}, status_code=503)
        version = stats.pop("registry_version")
        return {"status": "ok", "registry_version": version, "engine": stats}

    @app.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
    async def metrics(self):
        """Prometheus text: every model-server replica's latest published metrics, the routing
        outcomes, the requests each ingress replica admitted and each API key's usage (the
        same through any ingress replica)."""
        # The server handle's router lives in this process and keeps what replicas publish.
        counts = await self._counts()
        body = render(lambda: counts["replicas"], lambda: counts["routing"], lambda: counts["admitted"],
                      lambda: counts["keys"])
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    # --- tokenizer (vLLM's) -----------------------------------------------------------

    @app.post("/tokenize", responses=INFERENCE)
    async def tokenize(self, body: TokenizeRequest, authorization: str | None = Header(None)):
        adapter = await self._adapter(body.model, await self._inference_caller(authorization))
        handle = self._server.options(multiplexed_model_id=adapter)
        if body.messages is not None:
            result = await _replica_call(handle.tokenize_chat.remote(
                messages=body.chat_messages(), template=body.template_options(),
                add_special_tokens=body.special_tokens(), tools=body.tool_definitions(),
            ))
        else:
            result = await _replica_call(handle.tokenize.remote(prompt=body.prompt,
                                                                add_special_tokens=body.special_tokens()))
        if "error" in result:
            raise _from_item(result["error"])
        return result

    @app.post("/detokenize", responses=INFERENCE)
    async def detokenize(self, body: DetokenizeRequest, authorization: str | None = Header(None)):
        adapter = await self._adapter(body.model, await self._inference_caller(authorization))
        handle = self._server.options(multiplexed_model_id=adapter)
        result = await _replica_call(handle.detokenize.remote(tokens=body.tokens))
        if "error" in result:
            raise _from_item(result["error"])
        return result

    # --- adapter admin -------------------------------------------------------------

    async def _register(self, name: str, source: str, pinned: bool, replace: bool) -> dict:
        check = _admin_name_check(name, await self._base_name())
        return await self._call_admin("register", check, source, pinned, self._validator, replace=replace)

    @app.post("/v1/adapters", status_code=201, responses=ADMIN)
    async def register_adapter(self, body: AdapterRegisterRequest, authorization: str | None = Header(None)):
        self._admin_caller(authorization, body.name)
        if body.source is not None:
            return await self._register(body.name, body.source, body.pinned, body.replace)
        for part in body.merge.adapters:  # a merge reads them: the key's scope must cover each
            self._admin_caller(authorization, part)
        check = _admin_name_check(body.name, await self._base_name())
        return await self._call_admin("register_merged", check, body.merge.model_dump(), body.pinned,
                                      self._validator, replace=body.replace)

    @app.get("/v1/adapters", responses=ADMIN_LIST)
    async def list_adapters(self, authorization: str | None = Header(None)):
        caller = self._admin_caller(authorization)
        snap = await self._call_admin("snapshot", self._base.fingerprint)
        data = [dict(e, name=n) for n, e in sorted(snap["adapters"].items()) if caller.may_admin(n)]
        return {"object": "list", "version": snap["version"], "data": data}

    @app.get("/v1/adapters/{name}", responses=ADMIN_ONE)
    async def get_adapter(self, name: str, authorization: str | None = Header(None)):
        """One registered adapter's entry, as the list holds it."""
        self._admin_caller(authorization, name)
        snap = await self._call_admin("snapshot", self._base.fingerprint)
        entry = snap["adapters"].get(name)
        if entry is None:
            raise OpenAIError(f"adapter {name!r} is not registered", status_code=404, error_type="not_found_error",
                              param="name")
        return dict(entry, name=name)

    @app.delete("/v1/adapters/{name}", responses=ADMIN)
    async def unregister_adapter(self, name: str, authorization: str | None = Header(None)):
        self._admin_caller(authorization, name)
        return await self._call_admin("unregister", name, self._base)

    @app.patch("/v1/adapters/{name}", responses=ADMIN)
    async def pin_adapter(self, name: str, body: AdapterPinRequest, authorization: str | None = Header(None)):
        self._admin_caller(authorization, name)
        return await self._call_admin("set_pinned", name, body.pinned, self._base)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses={**PLAIN_TEXT, **ADMIN})
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, authorization: str | None = Header(None)):
        self._admin_caller(authorization, body.lora_name)
        try:
            await self._register(body.lora_name, body.lora_path, False, body.load_inplace)
        except OpenAIError as e:
            if e.code != "adapter_exists":
                raise
            raise OpenAIError(  # as vLLM words it
                f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.", param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
               responses={**PLAIN_TEXT, **ADMIN})
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest, authorization: str | None = Header(None)):
        self._admin_caller(authorization, body.lora_name)
        await self._call_admin("unregister", body.lora_name, self._base)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


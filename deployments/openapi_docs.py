"""What the OpenAPI schema says each endpoint answers: every status it returns, with the
OpenAI error body, and every content type (event streams, Prometheus text, plain text).

FastAPI documents a 422 for every route with a body or parameters; this app answers a bad
request with a 400 in the OpenAI format instead, so the schema drops the 422 (`truthful`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

_WHY = {
    400: "A request field is invalid (error.param names it), or the body is not JSON.",
    401: "No API key, or one that is not valid (when API keys are on; admin calls always).",
    403: "The key may not do this: an admin key for inference, an inference key for admin calls, or an "
         "adapter outside an admin key's scope.",
    404: "The model is neither the base model nor an adapter this key may use, or no such adapter.",
    409: "The adapter name is registered already (code adapter_exists; send replace=true to replace it), or "
         "belongs to another base model sharing the registry.",
    413: "The body is over max_request_bytes.",
    429: "The key is over its requests_per_minute or tokens_per_minute; Retry-After says when to retry.",
    503: "Every replica is busy and the queue full (code overloaded), the replica serving it failed "
         "(replica_failed), the adapter cannot be loaded from its storage now (adapter_unavailable), the admin "
         "actor failed during the call (admin_unavailable), or a component is unavailable; Retry-After says when "
         "to retry.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail = Field(..., description="What went wrong; param names the request field it concerns.")


def errors(*statuses: int) -> dict[int, dict]:
    """FastAPI ``responses`` for these statuses, each with the OpenAI error body."""
    out: dict[int, dict] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _WHY[status]}
        if status in (429, 503):
            out[status]["headers"] = _RETRY_AFTER
    return out


# Generation and tokenizer calls: bad fields, keys, unknown models, the body cap, rates, overload.
INFERENCE = errors(400, 401, 403, 404, 413, 429, 503)
# Calls without a body that still take a key: the model list.
MODELS = errors(401, 403, 429, 503)
MODEL = errors(401, 403, 404, 429, 503)
ADMIN = errors(400, 401, 403, 404, 409, 413, 503)
ADMIN_LIST = errors(401, 403, 503)
ADMIN_ONE = errors(401, 403, 404, 503)

STREAMABLE = {200: {"description": "The response; with stream=true, server-sent events (data: {chunk}, ending "
                                   "data: [DONE]).",
                    "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}}
PLAIN_TEXT = {200: {"description": "A line of text.", "content": {"text/plain": {"schema": {"type": "string"}}}}}
PROMETHEUS = {200: {"description": "Prometheus text exposition of every replica's metrics.",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}
HEALTH = {503: {"description": "A replica or the admin actor does not answer.",
                "content": {"application/json": {"schema": {
                    "type": "object", "required": ["status", "reason"],
                    "properties": {"status": {"type": "string", "enum": ["unhealthy"]},
                                   "reason": {"type": "string"}}}}}}}


def truthful(schema: dict) -> dict:
    """The schema as the app answers: FastAPI's validation-error responses and their components
    removed, and every error body application/json (FastAPI files an error model under a
    text/plain route's media type)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            for status, response in responses.items():
                content = response.get("content", {})
                if not status.startswith("2") and "text/plain" in content:
                    response["content"] = {"application/json": content.pop("text/plain"), **content}
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema

"""OpenAI-compatible request/response bodies and the OpenAI error format."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lora_runtime.engine.grammar import GuidedSpec
from lora_runtime.errors import ServingError

# lora_runtime.engine.sampling.MAX_LOGPROBS (not imported: the ingress stays free of JAX).
MAX_LOGPROBS = 20
MAX_CHOICES = 16  # most choices (n) one request may ask for
MAX_PROMPTS = 64  # most prompts one completions request may carry, and most sequences (prompts x n)
_TOKEN_ID = re.compile(r"\s*[+-]?\d+\s*")  # what int() reads as a token id (range checked later)
MAX_STOP = 16  # most stop strings one request may give
MAX_STOP_CHARS = 256  # longest stop string


class OpenAIError(Exception):
    """An error the HTTP edge returns as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


ERROR_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class FieldError(ValueError):
    """A body check's failure that concerns one field (``param``), where pydantic would only
    locate it at the body: the HTTP edge reports the field as ``error.param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def validation_error(error: dict) -> OpenAIError:
    """One of a pydantic ValidationError's errors() as the 400 naming its field: our checks'
    FieldError names it, else the error's location in the body."""
    cause = error.get("ctx", {}).get("error")
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    param = cause.param if isinstance(cause, FieldError) else ".".join(loc) or None
    msg = error.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix of our messages
    return OpenAIError(f"{param}: {msg}" if loc else msg, param=param)


def _surrogate_path(value, path: str) -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate (JSON's "\\ud800"
    escapes parse to one): no tokenizer or response can encode it."""
    if isinstance(value, str):
        return path if any("\ud800" <= c <= "\udfff" for c in value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _surrogate_path(key, path):
            return f"{path}.{key!r}".lstrip(".")
        if (found := _surrogate_path(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")):
            return found.lstrip(".")
    return None


class _Body(BaseModel):
    """A request body: unknown fields are an error naming the field, not silently dropped, and
    so is a string no encoding can carry."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data):
        where = _surrogate_path(data, "")
        if where is not None:
            raise FieldError(f"{where or 'the body'} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
                             "escape), which is not text", param=where.split("[")[0].split(".")[0] or None)
        return data


class _Request(_Body):

    model: str = Field(..., min_length=1, description="Base model name or adapter name.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    # Unset sampling fields take the checkpoint's generation_config.json values, else the
    # neutral ones (lora_runtime/model/generation_defaults.py; the generation_config arg).
    temperature: float | None = Field(None, description="0 is greedy. Unset: the model's default, else 1.")
    top_p: float | None = Field(None, description="Unset: the model's default, else 1.")
    top_k: int | None = Field(None, description="Extension: 0 (or -1) disables the top-k cut. Unset: the model's "
                              "default, else off.")
    min_p: float | None = Field(None, description="Extension (vLLM): drop tokens less likely than min_p times the "
                                "likeliest, in [0, 1]; 0 disables it. Unset: the model's default, else off.")
    seed: int | None = None
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP} strings (each 1-{MAX_STOP_CHARS} characters) that end the text.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end the text.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    n: int = Field(1, description=f"Choices to generate, 1-{MAX_CHOICES} (each its own sequence).")
    presence_penalty: float = Field(0.0, description="Subtracted from each generated token's logit (-2 to 2).")
    frequency_penalty: float = Field(0.0, description="Subtracted per earlier occurrence of a token (-2 to 2).")
    repetition_penalty: float | None = Field(
        None, description="Extension (vLLM, HF): divides positive, multiplies negative logits of prompt and output "
        "tokens, in (0, 2]. Unset: the model's default, else 1."
    )
    min_tokens: int = Field(0, description="Extension (vLLM): EOS and stop_token_ids are held back until this many.")
    skip_special_tokens: bool = Field(True, description="Extension (vLLM): leave special tokens out of the text.")
    include_stop_str_in_output: bool = Field(False, description="Extension (vLLM): keep the stop string that ended it.")
    user: str | None = Field(None, description="End-user id, recorded in logs only.")
    priority: int = Field(
        0, ge=-2**31, lt=2**31, description="Extension (vLLM): lower is served first, and may preempt running "
        "requests of a higher value; not 0 only where the deployment's scheduling_policy is priority.")
    truncate_prompt_tokens: int | None = Field(
        None, description="Extension (vLLM): keep only the prompt's last k tokens (after the chat template); -1: "
        "as many as leave room for max_tokens within max_seq_len.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> value in [-100, 100] added to its logit before sampling."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="Extension (vLLM): only these token ids may be generated (the end-of-sequence token "
        "too only if listed); with a grammar, what both allow.")
    bad_words: list[str] | None = Field(
        None, description="Extension (vLLM): words the output may not contain, as tokens (at a text's start or "
        "after a space); up to 64, each 1-256 characters.")
    response_format: "ResponseFormat | None" = Field(
        None, description="text, json_object (any JSON object) or json_schema (output valid against the schema).")
    guided_json: dict | str | None = Field(None, description="Extension (vLLM): a JSON schema the output matches.")
    guided_regex: str | None = Field(None, description="Extension (vLLM): a regex the output matches.")
    guided_choice: list[str] | None = Field(None, description="Extension (vLLM): the output is one of these.")
    guided_grammar: str | None = Field(
        None, description="Extension (vLLM): a Lark (or GBNF) grammar the output matches.")
    guided_whitespace_pattern: str | None = Field(
        None, description="Extension (vLLM): the whitespace JSON output may hold between tokens (default: "
        "compact JSON).")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias key {key!r} is not a token id")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP}")
        long = [s for s in stops if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"stop string of {len(long[0])} characters; at most {MAX_STOP_CHARS}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and not 1 <= v < 2**31:
            raise ValueError(f"truncate_prompt_tokens={v} must be -1 or in [1, 2**31)")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n={v} must be in [1, {MAX_CHOICES}]")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info) -> float:
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{info.field_name}={v} must be in [-2, 2]")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed with stream=true", "stream_options")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        self.guided()  # raises when more than one field constrains the output
        return self

    def guided(self) -> GuidedSpec | None:
        """What the output must match: response_format or one guided_* field; FieldError when
        more than one is given."""
        given = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given.append("response_format")
        given += [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, name) is not None]
        if len(given) > 1:
            raise FieldError(f"{' and '.join(given)} both constrain the output; give one", given[1])
        ws = self.guided_whitespace_pattern
        if not given:
            return None
        if given[0] == "response_format":
            if fmt.type == "json_object":
                return GuidedSpec("json_object", whitespace=ws, param="response_format")
            return GuidedSpec("json_schema", json.dumps(fmt.json_schema.schema_), whitespace=ws,
                              param="response_format")
        if given[0] == "guided_json":
            value = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return GuidedSpec("json_schema", value, whitespace=ws, param="guided_json")
        if given[0] == "guided_choice":
            return GuidedSpec("choice", json.dumps(self.guided_choice), param="guided_choice")
        if given[0] == "guided_regex":
            return GuidedSpec("regex", self.guided_regex, param="guided_regex")
        return GuidedSpec("grammar", self.guided_grammar, param="guided_grammar")

    def sampling(self, default_max_tokens: int | None) -> dict:
        """Keyword arguments of lora_runtime SamplingParams (max_tokens None = fill context)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs_wanted(),
            "prompt_logprobs": self.prompt_logprobs_wanted(),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            "allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            "bad_words": tuple(self.bad_words or ()),
            "guided": None if (spec := self.guided()) is None else spec.to_dict(),
        }

    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token to report log-probabilities for; None: none."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """The same for the prompt's tokens."""
        return None

    def choice_samplings(self, default_max_tokens: int | None) -> list[dict]:
        """sampling() for each of the n choices; a seeded request gives choice i the seed
        seed + i, so the choices differ and each is reproducible."""
        base = self.sampling(default_max_tokens)
        count = self.candidates
        if base["seed"] is None:
            return [base] * count
        return [{**base, "seed": (base["seed"] + i) % 2**63} for i in range(count)]

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt: n, or best_of of which the best n are returned."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format of type json_schema needs its json_schema", "response_format")
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError(f"response_format of type {self.type} takes no json_schema", "response_format")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(_Request):
    """Body of POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description=f"A prompt (text or token ids) or a list of up to {MAX_PROMPTS} prompts."
    )
    echo: bool = Field(False, description="Return the prompt ahead of the completion (with logprobs: its too).")
    logprobs: int | None = Field(
        None, description=f"Log-probabilities of each token and of the n likeliest (0-{MAX_LOGPROBS})."
    )
    suffix: str | None = None
    best_of: int | None = Field(
        None, description=f"Generate best_of sequences (n-{MAX_CHOICES}) per prompt and return the n with the "
        "highest log-probability per token; not with stream.")

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    def ranks_candidates(self) -> bool:
        """Whether more sequences are generated than returned (best_of > n)."""
        return self.candidates > self.n

    def sampling(self, default_max_tokens: int | None) -> dict:
        fields = super().sampling(default_max_tokens)
        if self.ranks_candidates() and fields["logprobs"] is None:
            fields["logprobs"] = 0  # the ranking reads each sampled token's log-probability
        return fields

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={v} must be in [0, {MAX_LOGPROBS}]")
        return v

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("prompt='' is empty")
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt=[] is empty")
            if isinstance(v[0], (str, list)):
                if len(v) > MAX_PROMPTS:
                    raise ValueError(f"prompt has {len(v)} prompts; at most {MAX_PROMPTS}")
                empty = [i for i, p in enumerate(v) if len(p) == 0]
                if empty:
                    raise ValueError(f"prompt[{empty[0]}] is empty")
                if len(v) == 1:
                    return v[0]
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list of them."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix is not None:
            raise FieldError("suffix is not supported", "suffix")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_CHOICES:
                raise FieldError(f"best_of={self.best_of} must be in [n={self.n}, {MAX_CHOICES}]", "best_of")
            if self.stream and self.best_of > self.n:
                raise FieldError(f"best_of={self.best_of} > n={self.n} cannot stream: the best are known only "
                                 "once all are done", "best_of")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str = Field(..., description="The call's arguments as a JSON object, in a string.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(
        None, description="Extension (vLLM): an assistant turn's reasoning, for templates that show it (Qwen3).")
    reasoning: str | None = Field(None, description="Extension: the same as reasoning_content.")

    def template_message(self) -> dict:
        """The message as chat templates read it: a call's arguments as a dict (transformers'
        convention), a tool result with the id of its call, reasoning under the names
        templates read (reasoning_content; thinking, gpt-oss's), as transformers aliases them."""
        message = {"role": self.role, "content": self.text()}
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = message["thinking"] = reasoning
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type={part.get('type')!r} is not supported; only text")
            parts.append(part["text"])
        return "".join(parts)


# Template variables a request may not set through chat_template_kwargs: its own fields set them.
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "continue_final_message")


class _ChatTemplateOptions(BaseModel):
    """How a chat's messages are rendered into its prompt (vLLM's fields)."""

    model_config = ConfigDict(extra="forbid")
    add_generation_prompt: bool | None = Field(
        None, description="Extension (vLLM): end with the assistant turn's opening (default true; false with "
        "continue_final_message).")
    continue_final_message: bool = Field(
        False, description="Extension (vLLM): the answer continues the last message (e.g. an assistant turn's "
        "given beginning) instead of starting a new turn.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Extension (vLLM): more variables for the chat template, e.g. {"enable_thinking": false}.')

    @model_validator(mode="after")
    def _template_options(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message and add_generation_prompt both true: the answer would both "
                             "continue the last message and start a new turn; give one", "continue_final_message")
        own = sorted(set(self.chat_template_kwargs or ()) & set(_TEMPLATE_OWN))
        if own:
            raise FieldError(f"chat_template_kwargs may not set {', '.join(own)}: the request's own fields set "
                             "them", "chat_template_kwargs")
        return self

    def template_options(self) -> dict:
        """Keyword arguments of Tokenizer.apply_chat_template besides messages and tools."""
        return {"add_generation_prompt": self.generation_prompt(),
                "continue_final_message": self.continue_final_message,
                "template_kwargs": dict(self.chat_template_kwargs or {})}

    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ChatCompletionRequest(_Request, _ChatTemplateOptions):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(
        None, description=f"With logprobs: also the n likeliest tokens at each position (0-{MAX_LOGPROBS})."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required (at least one call) or a named function.")
    parallel_tool_calls: bool = Field(True, description="Whether one answer may hold several calls.")
    # OpenAI fields taken and checked, which change nothing of the answer here.
    store: bool | None = Field(None, description="Taken, changes nothing: this server keeps no completions.")
    metadata: dict[str, str] | None = Field(None, description="Taken, changes nothing (OpenAI stores it).")
    service_tier: str | None = Field(None, description="Taken, changes nothing: one tier here.")
    safety_identifier: str | None = Field(None, description="Taken, changes nothing (as user).")
    prompt_cache_key: str | None = Field(
        None, description="Taken, changes nothing: the prefix cache finds shared prompt prefixes itself.")
    prediction: dict | None = Field(None, description="Taken, changes nothing (predicted output, a latency hint).")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Taken, changes nothing; a template's own switch goes in chat_template_kwargs.")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Taken, changes nothing.")
    modalities: list[Literal["text"]] | None = Field(None, description="Only text.")
    # OpenAI fields of what this server does not do: refused by name (when not null).
    audio: dict | None = None
    web_search_options: dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _not_served(self):
        if self.audio is not None:
            raise FieldError("audio output is not supported: answers are text", "audio")
        if self.web_search_options is not None:
            raise FieldError("web_search_options is not supported: this server does not search the web",
                             "web_search_options")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise FieldError(f"{name} (deprecated in OpenAI's API) is not supported; send tools and "
                                 "tool_choice", name)
        return self

    @model_validator(mode="after")
    def _unsupported(self):
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise FieldError(f"top_logprobs={self.top_logprobs} must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
            if not self.logprobs:
                raise FieldError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise FieldError(
                    f"max_tokens={self.max_tokens} and max_completion_tokens="
                    f"{self.max_completion_tokens} disagree", "max_completion_tokens",
                )
            self.max_tokens = self.max_completion_tokens
        for i, m in enumerate(self.messages):
            m.text()  # raises on non-text parts
            for j, call in enumerate(m.tool_calls or ()):
                try:
                    args = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict):
                    raise FieldError(f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                                     "messages")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError(f"tools name {next(n for n in names if names.count(n) > 1)!r} twice", "tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise FieldError("tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(f"tool_choice names function {choice.function.name!r}, which tools do not hold",
                             "tool_choice")
        if self.continue_final_message and (self.guided() is not None or self.forces_tool_call):
            raise FieldError("continue_final_message with a constrained answer (response_format, guided_*, or "
                             "tool_choice required or a named function) is not supported: the constraint would "
                             "start over after the given beginning", "continue_final_message")
        if self.forces_tool_call and self.guided() is not None:
            raise FieldError("tool_choice required or a named function constrains the output already; drop "
                             "response_format", "response_format")
        for i, t in enumerate(self.tools or ()):
            params = t.function.parameters
            if params is not None:
                if params.get("type", "object") != "object":
                    raise FieldError(f"tools[{i}].function.parameters must be a JSON schema of an object",
                                     "tools")
                try:
                    GuidedSpec("json_schema", json.dumps(params), param="tools").check()
                except ServingError as e:  # llguidance's message
                    raise FieldError(f"tools[{i}].function.parameters: {e}", "tools") from None

    @property
    def forces_tool_call(self) -> bool:
        """Whether the answer must be a call (tool_choice required or a named function): a grammar."""
        return self.calls_tools and self.tool_choice not in (None, "auto")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_request(self) -> dict | None:
        """What the replica needs of the tools: their definitions (the template renders them),
        which must be called ("auto", "required" or a function's name) and parallel_tool_calls."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools],
                "choice": choice.function.name if isinstance(choice, NamedToolChoice) else choice,
                "parallel": self.parallel_tool_calls}

    def chat_messages(self) -> list[dict]:
        return [m.template_message() for m in self.messages]


class AdapterMerge(_Body):
    """How to make an adapter from registered ones: PEFT's add_weighted_adapter
    (lora_runtime/lora/merge.py)."""
    adapters: list[str] = Field(..., description="Registered adapters to merge (1 to 16).")
    weights: list[float] = Field(..., description="One weight per adapter; negative subtracts.")
    combination_type: str = Field("svd", description="svd, cat, linear, ties, dare_linear, dare_ties or "
                                  "magnitude_prune.")
    svd_rank: int | None = Field(None, description="svd: the merged rank (default: the adapters' largest).")
    density: float | None = Field(None, description="ties, dare_*, magnitude_prune: the fraction of values kept.")
    majority_sign_method: str = Field("total", description="ties, dare_ties: 'total' or 'frequency'.")
    seed: int = Field(0, description="dare_*: the seed of the random pruning.")


class AdapterRegisterRequest(_Body):
    """Body of POST /v1/adapters: an adapter's ``source``, or a ``merge`` of registered adapters."""
    name: str
    source: str | None = Field(None, description="Path or URL of the adapter's files.")
    merge: AdapterMerge | None = Field(None, description="Make the adapter by merging registered ones (in place "
                                       "of a source).")
    pinned: bool = False
    replace: bool = Field(False, description="Replace the adapter if the name is registered already (else a 409).")

    @model_validator(mode="after")
    def _source_or_merge(self):
        if (self.source is None) == (self.merge is None):
            raise FieldError("give exactly one of 'source' (the adapter's files) and 'merge' (registered adapters to "
                             "merge)", "source")
        return self


class LoadLoRAAdapterRequest(_Body):
    """Body of vLLM's POST /v1/load_lora_adapter."""
    lora_name: str
    lora_path: str
    load_inplace: bool = Field(False, description="Replace the adapter if the name is loaded already (else a 400).")


class UnloadLoRAAdapterRequest(_Body):
    """Body of vLLM's POST /v1/unload_lora_adapter."""
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Body, _ChatTemplateOptions):
    """Body of vLLM's POST /tokenize: a text, or a chat rendered as /v1/chat/completions renders it
    (add_generation_prompt, continue_final_message and chat_template_kwargs with messages only)."""
    model: str = Field(..., min_length=1, description="Base model name or adapter name.")
    prompt: str | None = Field(None, description="A text to tokenize (this or messages).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A chat to render with the model's chat template and tokenize."
    )
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS); default true for prompt, false for messages, "
        "whose chat template writes them."
    )

    tools: list[Tool] | None = Field(None, description="With messages: the tools the template renders, as chat "
                                     "completions takes them.")

    @field_validator("messages")
    @classmethod
    def _text_only(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        for m in v or ():
            m.text()  # raises on non-text parts
        return v

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            given = "both" if self.prompt is not None else "neither"
            raise ValueError(f"exactly one of prompt and messages is required; {given} given")
        if self.messages is None:
            given = [name for name, set_ in (("add_generation_prompt", self.add_generation_prompt is not None),
                                             ("continue_final_message", self.continue_final_message),
                                             ("chat_template_kwargs", self.chat_template_kwargs is not None))
                     if set_]
            if given:
                raise ValueError(f"{given[0]} applies to messages only")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools apply to messages only")
        return self

    def chat_messages(self) -> list[dict]:
        return [m.template_message() for m in self.messages or ()]

    def tool_definitions(self) -> list[dict] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: vLLM's defaults when not given."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(_Body):
    """Body of vLLM's POST /detokenize."""
    model: str = Field(..., min_length=1, description="Base model name or adapter name.")
    tokens: list[int] = Field(..., description="Token ids to turn back into text.")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(entries: list[dict] | None, text_offset: int = 0) -> dict | None:
    """The legacy completions ``logprobs`` object from per-token entries (the chat format:
    token, logprob, bytes, top_logprobs); the sampled token is always in its top dict."""
    if entries is None:
        return None
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # A prompt's first token has no log-probability, so no top list (None, as OpenAI).
        "top_logprobs": [None if e["logprob"] is None else
                         {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                         for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: list[dict] | None = None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if reasoning is not None:  # what the answer reasoned, as vLLM's reasoning parsers return it
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(logprobs),
        "finish_reason": finish_reason,
    }


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


class AdapterPinRequest(_Body):
    """Body of PATCH /v1/adapters/{name}."""
    pinned: bool

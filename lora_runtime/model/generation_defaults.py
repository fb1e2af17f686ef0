"""The sampling defaults a checkpoint's creator recommends, from its ``generation_config.json``.

A request that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens
unset takes the checkpoint's value, as vLLM's `--generation-config auto` (its default)
does: Qwen3, for one, ships temperature 0.6, top_p 0.95 and top_k 20. Past those, the
neutral values (`NEUTRAL`) apply. transformers' ``max_new_tokens`` is the default
max_tokens (capped by the context that is left). ``do_sample`` is ignored, as vLLM ignores
it: a request's temperature 0 is what asks for greedy decoding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lora_runtime.errors import CheckpointError

# A sampling field's value when neither the request nor the checkpoint sets it.
NEUTRAL: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                   "repetition_penalty": 1.0}
# generation_config.json field -> (SamplingParams field, whether it is an integer)
_FIELDS: dict[str, tuple[str, bool]] = {
    "temperature": ("temperature", False), "top_p": ("top_p", False), "top_k": ("top_k", True),
    "min_p": ("min_p", False), "repetition_penalty": ("repetition_penalty", False),
    "max_new_tokens": ("max_tokens", True),
}


def read_generation_defaults(folder: str | Path) -> dict[str, float | int]:
    """The sampling fields `folder`'s generation_config.json sets (SamplingParams names), each
    checked as a request's value would be; {} without the file. CheckpointError names a bad one."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(path)!r} must hold an object, got {type(config).__name__}")
    out: dict[str, float | int] = {}
    for key, (field, integer) in _FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        out[field] = _checked(path, key, value, integer)
    if out:  # the same ranges a request's values are held to
        from lora_runtime.engine.sampling_params import SamplingParams
        from lora_runtime.errors import ServingError

        try:
            SamplingParams(**with_defaults(dict(out), {})).validate()
        except ServingError as e:
            raise CheckpointError(f"{str(path)!r}: {e}") from None
    return out


def _checked(path: Path, key: str, value: Any, integer: bool) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a finite number"
        raise CheckpointError(f"{str(path)!r}: {key}={value!r} must be {kind}")
    if key == "max_new_tokens" and value <= 0:
        raise CheckpointError(f"{str(path)!r}: {key}={value!r} must be positive")
    return int(value) if integer else float(value)


def with_defaults(sampling: dict[str, Any], defaults: dict[str, float | int]) -> dict[str, Any]:
    """`sampling` (SamplingParams keyword arguments, None where the request left a field
    unset) with each unset sampling field taken from `defaults`, else its neutral value.
    max_tokens is left as given: its default depends on the prompt (`default_max_tokens`)."""
    out = dict(sampling)
    for field, neutral in NEUTRAL.items():
        if out.get(field) is None:
            out[field] = defaults.get(field, neutral)
    return out


def default_max_tokens(room: int, defaults: dict[str, float | int]) -> int:
    """max_tokens for a request that left it unset: the context left (`room`, at least 1),
    capped by the checkpoint's max_new_tokens."""
    room = max(1, room)
    return min(room, int(defaults["max_tokens"])) if "max_tokens" in defaults else room

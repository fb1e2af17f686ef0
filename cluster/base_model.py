"""Which base model an adapter registry entry belongs to: a name and a config fingerprint.

One registry may be shared by deployments of different base models (the default
registry file is one per machine). Each entry records the base model it was validated
against; a deployment serves and lists only its own base model's entries.

The fingerprint is a sha256 over the ``ModelConfig`` fields that fix the weights' shapes
and what they mean: architecture, sizes, heads, RoPE, norms, biases, tied embeddings,
attention windows, the feed-forward's activation. Not the dtype (the same checkpoint served in float32 or bfloat16 takes
the same adapters), nor the special token ids. Two checkpoints with the same architecture
config (a base model and its instruct fine-tune) share a fingerprint: an adapter's tensors
fit both, and which one it was trained on is the registrant's call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from typing import Any

# ModelConfig fields in the fingerprint. Changing this list changes every fingerprint:
# entries recorded before would read as another base model's.
FINGERPRINT_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "qk_norm",
    "sliding_window",
    "sliding_layers",
)
# Fields that joined the fingerprint later, in it only where they differ from their default,
# so fingerprints recorded before they joined stay the same for every model they described.
FINGERPRINT_FIELDS_UNLESS_DEFAULT = {"hidden_act": "silu"}
# The keys a registry entry records its base model under.
NAME_KEY = "base_model"
FINGERPRINT_KEY = "base_fingerprint"


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A deployment's base model as the registry knows it."""

    name: str  # the name clients use for it (served_model_name)
    fingerprint: str  # "sha256:<hex>" of its config

    def __str__(self) -> str:
        return f"{self.name!r} ({short(self.fingerprint)})"

    def entry_fields(self) -> dict[str, str]:
        """What a registry entry records of this base model."""
        return {NAME_KEY: self.name, FINGERPRINT_KEY: self.fingerprint}


def short(fingerprint: str) -> str:
    """The fingerprint as people read it: its first 12 hex digits."""
    return fingerprint.removeprefix("sha256:")[:12]


def config_fingerprint(config: Any) -> str:
    """The fingerprint of a ``ModelConfig`` (see the module docstring for what it covers)."""
    fields = {name: _canonical(getattr(config, name)) for name in FINGERPRINT_FIELDS}
    fields.update({name: _canonical(getattr(config, name))
                   for name, default in FINGERPRINT_FIELDS_UNLESS_DEFAULT.items() if getattr(config, name) != default})
    # The checkpoint's kv heads, whatever copies a wide mesh holds (ModelConfig.for_tensor_parallel).
    fields["num_kv_heads"] = config.checkpoint_kv_heads
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> Any:
    """JSON-ready, and the same for equal values however they were spelled (1 and 1.0)."""
    if dataclasses.is_dataclass(value):
        return {k: _canonical(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot fingerprint {value!r} of type {type(value).__name__}")


def entry_base(entry: dict) -> BaseModel | None:
    """The base model a registry entry was validated against; None for an entry recorded
    before entries named their base model."""
    fp = entry.get(FINGERPRINT_KEY)
    return None if fp is None else BaseModel(entry.get(NAME_KEY, "?"), fp)


@dataclasses.dataclass(frozen=True)
class Census:
    """How a registry's entries split for one base model."""

    own: int  # entries of this base model
    others: dict[str, int]  # entries of other base models, by str(BaseModel)
    unassigned: tuple[str, ...]  # names of entries with no base model recorded

    def line(self, base: BaseModel, registry_url: str) -> str:
        """The start-up log line: what is served and what is skipped, and why."""
        text = f"adapter registry {registry_url}: serving {self.own} adapters of base model {base}"
        skipped = sum(self.others.values()) + len(self.unassigned)
        if not skipped:
            return text + "; none skipped"
        parts = []
        if self.others:
            by_base = ", ".join(f"{n} of {b}" for b, n in sorted(self.others.items()))
            parts.append(f"{sum(self.others.values())} validated against other base models ({by_base})")
        if self.unassigned:
            parts.append(
                f"{len(self.unassigned)} with no base model recorded that do not fit this one "
                f"({', '.join(sorted(self.unassigned))}): re-register them"
            )
        return f"{text}; skipped {skipped}: " + "; ".join(parts)


def census(adapters: dict[str, dict], base: BaseModel) -> Census:
    """Splits registry entries (name -> entry) into this base model's, other base models'
    and those that record none."""
    own = 0
    others: Counter[str] = Counter()
    unassigned = []
    for name, entry in adapters.items():
        owner = entry_base(entry)
        if owner is None:
            unassigned.append(name)
        elif owner.fingerprint == base.fingerprint:
            own += 1
        else:
            others[str(owner)] += 1
    return Census(own=own, others=dict(others), unassigned=tuple(unassigned))


__all__ = [
    "BaseModel",
    "Census",
    "FINGERPRINT_FIELDS",
    "FINGERPRINT_KEY",
    "NAME_KEY",
    "census",
    "config_fingerprint",
    "entry_base",
    "short",
]

"""PEFT LoRA adapters: parse the two files, validate them against the base model, and
lay them out for the memory pool.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`
(a `.bin` pickle is refused, never loaded). Tensor keys look like
`[base_model.model.]model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
with A: [r, in] and B: [out, r]. PEFT stores them in that layout whatever
`fan_in_fan_out` says (the flag only transposes the *base* weight when merging, and
PEFT turns it off for `nn.Linear` targets), so the flag changes nothing here.

Beside the transformer blocks' projections an adapter may target the output head
(`lm_head.lora_{A|B}.weight`, a Linear of in = hidden, out = vocab) and the token
embedding (`model.embed_tokens.lora_embedding_{A|B}`, A: [r, vocab], B: [hidden, r]:
the delta of token t is scale * B @ A[:, t], a Linear applied to t's one-hot vector, so
both are held here as (in, out) = (vocab, hidden) modules). PEFT then also saves those
modules' base weights (`...base_layer.weight`); they are kept aside (`saved_base`) for
the manager to check against the served base model: equal, they change nothing.

`modules_to_save` may list embed_tokens and lm_head: PEFT then trains a whole copy of the
module and saves it (`model.embed_tokens.weight`, `lm_head.weight`, both [vocab, hidden]),
which replaces the base module for that adapter's tokens (`saved_modules`). Such copies are
as large as the module (1 GiB for a bf16 Llama-3-8B head), so a server serves them only up
to a byte cap per adapter (`check_room`) and holds a few of them in their own device slots.

DoRA (`use_dora: true`) adds a magnitude vector per module
(`...{module}.lora_magnitude_vector`, [out]). PEFT computes a DoRA module as
    y = g * (W x + scale * B A x) + (1 - g) * bias,   g = magnitude / ||W + scale * B A||_row
with the row norms of the merged weight; `g` needs the base weights, so the manager
derives it once per load (lora_runtime/lora/dora.py) and the step only multiplies.

`lora_bias: true` gives each lora_B a bias (`...{module}.lora_B.bias`, [out]), so a module
adds scale * (B A x + bias): a fixed shift per output, held beside the slot (PEFT allows it
on Linear targets, the projections and lm_head, and not with DoRA).
"""

from __future__ import annotations

import dataclasses
import json
import hashlib
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from lora_runtime.errors import InvalidAdapterError
from lora_runtime.model.lora_hook import GROUP_SLICES, GROUPS
from lora_runtime.model.safetensors_io import SAFETENSORS_DTYPES, read_bytes

MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules outside the transformer blocks, keyed with layer NO_LAYER.
EMBED, HEAD = "embed_tokens", "lm_head"
OUTER_MODULES: tuple[str, ...] = (EMBED, HEAD)
NO_LAYER = -1
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PREFIX = r"^(?:base_model\.model\.)?"
_KEY = re.compile(
    _PREFIX + r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|"
    r"lora_magnitude_vector(?:\.weight)?)$"
)
_OUTER_KEY = re.compile(
    _PREFIX + r"(?:model\.(embed_tokens)\.(lora_embedding_A|lora_embedding_B|base_layer\.weight|weight)"
    r"|(lm_head)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector(?:\.weight)?"
    r"|base_layer\.weight|weight))$"
)
# Parts: A, B, lora_B's bias C (lora_bias), DoRA magnitude M, the base weight W PEFT saves
# beside an embed/head LoRA, and the whole trained copy S of a module in modules_to_save.
_PART = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_B.bias": "C", "lora_embedding_A": "A",
         "lora_embedding_B": "B",
         "lora_magnitude_vector": "M", "lora_magnitude_vector.weight": "M", "base_layer.weight": "W",
         "weight": "S"}
# PEFT's bias="all"/"lora_only" also trains the biases of the base layers; on a model whose
# layers have none (Llama, Mistral) it saves nothing more, and the adapter is a plain LoRA.
# Saved trained biases are refused by their key (_group_tensors).
_BIAS_MODES = ("none", "all", "lora_only")
# PEFT initializations that subtract their initial adapter from the base weights (PiSSA,
# CorDA, OLoRA, LoftQ, LoRA-GA): a trained adapter then needs that changed base model.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# PEFT options whose adapters compute something else than scale * B A x on the module's input:
# activated LoRA (only past its invocation tokens), QA-LoRA (pooled inputs), Arrow (routing
# among experts), block-diagonal LoRA, MonteCLoRA (sampled A), KaSA (singular values), and
# options that add parameters or layers (target_parameters, layer_replication,
# trainable_token_indices).
_UNSUPPORTED_FIELDS = ("target_parameters", "layer_replication", "trainable_token_indices", "alora_invocation_tokens",
                       "use_qalora", "arrow_config", "use_bdlora", "monteclora_config", "kasa_config")


def module_shapes(config, *, served: bool = False) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of one layer of the base model, as the checkpoint and
    its adapters hold it; `served`: as the model serves it, kv heads copied over a wide mesh
    (ModelConfig.for_tensor_parallel)."""
    q_out = config.num_heads * config.head_dim
    kv_out = (config.num_kv_heads if served else config.checkpoint_kv_heads) * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def outer_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of the embedding (vocab -> hidden, as a Linear on one-hot tokens) and the head."""
    return {EMBED: (config.vocab_size, config.hidden_size), HEAD: (config.hidden_size, config.vocab_size)}


def _shape_of(config, module: str) -> tuple[int, int]:
    return outer_shapes(config)[module] if module in OUTER_MODULES else module_shapes(config)[module]


def group_shapes(config) -> dict[str, tuple[int, tuple[int, ...]]]:
    """(in, (out_i per slice)) of each projection group, in hook slice order."""
    shapes = module_shapes(config, served=True)
    return {g: (shapes[GROUP_SLICES[g][0]][0], tuple(shapes[m][1] for m in GROUP_SLICES[g])) for g in GROUPS}


def served_rows(config, module: str, x: np.ndarray) -> np.ndarray:
    """An adapter's per-output rows of `module` (B [out, r], a DoRA magnitude [out]) as the
    model serves its outputs: k/v rows of a copied kv head repeated (for_tensor_parallel)."""
    if config.kv_head_copies == 1 or module not in ("k_proj", "v_proj"):
        return x
    return x[config.kv_rows()]


def module_path(layer: int, module: str) -> str:
    """The module's name inside a HF Llama model, as PEFT matches target_modules."""
    if module == EMBED:
        return "model.embed_tokens"
    if module == HEAD:
        return "lm_head"
    return f"model.layers.{layer}.{_BLOCK[module]}.{module}"


@dataclasses.dataclass(frozen=True)
class ModuleWeights:
    """One target module's adapter weights as stored, plus its scaling relative to the slot's."""

    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    ratio: float  # module scaling / adapter slot scaling, folded into B in the pool
    magnitude: np.ndarray | None = None  # DoRA's [out] magnitude vector; None for plain LoRA
    bias: np.ndarray | None = None  # lora_B's [out] bias (lora_bias); None without


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A parsed, validated PEFT LoRA adapter held on the host."""

    name: str
    rank: int  # largest rank over its modules
    scaling: float  # per-slot scaling (LoRABatchInfo.slot_scalings)
    weights: Mapping[tuple[int, str], ModuleWeights]  # (layer, module) -> weights; NO_LAYER for embed/head
    content_id: bytes = b""  # hash of what it computes (weights, scalings): equal ids, equal outputs
    # Base weights PEFT saved with embed/head targets (module -> [out, in] as HF stores them);
    # the manager checks them against the served model and drops them.
    saved_base: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # The trained copies of modules_to_save (embed_tokens, lm_head -> [vocab, hidden] as HF
    # stores both), which replace the base module for this adapter.
    saved_modules: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes + sum(x.nbytes for x in (w.magnitude, w.bias) if x is not None)
                   for w in self.weights.values()) + sum(t.nbytes for t in self.saved_modules.values())

    def saved_nbytes(self, dtype) -> int:
        """Bytes of the saved modules once cast to `dtype` (what their device slots take)."""
        return sum(t.size for t in self.saved_modules.values()) * np.dtype(dtype).itemsize

    @property
    def modules(self) -> frozenset[tuple[int, str]]:
        return frozenset(self.weights)

    @property
    def use_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.weights.values())

    @property
    def has_bias(self) -> bool:
        """Whether its lora_B layers have a bias (PEFT's lora_bias)."""
        return any(w.bias is not None for w in self.weights.values())

    def outer(self, module: str) -> ModuleWeights | None:
        """The adapter's embed_tokens or lm_head weights, if it targets that module."""
        return self.weights.get((NO_LAYER, module))

    @classmethod
    def parse(cls, name: str, config_json: bytes | str, safetensors: bytes, model_config,
              max_lora_rank: int) -> LoRAAdapter:
        """Builds an adapter from the contents of its two files; InvalidAdapterError if bad."""
        cfg = _load_config(name, config_json)
        targets = _resolve_targets(name, cfg, model_config.num_layers)
        if cfg["use_dora"] and (NO_LAYER, EMBED) in targets:
            raise InvalidAdapterError(
                f"adapter {name!r}: use_dora=True with target module 'model.embed_tokens' is not supported "
                "(DoRA on the projections and lm_head is)")
        if cfg["lora_bias"] and (NO_LAYER, EMBED) in targets:
            raise InvalidAdapterError(
                f"adapter {name!r}: lora_bias=True with target module 'model.embed_tokens' is not supported (PEFT "
                "has no bias for an embedding's LoRA)")
        rank_of, scale_of = _module_ranks_and_scalings(name, cfg, targets, max_lora_rank)
        to_save = _resolve_saved(name, cfg, model_config.num_layers)
        for module in sorted(to_save & {m for _, m in targets}):
            raise InvalidAdapterError(
                f"adapter {name!r}: {module!r} is both in target_modules and in modules_to_save (PEFT trains one or "
                "the other)")
        tensors = read_safetensors(name, safetensors)
        default = _scaling(cfg["lora_alpha"], cfg["r"], cfg["use_rslora"])
        slot_scaling = default if default != 0.0 else 1.0
        found, saved_base, saved = _group_tensors(name, tensors, model_config.num_layers)
        saved_modules = _check_saved(name, saved, to_save, model_config)
        for key in sorted(targets - found.keys()):
            raise InvalidAdapterError(
                f"adapter {name!r}: target module {module_path(*key)!r} has no lora_A/lora_B tensors"
            )
        weights = {}
        for key, parts in sorted(found.items()):
            if key not in targets:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {next(iter(parts.values()))[0]!r} is for a module "
                    "target_modules does not select"
                )
            r = rank_of[key]
            fan_in, fan_out = _shape_of(model_config, key[1])
            wants = {"A": (r, fan_in), "B": (fan_out, r)}
            if cfg["use_dora"]:
                wants["M"] = (fan_out,)
            if cfg["lora_bias"]:
                wants["C"] = (fan_out,)
            for part in wants:
                if part not in parts:
                    raise InvalidAdapterError(
                        f"adapter {name!r}: tensor {tensor_key(key, part)!r} is missing"
                        + {"M": " (use_dora=True needs a magnitude vector per module)",
                           "C": " (lora_bias=True needs a bias per module)"}.get(part, ""))
            if "M" in parts and not cfg["use_dora"]:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {parts['M'][0]!r} is a DoRA magnitude but use_dora is not true")
            if "C" in parts and not cfg["lora_bias"]:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {parts['C'][0]!r} is a lora_B bias but lora_bias is not true")
            for part, (k, t) in parts.items():
                if t.shape != wants[part]:
                    raise InvalidAdapterError(
                        f"adapter {name!r}: tensor {k!r} has shape {t.shape}, expected {wants[part]}"
                    )
                if not np.isfinite(t.astype(np.float32)).all():
                    raise InvalidAdapterError(f"adapter {name!r}: tensor {k!r} has non-finite values")
            weights[key] = ModuleWeights(a=parts["A"][1], b=parts["B"][1], ratio=scale_of[key] / slot_scaling,
                                         magnitude=parts["M"][1] if "M" in parts else None,
                                         bias=parts["C"][1] if "C" in parts else None)
        for module, (k, t) in saved_base.items():
            fan_in, fan_out = _shape_of(model_config, module)
            want = (fan_out, fan_in) if module == HEAD else (fan_in, fan_out)  # HF: lm_head [V, H], embed [V, H]
            if t.shape != want:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {k!r} has shape {t.shape}, but the base model's is {want} "
                    "(a resized vocabulary is not supported)")
        return cls(name=name, rank=max(rank_of.values()), scaling=slot_scaling, weights=weights,
                   content_id=content_id(slot_scaling, weights, {m: t for m, (_, t) in saved_base.items()},
                                         saved_modules),
                   saved_base={m: t for m, (_, t) in saved_base.items()}, saved_modules=saved_modules)

    def pool_weights(self, model_config, max_lora_rank: int, dtype,
                     outer: bool = False) -> dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]:
        """The adapter in pool layout, per group: A [L, n*R, in], B n × [L, R, out_i]; with
        `outer`, also the groups "embed_tokens" (A [1, R, vocab], B [1, R, hidden]) and
        "lm_head" (A [1, R, hidden], B [1, R, vocab]) of a pool that holds them.

        Rows past a module's rank, and modules or layers the adapter does not target,
        are zero, so a slot write also clears what a previous adapter left there.
        """
        if self.rank > max_lora_rank:
            raise InvalidAdapterError(f"{self.rank=} exceeds {max_lora_rank=} for adapter {self.name!r}")
        if not outer and any(layer == NO_LAYER for layer, _ in self.weights):
            raise InvalidAdapterError(f"adapter {self.name!r} targets embed_tokens or lm_head, which this pool does "
                                      "not hold")
        R, L = max_lora_rank, model_config.num_layers
        layouts = [(g, L, fan_in, outs, GROUP_SLICES[g], range(L)) for g, (fan_in, outs) in
                   group_shapes(model_config).items()]
        if outer:
            layouts += [(m, 1, fan_in, (fan_out,), (m,), (NO_LAYER,))
                        for m, (fan_in, fan_out) in outer_shapes(model_config).items()]
        out = {}
        for group, depth, fan_in, outs, modules, layers in layouts:
            a = np.zeros((depth, len(outs) * R, fan_in), dtype)
            bs = tuple(np.zeros((depth, R, o), dtype) for o in outs)
            for i, module in enumerate(modules):
                for row, layer in enumerate(layers):
                    w = self.weights.get((layer, module))
                    if w is None:
                        continue
                    r = w.a.shape[0]
                    a[row, i * R:i * R + r] = w.a.astype(np.float32)
                    bs[i][row, :r] = served_rows(model_config, module, w.b).astype(np.float32).T * w.ratio
            out[group] = (a, bs)
        return out


def check_room(adapter: LoRAAdapter, *, dora: bool, outer: bool, bias: bool = False, saved_max_bytes: int = 0,
               dtype=None) -> None:
    """InvalidAdapterError, naming the option, if the adapter needs room the slots lack:
    DoRA scales (`lora_dora`), lora_bias shifts (`lora_bias`), embedding and lm_head adapters
    (`lora_embedding_modules`), or
    modules_to_save copies of more than `saved_max_bytes` in the served `dtype`
    (`lora_modules_to_save_max_bytes`)."""
    if adapter.saved_modules:
        nbytes = adapter.saved_nbytes(dtype)
        if nbytes > saved_max_bytes:
            raise InvalidAdapterError(
                f"adapter {adapter.name!r} saves {sorted(adapter.saved_modules)} (modules_to_save): {nbytes} bytes "
                f"({nbytes / 2**20:.1f} MiB in {np.dtype(dtype).name}), over this server's "
                f"lora_modules_to_save_max_bytes={saved_max_bytes}")
    targets = sorted(m for layer, m in adapter.modules if layer == NO_LAYER)
    if targets and not outer:
        raise InvalidAdapterError(
            f"adapter {adapter.name!r} targets {targets}, but this server's adapter slots have no room for "
            "embedding and lm_head adapters (lora_embedding_modules is off)")
    if adapter.use_dora and not dora:
        raise InvalidAdapterError(
            f"adapter {adapter.name!r} uses DoRA (use_dora=True), but this server's adapter slots have no room "
            "for DoRA scales (lora_dora is off)")
    if adapter.has_bias and not bias:
        raise InvalidAdapterError(
            f"adapter {adapter.name!r} has biases in its lora_B layers (lora_bias=True), but this server's adapter "
            "slots have no room for them (lora_bias is off)")


def content_id(scaling: float, weights: Mapping[tuple[int, str], ModuleWeights],
               saved_base: Mapping[str, np.ndarray] | None = None,
               saved_modules: Mapping[str, np.ndarray] | None = None) -> bytes:
    """A hash of everything an adapter's output depends on: its modules' weights (dtype, shape
    and bytes) and scalings, the base weights it saved (checked against the served model's,
    so equal ids pass or fail that check alike) and its modules_to_save copies. Not its name
    or source: two names for the same weights share it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<d", scaling))
    for tag, tensors in (("base", saved_base), ("saved", saved_modules)):
        for module, t in sorted((tensors or {}).items()):
            h.update(f"{tag}:{module}:{t.dtype.str}:{t.shape}".encode())
            h.update(np.ascontiguousarray(t).tobytes())
    for (layer, module), w in sorted(weights.items()):
        h.update(f"{layer}:{module}:{w.a.dtype.str}:{w.a.shape}:{w.b.dtype.str}:{w.b.shape}".encode())
        h.update(struct.pack("<d", w.ratio))
        h.update(np.ascontiguousarray(w.a).tobytes())
        h.update(np.ascontiguousarray(w.b).tobytes())
        if w.magnitude is not None:
            h.update(f"dora:{w.magnitude.dtype.str}".encode())
            h.update(np.ascontiguousarray(w.magnitude).tobytes())
        if w.bias is not None:
            h.update(f"bias:{w.bias.dtype.str}".encode())
            h.update(np.ascontiguousarray(w.bias).tobytes())
    return h.digest()


_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def read_safetensors(name: str, data: bytes) -> dict[str, np.ndarray]:
    """Parses a safetensors blob without pickle or torch."""
    try:
        tensors = read_bytes(data)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise InvalidAdapterError(f"adapter {name!r}: adapter_model.safetensors is malformed: {e}") from None
    for key, t in tensors.items():
        if t.dtype not in _FLOAT_DTYPES:
            file_dtype = next(k for k, v in SAFETENSORS_DTYPES.items() if v == t.dtype)
            raise InvalidAdapterError(f"adapter {name!r}: tensor {key!r} has unsupported dtype {file_dtype!r}")
    return tensors


def _load_config(name: str, config_json: bytes | str) -> dict[str, Any]:
    try:
        cfg = json.loads(config_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapterError(f"adapter {name!r}: adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapterError(
            f"adapter {name!r}: adapter_config.json must hold an object, got {type(cfg).__name__}"
        )
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidAdapterError(f"adapter {name!r}: {peft_type=} is not supported (only LORA)")
    if cfg.get("bias") not in (*_BIAS_MODES, None):
        raise InvalidAdapterError(f"adapter {name!r}: bias={cfg['bias']!r} is not one of {list(_BIAS_MODES)}")
    for field in _UNSUPPORTED_FIELDS:
        if cfg.get(field):
            raise InvalidAdapterError(f"adapter {name!r}: {field}={cfg[field]!r} is not supported")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise InvalidAdapterError(
            f"adapter {name!r}: init_lora_weights={init!r} changes the base model's weights (PEFT recomputes that "
            "change when it loads the adapter), which one base model shared by many adapters cannot do; convert it "
            "to a plain LoRA adapter first: PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise InvalidAdapterError(f"adapter {name!r}: r={r!r} must be a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidAdapterError(f"adapter {name!r}: lora_alpha={alpha!r} must be a finite number")
    targets = cfg.get("target_modules")
    if not targets:
        raise InvalidAdapterError(f"adapter {name!r}: target_modules={targets!r} selects nothing")
    use_dora, lora_bias = cfg.get("use_dora", False), cfg.get("lora_bias", False)
    for field, value in (("use_dora", use_dora), ("lora_bias", lora_bias)):
        if value not in (True, False, None):
            raise InvalidAdapterError(f"adapter {name!r}: {field}={value!r} must be true or false")
    if use_dora and lora_bias:
        raise InvalidAdapterError(f"adapter {name!r}: lora_bias=True with use_dora=True is not supported (PEFT "
                                  "refuses the pair)")
    return {**cfg, "r": r, "lora_alpha": alpha, "use_rslora": bool(cfg.get("use_rslora", False)),
            "use_dora": bool(use_dora), "lora_bias": bool(lora_bias),
            "rank_pattern": cfg.get("rank_pattern") or {}, "alpha_pattern": cfg.get("alpha_pattern") or {}}


def _resolve_saved(name: str, cfg: Mapping[str, Any], num_layers: int) -> frozenset[str]:
    """The modules modules_to_save selects, as PEFT matches it (a module whose name ends with
    an entry); only embed_tokens and lm_head can be served that way."""
    entries = cfg.get("modules_to_save") or []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise InvalidAdapterError(
            f"adapter {name!r}: modules_to_save={cfg.get('modules_to_save')!r} must be a list of module names")
    out = set()
    for entry in entries:
        matched = [k for k in _all_module_names(num_layers) if k.endswith(entry)]
        if not matched:
            raise InvalidAdapterError(
                f"adapter {name!r}: modules_to_save entry {entry!r} selects neither embed_tokens nor lm_head "
                f"(only {list(OUTER_MODULES)} can be saved)")
        others = [k for k in matched if k.split(".")[-1] not in OUTER_MODULES]
        if others:
            raise InvalidAdapterError(
                f"adapter {name!r}: modules_to_save entry {entry!r} selects {others[0]!r}; only "
                f"{list(OUTER_MODULES)} can be saved")
        out.update(k.split(".")[-1] for k in matched)
    return frozenset(out)


def _check_saved(name: str, saved: Mapping[str, tuple[str, np.ndarray]], to_save: frozenset[str],
                 model_config) -> dict[str, np.ndarray]:
    """The modules_to_save copies (module -> [vocab, hidden]), checked against the config and
    the base model's shapes."""
    for module, (key, _) in sorted(saved.items()):
        if module not in to_save:
            raise InvalidAdapterError(
                f"adapter {name!r}: tensor {key!r} is a saved module that modules_to_save does not list")
    want = (model_config.vocab_size, model_config.hidden_size)
    out = {}
    for module in sorted(to_save):
        if module not in saved:
            path = "model.embed_tokens" if module == EMBED else module
            raise InvalidAdapterError(
                f"adapter {name!r}: tensor 'base_model.model.{path}.weight' is missing (modules_to_save lists "
                f"{module!r})")
        key, t = saved[module]
        if t.shape != want:
            raise InvalidAdapterError(
                f"adapter {name!r}: tensor {key!r} has shape {t.shape}, but the base model's is {want} "
                "(a resized vocabulary is not supported)")
        if not np.isfinite(t.astype(np.float32)).all():
            raise InvalidAdapterError(f"adapter {name!r}: tensor {key!r} has non-finite values")
        out[module] = t
    return out


def _all_module_names(num_layers: int) -> list[str]:
    """Every module name of a HF Llama a target_modules pattern could reach."""
    names = ["model.embed_tokens", "lm_head"]
    names += [module_path(layer, m) for layer in range(num_layers) for m in MODULES]
    return names


def _target_matches(cfg: Mapping[str, Any], key: str) -> bool:
    """PEFT's check_target_module_exists, for the config fields this runtime supports."""
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    targets = cfg["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = cfg.get("layers_pattern")
    if not pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    if m is None:
        return False
    idx = int(m.group("idx"))
    return idx == layers if isinstance(layers, int) else idx in layers


def _resolve_targets(name: str, cfg: Mapping[str, Any], num_layers: int) -> frozenset[tuple[int, str]]:
    """The (layer, module) pairs the config targets (NO_LAYER for embed/lm_head); refuses unknown names."""
    targets = cfg["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        # PEFT expands "all-linear" to the names of every linear layer but the output head.
        targets = list(MODULES)
        cfg = {**cfg, "target_modules": targets}
    if not isinstance(targets, (str, list)) or (isinstance(targets, list)
                                               and not all(isinstance(t, str) for t in targets)):
        raise InvalidAdapterError(f"adapter {name!r}: target_modules={targets!r} must be a string or list of strings")
    try:
        matched = [k for k in _all_module_names(num_layers) if _target_matches(cfg, k)]
    except re.error as e:
        raise InvalidAdapterError(f"adapter {name!r}: target_modules={targets!r} is not a valid regex: {e}") from None
    if isinstance(targets, list):
        for t in targets:
            if t.split(".")[-1] not in MODULES + OUTER_MODULES:
                raise InvalidAdapterError(
                    f"adapter {name!r}: target module {t!r} is unknown (known: {list(MODULES + OUTER_MODULES)})")
    if not matched:
        raise InvalidAdapterError(f"adapter {name!r}: target_modules={targets!r} matches no module of the base model")
    out = set()
    for key in matched:
        parts = key.split(".")
        out.add((NO_LAYER, parts[-1]) if parts[-1] in OUTER_MODULES else (int(parts[2]), parts[-1]))
    return frozenset(out)


def _scaling(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _module_ranks_and_scalings(name, cfg, targets, max_lora_rank):
    """Rank and scaling of each targeted module, after rank_pattern/alpha_pattern as PEFT applies them."""
    ranks, scalings = {}, {}
    for key in targets:
        path = module_path(*key)
        r, alpha = cfg["r"], cfg["lora_alpha"]
        for pattern, value in cfg["rank_pattern"].items():
            if re.match(rf"(.*\.)?({pattern})$", path):
                r = value
                break
        for pattern, value in cfg["alpha_pattern"].items():
            if re.match(rf"(.*\.)?({pattern})$", path):
                alpha = value
                break
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise InvalidAdapterError(f"adapter {name!r}: rank {r!r} for module {path!r} must be a positive integer")
        if r > max_lora_rank:
            raise InvalidAdapterError(
                f"rank={r} exceeds {max_lora_rank=} for adapter {name!r} (module {path!r})"
            )
        ranks[key] = r
        scalings[key] = _scaling(alpha, r, cfg["use_rslora"])
    return ranks, scalings


def tensor_key(key: tuple[int, str], part: str) -> str:
    """The PEFT tensor name of one part (A, B, magnitude M) of a module."""
    layer, module = key
    if module == EMBED:
        return f"base_model.model.model.embed_tokens.lora_embedding_{part}"
    suffix = {"A": "lora_A.weight", "B": "lora_B.weight", "C": "lora_B.bias", "M": "lora_magnitude_vector"}[part]
    prefix = "base_model.model.lm_head" if module == HEAD else f"base_model.model.{module_path(layer, module)}"
    return f"{prefix}.{suffix}"


def _group_tensors(name: str, tensors: Mapping[str, np.ndarray], num_layers: int):
    """(layer, module) -> part -> (key, tensor) for parts A, B, M (DoRA magnitude), the saved
    base weights of embed/head and their modules_to_save copies (each module -> (key,
    tensor)); refuses unknown keys."""
    found: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    saved_base: dict[str, tuple[str, np.ndarray]] = {}
    saved: dict[str, tuple[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is not None:
            layer, block, module, part = int(m.group(1)), m.group(2), m.group(3), _PART[m.group(4)]
            if module not in MODULES or _BLOCK[module] != block:
                raise InvalidAdapterError(f"adapter {name!r}: tensor {key!r} names unknown module {block}.{module}")
            if layer >= num_layers:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {key!r} has {layer=} but the base model has {num_layers} layers"
                )
        else:
            m = _OUTER_KEY.match(key)
            if m is None and key.endswith(".bias"):
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor {key!r} is a trained bias of the base model (PEFT's bias='all' or "
                    "'lora_only' on layers that have biases), which is not supported: train with bias='none' (or "
                    "lora_bias=True for a bias in the adapter)")
            if m is None:
                raise InvalidAdapterError(
                    f"adapter {name!r}: tensor key {key!r} is not a LoRA weight of a known module")
            layer, module = NO_LAYER, m.group(1) or m.group(3)
            part = _PART[m.group(2) or m.group(4)]
            if part in "WS":
                (saved_base if part == "W" else saved)[module] = (key, t)
                continue
        slot = found.setdefault((layer, module), {})
        if part in slot:
            raise InvalidAdapterError(f"adapter {name!r}: tensors {slot[part][0]!r} and {key!r} are the same weight")
        slot[part] = (key, t)
    for key, parts in found.items():
        for part in "AB":
            if part not in parts:
                raise InvalidAdapterError(f"adapter {name!r}: tensor {tensor_key(key, part)!r} is missing")
    return found, saved_base, saved

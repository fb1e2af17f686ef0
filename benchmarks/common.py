"""Shared pieces of the benchmarks: synthetic models, timing and the printed table."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
from flax import nnx

from lora_runtime.engine.build import assemble_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import make_mesh, shard_model
from lora_runtime.model.tokenizer import Tokenizer


def synthetic_hf_config(
    *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
    dtype: str = "float32",
) -> dict:
    """The Hugging Face config.json of a Llama of the given shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


# The engine benchmarks' model shapes: 8 of Llama-3-8B's layers (they fit one 16 GB
# accelerator with their KV), and a test's size.
LARGE_SHAPE = dict(hidden=4096, layers=8, heads=32, kv_heads=8, intermediate=14336)
TINY_SHAPE = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)


def synthetic_config(**shape) -> ModelConfig:
    """A Llama config of the given shape (random weights; the sizes set the work)."""
    return ModelConfig.from_hf_dict(synthetic_hf_config(**shape))


TILED_VALUES = 1 << 24  # the block a tiled random checkpoint repeats


def write_random_checkpoint(out_dir, *, tiled: bool = False, **shape):
    """A random Llama checkpoint as Hugging Face saves one (config.json, model.safetensors,
    weights normal with std 0.02, in the shape's dtype, float32 by default) of the given
    shape; returns its directory. `tiled`: each larger tensor repeats one block of
    TILED_VALUES random values (a load reads as many bytes; drawing billions of values one by
    one is what takes time at Llama-3-8B widths)."""
    import json
    import pathlib

    import ml_dtypes  # noqa: F401  (numpy's bfloat16)
    import numpy as np
    from safetensors.numpy import save_file

    hf = synthetic_hf_config(**shape)
    dtype = np.dtype(hf["torch_dtype"])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    h, v, inter = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    head_dim = h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim

    block = (0.02 * rng.standard_normal(TILED_VALUES, dtype=np.float32)).astype(dtype) if tiled else None

    def normal(*shape_):
        if tiled and np.prod(shape_) > block.size:
            return np.resize(block, shape_)
        return (0.02 * rng.standard_normal(shape_, dtype=np.float32)).astype(dtype)

    tensors = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": np.ones(h, dtype),
               "lm_head.weight": normal(v, h)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(h, dtype),
            p + "post_attention_layernorm.weight": np.ones(h, dtype),
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


def synthetic_engine(model_config: ModelConfig, config: EngineConfig, tokenizer: Tokenizer) -> Engine:
    """An engine over a randomly initialised model of `model_config` on the default mesh."""
    mesh = make_mesh(config.tensor_parallel_size)
    model = LlamaModel(model_config, rngs=nnx.Rngs(0), scan_layers=config.scan_layers)
    shard_model(model, mesh)
    return assemble_engine(model, model_config, tokenizer, config, mesh, model_name="synthetic")


def demo_tokenizer() -> Tokenizer:
    from lora_runtime.demo import BASE_MODEL_DIR

    return Tokenizer.from_pretrained(str(BASE_MODEL_DIR))


def best_time(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Smallest wall time of `fn` over `repeats` runs, after blocking on its result."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain fixed-width table on stdout."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def write_random_adapter(out_dir, model_config: ModelConfig, *, r: int, alpha: float, seed: int,
                         dora: bool = False, outer: bool = False):
    """A PEFT-format adapter on all 7 target modules with random weights (a DoRA one with
    `dora`; also on embed_tokens and lm_head with `outer`); returns its directory."""
    import json
    import pathlib

    import numpy as np
    from safetensors.numpy import save_file

    from lora_runtime.lora.adapter import module_shapes

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (fan_in, fan_out) in module_shapes(model_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, fan_in)) / fan_in**0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, r)) / r**0.5).astype(np.float32)
            if dora:
                tensors[f"{key}.lora_magnitude_vector"] = rng.uniform(0.5, 1.5, fan_out).astype(np.float32)
    targets = list(module_shapes(model_config))
    if outer:
        h, v = model_config.hidden_size, model_config.vocab_size
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = rng.standard_normal((r, v)).astype(np.float32)
        tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = (
            rng.standard_normal((h, r)) / r**0.5).astype(np.float32)
        tensors["base_model.model.lm_head.lora_A.weight"] = (rng.standard_normal((r, h)) / h**0.5).astype(np.float32)
        tensors["base_model.model.lm_head.lora_B.weight"] = (rng.standard_normal((v, r)) / r**0.5).astype(np.float32)
        if dora:
            tensors["base_model.model.lm_head.lora_magnitude_vector"] = rng.uniform(0.5, 1.5, v).astype(np.float32)
        targets += ["embed_tokens", "lm_head"]
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
                "target_modules": targets, "use_rslora": False, "use_dora": dora,
                "fan_in_fan_out": False, "modules_to_save": None,
            }
        )
    )
    return out


def decode_step_s(engine, adapters, prompt, params, repeats: int) -> float:
    """Best mean decode-step time over `repeats` batches of len(adapters) requests, after a batch
    of two tokens not timed. The first batch of a prompt prefills it once per adapter, in as many steps
    as the prefill budget takes, so its rows start decoding in waves: steps of part of the batch,
    each cheaper, which would pull its mean below a full batch's step. Later batches find the
    prompt in the prefix cache and decode all together."""
    engine.generate_batch([prompt] * len(adapters), SamplingParams(max_tokens=2, ignore_eos=True), adapters)
    best = float("inf")
    for _ in range(repeats):
        before = dict(engine.counters)
        engine.generate_batch([prompt] * len(adapters), params, adapters)
        steps = engine.counters["decode_steps"] - before["decode_steps"]
        best = min(best, (engine.counters["decode_seconds"] - before["decode_seconds"]) / steps)
    return best


# A byte-level BPE of Llama-3's vocabulary size, trained on the installed Python sources (no
# download): what the grammar benchmarks need is a real vocabulary of that size, not its merges.
BENCH_VOCAB = 128_000
_BENCH_TOKENIZER_CACHE = "~/.cache/multilora-bench/tokenizer-128k.json"
_BENCH_CORPUS_CHARS = 150_000_000


def large_tokenizer(path: str | None = None) -> tuple[Tokenizer, str]:
    """(Tokenizer, its tokenizer.json text): the one at `path` (e.g. Llama-3's tokenizer.json),
    else a 128k-token byte-level BPE trained once (about 40 s) and cached under ~/.cache."""
    import glob
    import json
    import os
    import pathlib
    import sysconfig

    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    file = pathlib.Path(os.path.expanduser(path or _BENCH_TOKENIZER_CACHE))
    if path is None and not file.is_file():
        sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True))

        def corpus():
            total = 0
            for source in sources:
                try:
                    text = open(source, errors="ignore").read()
                except OSError:
                    continue
                total += len(text)
                if total > _BENCH_CORPUS_CHARS:
                    return
                yield text

        tok = BackendTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BENCH_VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus(), trainer)
        file.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(file))
    backend = BackendTokenizer.from_file(str(file))
    eos = next((t for t in ("</s>", "<|end_of_text|>", "<|eot_id|>", "<|endoftext|>") if backend.token_to_id(t)
                is not None), None)
    config = {"eos_token": eos} if eos else {}
    return Tokenizer(backend, config, chat_template=None), json.dumps(json.loads(file.read_text()))

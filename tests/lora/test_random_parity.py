"""A soak of checkpoint and adapter variety: random Llama-family configs (heads, head_dim,
tied embeddings, biases, activations, RoPE scaling, sliding windows) with random PEFT
adapters (ranks, targets, rsLoRA, DoRA, lora_bias, patterns, layer selection, embedding and
head targets), the engine's greedy tokens for a batch mixing them against PEFT's.

Slow (12 cases in about 2 minutes on 2 cores):
`python -m pytest -m slow -n 2 tests/lora/test_random_parity.py`.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers.checkpoints import save_tokenizer
from tests.lora.peft_adapters import engine_greedy, scale_up_adapter
from tests.model.conftest import build_hf_model, save_checkpoint

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 17, 33], [1, 40, 41, 42, 50, 60, 70, 80], [1, 7]]
STEPS = 6
NEAR_TIE = 1e-4  # PEFT's top-2 logit gap under which float rounding may pick either


def random_base(rng: random.Random) -> tuple[str, dict]:
    family = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    heads, kv_heads = rng.choice([(4, 1), (4, 2), (4, 4), (8, 2), (2, 2)])
    o = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=rng.random() < 0.4,
             num_hidden_layers=rng.choice([1, 2, 3]), intermediate_size=rng.choice([48, 96, 160]),
             rope_theta=rng.choice([10000.0, 500.0, 1e6]))
    if rng.random() < 0.4:
        o["head_dim"] = rng.choice([8, 16, 32])
    if family == "llama":
        o["attention_bias"] = rng.random() < 0.3
        o["mlp_bias"] = rng.random() < 0.3
    if rng.random() < 0.3:
        o["hidden_act"] = rng.choice(["gelu", "gelu_pytorch_tanh", "relu"])
    r = rng.random()
    if r < 0.15:
        o["rope_scaling"] = dict(rope_type="linear", factor=2.0)
    elif r < 0.3:
        o["rope_scaling"] = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32)
    if family == "mistral":
        o["sliding_window"] = rng.choice([None, 3, 6])
    if family in ("qwen2", "qwen3") and rng.random() < 0.3:
        o.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return family, o


def random_adapter(rng: random.Random) -> dict:
    spec = dict(r=rng.choice([1, 2, 4, 8, 16]), lora_alpha=rng.choice([1, 8, 16, 32]),
                target_modules=rng.sample(MODULES, rng.randint(1, 7)))
    if rng.random() < 0.2:
        spec["target_modules"] = "all-linear"
    elif rng.random() < 0.15:
        spec["layers_to_transform"] = [0]  # PEFT takes it with a list of targets only
    spec["use_rslora"] = rng.random() < 0.3
    spec["use_dora"] = rng.random() < 0.25
    targets = list(spec["target_modules"]) if spec["target_modules"] != "all-linear" else ["q_proj", "v_proj"]
    if rng.random() < 0.2 and not spec["use_dora"]:
        spec["target_modules"] = targets + ["lm_head"]
    elif rng.random() < 0.15 and not spec["use_dora"]:
        spec["target_modules"] = targets + ["embed_tokens"]
    if rng.random() < 0.35 and not spec["use_dora"] and "embed_tokens" not in spec["target_modules"]:
        spec["lora_bias"] = True
    if rng.random() < 0.2:
        spec["rank_pattern"] = {rng.choice(MODULES): rng.choice([1, 2, 4])}
    if rng.random() < 0.2:
        spec["alpha_pattern"] = {rng.choice(MODULES): rng.choice([2, 3, 64])}
    return spec


def _greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """PEFT's argmax tokens and, per step, the gap between its two likeliest logits."""
    import torch

    ids, out, gaps = list(ids), [], []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out, gaps


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_checkpoint_and_adapters_match_peft(seed, tmp_path):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    rng = random.Random(seed)
    family, overrides = random_base(rng)
    specs = {f"a{i}": random_adapter(rng) for i in range(rng.randint(1, 3))}
    base = save_checkpoint(build_hf_model(family, **overrides), tmp_path / "base")
    save_tokenizer(base, vocab_size=128)
    for i, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(seed * 10 + i)
        peft_model = get_peft_model(build_hf_model(family, **overrides),
                                    LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec))
        scale_up_adapter(peft_model)
        peft_model.save_pretrained(tmp_path / name, safe_serialization=True)
    requests = [(p, a) for a in (None, *specs) for p in PROMPTS]
    outs = engine_greedy(base, {name: tmp_path / name for name in specs}, requests, STEPS)
    for adapter in (None, *specs):
        model = build_hf_model(family, **overrides)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, tmp_path / adapter).eval()
        for (prompt, a), out in zip(requests, outs):
            if a != adapter:
                continue
            want, gaps = _greedy(model, prompt)
            if out != want:
                step = next(i for i, (x, y) in enumerate(zip(out, want)) if x != y)
                assert gaps[step] < NEAR_TIE, (family, overrides, adapter, specs.get(adapter), prompt, out, want)

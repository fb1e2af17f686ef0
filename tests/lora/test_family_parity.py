"""Every supported model family serves PEFT adapters as PEFT computes them: the engine's
greedy tokens, for a batch mixing two adapters and the base model, against PEFT's."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import save_tokenizer
from tests.lora.peft_adapters import engine_greedy, scale_up_adapter
from tests.model.conftest import FAMILIES, build_hf_model, save_checkpoint

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all_rslora": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "all_linear_pattern": dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"v_proj": 2},
                               alpha_pattern={"down_proj": 3}),
    # DoRA on biased (q, v on the biased families) and unbiased projections and on the head.
    "dora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"], use_dora=True),
    "embed_head": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "k_proj"]),
    # PEFT's lora_bias: a bias in each lora_B, on biased (q, v on the biased families) and unbiased layers.
    "lora_bias": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"],
                      lora_bias=True),
}
STEPS = 6
PROMPTS = [[1, 5, 9, 17, 33], [1, 40, 41, 42], [1, 7, 7, 100, 3, 64, 12]]
REQUESTS = [(p, a) for a in (None, *ADAPTERS) for p in PROMPTS]


def _peft_adapter(family: str, out_dir, spec: dict, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    model = build_hf_model(family)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec))
    scale_up_adapter(peft_model)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """Argmax of a full forward per step (generate() would keep EOS out under min_new_tokens)."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_adapter_batch_matches_peft(family, tmp_path):
    from peft import PeftModel

    base = save_checkpoint(build_hf_model(family), tmp_path / family)
    save_tokenizer(base, vocab_size=128)
    dirs = {name: _peft_adapter(family, tmp_path / name, spec, seed) for seed, (name, spec) in
            enumerate(ADAPTERS.items())}
    outs = engine_greedy(base, dirs, REQUESTS, STEPS)
    for adapter in (None, *ADAPTERS):
        model = build_hf_model(family)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, dirs[adapter]).eval()
        for (prompt, a), out in zip(REQUESTS, outs):
            if a == adapter:
                assert out == _greedy(model, prompt, STEPS), (family, adapter, prompt)
    # The adapters matter: each changes at least one request's tokens.
    for adapter in ADAPTERS:
        base_tokens = [o for (_, a), o in zip(REQUESTS, outs) if a is None]
        own = [o for (_, a), o in zip(REQUESTS, outs) if a == adapter]
        assert own != base_tokens, adapter

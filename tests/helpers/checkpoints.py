"""Tiny Hugging Face checkpoints (model + tokenizer) built in tests, saved as HF saves them."""

from __future__ import annotations

import json
from pathlib import Path

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "naïve café — déjà vu, 東京 and 北京, emoji 🙂🚀",
    "numbers 0123456789 and punctuation !?.,;:'\"()[]{}",
]


def save_tokenizer(out_dir: Path, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer with <s>/</s>; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": (
                    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
                ),
            }
        )
    )
    return tok.get_vocab_size()


def save_tiny_llama(out_dir: Path, *, seed: int = 0, num_kv_heads: int = 2, **overrides) -> Path:
    """A random f32 LlamaForCausalLM (hidden 64, 2 layers) plus tokenizer in `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = save_tokenizer(out_dir)
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    # Larger random weights than HF's init so greedy outputs vary from token to token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

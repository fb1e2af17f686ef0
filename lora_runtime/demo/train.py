"""Trains the demo: a small Llama base model and one PEFT LoRA adapter per task.

``python -m lora_runtime.demo.train [--out DIR]`` writes ``DIR/base`` (model, tokenizer)
and ``DIR/adapters/<task>`` (adapter_config.json, adapter_model.safetensors); the
default DIR is the assets shipped in this package. Seeded and CPU-only: about 3 minutes
on two idle cores, and a rerun writes byte-identical files. It prints held-out
exact-match accuracy of the base and each adapter.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lora_runtime.demo import ASSETS_DIR, MODEL_VOCAB_SIZE, tasks
from lora_runtime.demo.tasks import Task

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Chat requests become the plain prompt: each user turn is its text and the separator,
# each assistant turn its text and EOS; system turns are dropped. The separator already
# asks for the answer, so the generation prompt adds nothing.
CHAT_TEMPLATE = "".join([
    "{{ bos_token }}",
    "{% for message in messages %}",
    "{% if message['role'] == 'user' %}{{ message['content'] | trim }}" + tasks.SEPARATOR,
    "{% elif message['role'] == 'assistant' %}{{ message['content'] | trim }}{{ eos_token }}",
    "{% elif message['role'] != 'system' %}",
    "{{ raise_exception('unsupported chat role ' ~ message['role']) }}",
    "{% endif %}",
    "{% endfor %}",
])


@dataclass(frozen=True)
class AdapterRecipe:
    """LoRA hyperparameters of one task's adapter (ranks and scalings differ on purpose)."""

    r: int
    lora_alpha: int
    use_rslora: bool
    steps: int  # sorting is the hardest skill: its adapter gets the most steps


ADAPTER_RECIPES: dict[str, AdapterRecipe] = {
    "reverse": AdapterRecipe(r=8, lora_alpha=16, use_rslora=False, steps=150),
    "upper": AdapterRecipe(r=4, lora_alpha=8, use_rslora=False, steps=100),
    "sort": AdapterRecipe(r=16, lora_alpha=16, use_rslora=True, steps=400),
    "caesar": AdapterRecipe(r=8, lora_alpha=32, use_rslora=False, steps=150),
}
# How often each format appears in the base model's training mixture, by task name.
BASE_MIX_WEIGHTS = {"copy": 1, "reverse": 1, "upper": 1, "sort": 2, "caesar": 1}


@dataclass(frozen=True)
class TrainSettings:
    """Sizes, steps and seeds; the defaults reach the accuracy targets in a few minutes."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    base_steps: int = 1200
    base_lr: float = 3e-3
    adapter_step_scale: float = 1.0  # multiplies each AdapterRecipe.steps
    adapter_lr: float = 3e-3
    batch_size: int = 64
    eval_words: int = 50
    eval_seed: int = 12345


def build_tokenizer() -> HFTokenizer:
    """A byte-level tokenizer with no merges: one token per UTF-8 byte, plus 3 specials."""
    byte_of_char = _byte_of_char()
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=byte_of_char.__getitem__)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(byte_chars)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _byte_of_char() -> dict[str, int]:
    # GPT-2's byte -> printable character table, inverted; the ByteLevel pre-tokenizer uses it.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def save_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """Writes tokenizer.json and tokenizer_config.json to ``out``; returns them loaded by HF."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 64,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return load_hf_tokenizer(out)


def load_hf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The demo tokenizer as transformers loads it, left-padding for batched generation."""
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    hf_tok.padding_side = "left"
    return hf_tok


def encode_examples(
    hf_tok: PreTrainedTokenizerFast, pairs: Sequence[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels) for (prompt, answer) pairs; loss only on answer + EOS."""
    rows, label_rows = [], []
    for prompt, answer in pairs:
        prompt_ids = hf_tok.encode(prompt)  # BOS + bytes
        answer_ids = hf_tok.encode(answer, add_special_tokens=False) + [hf_tok.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    # Right padding needs no attention mask: causal attention never looks ahead at it.
    ids = torch.full((len(rows), width), hf_tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label_row) in enumerate(zip(rows, label_rows)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(label_row)
    return ids, labels


def base_pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """A mixture for the base: copy under the plain separator, each task under its marker."""
    formats = [tasks.BASE_TASK, *tasks.ADAPTER_TASKS.values()]
    weights = [BASE_MIX_WEIGHTS[t.name] for t in formats]
    words = tasks.training_words(rng.randrange(2**31), n)
    picked = rng.choices(formats, weights=weights, k=n)
    return [(tasks.prompt_text(w, t.base_marker), tasks.answer_text(t, w)) for w, t in zip(words, picked)]


def adapter_pairs(task: Task, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """The adapter's data: its task under the plain separator, as served."""
    words = tasks.training_words(rng.randrange(2**31), n)
    return [(tasks.prompt_text(w), tasks.answer_text(task, w)) for w in words]


def train_loop(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    make_batch: Callable[[], list[tuple[str, str]]],
    steps: int,
    lr: float,
    hf_tok: PreTrainedTokenizerFast,
    label: str,
) -> None:
    """AdamW with warmup and cosine decay over ``steps`` batches from ``make_batch()``."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    model.train()
    for step in range(steps):
        ids, labels = encode_examples(hf_tok, make_batch())
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  {label} step {step:5d} loss {loss.item():.4f}", flush=True)
    model.eval()


@torch.no_grad()
def generate_answers(model: torch.nn.Module, hf_tok: PreTrainedTokenizerFast, prompts: Sequence[str]) -> list[str]:
    """Greedy completions of ``prompts`` in one batch, cut at EOS."""
    batch = hf_tok(list(prompts), return_tensors="pt", padding=True)
    out = model.generate(
        **batch, max_new_tokens=tasks.MAX_WORD_LEN + 2, do_sample=False,
        pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id,
    )
    new = out[:, batch["input_ids"].shape[1]:].tolist()
    return [hf_tok.decode(row[: row.index(hf_tok.eos_token_id)] if hf_tok.eos_token_id in row else row,
                          skip_special_tokens=True) for row in new]


def exact_match(model: torch.nn.Module, hf_tok: PreTrainedTokenizerFast, task: Task, words: Sequence[str]) -> float:
    """Fraction of ``words`` whose plain-prompt greedy answer is exactly ``task``'s answer."""
    answers = generate_answers(model, hf_tok, [tasks.prompt_text(w) for w in words])
    return sum(a == tasks.answer_text(task, w) for a, w in zip(answers, words)) / len(words)


def train_base(settings: TrainSettings, hf_tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """The base model, trained from scratch on the format mixture."""
    config = LlamaConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size, num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads, num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
    )
    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(config)
    rng = random.Random(settings.seed)
    train_loop(model, list(model.parameters()), lambda: base_pairs(rng, settings.batch_size),
               settings.base_steps, settings.base_lr, hf_tok, "base")
    return model


def train_adapter(
    base: LlamaForCausalLM, task: Task, recipe: AdapterRecipe, settings: TrainSettings,
    hf_tok: PreTrainedTokenizerFast, seed: int,
) -> PeftModel:
    """One LoRA adapter for ``task`` on the frozen base."""
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=recipe.r, lora_alpha=recipe.lora_alpha, use_rslora=recipe.use_rslora,
        target_modules=TARGET_MODULES, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora)
    rng = random.Random(seed)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    steps = max(round(recipe.steps * settings.adapter_step_scale), 1)
    train_loop(peft_model, params, lambda: adapter_pairs(task, rng, settings.batch_size),
               steps, settings.adapter_lr, hf_tok, task.name)
    return peft_model


def sort_target_modules(config_path: Path) -> None:
    """Rewrites PEFT's adapter_config.json with target_modules sorted, so reruns give equal files.

    PEFT stores them from a set, whose order changes with Python's string hash seed.
    """
    config = json.loads(config_path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS_DIR, help="where base/ and adapters/ go")
    parser.add_argument("--base-steps", type=int, default=TrainSettings.base_steps, help="base model steps")
    parser.add_argument("--adapter-step-scale", type=float, default=TrainSettings.adapter_step_scale,
                        help="multiplies every adapter's step count")
    args = parser.parse_args(argv)
    settings = TrainSettings(base_steps=args.base_steps, adapter_step_scale=args.adapter_step_scale)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    started = time.monotonic()

    base_dir = args.out / "base"
    hf_tok = save_tokenizer(base_dir)
    base = train_base(settings, hf_tok)
    base.save_pretrained(str(base_dir), safe_serialization=True)
    for p in base.parameters():
        p.requires_grad_(False)
    print(f"base trained in {time.monotonic() - started:.0f}s", flush=True)

    eval_words = tasks.held_out_words(settings.eval_seed, settings.eval_words)
    results: dict[str, tuple[float, float]] = {}
    for i, (name, task) in enumerate(tasks.ADAPTER_TASKS.items()):
        base_acc = exact_match(base, hf_tok, task, eval_words)
        peft_model = train_adapter(base, task, ADAPTER_RECIPES[name], settings, hf_tok,
                                   seed=settings.seed + 1 + i)
        results[name] = (base_acc, exact_match(peft_model, hf_tok, task, eval_words))
        adapter_dir = args.out / "adapters" / name
        peft_model.save_pretrained(str(adapter_dir), safe_serialization=True)
        (adapter_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
        sort_target_modules(adapter_dir / "adapter_config.json")
        peft_model.unload()  # take the LoRA layers out so the next adapter starts from the bare base
        print(f"{name} adapter trained at {time.monotonic() - started:.0f}s", flush=True)

    copy_acc = exact_match(base, hf_tok, tasks.BASE_TASK, eval_words)
    print(f"\nheld-out exact match on {len(eval_words)} words (greedy)")
    print(f"{'task':8s} {'base':>6s} {'adapter':>8s}")
    for name, (base_acc, adapter_acc) in results.items():
        print(f"{name:8s} {base_acc:6.0%} {adapter_acc:8.0%}")
    print(f"{'copy':8s} {copy_acc:6.0%} {'-':>8s}")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"total_seconds={time.monotonic() - started:.0f} total_bytes={size}")


if __name__ == "__main__":
    main()

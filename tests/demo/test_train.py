"""The demo training script: reproducible, and writes files transformers, PEFT and our tokenizer load."""

import json

import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from lora_runtime.demo import tasks
from lora_runtime.demo.train import (
    ADAPTER_RECIPES,
    MODEL_VOCAB_SIZE,
    TARGET_MODULES,
    TrainSettings,
    encode_examples,
    main,
    save_tokenizer,
    train_base,
)
from lora_runtime.model.tokenizer import Tokenizer

TINY = TrainSettings(hidden_size=32, intermediate_size=64, base_steps=3, batch_size=8)


def test_examples_put_loss_only_on_answer_and_eos(tmp_path):
    hf_tok = save_tokenizer(tmp_path)
    ids, labels = encode_examples(hf_tok, [("hello=", "olleh"), ("abc=", "cba")])
    bos, eos, pad = hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id
    prompt = hf_tok.encode("hello=", add_special_tokens=False)
    answer = hf_tok.encode("olleh", add_special_tokens=False)
    assert ids[0].tolist() == [bos, *prompt, *answer, eos]
    assert labels[0].tolist() == [-100] * (1 + len(prompt)) + answer + [eos]
    assert ids[1].tolist()[-3:] == [pad] * 3 and labels[1].tolist()[-3:] == [-100] * 3


def test_base_training_is_reproducible(tmp_path):
    hf_tok = save_tokenizer(tmp_path)
    first, second = train_base(TINY, hf_tok).state_dict(), train_base(TINY, hf_tok).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert first["lm_head.weight"].shape == (MODEL_VOCAB_SIZE, TINY.hidden_size)


def test_script_writes_loadable_files(tmp_path, capsys):
    main(["--out", str(tmp_path), "--base-steps", "2", "--adapter-step-scale", "0.01"])
    printed = capsys.readouterr().out
    assert "held-out exact match on 50 words" in printed and "total_seconds=" in printed
    base = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    assert base.config.vocab_size == MODEL_VOCAB_SIZE and not base.config.tie_word_embeddings
    ours = Tokenizer.from_pretrained(str(tmp_path / "base"))
    assert ours.encode("hello=") == [ours.bos_token_id, *(ours.token_to_id(c) for c in "hello=")]
    assert ours.eos_token_ids == (base.config.eos_token_id,)
    for name, recipe in ADAPTER_RECIPES.items():
        folder = tmp_path / "adapters" / name
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["target_modules"] == sorted(TARGET_MODULES)  # stable order: reruns write equal files
        assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (
            recipe.r, recipe.lora_alpha, recipe.use_rslora
        )
        model = PeftModel.from_pretrained(base, str(folder))
        assert model.peft_config["default"].r == recipe.r
        base = model.unload()
    assert set(ADAPTER_RECIPES) == set(tasks.ADAPTER_TASKS)

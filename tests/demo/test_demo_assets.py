"""The shipped demo: adapters do their tasks on held-out words, the base does not."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoTokenizer, LlamaForCausalLM

from lora_runtime.demo import ADAPTERS_DIR, ASSETS_DIR, adapter_dir, demo_adapters, demo_model_dir, tasks
from lora_runtime.demo import BASE_MODEL_DIR as BASE_DIR
from lora_runtime.demo.train import TARGET_MODULES, exact_match, generate_answers, load_hf_tokenizer
from lora_runtime.model.tokenizer import Tokenizer

EVAL_WORDS = tasks.held_out_words(2026, 50)  # another seed than the training script reports


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_tok():
    return load_hf_tokenizer(BASE_DIR)


def _base() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(BASE_DIR)).eval()


def test_shipped_files_are_small_and_complete():
    names = {p.name for p in BASE_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert set(p.name for p in ADAPTERS_DIR.iterdir()) == set(tasks.ADAPTER_TASKS)
    size = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file())
    assert size < 8 * 2**20, f"demo assets are {size} bytes"


def test_path_helpers_point_at_the_shipped_files():
    assert (Path(demo_model_dir()) / "model.safetensors").is_file()
    adapters = demo_adapters()
    assert list(adapters) == ["reverse", "upper", "sort", "caesar"]
    assert all((path / "adapter_model.safetensors").is_file() for path in adapters.values())


def test_adapter_dir_rejects_unknown_task():
    with pytest.raises(ValueError, match="name='shout' is not a demo adapter"):
        adapter_dir("shout")


def test_adapter_configs_target_every_projection_with_varied_ranks():
    configs = {
        name: json.loads((ADAPTERS_DIR / name / "adapter_config.json").read_text()) for name in tasks.ADAPTER_TASKS
    }
    for name, config in configs.items():
        assert sorted(config["target_modules"]) == sorted(TARGET_MODULES), name
        assert (ADAPTERS_DIR / name / "adapter_model.safetensors").is_file()
    assert len({c["r"] for c in configs.values()}) > 1
    assert any(c["use_rslora"] for c in configs.values())


def test_base_copies_and_does_no_task(hf_tok):
    base = _base()
    assert exact_match(base, hf_tok, tasks.BASE_TASK, EVAL_WORDS) >= 0.9
    for name, task in tasks.ADAPTER_TASKS.items():
        assert exact_match(base, hf_tok, task, EVAL_WORDS) < 0.2, name


@pytest.mark.parametrize("name", list(tasks.ADAPTER_TASKS))
def test_adapter_does_its_task(hf_tok, name):
    task = tasks.ADAPTER_TASKS[name]
    model = PeftModel.from_pretrained(_base(), str(adapter_dir(name))).eval()
    assert exact_match(model, hf_tok, task, EVAL_WORDS) >= 0.9
    assert generate_answers(model, hf_tok, ["hello="]) == [task.transform("hello")]


def test_chat_prompt_is_the_plain_prompt(hf_tok):
    ours = Tokenizer.from_pretrained(str(BASE_DIR))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " hello "}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered, add_special_tokens=False) == ours.encode("hello=")


def test_our_tokenizer_encodes_demo_prompts_like_transformers(hf_tok):
    ours = Tokenizer.from_pretrained(str(BASE_DIR))
    auto = AutoTokenizer.from_pretrained(str(BASE_DIR))
    prompts = [tasks.prompt_text(w) for w in EVAL_WORDS] + ["hello=", "Hello, wörld 😀="]
    for prompt in prompts:
        ids = ours.encode(prompt)
        assert ids == hf_tok.encode(prompt) == auto.encode(prompt), prompt
        assert ids[0] == ours.bos_token_id
        assert ours.decode(ids) == prompt
    answer = hf_tok.encode("olleh", add_special_tokens=False) + [hf_tok.eos_token_id]
    assert ours.decode(answer) == "olleh"
    assert ours.eos_token_ids[0] == hf_tok.eos_token_id

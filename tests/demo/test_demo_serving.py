"""The shipped demo served by the project's own engine: adapters do their tasks, the base
does not, and the engine's greedy answers equal those of transformers + PEFT."""

import pytest

from lora_runtime.demo import adapter_dir, demo_adapters, demo_model_dir, tasks
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams

WORDS = tasks.held_out_words(7, 50)
GREEDY = SamplingParams(max_tokens=14, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    adapters = demo_adapters()
    eng = Engine.from_pretrained(
        demo_model_dir(),
        # One prefill bucket (longer prompts prefill in chunks): fewer programs to compile.
        EngineConfig(max_batch=32, max_seq_len=64, max_loras_per_batch=len(adapters), max_prefill_tokens=16),
    )
    for name, path in adapters.items():
        eng.lora_manager.register(name, str(path))
    yield eng.start()
    eng.shutdown()


@pytest.fixture(scope="module")
def answers(engine):
    """(adapter or None, word) -> the served answer, all requests mixed in shared batches."""
    jobs = [(a, w) for w in WORDS for a in (None, *tasks.ADAPTER_TASKS)]
    outs = engine.generate_batch([tasks.prompt_text(w) for _, w in jobs], GREEDY, [a for a, _ in jobs])
    assert all(o.finish_reason == "stop" for o in outs)  # each answer ends with EOS
    return {job: out.text for job, out in zip(jobs, outs)}


@pytest.mark.parametrize("name", list(tasks.ADAPTER_TASKS))
def test_served_adapter_does_its_task(answers, name):
    task = tasks.ADAPTER_TASKS[name]
    exact = sum(answers[name, w] == task.transform(w) for w in WORDS) / len(WORDS)
    assert exact >= 0.9, f"{name}: {exact:.0%} exact on held-out words"


def test_served_base_does_no_task_but_copies(answers):
    assert sum(answers[None, w] == w for w in WORDS) / len(WORDS) >= 0.9
    for name, task in tasks.ADAPTER_TASKS.items():
        # Words whose answer is the word itself (already sorted, say) do not count.
        differs = [w for w in WORDS if task.transform(w) != w]
        exact = sum(answers[None, w] == task.transform(w) for w in differs) / len(differs)
        assert exact < 0.2, f"base does {name} on {exact:.0%} of words"


def test_served_answers_equal_transformers_and_peft(answers):
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lora_runtime.demo.train import generate_answers, load_hf_tokenizer

    tok = load_hf_tokenizer(demo_model_dir())
    words = WORDS[:12]
    prompts = [tasks.prompt_text(w) for w in words]
    torch.set_num_threads(2)
    for name in (None, *tasks.ADAPTER_TASKS):
        model = LlamaForCausalLM.from_pretrained(demo_model_dir()).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapter_dir(name))).eval()
        assert generate_answers(model, tok, prompts) == [answers[name, w] for w in words], name


def test_special_tokens_in_the_text_on_request(engine):
    """The demo base copies the word, then ends it with EOS; past EOS, with
    skip_special_tokens=False, the EOS token's text appears in the output."""
    eos = engine.tokenizer.id_to_token(min(engine.tokenizer.eos_token_ids))
    base = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    [kept] = engine.generate_batch(["hello="], SamplingParams(**base, skip_special_tokens=False), [None])
    [plain] = engine.generate_batch(["hello="], SamplingParams(**base), [None])
    assert kept.token_ids == plain.token_ids and eos in kept.text and eos not in plain.text
    assert kept.text.startswith("hello" + eos)

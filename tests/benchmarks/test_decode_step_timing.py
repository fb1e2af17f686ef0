"""benchmarks.common.decode_step_s times batches whose rows decode together: a first batch of
long prompts over several adapters prefills them one adapter at a time, so its rows start
decoding in waves and its steps hold part of the batch (cheaper steps, a mean below a full
batch's). That batch is not the one timed."""

from __future__ import annotations

from benchmarks.common import (
    TINY_SHAPE, decode_step_s, demo_tokenizer, synthetic_config, synthetic_engine, write_random_adapter,
)
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams


def test_the_timed_batch_decodes_all_its_rows_together(tmp_path):
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype="float32", **TINY_SHAPE)
    prompt = [3 + (i % 50) for i in range(64)]
    # One 64-token prompt a prefill step: each adapter's copy of the prompt prefills alone.
    config = EngineConfig(max_batch=4, max_seq_len=96, max_loras_per_batch=2, max_prefill_tokens=64,
                          kv_block_size=16)
    engine = synthetic_engine(model_config, config, tokenizer)
    for i, name in enumerate(("a0", "a1")):
        engine.lora_manager.register(name, str(write_random_adapter(tmp_path / name, model_config, r=4, alpha=8,
                                                                    seed=i)))
    batches = []  # decode steps and row-steps of each batch decode_step_s runs
    generate = engine.generate_batch

    def counted(*args, **kwargs):
        before = dict(engine.counters)
        out = generate(*args, **kwargs)
        batches.append((engine.counters["decode_steps"] - before.get("decode_steps", 0),
                        engine.counters["decode_row_steps"] - before.get("decode_row_steps", 0)))
        return out

    engine.generate_batch = counted
    engine.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        step_s = decode_step_s(engine, ["a0", "a1", "a0", "a1"], prompt, params, repeats=1)
    finally:
        engine.shutdown()
    assert step_s > 0
    print("decode steps and row-steps of each batch:", batches)
    timed_steps, timed_rows = batches[-1]
    # The timed batch found its prompts cached: all 4 rows decode together from the first step
    # to the last, 11 tokens each after the prefill's. A batch whose rows started in waves
    # takes more steps for the same row-steps.
    assert timed_rows == 4 * 11
    assert timed_steps <= params.max_tokens
    assert len(batches) == 2  # the batch before it was not timed

"""Serves the shipped demo model and its adapters in-process and prints what each does.

    python -m lora_runtime.demo [--words hello,serving] [--backend auto]

One engine, one base model, four adapters (reverse, upper, sort, caesar): every word is
sent to the base model and to each adapter, all requests in the same batches.
"""

from __future__ import annotations

import argparse
import time

from lora_runtime.demo import demo_adapters, demo_model_dir, tasks
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--words", default="hello,serving,adapter", help="comma-separated lowercase words")
    parser.add_argument("--backend", default="auto", help="LoRA backend: auto, reference, xla, pallas")
    args = parser.parse_args(argv)
    words = [w.strip() for w in args.words.split(",") if w.strip()]
    adapters = demo_adapters()
    start = time.perf_counter()
    engine = Engine.from_pretrained(
        demo_model_dir(),
        EngineConfig(max_batch=16, max_seq_len=64, max_loras_per_batch=len(adapters), lora_backend=args.backend),
        model_name="demo-base",
    )
    for name, path in adapters.items():
        engine.lora_manager.register(name, str(path))
    engine.start()
    ready = time.perf_counter() - start
    try:
        jobs = [(adapter, word) for word in words for adapter in (None, *adapters)]
        params = SamplingParams(max_tokens=24, temperature=0.0)
        start = time.perf_counter()
        outs = engine.generate_batch([tasks.prompt_text(w) for _, w in jobs], params, [a for a, _ in jobs])
        took = time.perf_counter() - start
    finally:
        engine.shutdown()
    print(f"model demo-base + adapters {', '.join(adapters)}; ready in {ready:.1f}s "
          f"(backend {engine.runner.backend.name})")
    width = max(len(a or "demo-base") for a, _ in jobs)
    for (adapter, word), out in zip(jobs, outs):
        print(f"  model={adapter or 'demo-base':<{width}}  prompt={tasks.prompt_text(word)!r:<14} -> {out.text!r}")
    print(f"{len(jobs)} requests, {sum(o.completion_tokens for o in outs)} tokens in {took:.2f}s, "
          f"batched together ({engine.counters['decode_steps']} decode steps)")


if __name__ == "__main__":
    main()

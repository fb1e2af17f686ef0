"""Cost of the on-device sampler per decode step, by vocabulary size and sampling mode.

    python -m benchmarks.sampling [--quick]

Times the sampler of a step as the runner runs it (penalties, `sample`, log-probabilities)
over a batch of random logits: all rows greedy, all at a temperature, all with top-p, all
with min-p, all greedy with a frequency penalty, all greedy asking for log-probabilities.
Penalties, min-p and log-probabilities run only in steps where some row asks for them.
Logits are normal with std 4 ("peaked", a language model's spread: the top-p nucleus lies
among the likeliest candidates) and std 1 ("flat": it does not, so that row's top-p sorts the whole
vocabulary); `top_p_one_flat` has one flat row among peaked ones, which sorts that row
alone. Last line: `greedy_ms=<f> temperature_ms=<f> top_p_ms=<f> min_p_ms=<f> penalties_ms=<f>
logprobs_ms=<f> top_p_flat_ms=<f> top_p_one_flat_ms=<f>` for the largest vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from lora_runtime.engine.sampling import SamplingBatch, SamplingParams, apply_penalties, sample, step_logprobs

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.7),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "min_p": SamplingParams(temperature=0.7, min_p=0.05),
    "penalties": SamplingParams(temperature=0.0, frequency_penalty=0.5),
    "logprobs": SamplingParams(temperature=0.0, logprobs=5),
}


@jax.jit
def _step(logits, counts, batch):
    tokens = sample(apply_penalties(logits, counts, counts > 0, batch), batch)
    return tokens, step_logprobs(logits, tokens, batch.want_logprobs)


def time_ms(batch_size: int, vocab: int, params: SamplingParams, repeats: int, std: float = 4.0,
            flat_rows: int = 0) -> float:
    """Median ms of one sampler step; the first `flat_rows` rows get flat (std 1) logits."""
    logits = jax.random.normal(jax.random.key(0), (batch_size, vocab), jnp.float32)
    logits = logits * jnp.where(jnp.arange(batch_size)[:, None] < flat_rows, 1.0, std)
    counts = jnp.zeros((batch_size, vocab), jnp.int32)
    batch = SamplingBatch.from_rows([(params, seed, 0) for seed in range(batch_size)])
    jax.block_until_ready(_step(logits, counts, batch))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(_step(logits, counts, batch))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one vocabulary size, few repeats")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    vocabs = [32000] if args.quick else [32000, 128256]
    repeats = 3 if args.quick else 10
    print(f"platform={jax.default_backend()} batch={args.batch}")
    names = [*MODES, "top_p_flat", "top_p_one_flat"]
    print(f"{'vocab':>7s} " + " ".join(f"{m + ' ms':>15s}" for m in names))
    row = {}
    for vocab in vocabs:
        row = {m: time_ms(args.batch, vocab, params, repeats) for m, params in MODES.items()}
        row["top_p_flat"] = time_ms(args.batch, vocab, MODES["top_p"], repeats, std=1.0)
        row["top_p_one_flat"] = time_ms(args.batch, vocab, MODES["top_p"], repeats, flat_rows=1)
        print(f"{vocab:7d} " + " ".join(f"{row[m]:15.2f}" for m in names), flush=True)
    print(" ".join(f"{m}_ms={row[m]:.3f}" for m in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

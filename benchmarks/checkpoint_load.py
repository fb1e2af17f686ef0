"""How fast a replica reads its checkpoint onto the devices (load_model), at Llama-3-8B widths.

    python -m benchmarks.checkpoint_load [--layers N] [--dtype bfloat16] [--widths 8b|small] [--checkpoint DIR]

Writes a random checkpoint (safetensors, as Hugging Face saves one) unless one is given,
reads it once to have it in the page cache (a restart finds it there, or reads the disk at
the disk's speed), then loads it: its layers stacked for the loop, sharded over every device.
Prints the seconds and GB/s of the load, and of its host part (reading and transposing the
kernels, stored [out, in]) by the loader's own timing. Last line:
`load_s=<f> load_gb_per_s=<f> host_share=<f>`.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

import jax
from flax import nnx

from benchmarks.common import print_table, write_random_checkpoint
from benchmarks.engine_scale import WIDTHS
from lora_runtime.model.loader import load_model
from lora_runtime.model.sharding import make_mesh



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--widths", choices=("8b", "small"), default="8b")
    parser.add_argument("--checkpoint", default=None, help="an existing checkpoint directory to load instead")
    parser.add_argument("--profile", default=None, help="write the load's profile (cumulative) to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            start = time.perf_counter()
            checkpoint = str(write_random_checkpoint(f"{tmp}/base", tiled=True, layers=args.layers,
                                                     dtype=args.dtype, **WIDTHS[args.widths]))
            print(f"wrote the checkpoint in {time.perf_counter() - start:.1f} s")
        size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                   if f.endswith(".safetensors"))
        for f in os.listdir(checkpoint):  # into the page cache
            with open(os.path.join(checkpoint, f), "rb") as stream:
                while stream.read(1 << 26):
                    pass
        mesh = make_mesh(len(jax.devices()))
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        _, model = load_model(checkpoint, mesh, dtype=args.dtype, scan_layers=True)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        profile.disable()
        seconds = time.perf_counter() - start
    stats = pstats.Stats(profile)
    host = sum(v[3] for k, v in stats.stats.items() if k[2] == "read" and k[0].endswith(os.path.join("model", "loader.py")))
    if args.profile:
        with open(args.profile, "w") as f:
            pstats.Stats(profile, stream=f).sort_stats("cumulative").print_stats(40)
    print(f"device={jax.devices()[0].platform} x{len(jax.devices())} cores={os.cpu_count()} "
          f"checkpoint={size / 1e9:.2f} GB ({args.layers} layers, {args.dtype})")
    print_table(["checkpoint load", "seconds", "GB/s"],
                [("whole load (onto the devices)", seconds, size / seconds / 1e9),
                 ("of which host reads and transposes", host, size / host / 1e9 if host else 0.0)])
    print(f"load_s={seconds:.2f} load_gb_per_s={size / seconds / 1e9:.3f} host_share={host / seconds:.3f}")


if __name__ == "__main__":
    main()

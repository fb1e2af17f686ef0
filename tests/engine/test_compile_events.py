"""Compilations counted from JAX's compile events, and the persistent compilation cache
across engine restarts (each run a fresh process, as a restarted replica is)."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_runtime.engine import compile_events
from lora_runtime.engine.config import EngineConfig
from tests.helpers.checkpoints import save_tiny_llama


def test_a_compile_counts_on_the_thread_that_compiled_it():
    here = compile_events.counts()
    seen = {}

    def other():
        before = compile_events.counts()
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(np.arange(5.0))
        after = compile_events.counts()
        seen["delta"], seen["seconds"] = after.builds - before.builds, after.seconds - before.seconds

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["delta"] == 1 and seen["seconds"] > 0  # the compile's duration, from the same event
    assert compile_events.counts().builds == here.builds  # this thread compiled nothing
    assert compile_events.counts().seconds == here.seconds


def test_compiles_inside_a_host_callback_are_counted_apart():
    """A host callback inside a step (Pallas interpret mode's kernels) that builds a JAX helper,
    on whichever thread XLA runs it, does not count as a compile of the step's caller."""
    from jax.experimental import io_callback

    helper = jax.jit(lambda x: jnp.tan(x) / 3.0)

    def on_host(x):
        return np.asarray(helper(np.asarray(x)))  # builds the helper program the first time

    step = jax.jit(lambda x: io_callback(on_host, jax.ShapeDtypeStruct((6,), jnp.float32), x))
    x = np.arange(6, dtype=np.float32)
    step.lower(x).compile()  # the step's own build, ahead of the run
    before, inside = compile_events.process_counts().builds, compile_events.callback_builds()
    step(x).block_until_ready()
    assert compile_events.process_counts().builds == before
    assert compile_events.callback_builds() == inside + 1


def test_the_cache_directory_defaults_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert EngineConfig().compilation_cache_path() == str(tmp_path / "multilora" / "jax-compile")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert EngineConfig().compilation_cache_path() == str(tmp_path / "jax")
    assert EngineConfig(compilation_cache_dir=None).compilation_cache_path() is None
    assert EngineConfig(compilation_cache_dir="").compilation_cache_path() is None
    assert EngineConfig(compilation_cache_dir="/x/y").compilation_cache_path() == "/x/y"


_RUN = textwrap.dedent("""
    import json, sys, time
    from lora_runtime.engine import compile_events
    from lora_runtime.engine.config import EngineConfig
    from lora_runtime.engine.engine import Engine
    from lora_runtime.engine.sampling import SamplingParams
    config = EngineConfig(max_batch=4, max_seq_len=128, max_loras_per_batch=2, max_lora_rank=8,
                          compilation_cache_dir=sys.argv[2])
    start = time.perf_counter()
    engine = Engine.from_pretrained(sys.argv[1], config).start()
    ready = time.perf_counter() - start
    out = engine.generate_batch(["hello there"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    c = compile_events.process_counts()
    print(json.dumps({"compiled": c.compiled, "hits": c.cache_hits, "ready_s": ready,
                      "warm_builds": engine.warm_counts.builds, "tokens": out[0].token_ids,
                      "after": engine.compiles_after_warmup, "programs": len(engine.runner.programs),
                      "programs_read": engine.runner.programs.loaded, "warm_ran": engine.warm_ran}))
    engine.shutdown()
""")


def test_engines_started_together_share_their_compiles_and_a_restart_reads_them(tmp_path):
    """Two engines start at once over one empty persistent cache, as replicas on one host
    do: each takes the steps in an order of its own, so each reads much of what the other
    compiled. Then a restarted engine reads every step program back: its compiled executable
    from the compilation cache, and the program itself from the exports the first start stored
    (engine/program_store.py), so it does not trace the model again."""
    checkpoint = save_tiny_llama(tmp_path / "ckpt")
    cache = tmp_path / "compile-cache"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")

    def run(engines: int) -> list[dict]:
        procs = [subprocess.Popen([sys.executable, "-c", _RUN, str(checkpoint), str(cache)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(engines)]
        outs = [p.communicate(timeout=600) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    first, second = run(2)
    programs = first["warm_builds"]
    assert second["warm_builds"] == programs and first["after"] == second["after"] == 0
    assert first["tokens"] == second["tokens"]
    # In one order both compile nearly every program (94 of 2 x 55 when last measured); in
    # orders of their own, what one compiled the other mostly read (66 of 110).
    assert first["compiled"] + second["compiled"] <= 1.45 * programs, (first, second)
    [warm] = run(1)
    assert warm["tokens"] == first["tokens"]
    # Every step program is read back; at most a few tiny eager ops are compiled.
    assert warm["hits"] >= programs - 3 and warm["compiled"] <= 3, (first, warm)
    assert warm["after"] == 0
    # Every step shape (prefill, extend, decode, sampler, prompt log-probabilities) came back
    # as a stored export.
    assert first["programs"] == warm["programs"] == warm["programs_read"] > 0, (first, warm)
    # The first starts ran the largest steps once; the restart, over the same programs, did not.
    assert first["warm_ran"] and second["warm_ran"] and not warm["warm_ran"]


_MIN_TIME = textwrap.dedent("""
    import sys, jax
    from lora_runtime.engine import compile_events
    compile_events.enable_persistent_cache(sys.argv[1])
    print(jax.config.jax_persistent_cache_min_compile_time_secs)
""")


@pytest.mark.parametrize("env_value, kept", [(None, 0.0), ("5", 5.0)])
def test_every_program_is_cached_unless_the_environment_sets_a_least_compile_time(tmp_path, env_value, kept):
    """JAX's own default (1 s) would leave the quick half of a warm-up to compile again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    if env_value is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = env_value
    proc = subprocess.run([sys.executable, "-c", _MIN_TIME, str(tmp_path / "cache")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split()[-1]) == kept


def test_a_cache_url_goes_to_jax_as_it_is(tmp_path):
    """gs://... is JAX's to open (replicas on other machines share it): no local directory is
    made for it."""
    code = textwrap.dedent("""
        import jax, os, sys
        from lora_runtime.engine import compile_events
        print(compile_events.enable_persistent_cache("gs://some-bucket/jax-compile"))
        print(jax.config.jax_compilation_cache_dir)
        print(sorted(os.listdir(".")))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out == ["gs://some-bucket/jax-compile", "gs://some-bucket/jax-compile", "[]"]

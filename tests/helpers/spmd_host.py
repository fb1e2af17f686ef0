"""One host of a replica spanning two processes, without Ray (tests/engine/test_spmd.py).

    python -m tests.helpers.spmd_host SPEC_JSON

SPEC_JSON holds the role ("leader" or "follower"), the JAX process id and count, the
coordinator and op-link ports, the op link's key (hex), the checkpoint and adapters, and
(leader) where to write the outputs. The leader serves the requests of `run_requests`
and writes their outputs as JSON; the follower follows it. Each process sets its own
device count (XLA_FLAGS, the other flags kept) before JAX starts.
"""

from __future__ import annotations

import json
import os
import sys
import threading

# One prefill bucket: half the programs each process compiles (buckets are tested in
# tests/engine/test_engine.py).
ENGINE = dict(max_batch=4, max_seq_len=32, max_loras_per_batch=2, max_lora_rank=16, lora_backend="xla",
              lora_modules_to_save_max_bytes=1 << 20, max_prefill_tokens=16)


def engine_config(tp: int, **overrides):
    from lora_runtime.engine.config import EngineConfig

    return EngineConfig(**{**ENGINE, "tensor_parallel_size": tp, **overrides})


def run_requests(engine, adapters: dict[str, str]) -> list[dict]:
    """Registers `adapters` (name -> path; the first pinned) and serves a mix of requests:
    greedy base and adapter rows in one batch (more adapters than slots: writes and
    evictions), a seeded sampled row with log-probabilities, prompt log-probabilities, a
    penalized row; returns each output's tokens and log-probabilities."""
    from lora_runtime.engine.sampling import SamplingParams

    names = list(adapters)
    for i, name in enumerate(names):
        engine.lora_manager.register(name, adapters[name], pinned=i == 0)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["the quick brown fox", "hello world", "numbers 0123"]
    requests = [(p, greedy, a) for a in [None, *names] for p in prompts]
    requests += [
        ("a lazy dog", SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=7, logprobs=2,
                                      ignore_eos=True), names[-1]),
        ("hello world", SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True), names[0]),
        ("the quick", SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True), None),
    ]
    outs = engine.generate_batch([r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests])
    return [{"tokens": list(o.token_ids),
             "logprobs": None if o.logprobs is None else [lp.logprob for lp in o.logprobs],
             "prompt_logprobs": None if o.prompt_logprobs is None else
             [None if lp is None else lp.logprob for lp in o.prompt_logprobs]} for o in outs]


def main(spec: dict) -> None:
    from deployments.placement import host_device_flags

    os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), spec["local_devices"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from lora_runtime.engine import spmd
    from lora_runtime.engine.engine import Engine
    from lora_runtime.errors import HostLostError

    spmd.join_runtime(f"127.0.0.1:{spec['coordinator_port']}", spec["processes"], spec["process_id"], 120)
    tp = spec["processes"] * spec["local_devices"]
    authkey = bytes.fromhex(spec["authkey"])
    if spec["role"] == "follower":
        conn = spmd.connect(("127.0.0.1", spec["link_port"]), authkey)
        conn.send(("hello", spec["process_id"]))

        def build(plan):
            engine = Engine.from_pretrained(spec["checkpoint"], engine_config(tp), plan=plan)
            if spec.get("die_after_samples"):  # a host that crashes mid-stream
                _die_after(engine.runner, spec["die_after_samples"])
            return engine

        spmd.serve_follower(conn, build)
        return
    from multiprocessing.connection import Listener

    listener = Listener(("127.0.0.1", spec["link_port"]), authkey=authkey)
    mirror = spmd.Mirror(spmd.accept(listener, spec["processes"] - 1, timeout_s=120))
    engine = Engine.from_pretrained(spec["checkpoint"], engine_config(tp))
    spmd.attach(engine, mirror)
    engine.start()
    # The requests run on a thread of their own: a step whose collective waits for a host
    # that died waits until the runtime ends the process, so the answer is read from here.
    done, box = threading.Event(), {}

    def serve() -> None:
        try:
            box["outputs"] = run_requests(engine, spec["adapters"])
        except Exception as err:
            box["error"] = f"{type(err).__name__}: {err}"
        finally:
            done.set()

    threading.Thread(target=serve, daemon=True).start()
    while not done.wait(0.2) and mirror.lost is None:
        pass
    if mirror.lost is None:
        result = {**box, "ops_sent": mirror.ops_sent, "lost": None,
                  "compiles_after_warmup": engine.compiles_after_warmup}
        engine.shutdown()
        mirror.close()
    else:
        try:
            mirror.check()
            status = None
        except HostLostError as err:  # what a replica answers every request from here on
            status = err.status_code
        result = {"lost": mirror.lost, "status": status}
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    if mirror.lost is not None:  # the runtime's end would wait for the lost host
        os._exit(0)


def _die_after(runner, samples: int) -> None:
    """Ends this process abruptly at its `samples`-th sample op of a request (warm-up's
    sample no row)."""
    real, seen = runner.op_sample, [0]

    def op_sample(sampling, seq_rows, mask):
        seen[0] += bool((seq_rows >= 0).any())
        if seen[0] == samples:
            os._exit(17)
        return real(sampling, seq_rows, mask)

    runner.op_sample = op_sample


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

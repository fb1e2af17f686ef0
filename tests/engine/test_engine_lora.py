"""The engine with adapters: mixed-adapter batches against PEFT, slot limits, fairness."""

import threading
import time

import jax
import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.engine.scheduler import Admission
from lora_runtime.errors import AdapterNotFoundError
from lora_runtime.lora.adapter import LoRAAdapter
from tests.helpers.checkpoints import save_tiny_llama
from tests.lora.peft_adapters import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["the quick brown fox", "hello world", "numbers 0123", "a lazy dog jumps"]
SPECS = {
    "r4": dict(r=4, alpha=8, target_modules=ALL, seed=1),
    "r8_rslora": dict(r=8, alpha=16, target_modules=ALL, use_rslora=True, seed=2),
    "r16": dict(r=16, alpha=8, target_modules=ALL, seed=3),
    "r8_qv": dict(r=8, alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], seed=4),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 4 kv heads so the same checkpoint also runs with TP=4.
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_lora"), num_kv_heads=4)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_adapters")
    return {name: make_peft_adapter(checkpoint, root / name, **spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def peft_greedy(checkpoint, adapters):
    """PEFT's greedy tokens for each (adapter or None, prompt)."""
    return _peft_greedy(checkpoint, adapters, PROMPTS)


def _peft_greedy(checkpoint, adapters, prompts) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_runtime.model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(checkpoint))
    out = {}
    for name in [None, *adapters]:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        for prompt in prompts:
            ids = tok.encode(prompt)
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                min_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0,
            )
            out[name, prompt] = gen[0, len(ids):].tolist()
    return out


def _engine(checkpoint, adapters, **overrides):
    # One prefill bucket (longer prompts prefill in chunks): a quarter of the programs to
    # compile for each engine shape here. Buckets are tested in test_engine.py.
    cfg = dict(max_batch=8, max_seq_len=64, max_loras_per_batch=4, max_lora_rank=16, lora_backend="reference",
               max_prefill_tokens=16)
    cfg.update(overrides)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**cfg))
    for name, path in adapters.items():
        engine.lora_manager.register(name, str(path))
    return engine.start()


@pytest.mark.parametrize(
    "backend, tp", [("reference", 1), ("xla", 1), ("reference", 4), ("pallas", 1)]
)
def test_mixed_adapter_batch_matches_peft(checkpoint, adapters, peft_greedy, backend, tp):
    engine = _engine(checkpoint, adapters, lora_backend=backend, tensor_parallel_size=tp)
    decode = engine.runner.dispatch_decode
    reads_pool = []  # per decode step: whether it ran the adapter pool

    def spy(inputs, pool, host_work=None):
        reads_pool.append(inputs.lora is not None)
        return decode(inputs, pool, host_work)

    engine.runner.dispatch_decode = spy
    try:
        # Base traffic alone runs the base model's program: no pool, no adapter work.
        outs = engine.generate_batch(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [peft_greedy[None, p] for p in PROMPTS]
        assert reads_pool and not any(reads_pool)
        reads_pool.clear()
        names = [None, *adapters]
        jobs = [(n, p) for p in PROMPTS for n in names]  # 20 requests, 5 adapters mixed
        outs = engine.generate_batch([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
        for (name, prompt), out in zip(jobs, outs):
            assert out.token_ids == peft_greedy[name, prompt], (name, prompt)
        assert any(reads_pool)
        assert engine.compiles_after_warmup == 0
    finally:
        engine.shutdown()


def test_a_mesh_wider_than_the_kv_heads_serves_like_peft(tmp_path_factory):
    """tensor_parallel_size 4 over a checkpoint of 2 kv heads (each held by two devices): the
    base model, a LoRA and a DoRA adapter of every projection k and v included, mixed in one
    batch, give PEFT's greedy tokens."""
    root = tmp_path_factory.mktemp("kv_copies")
    checkpoint = save_tiny_llama(root / "base", num_kv_heads=2)
    adapters = {"lora": make_peft_adapter(checkpoint, root / "lora", r=8, alpha=16, target_modules=ALL, seed=5),
                "dora": make_peft_adapter(checkpoint, root / "dora", r=4, alpha=8, target_modules=ALL, seed=6,
                                          use_dora=True)}
    want = _peft_greedy(checkpoint, adapters, PROMPTS[:2])
    engine = _engine(checkpoint, adapters, lora_backend="xla", tensor_parallel_size=4)
    try:
        assert engine.model_config.kv_head_copies == 2
        jobs = [(n, p) for p in PROMPTS[:2] for n in [None, *adapters]]
        outs = engine.generate_batch([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
        for (name, prompt), out in zip(jobs, outs):
            assert out.token_ids == want[name, prompt], (name, prompt)
    finally:
        engine.shutdown()


# The reference backend over classes is checked against PEFT in tests/lora/test_peft_parity.py.
@pytest.mark.parametrize("backend", ["xla"])
def test_rank_classes_serve_mixed_ranks_like_peft(checkpoint, adapters, peft_greedy, backend):
    """A rank-aware pool in the bytes of 2 padded rank-16 slots: ranks 4, 8, 8 and 16 take their
    narrowest classes, spill wider, evict within a class, and every output equals PEFT's."""
    engine = _engine(checkpoint, adapters, lora_backend=backend, max_loras_per_batch=2,
                     lora_rank_classes=[4, 8, 16], max_wait_steps=4)
    try:
        pool = engine.lora_manager.pool
        assert [(c.rank, c.num_slots) for c in pool.classes] == [(4, 2), (8, 1), (16, 1)]
        names = [None, *adapters] * 2
        jobs = [(n, p) for n in names for p in PROMPTS[:2]]
        outs = engine.generate_batch([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
        for (name, prompt), out in zip(jobs, outs):
            assert out.token_ids == peft_greedy[name, prompt], (name, prompt)
        assert engine.lora_manager.stats().evictions > 0
        assert engine.compiles_after_warmup == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_rows_aligned_as_on_tpu_serve_like_peft(monkeypatch, checkpoint, adapters, peft_greedy, backend):
    """A pool laid out as on TPU (rows and the terms' slots rounded up to 8: rank 4 held in 8
    rows, 3 slots' terms in 8): writes, DoRA-ready terms and every step give PEFT's tokens."""
    from lora_runtime.lora import memory_pool
    monkeypatch.setattr(memory_pool, "row_align_for", lambda platform: memory_pool.TPU_ROW_ALIGN)
    engine = _engine(checkpoint, adapters, lora_backend=backend, max_loras_per_batch=3,
                     lora_rank_classes=[4, 16], max_wait_steps=4)
    try:
        pool = engine.lora_manager.pool
        assert [(c.rank, c.rows) for c in pool.classes] == [(4, 8), (16, 16)]
        a, (b, *_) = pool.stacked_group("qkv", 0)
        assert a.shape[2] == 3 * 8 and b.shape[2] == 8
        assert {x.shape[1] for x in jax.tree_util.tree_leaves(pool.scale)} == {8}
        jobs = [(n, p) for n in [None, *adapters] for p in PROMPTS[:2]]
        outs = engine.generate_batch([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
        for (name, prompt), out in zip(jobs, outs):
            assert out.token_ids == peft_greedy[name, prompt], (name, prompt)
        assert engine.compiles_after_warmup == 0
    finally:
        engine.shutdown()


def test_modules_to_save_adapters_serve_like_peft(checkpoint, tmp_path):
    """Adapters with trained copies of lm_head or embed_tokens (PEFT modules_to_save) decode what
    PEFT generates, mixed with base traffic; two saved heads share one saved-module slot, so the
    second waits for the first and evicts it; nothing compiles after warm-up."""
    specs = {"save_head": dict(r=4, alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], seed=11),
             "save_head2": dict(r=8, alpha=8, target_modules=ALL, modules_to_save=["lm_head"], seed=12),
             "save_embed": dict(r=4, alpha=16, target_modules=["v_proj"], modules_to_save=["embed_tokens"], seed=13)}
    dirs = {name: make_peft_adapter(checkpoint, tmp_path / name, **spec) for name, spec in specs.items()}
    want = _peft_greedy(checkpoint, dirs, PROMPTS[:2])
    engine = _engine(checkpoint, dirs, lora_modules_to_save_max_bytes=1 << 24, lora_modules_to_save_slots=1,
                     max_wait_steps=2)
    try:
        assert engine.lora_manager.pool.num_saved_slots == 1
        jobs = [(n, p) for n in (None, *dirs) for p in PROMPTS[:2]]
        outs = engine.generate_batch([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
        for (name, prompt), out in zip(jobs, outs):
            assert out.token_ids == want[name, prompt], (name, prompt)
        for name in dirs:  # each copy changed what the adapter generates
            assert any(want[name, p] != want[None, p] for p in PROMPTS[:2]), name
        assert engine.lora_manager.stats().evictions > 0
        assert engine.compiles_after_warmup == 0
    finally:
        engine.shutdown()


def test_slot_limit_fairness_and_unknown_adapters(checkpoint, adapters, peft_greedy):
    # 2 slots, 4 adapters: requests wait for a slot, never more than 2 adapters per batch.
    engine = _engine(checkpoint, adapters, max_loras_per_batch=2, max_wait_steps=4)
    try:
        names = list(adapters) * 3
        outs = engine.generate_batch([PROMPTS[0]] * len(names), GREEDY, names)
        for name, out in zip(names, outs):
            assert out.token_ids == peft_greedy[name, PROMPTS[0]]
        assert engine.counters["max_batch_adapters"] <= 2
        assert engine.lora_manager.stats().evictions > 0
        assert engine.compiles_after_warmup == 0
        with pytest.raises(AdapterNotFoundError, match="nope"):
            engine.generate_batch([PROMPTS[0]], GREEDY, ["nope"])
    finally:
        engine.shutdown()


def test_slots_beyond_the_batch_rows_keep_adapters_resident(checkpoint, adapters, peft_greedy):
    # 4 slots, 2 rows: each batch uses at most 2 adapters; the other slots keep the rest on the device.
    engine = _engine(checkpoint, adapters, max_batch=2, max_loras_per_batch=4)
    try:
        names = list(adapters)
        for _ in range(2):
            outs = engine.generate_batch([PROMPTS[0]] * len(names), GREEDY, names)
            assert [o.token_ids for o in outs] == [peft_greedy[n, PROMPTS[0]] for n in names]
        stats = engine.lora_manager.stats()
        assert stats.loads == len(names) and stats.evictions == 0  # the second round loaded nothing
        assert engine.counters["max_batch_adapters"] <= 2
    finally:
        engine.shutdown()


def test_adapter_memory_fraction_gives_the_engine_the_slots_its_plan_sized(checkpoint, adapters, peft_greedy):
    # The plan of a device with a memory limit (CPU reports none: the plan is made for one here)
    # sizes the pool at 6 slots where max_loras_per_batch says 1: the engine, its manager and its
    # scheduler take the plan's count, so the four adapters stay resident between rounds.
    from lora_runtime.engine.memory_plan import adapter_pool_bytes, plan_memory, pool_options
    from lora_runtime.model.config import ModelConfig
    from lora_runtime.model.sharding import make_mesh

    config = EngineConfig(max_batch=4, max_seq_len=64, max_loras_per_batch=1, max_lora_rank=16,
                          lora_backend="reference", max_prefill_tokens=16, kv_cache_bytes=1 << 20)
    model_config = ModelConfig.from_pretrained(str(checkpoint), dtype=config.dtype)
    one = adapter_pool_bytes(model_config, 1, 1, 16, **pool_options(config), platform="cpu")
    device_bytes = 1 << 30
    config = config.model_copy(update={"adapter_memory_fraction": 6.5 * one / (0.9 * device_bytes)})
    plan = plan_memory(model_config, config, make_mesh(1), platform="cpu", block_size=config.block_size("cpu"),
                       device_bytes=device_bytes)
    assert plan.adapter_slots == 6
    engine = Engine.from_pretrained(str(checkpoint), config, plan=plan)
    try:
        for name, path in adapters.items():
            engine.lora_manager.register(name, str(path))
        engine.start()
        assert engine.config.max_loras_per_batch == engine.lora_manager.num_slots == 6
        names = list(adapters)
        for _ in range(2):
            outs = engine.generate_batch([PROMPTS[0]] * len(names), GREEDY, names)
            assert [o.token_ids for o in outs] == [peft_greedy[n, PROMPTS[0]] for n in names]
        stats = engine.lora_manager.stats()
        assert stats.loads == len(names) and stats.evictions == 0  # one slot would have loaded 8 times
        assert engine.counters["max_batch_adapters"] == len(names)
    finally:
        engine.shutdown()


def test_cold_adapter_is_not_starved(checkpoint, adapters):
    # One slot held by a stream of requests for "r4"; a request for "r16" must still get in.
    engine = _engine(checkpoint, adapters, max_loras_per_batch=1, max_wait_steps=3, max_batch=4)
    try:
        long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        done = threading.Event()
        finished = []

        def collect(out):
            if out.finished:
                finished.append(out.request_id)
                if out.request_id == "cold":
                    done.set()

        for i in range(3):
            engine.submit(PROMPTS[0], long, collect, adapter="r4", request_id=f"warm{i}")
        engine.submit(PROMPTS[1], long, collect, adapter="r16", request_id="cold")
        # Keep feeding warm requests while the cold one waits.
        for i in range(3, 30):
            engine.submit(PROMPTS[0], long, collect, adapter="r4", request_id=f"warm{i}")
            if done.wait(0.05):
                break
        assert done.wait(60), "the cold adapter's request never ran"
        # It ran before the later warm requests: the wait is bounded.
        assert finished.index("cold") < len(finished) - 1 or len(finished) < 30
    finally:
        engine.shutdown()


def test_unregister_while_in_flight(checkpoint, adapters, peft_greedy):
    engine = _engine(checkpoint, adapters)
    try:
        long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        got = threading.Event()
        outs = []

        def collect(out):
            outs.append(out)
            if out.finished:
                got.set()

        engine.submit(PROMPTS[0], long, collect, adapter="r4")
        while not outs:
            threading.Event().wait(0.01)
        engine.lora_manager.unregister("r4")
        with pytest.raises(AdapterNotFoundError, match="r4"):
            engine.generate_batch([PROMPTS[0]], GREEDY, ["r4"])
        assert got.wait(60)
        tokens = [t for o in outs for t in o.token_ids]
        assert outs[-1].finish_reason == "length" and len(tokens) == 20
        assert tokens[:8] == peft_greedy["r4", PROMPTS[0]]
        # Its slot is free again and other adapters still serve.
        assert engine.lora_manager.slot_of("r4") is None
        assert engine.generate_batch([PROMPTS[1]], GREEDY, ["r16"])[0].token_ids == peft_greedy["r16", PROMPTS[1]]
    finally:
        engine.shutdown()


def test_waiting_request_prefetches_its_adapter_off_the_step_loop(checkpoint, adapters, peft_greedy):
    # A host cache of one adapter: registering four leaves only the last one cached.
    engine = _engine(checkpoint, adapters, max_cpu_loras=1)
    padded_on = []
    pool_weights = LoRAAdapter.pool_weights

    def spy(self, *args):
        padded_on.append(threading.get_ident())
        return pool_weights(self, *args)

    LoRAAdapter.pool_weights = spy
    try:
        assert not engine.lora_manager.is_host_cached("r4")
        before = engine.lora_manager.stats()
        long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = []
        engine.submit(PROMPTS[0], long, outs.append)  # keeps decode steps going
        out = engine.generate_batch([PROMPTS[2]], GREEDY, ["r4"])[0]
        assert out.token_ids == peft_greedy["r4", PROMPTS[2]]
        after = engine.lora_manager.stats()
        # The files were fetched by the background prefetch that the request's arrival
        # started; admission then found them in the host cache instead of fetching inline.
        assert after.fetches - before.fetches == 1
        assert after.host_misses - before.host_misses == 0
        assert after.host_hits - before.host_hits == 1
        # Padding to the slot layout ran on a fetch thread too: the loop only wrote the slot.
        assert padded_on and engine._thread.ident not in padded_on
    finally:
        LoRAAdapter.pool_weights = pool_weights
        engine.shutdown()


def test_submit_and_pinning_do_not_wait_for_a_running_step(checkpoint, adapters, peft_greedy):
    """While a step runs, submit returns at once; a slot write asked for on another thread
    (pinning) waits for the loop and runs between steps, never under a running step."""
    engine = _engine(checkpoint, adapters)
    decode = engine.runner.dispatch_decode
    in_step, release = threading.Event(), threading.Event()

    def held(inputs, pool, host_work=None):
        in_step.set()
        release.wait(60)
        return decode(inputs, pool, host_work)

    engine.runner.dispatch_decode = held
    try:
        outs = []
        engine.submit(PROMPTS[0], GREEDY, outs.append, adapter="r4")
        assert in_step.wait(60)
        submitted, pinned = threading.Event(), threading.Event()
        threading.Thread(target=lambda: (engine.submit(PROMPTS[1], GREEDY, outs.append, adapter="r16"),
                                         submitted.set())).start()
        threading.Thread(target=lambda: (engine.lora_manager.set_pinned("r8_qv", True), pinned.set())).start()
        assert submitted.wait(10)  # the step is still held: submit did not wait for it
        assert not pinned.wait(0.5)  # the pool write waits for the loop
        release.set()
        assert pinned.wait(60) and engine.lora_manager.is_resident("r8_qv")
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            got = {o.request_id: o for o in outs if o.finished}
            time.sleep(0.01)
        assert len(got) == 2 and all(o.error is None for o in got.values())
        done = engine.generate_batch([PROMPTS[0], PROMPTS[1], PROMPTS[2]], GREEDY, ["r4", "r16", "r8_qv"])
        assert [o.token_ids for o in done] == [peft_greedy[n, p] for n, p in
                                               (("r4", PROMPTS[0]), ("r16", PROMPTS[1]), ("r8_qv", PROMPTS[2]))]
        assert engine.compiles_after_warmup == 0
    finally:
        release.set()
        engine.runner.dispatch_decode = decode
        engine.shutdown()


def _peft_tokens(checkpoint, adapter_dir, ids, n):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    gen = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return gen[0, len(ids):].tolist()


def test_cached_prefixes_are_per_adapter_version(checkpoint, adapters):
    """K/V depend on the adapter's content: a prefix cached for the base model or for other
    weights is not reused; the same weights registered again keep theirs. Chunked prompts, the
    model over 2 devices, PEFT's tokens."""
    engine = _engine(checkpoint, adapters, lora_backend="xla", tensor_parallel_size=2, max_prefill_tokens=16)
    try:
        shared = engine.tokenizer.encode("a long shared preamble for every request that comes here: ")[:32]
        assert len(shared) == 32  # two whole blocks
        first, second = shared + [70, 71], shared + [72, 73, 74]
        ids = second
        engine.generate_batch([first], GREEDY, [None])
        out = engine.generate_batch([first], GREEDY, ["r4"])[0]
        assert out.cached_tokens == 0  # the base model's K/V of the same tokens differ
        out = engine.generate_batch([second], GREEDY, ["r4"])[0]
        assert out.cached_tokens == 32
        assert out.token_ids == _peft_tokens(checkpoint, adapters["r4"], ids, GREEDY.max_tokens)
        engine.lora_manager.register("r4", str(adapters["r16"]))  # a new version, other weights
        out = engine.generate_batch([second], GREEDY, ["r4"])[0]
        assert out.cached_tokens == 0
        assert out.token_ids == _peft_tokens(checkpoint, adapters["r16"], ids, GREEDY.max_tokens)
        engine.lora_manager.register("r4", str(adapters["r16"]))  # the same weights again
        again = engine.generate_batch([second], GREEDY, ["r4"])[0]
        assert again.cached_tokens > 0 and again.token_ids == out.token_ids
        assert engine.stats()["extend_steps"] > 0 and engine.compiles_after_warmup == 0

        # The rests of cached prompts of two adapters and the base model, in one step.
        names = ["r8_rslora", "r8_qv", None]
        engine.generate_batch([first] * 3, GREEDY, names)
        scheduler, admit = engine.scheduler, engine.scheduler.admit
        scheduler.admit = lambda *a, **kw: Admission() if 0 < len(scheduler.waiting) < 3 else admit(*a, **kw)
        before = engine.stats()["extend_steps"]
        try:
            outs = engine.generate_batch([second] * 3, GREEDY, names)
        finally:
            scheduler.admit = admit
        assert engine.stats()["extend_steps"] == before + 1
        for name, out in zip(names, outs):
            assert out.cached_tokens > 0
            if name is not None:
                assert out.token_ids == _peft_tokens(checkpoint, adapters[name], ids, GREEDY.max_tokens), name
        assert engine.compiles_after_warmup == 0

        # Unregistered and registered again from other files: the version starts again at 1, the
        # cached K/V of its old weights are not used, those of the new weights (computed above
        # under the name r4) are: the cache knows adapters by content, not by name.
        engine.lora_manager.unregister("r8_qv")
        assert engine.lora_manager.register("r8_qv", str(adapters["r4"])).version == 1
        out = engine.generate_batch([second], GREEDY, ["r8_qv"])[0]
        assert out.cached_tokens == 32
        assert out.token_ids == _peft_tokens(checkpoint, adapters["r4"], ids, GREEDY.max_tokens)
    finally:
        engine.shutdown()

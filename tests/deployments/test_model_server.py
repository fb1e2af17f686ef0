"""The model-server replica's shutdown, without a cluster: Serve calls __del__ on a replica
whose __init__ failed part way too (it was stopped while starting)."""

import asyncio

from deployments.config import AppArgs
from deployments.model_server import LoRAModelServer
from lora_runtime.demo import demo_model_dir
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine


def _unstarted() -> object:
    cls = getattr(LoRAModelServer, "func_or_class", LoRAModelServer)
    replica = object.__new__(cls)
    replica._args = AppArgs(model="demo")
    return replica


def test_a_replica_stopped_before_its_engine_existed_shuts_down_cleanly():
    replica = _unstarted()
    asyncio.run(replica.__del__())
    assert replica._draining


def test_a_replica_stopped_after_its_engine_started_stops_the_engine():
    replica = _unstarted()
    # The engine started; the registry view did not (as when Serve stops a starting replica).
    engine = Engine.from_pretrained(demo_model_dir(), EngineConfig(max_batch=2, max_seq_len=32, max_loras_per_batch=0))
    replica._engine = engine.start()
    assert engine.is_alive()
    asyncio.run(replica.__del__())
    assert not engine.is_alive()


def test_a_requests_unset_sampling_fields_take_the_checkpoints_generation_config(tmp_path):
    """generation_config 'auto' (the default): what the request leaves unset comes from the
    checkpoint's generation_config.json; 'vllm': the neutral values."""
    import json
    import shutil

    from deployments.openai_protocol import CompletionRequest

    folder = tmp_path / "model"
    shutil.copytree(demo_model_dir(), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.6, top_k=20, repetition_penalty=1.1, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(config))
    engine = Engine.from_pretrained(str(folder), EngineConfig(max_batch=2, max_seq_len=32, max_loras_per_batch=0))
    replica = _unstarted()
    replica._engine = engine

    def sampling(mode: str, **fields):
        replica._args = AppArgs(model="demo", max_seq_len=32, generation_config=mode)
        body = CompletionRequest(model="m", prompt=[1, 5, 6], **fields)
        return replica._sampling({"sampling": body.sampling(None)}, [1, 5, 6])

    auto = sampling("auto", top_p=0.9)
    assert (auto.temperature, auto.top_k, auto.repetition_penalty, auto.max_tokens) == (0.6, 20, 1.1, 5)
    assert auto.top_p == 0.9 and auto.min_p == 0.0  # the request's value; neither sets min_p
    assert sampling("auto", temperature=0, max_tokens=9).temperature == 0
    assert sampling("auto", max_tokens=9).max_tokens == 9
    neutral = sampling("vllm")
    assert (neutral.temperature, neutral.top_k, neutral.repetition_penalty, neutral.max_tokens) == (1.0, 0, 1.0, 29)

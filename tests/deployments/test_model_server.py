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

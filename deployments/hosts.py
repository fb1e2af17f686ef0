"""The other hosts of a multi-host replica: a worker per host in the replica's placement
group, one JAX runtime over all of them, and the op link the replica's engine drives them
through (lora_runtime/engine/spmd.py).

The replica (Serve's actor, in the group's first bundle) leads: it alone talks to Serve
and schedules; each worker joins the runtime, builds the same engine with the leader's
memory plan and launches the device ops the leader sends, on its own devices.

JAX process ids: where every host knows its TPU worker id (the hosts of a multi-host TPU
slice), they are those, so the runtime numbers hosts as the slice does; else the leader is
process 0 and the workers follow in bundle order. The runtime's coordinator runs in
process 0, on a port its host picked.

A worker that fails, dies or stops answering makes the replica lost: its requests fail
with a 503, its health check fails, and Serve replaces it whole (the placement group and
the workers go with the replica that owns them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.admin import resolve_model_path, resolve_tokenizer_path
from deployments.config import AppArgs
from deployments.placement import PlacementError, check_devices
from lora_runtime.engine import spmd

logger = logging.getLogger("ray.serve")

JOIN_TIMEOUT_S = 600  # workers starting, the runtime forming, the op links connecting
ALIVE_TIMEOUT_S = 10.0  # a worker that does not answer a health probe this fast is lost
_TPU_WORKER_ID_LABEL = "ray.io/tpu-worker-id"


def describe_host() -> dict:
    """This process's node address, its TPU worker id (None off a TPU slice) and a free port
    (the runtime's coordinator's, should this host be process 0)."""
    ip = ray.util.get_node_ip_address()
    worker_id = os.environ.get("TPU_WORKER_ID") or ray.get_runtime_context().get_node_labels().get(_TPU_WORKER_ID_LABEL)
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return {"ip": ip, "tpu_worker_id": None if worker_id in (None, "") else int(worker_id), "port": port}


def process_ids(hosts: list[dict]) -> list[int]:
    """Each host's JAX process id (hosts[0] is the leader): their TPU worker ids where all
    have distinct ones from 0, else their order."""
    ids = [h["tpu_worker_id"] for h in hosts]
    if None not in ids and sorted(ids) == list(range(len(hosts))):
        return ids
    return list(range(len(hosts)))


class HostWorker:
    """One host of a multi-host replica besides its leader (a Ray actor in the replica's
    placement group): joins the runtime, builds the engine, follows the leader's ops."""

    def __init__(self, args: dict):
        self._args = AppArgs(**args)

    def describe(self) -> dict:
        return describe_host()

    def alive(self) -> bool:
        return True

    def join(self, coordinator: str, processes: int, process_id: int, leader: tuple[str, int],
             authkey: bytes) -> list[str]:
        """Joins the runtime and the leader's op link; returns this host's devices. The
        engine is built and followed on a thread of its own from here on."""
        import jax

        a = self._args
        devices = spmd.join_runtime(coordinator, processes, process_id)
        check_devices(a.accelerator, a.tensor_parallel_size, devices, hosts=a.hosts_per_replica,
                      local=jax.local_devices())
        conn = spmd.connect(tuple(leader), authkey)
        conn.send(("hello", process_id))
        threading.Thread(target=self._follow, args=(conn,), name="host-follower", daemon=True).start()
        return [f"{d.platform}:{d.id}" for d in jax.local_devices()]

    def _build(self, plan):
        from lora_runtime.engine.engine import Engine

        a = self._args
        return Engine.from_pretrained(resolve_model_path(a.model), a.engine_config(), model_name=a.served_model_name,
                                      tokenizer_path=resolve_tokenizer_path(a.tokenizer), plan=plan)

    def _follow(self, conn) -> None:
        clean = False
        try:
            spmd.serve_follower(conn, self._build)
            clean = True
        except Exception:
            logger.exception("this host of a multi-host replica failed")
        finally:
            conn.close()
            if clean:  # the leader said stop: end the runtime with it
                spmd.leave_runtime()
            # Nothing on this host serves any more: free its devices now.
            os._exit(0)


class ReplicaHosts:
    """A multi-host replica's other hosts, as its leader holds them."""

    def __init__(self, workers: list, mirror: spmd.Mirror):
        self._workers = workers
        self.mirror = mirror

    @classmethod
    async def start(cls, args: AppArgs) -> "ReplicaHosts":
        """Starts a worker on each other host of this replica's placement group and forms the
        runtime and the op link with them (this process joins as the leader)."""
        hosts = args.hosts_per_replica
        group = get_current_placement_group()
        if group is None:
            raise PlacementError(f"hosts_per_replica={hosts} but this replica runs in no placement group: deploy it "
                                 "with build_app, which asks Serve for one bundle per host")
        placement = args.placement(None)
        own = describe_host()
        listener, address, authkey = spmd.listen(own["ip"])
        worker = ray.remote(HostWorker)
        workers = [worker.options(**placement.worker_options(), max_restarts=0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      group, placement_group_bundle_index=i, placement_group_capture_child_tasks=False))
                   .remote(args.model_dump()) for i in range(1, hosts)]
        try:
            described = await asyncio.wait_for(asyncio.gather(*(w.describe.remote() for w in workers)),
                                               JOIN_TIMEOUT_S)
            ids = process_ids([own, *described])
            first = [own, *described][ids.index(0)]
            coordinator = f"{first['ip']}:{first['port']}"
            # The workers connect to the op link inside join: accept them meanwhile.
            accepting = asyncio.ensure_future(asyncio.to_thread(spmd.accept, listener, hosts - 1, JOIN_TIMEOUT_S))
            joins = [w.join.remote(coordinator, hosts, pid, address, authkey) for w, pid in zip(workers, ids[1:])]
            await asyncio.to_thread(spmd.join_runtime, coordinator, hosts, ids[0], JOIN_TIMEOUT_S)
            devices = await asyncio.wait_for(asyncio.gather(*joins), JOIN_TIMEOUT_S)
            conns = await accepting
        except BaseException:
            for w in workers:
                ray.kill(w)
            raise
        finally:
            listener.close()
        logger.info("multi-host replica: leader is JAX process %d of %d; other hosts' devices %s", ids[0], hosts,
                    devices)
        return cls(workers, spmd.Mirror(conns))

    def attach(self, engine) -> None:
        """Makes `engine` (built, not started) the leader of the other hosts' engines."""
        spmd.attach(engine, self.mirror)

    async def check(self) -> None:
        """Raises HostLostError once a host failed, went away or stops answering."""
        self.mirror.check()
        try:
            await asyncio.wait_for(asyncio.gather(*(w.alive.remote() for w in self._workers)), ALIVE_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as err:
            self.mirror.lose(f"a worker did not answer its health probe ({type(err).__name__}: {err})")
            self.mirror.check()

    def close(self) -> None:
        """Tells the other hosts to stop, and leaves the runtime with them."""
        lost = self.mirror.lost is not None
        self.mirror.close()
        if not lost:  # else the runtime's end would wait for a host that is gone
            spmd.leave_runtime()


__all__ = ["HostWorker", "ReplicaHosts", "describe_host", "process_ids"]

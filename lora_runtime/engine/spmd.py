"""One replica over several hosts (SPMD): the leader's engine decides, every host computes.

Every process of a multi-host replica holds the same engine objects (its shards of the
weights, the KV cache and the adapter pool, over one global mesh), and all of them must
launch the same jitted programs in the same order, or their collectives never meet. The
leader (the process Serve talks to) alone schedules. Each device op its runner or adapter
manager launches goes first, with its host inputs, to every follower, which launches it on
its own shards:

    leader:    send ("op", "runner", "forward", (kind, inputs, POOL)) → launch it → host work
               → send ("op", "runner", "sample", (...)) → launch it → read the tokens
    follower:  recv → launch                     ...  recv → launch (its tokens unread)

An op is a method `op_<name>` of the runner or the manager that takes host values only;
an adapter pool argument travels as the POOL marker and each process uses its own. Hints
are messages that launch nothing (a follower starts fetching an adapter the leader will
write): they run on the follower's fetch threads, in no particular order with the ops.

The wire is multiprocessing.connection over TCP (pickled messages, HMAC-authenticated with
a key of the replica's own), one ordered connection per follower. A follower that fails an
op (other than a request's own error, which the leader's launch raised too) or goes away
makes the replica lost: the leader's next op raises HostLostError, a step that failed
meanwhile (its collective's peer gone) fails its requests with it too (ModelRunner.failure_cause),
and the replica's health check fails so that Serve replaces it whole.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Client, Connection, Listener

from lora_runtime.errors import HostLostError, ServingError

logger = logging.getLogger(__name__)

POOL = "<adapter pool>"  # stands for the process's own adapter pool in an op's arguments
READY_TIMEOUT_S = 900.0
SHUTDOWN_TIMEOUT_S = 30  # how long a stopping process waits for the others at the runtime's end  # how long the leader's first op waits for followers to build and compile


def join_runtime(coordinator: str, processes: int, process_id: int, timeout_s: int = 300,
                 heartbeat_timeout_s: int = 60) -> list:
    """Joins the replica's one JAX runtime (the coordinator runs in process 0) and starts the
    backend at once: every process's backend starts together (they exchange their devices),
    so none may wait for another before it; returns the global devices. A process that
    misses heartbeats for `heartbeat_timeout_s` ends the runtime, and every process with it."""
    import jax

    jax.distributed.initialize(coordinator, processes, process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    return jax.devices()


def leave_runtime() -> None:
    """Ends this process's part of the runtime; every process leaves together (a barrier)."""
    import jax

    jax.distributed.shutdown()


def listen(host: str) -> tuple[Listener, tuple[str, int], bytes]:
    """The leader's listener for its followers: (listener, its address, the key they need)."""
    authkey = secrets.token_bytes(32)
    listener = Listener((host, 0), authkey=authkey)
    return listener, listener.address, authkey


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float = 120.0) -> Connection:
    """A follower's connection to its leader, retried until the leader listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(tuple(address), authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def accept(listener: Listener, count: int, timeout_s: float) -> dict[int, Connection]:
    """The followers' connections by JAX process id (each says hello with its own)."""
    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + timeout_s

    def run() -> None:
        while len(conns) < count:
            conn = listener.accept()
            kind, process_id = conn.recv()
            if kind != "hello":
                raise RuntimeError(f"a follower said {kind!r} before hello")
            conns[int(process_id)] = conn

    thread = threading.Thread(target=run, name="spmd-accept", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        listener.close()
        raise TimeoutError(f"{len(conns)} of {count} follower hosts connected within {timeout_s:g} s")
    return conns


class Mirror:
    """The leader's side: sends each device op to every follower before it is launched here,
    and watches the followers (ready, failed, gone)."""

    def __init__(self, conns: dict[int, Connection], *, ready_timeout_s: float = READY_TIMEOUT_S,
                 on_lost: Callable[[str], None] | None = None):
        self._conns = dict(sorted(conns.items()))
        self._send_lock = threading.Lock()  # ops (engine thread) and hints (fetch threads) share a socket
        self._issuer = threading.Lock()  # never waited on: tells ops launched from two threads at once
        self._ready = threading.Event()
        self._lost = threading.Event()
        self._ready_count = 0
        self._ready_timeout_s = ready_timeout_s
        self._state_lock = threading.Lock()
        self.lost: str | None = None
        self._on_lost = on_lost
        self._closing = False
        self.ops_sent = 0
        for pid, conn in self._conns.items():
            threading.Thread(target=self._watch, args=(pid, conn), name=f"spmd-watch-{pid}", daemon=True).start()
        if not self._conns:
            self._ready.set()

    @property
    def hosts(self) -> int:
        """Processes of the replica, the leader included."""
        return len(self._conns) + 1

    def check(self) -> None:
        """Raises HostLostError once a follower failed or went away."""
        if self.lost is not None:
            raise HostLostError(f"this replica lost one of its hosts ({self.lost}); it is being replaced, retry")

    def lost_within(self, timeout_s: float) -> bool:
        """Whether the replica is lost, or becomes lost within `timeout_s`: a step that failed
        because a host died (its collective's peer gone) may fail before the watcher of that
        host's connection has seen it close."""
        return self._lost.wait(timeout_s)

    @contextlib.contextmanager
    def issuing(self, target: str, name: str, args: Sequence) -> Iterator[None]:
        """Sends op `name` of `target` ("runner" or "adapters") to the followers; the caller
        launches it locally inside the block, so every process launches ops in one order."""
        if not self._issuer.acquire(blocking=False):
            raise RuntimeError(f"device op {target}.{name} launched while another thread launches one: a multi-host "
                               "replica's device ops must come from one thread (the engine's loop)")
        try:
            self._wait_ready()
            self.check()
            self._send(("op", target, name, _wire(args)))
            self.ops_sent += 1
            yield
        finally:
            self._issuer.release()

    def hint(self, target: str, name: str, args: Sequence) -> None:
        """Sends a message that launches nothing (method hint_<name> of the follower's target)."""
        if self.lost is None:
            self._send(("hint", target, name, _wire(args)))

    def broadcast(self, message: tuple) -> None:
        """Sends a control message (e.g. the build order) to every follower."""
        self._send(message)

    def close(self) -> None:
        """Tells the followers to stop and closes their connections."""
        self._closing = True
        with contextlib.suppress(Exception):
            self._send(("stop",))
        for conn in self._conns.values():
            with contextlib.suppress(Exception):
                conn.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            for pid, conn in self._conns.items():
                try:
                    conn.send(message)
                except (OSError, EOFError, ValueError) as err:
                    self.lose(f"host {pid}: sending failed ({err})")
                    self.check()

    def _wait_ready(self) -> None:
        if not self._ready.wait(self._ready_timeout_s):
            self.lose(f"{len(self._conns) - self._ready_count} follower host(s) not ready after "
                       f"{self._ready_timeout_s:g} s")

    def _watch(self, pid: int, conn: Connection) -> None:
        try:
            while True:
                message = conn.recv()
                if message[0] == "ready":
                    with self._state_lock:
                        self._ready_count += 1
                        if self._ready_count == len(self._conns):
                            self._ready.set()
                elif message[0] == "error":
                    self.lose(f"host {pid}: {message[1]}")
        except (EOFError, OSError) as err:
            if not self._closing:
                self.lose(f"host {pid} closed its connection ({type(err).__name__})")

    def lose(self, why: str) -> None:
        """Marks the replica lost (the first reason is kept)."""
        with self._state_lock:
            if self.lost is not None:
                return
            self.lost = why
        logger.error("multi-host replica lost a host: %s", why)
        self._lost.set()
        self._ready.set()  # an op waiting for readiness fails now
        if self._on_lost is not None:
            self._on_lost(why)


def _wire(args: Sequence) -> tuple:
    """An op's arguments as sent: an adapter pool as the POOL marker."""
    from lora_runtime.lora.memory_pool import LoRAMemoryPool

    return tuple(POOL if isinstance(a, LoRAMemoryPool) else a for a in args)


def attach(engine, mirror: Mirror) -> None:
    """Makes `engine` (built, not started) its followers' leader: they build theirs with its
    memory plan (every host's cache one shape), and its device ops go to them first."""
    mirror.broadcast(("build", engine.memory_plan))
    engine.runner.mirror = mirror
    if engine.lora_manager is not None:
        engine.lora_manager.mirror = mirror


def serve_follower(conn: Connection, build: Callable[[object], object]) -> None:
    """A follower from its connection on: builds its engine with `build(leader's memory plan)`
    when the leader says, then follows it (follow) until it stops."""
    message = conn.recv()
    if message[0] == "stop":
        return
    if message[0] != "build":
        raise RuntimeError(f"the leader said {message[0]!r} before build")
    try:
        engine = build(message[1])
    except Exception as err:
        conn.send(("error", f"building the engine failed: {err!r}"))
        raise
    try:
        follow(engine, conn)
    finally:
        if engine.lora_manager is not None:
            engine.lora_manager.close()


def follow(engine, conn: Connection) -> None:
    """A follower's loop: compiles the engine's steps, tells the leader it is ready, then
    launches each op the leader sends, in order, until it says stop or goes away."""
    engine.compile_steps()
    conn.send(("ready",))
    manager = engine.lora_manager
    targets = {"runner": engine.runner, "adapters": manager}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            logger.warning("the leader host closed its connection; this follower stops")
            return
        if message[0] == "stop":
            return
        kind, target, name, args = message
        args = tuple(manager.pool if isinstance(a, str) and a == POOL else a for a in args)
        if kind == "hint":
            getattr(targets[target], "hint_" + name)(*args)
            continue
        try:
            getattr(targets[target], "op_" + name)(*args)
        except ServingError as err:  # a request's own error: the leader's launch raised it too
            logger.info("op %s.%s raised %s (as on the leader)", target, name, err)
        except Exception as err:
            logger.exception("op %s.%s failed on this follower", target, name)
            conn.send(("error", f"op {target}.{name} failed: {err!r}"))
            raise


__all__ = ["Mirror", "POOL", "accept", "attach", "connect", "follow", "join_runtime", "leave_runtime", "listen", "serve_follower"]

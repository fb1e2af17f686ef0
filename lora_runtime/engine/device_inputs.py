"""A step's small host inputs, kept on the device while they repeat.

Every launch of a step program sends its host arrays to the device, one transfer each, and a
decode step has some thirty: the tokens and positions, the attention metadata, the adapter
batch (LoRABatchInfo, nine arrays) and the sampling parameters (SamplingBatch, fourteen).
Most of them repeat from one decode step to the next: the adapter batch and the sampling
parameters change only when a sequence joins or leaves the batch (the sampler's `step`
excepted), the block tables when a sequence takes a new block. On an accelerator each
transfer costs the engine thread tens of microseconds while the device waits for the launch.

`DeviceInputs.put` keeps the last device copy of each small leaf of each named input and
sends a leaf only when its bytes differ from that copy's. The copies are replicated over the
replica's mesh, the layout the step programs are compiled for (`specs` gives the warm-up the
same layout without sending anything). A leaf is sent through a jitted identity, whose
launch transfers it in the runtime's own code: `jax.device_put` from Python cost about 40 us
a leaf on CPU, the identity about 5 (it is compiled for each leaf shape by `specs`, in
warm-up). Leaves past `MAX_KEPT_BYTES` (a grammar's token mask) go as they are: comparing
them would cost what it saves. One owner: the thread that launches
the steps (on a multi-host replica every process keeps its own copies of the same values).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

MAX_KEPT_BYTES = 64 << 10


def _kept(leaf) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic)) and leaf.nbytes <= MAX_KEPT_BYTES


class DeviceInputs:
    """The device copies of the small host leaves of a step's inputs, per input name."""

    def __init__(self, mesh: jax.sharding.Mesh):
        self.sharding = NamedSharding(mesh, PartitionSpec())
        self._identity = jax.jit(lambda leaf: leaf, out_shardings=self.sharding)
        self._ready: set[tuple] = set()  # (shape, dtype) the identity is compiled for
        self._ready_lock = threading.Lock()  # specs runs on the warm-up's threads
        self._copies: dict[tuple[str, int], tuple[tuple, jax.Array]] = {}
        self.sent = 0  # leaves sent to the device
        self.reused = 0  # leaves whose device copy was used again

    def put(self, name: str, tree):
        """`tree` with each small host leaf replaced by its device copy, sent only if the leaf's
        shape, dtype or bytes changed since the last `put` of `name`."""
        leaves, treedef = jax.tree.flatten(tree)
        out = list(leaves)
        sent = kept = 0
        for i, leaf in enumerate(leaves):
            if not _kept(leaf):
                continue
            kept += 1
            key = (leaf.shape, leaf.dtype, leaf.tobytes())
            copy = self._copies.get((name, i))
            if copy is None or copy[0] != key:
                # A copy: the caller may reuse its array, and a CPU device may alias the one sent.
                copy = (key, self._identity(np.array(leaf)))
                self._copies[(name, i)] = copy
                sent += 1
            out[i] = copy[1]
        self.sent += sent
        self.reused += kept - sent
        return jax.tree.unflatten(treedef, out)

    def specs(self, tree):
        """`tree` as `put` would give it, with the device copies' shapes and layout in place of
        the small leaves (ahead-of-time compilation: nothing is sent, the identity that sends
        such leaves is compiled)."""
        def spec(leaf):
            if not _kept(leaf):
                return leaf
            shape, dtype = np.shape(leaf), np.asarray(leaf).dtype
            with self._ready_lock:
                new = (shape, dtype) not in self._ready
                self._ready.add((shape, dtype))
            if new:
                self._identity.trace(jax.ShapeDtypeStruct(shape, dtype)).lower().compile()
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)
        return jax.tree.map(spec, tree)

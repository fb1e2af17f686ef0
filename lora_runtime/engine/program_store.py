"""The engine's step programs kept as serialized exports, so a restart skips tracing them.

JAX's persistent compilation cache saves what XLA compiles, but a restarted replica must
still trace and lower every step shape to find its cache entry: in Python, holding the
interpreter lock, so the warm-up's threads take turns. At Llama-3-8B widths on a TPU that
is most of a cached warm-up. A `ProgramStore` saves each step program the warm-up builds as
a `jax.export` serialization (StableHLO, and the structure of its outputs) under the
compilation cache (`programs/`); the next start deserializes it and compiles that, which the
compilation cache then serves, instead of running the Python that traces the model.

A program is found again only if nothing that shaped it changed: the store's key holds the
source of `lora_runtime` and `kernels`, the JAX version, the devices, the model's graph and
config, the engine config, and the program's argument structure, shapes, dtypes and
shardings. Anything else falls back to tracing as before. A replica spanning hosts (several
JAX processes) traces its programs in each, as before.

Calls go through `call`: a step whose argument structure and shapes match a program the
store compiled runs that executable; any other runs the jitted function, as without a
store. A program that cannot be exported (a host callback inside it: Pallas kernels
interpreted on CPU) is traced and compiled the usual way.

A start whose every program came from the store, and which then ran its warm-up's checks,
leaves a mark of that set of programs (`proven/`); the next start with the same programs
finds it (`proven`) and need not run them again to know they run on this device
(Engine.warmup).

Like the compilation cache, the directory is trusted code: it must be writable by the
serving user only (the output structures are pickled).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import pathlib
import pickle
import re
import threading

import jax
import numpy as np

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what a stored file holds changes
_SOURCE_PACKAGES = ("lora_runtime", "kernels")


@functools.cache
def source_digest() -> str:
    """A digest of the Python source the step programs are traced from."""
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[2]
    for package in _SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def exports_available() -> bool:
    """Whether jax.export can serialize here (it needs the flatbuffers package)."""
    return importlib.util.find_spec("flatbuffers") is not None


def _leaf_signature(leaf) -> tuple:
    """(shape, dtype) of an argument leaf: on every call, so kept cheap (a dtype's str costs
    several microseconds; the dtype itself hashes)."""
    try:
        return leaf.shape, leaf.dtype
    except AttributeError:  # a Python scalar
        return np.shape(leaf), np.result_type(leaf)


def _leaf_spec(leaf) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class ProgramStore:
    """Step programs compiled from stored exports (see the module docstring).

    `directory`: where the exports live (a local path or an fsspec URL); None keeps nothing
    and compiles every program by tracing it, as jit does. `context`: what besides the
    arguments shapes the programs (the model's graph, configs, kernel choices), as text.
    """

    def __init__(self, directory: str | None, context: str):
        if directory and not exports_available():
            logger.warning("jax.export cannot serialize here (flatbuffers missing): step programs are "
                           "traced at every start")
            directory = None
        if jax.process_count() > 1:  # a replica spanning hosts traces its programs in every process
            directory = None
        self.directory = directory
        self._context = _digest("\n".join((f"format {FORMAT}", jax.__version__, source_digest(), _devices(), context)))
        self._programs: dict[tuple, tuple[object, object]] = {}
        self._first: dict[str, tuple] = {}  # name -> (last first argument, its leaves, signature): _flatten
        self._lock = threading.Lock()
        self._keys: set[str] = set()  # keys of the programs compiled from the store
        self.loaded = 0  # programs compiled from a stored export
        self.saved = 0  # programs exported and stored by this process
        self.traced = 0  # programs traced because they cannot be exported

    def __len__(self) -> int:
        return len(self._programs)

    # ---- the hot path -----------------------------------------------------------------

    def call(self, name: str, fn, args: tuple):
        """`fn(*args)`, through the executable compiled for these arguments if there is one."""
        if not self._programs:
            return fn(*args)
        leaves, signature = self._flatten(name, args)
        found = self._programs.get((name, signature))
        if found is None:
            return fn(*args)
        executable, out_tree = found
        return jax.tree.unflatten(out_tree, executable(*leaves))

    def _flatten(self, name: str, args: tuple) -> tuple[list, tuple]:
        """(leaves, signature: treedefs, shapes and dtypes) of `args`. A first argument that is
        a pytree, not an array, is remembered per program while the same object comes first
        again: the runner passes its weights first, one object that is replaced, never changed
        in place, and flattening a model's state (hundreds of variables, through flax's
        Python) cost more than the rest of a dispatch."""
        first, rest = args[0], args[1:]
        remembered = self._first.get(name)
        if remembered is None or remembered[0] is not first:
            leaves, tree = jax.tree.flatten(first)
            remembered = (first, leaves, (tree, tuple(map(_leaf_signature, leaves))))
            if not isinstance(first, jax.Array):  # an array (logits) is new at every call
                self._first[name] = remembered
        leaves, tree = jax.tree.flatten(rest)
        return [*remembered[1], *leaves], (remembered[2], tree, tuple(map(_leaf_signature, leaves)))

    # ---- warm-up ----------------------------------------------------------------------

    def compile(self, name: str, fn, args: tuple, *, donate: tuple[int, ...] = ()):
        """Compiles `fn` (jitted, donating the arguments at `donate`) for `args` (arrays or
        ShapeDtypeStructs) and returns its outputs' shardings; `call` then runs it. Thread-safe."""
        if self.directory is None:
            return _traced(fn, args)
        leaves, tree = jax.tree.flatten(args)
        specs = [_leaf_spec(leaf) for leaf in leaves]
        key = _digest(repr((self._context, name, str(tree), [(tuple(s.shape), str(s.dtype)) for s in specs],
                            [str(s.sharding) for s in specs], donate)))
        stored = self._read(key)
        if stored is None:
            stored = self._export(fn, tree, specs)
            if stored is None:  # not exportable
                with self._lock:
                    self.traced += 1
                return _traced(fn, args)
            self._write(key, stored)
        exported, out_tree = stored
        counts = [len(jax.tree.leaves(a)) for a in args]
        donated = tuple(i for pos in donate for i in range(sum(counts[:pos]), sum(counts[:pos + 1])))
        executable = jax.jit(_named(exported.call, name), donate_argnums=donated).trace(*specs).lower().compile()
        with self._lock:
            self._programs[(name, self._flatten(name, args)[1])] = (executable, out_tree)
            self._keys.add(key)
        return jax.tree.unflatten(out_tree, executable.output_shardings)

    # ---- proven sets of programs --------------------------------------------------------

    def proven(self, check: str) -> bool:
        """Whether an earlier start compiled exactly this start's programs, every one from the
        store, and passed `check` with them (marked by `prove`)."""
        path = self._proof_path(check)
        if path is None:
            return False
        try:
            if "://" in path:
                import fsspec

                return fsspec.filesystem(path.split("://", 1)[0]).exists(path)
            return os.path.exists(path)
        except OSError:
            return False

    def prove(self, check: str) -> None:
        """Marks that this start's programs passed `check` (what the warm-up ran to prove them)."""
        path = self._proof_path(check)
        if path is None:
            return
        try:
            _put(path, b"")
        except OSError as exc:
            logger.warning("could not mark the step programs as proven (%s)", exc)

    def _proof_path(self, check: str) -> str | None:
        """Where the mark of this start's programs and `check` lives; None where there is none
        to make: no store, or a program that is not in it (traced at every start)."""
        with self._lock:
            if self.directory is None or self.traced or not self._keys:
                return None
            digest = _digest("\n".join((self._context, check, *sorted(self._keys))))
        return f"{self.directory.rstrip('/')}/proven/{digest}"

    def _export(self, fn, tree, specs):
        """(export, output structure) of `fn` over flat arguments; None if it cannot be exported."""
        out_trees = []

        def flat(*leaves):
            out_leaves, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(tree, leaves)))
            out_trees.append(out_tree)
            return out_leaves

        try:
            exported = jax.export.export(jax.jit(flat))(*specs)
            exported.serialize()  # what cannot be serialized fails here rather than at the write
        except Exception as exc:  # noqa: BLE001  (any refusal: callbacks, unstable custom calls)
            logger.info("step program not exportable (%s): traced at every start", str(exc).splitlines()[0][:200])
            return None
        return exported, out_trees[0]

    def _path(self, key: str) -> str:
        return f"{self.directory.rstrip('/')}/{key[:2]}/{key}.jaxexport"

    def _read(self, key: str):
        path = self._path(key)
        try:
            if "://" in path:
                import fsspec

                with fsspec.open(path, "rb") as f:
                    data = f.read()
            else:
                data = pathlib.Path(path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("stored step program %s unreadable (%s): tracing it", path, exc)
            return None
        try:
            serialized, out_tree = pickle.loads(data)
            exported = jax.export.deserialize(bytearray(serialized))
        except Exception as exc:  # noqa: BLE001  (a torn or foreign file: trace instead, and replace it)
            logger.warning("stored step program %s unusable (%s): tracing it", path, exc)
            return None
        with self._lock:
            self.loaded += 1
        return exported, out_tree

    def _write(self, key: str, stored) -> None:
        exported, out_tree = stored
        data = pickle.dumps((bytes(exported.serialize()), out_tree))
        path = self._path(key)
        try:
            _put(path, data)
        except OSError as exc:
            logger.warning("could not store step program %s (%s)", path, exc)
            return
        with self._lock:
            self.saved += 1


def _put(path: str, data: bytes) -> None:
    """Writes `data` at `path` (a local path or an fsspec URL) whole: readers never see half a
    file. Raises OSError."""
    if "://" in path:
        import fsspec

        with fsspec.open(path, "wb") as f:  # an object store's write lands whole or not at all
            f.write(data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"  # the umask's mode, as JAX's cache files
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def _named(fn, name: str):
    """`fn` under `name`, which jit gives the program (`jit_decode`): what a profile shows."""
    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def _traced(fn, args: tuple):
    """Compiles `fn` for `args` as jit does (tracing it; jit's cache keeps the executable
    for the call) and returns its outputs' shardings."""
    return fn.trace(*args).lower().compile().output_shardings


def _digest(text: str) -> str:
    """sha256 of `text` without the object addresses reprs carry (`<function f at 0x...>`),
    which differ from process to process."""
    return hashlib.sha256(re.sub(r" at 0x[0-9a-f]+", "", text).encode()).hexdigest()


def _devices() -> str:
    devices = jax.devices()
    return f"{devices[0].platform} {devices[0].device_kind} x{len(devices)} processes {jax.process_count()}"

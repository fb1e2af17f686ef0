"""The engine of one replica: a step loop on its own thread behind an asyncio API.

Requests arrive from any thread (`submit`) or coroutine (`generate`); the loop admits
waiting requests between decode steps (continuous batching), runs at most one packed
prefill step and one decode step per iteration, and hands each request its new tokens
and text through a callback. Only the loop thread touches the scheduler, the runner
and the LoRA pool.

A failure fails the requests that caused it, where that can be told, and the loop serves
on. Host work on one sequence's output (its tokens, text, stop strings) that raises fails
that sequence alone. A step (inputs, device call) that raises with one sequence in it
fails that sequence; with several, they become suspects: each is then run alone for
`ISOLATION_STEPS` steps while the others pause, and one whose lone step fails again is the
one failed. A step that consumed the KV cache (donated) takes every running sequence's
K/V with it: those are recomputed from their tokens (as after a preemption), not failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import queue
import random
import threading
import time
import uuid
from typing import AsyncIterator, Callable, Sequence as Seq, TypeVar

import numpy as np

from lora_runtime.engine import compile_events
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.bad_words import bad_words_ids, banned_tokens
from lora_runtime.engine.grammar import GrammarCompiler, GrammarMatcher, mask_words, token_set_mask
from lora_runtime.engine.runner import ModelRunner, PendingSample, Sampled, StepInputs, history_bucket
from lora_runtime.engine.sampling import SamplingBatch, SamplingParams
from lora_runtime.engine.scheduler import Admission, Scheduler
from lora_runtime.engine.sequence import RequestOutput, Sequence, TokenLogprob
from lora_runtime.errors import AdapterNotFoundError, CapacityError, HostLostError, InvalidRequestError, ServingError
from lora_runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer
from lora_runtime.native_thread import name_native_thread

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["Engine", "RequestOutput", "SamplingParams"]


# A several-sequence extend step computes the rests of up to ROWS_SEQUENCES prompts of up to
# ROWS_CHUNK_MAX tokens each (C tokens per sequence, padded).
ROWS_CHUNK_MAX = 64
ROWS_SEQUENCES = 8
# Steps a suspect of a failed step runs alone before it rejoins the batch: its prefill and a decode.
ISOLATION_STEPS = 2


class Engine:
    """Serves many concurrent sequences of one base model and its adapters."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        lora_manager=None,
        model_name: str = "base",
    ):
        self.runner = runner
        self.config: EngineConfig = runner.config
        self.model_config = runner.model_config
        self.tokenizer = tokenizer
        self.lora_manager = lora_manager
        self.model_name = model_name
        self.scheduler = Scheduler(self.config, lora_manager, num_blocks=runner.num_blocks,
                                   block_size=runner.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls_lock = threading.Lock()  # orders calls handed to the loop with its end
        self._loop_done = True
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._eos = frozenset(tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.counters = {
            "requests": 0, "finished": 0, "aborted": 0, "failed": 0,
            "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
            "prefill_seconds": 0.0, "decode_seconds": 0.0, "decode_row_steps": 0,
            "max_batch_adapters": 0,  # most distinct adapters seen in one decode step
            "extend_steps": 0,  # chunks of prompts computed over a cached prefix or earlier chunks
            "failed_steps": 0,  # steps that raised (their requests failed, or were run alone to tell)
            "isolated_steps": 0,  # steps run with one suspect alone
            "masked_rows": 0,  # sampled rows constrained by a grammar, allowed_token_ids or bad_words
            "mask_seconds": 0.0,  # host time computing their allowed-token masks
        }
        self.memory_plan = None  # the MemoryPlan the cache was sized by (set by the builder)
        # The checkpoint's recommended sampling values (model/generation_defaults.py; set by the builder).
        self.generation_defaults: dict[str, float | int] = {}
        # What warm-up built (JAX's compile events: executables, of which cache hits, seconds).
        self.warm_counts: compile_events.CompileCounts | None = None
        self.warm_seconds: float | None = None  # the warm-up's wall time
        self.warm_ran: bool | None = None  # whether warm-up ran the largest steps (see warmup)
        self._loop_builds = 0
        self._phase: list[Sequence] = []  # the sequences of the part of a step now running
        # Sequences with a token whose text (detokenizing, stop strings, the stream item) waits
        # for the next decode step to be dispatched, so that host work overlaps the device's.
        self._text_pending: list[Sequence] = []
        self._in_flight: _DecodeStep | None = None  # the decode step dispatched but not settled (async_decode)
        # A packed prefill dispatched but not settled (async_decode): its first tokens are read
        # once the step's decode is dispatched behind it, so the device never waits for the host.
        self._prefill_in_flight: _PrefillStep | None = None
        # Where the next settled decode step's time starts: the last decode step's settling or
        # the end of a prefill step since (None: idle since); see _settle_step.
        self._decode_clock: float | None = None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls, model_path: str, config: EngineConfig, *, model_name: str | None = None, tokenizer_path: str | None = None,
        plan=None,
    ) -> "Engine":
        """Loads the checkpoint sharded over `tensor_parallel_size` devices and builds the engine
        (with the tokenizer of `tokenizer_path` when given, else the checkpoint's; with the
        MemoryPlan `plan` when given, else its own)."""
        from lora_runtime.engine.build import build_engine

        return build_engine(model_path, config, model_name=model_name, tokenizer_path=tokenizer_path, plan=plan)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> "Engine":
        """Compiles every step shape, then starts the loop thread."""
        if self._thread is None:
            self.warmup()
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._loop_done = False
            if self.lora_manager is not None:
                self.lora_manager.set_device_owner(self._call_on_loop)
            self._thread.start()
        return self

    def _call_on_loop(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the loop thread between steps and returns its result (or raises its
        error): how other threads reach state the loop owns, such as the adapter pool."""
        if threading.current_thread() is self._thread:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._calls_lock:
            inline = self._loop_done
            if not inline:
                self._inbox.put(("call", (fn, future)))
        if inline:  # the loop has stopped: nothing else touches its state
            return fn()
        self._wake.set()
        return future.result()

    def warmup(self) -> None:
        """Builds every step shape: packed prefill, prompt log-probabilities and one-sequence
        extend per prefill bucket, several-sequence extend per bucket up to ROWS_CHUNK_MAX,
        decode, and the sampler per row count; with adapters, each step twice (a step where
        no token uses an adapter runs the base model alone and pays nothing for LoRA).

        They compile ahead of time in parallel, a thread per core. Then the largest shape of
        each kind of step runs once on idle rows (and the prompt log-probabilities after the
        largest prefill): a program that compiles but cannot run (device memory at the
        largest bucket) fails at start rather than at a request. The smaller shapes need no
        run: the ahead-of-time compile left them in jit's cache, and running them would cost
        time that grows with depth. A restart whose every step program came from the program
        store, the same set an earlier start ran this way, skips those runs (`warm_ran` is
        then False): that start proved them on this device, and at Llama-3-8B widths on a CPU
        they were most of a cached start. Then what is built on a first run: the sampler's
        idle logits per row count, the row-state reset per history bucket and the adapter
        slot write (with DoRA's scales, compiled)."""
        runner = self.runner
        start = time.perf_counter()
        self.grammars  # noqa: B018  (its tokenizer index builds on its own thread meanwhile)
        built = self.compile_steps()
        before = compile_events.counts()
        largest = _largest_of_each_kind(self._warm_steps())
        check = "largest steps ran: " + repr([(kind, inputs.tokens.shape, inputs.lora is None)
                                              for kind, inputs, _ in largest])
        self.warm_ran = not runner.programs.proven(check)
        run_step = {"prefill": runner.prefill, "extend": runner.extend, "decode": runner.decode}
        for kind, inputs, pool in largest if self.warm_ran else ():
            run_step[kind](inputs, pool)
            if kind == "prefill" and _reads_head(inputs, pool):
                runner.prompt_logprobs(np.zeros(inputs.tokens.shape[0], np.int32))
        for rows in self._sample_rows():  # the idle logits it builds (the sampler compiled ahead)
            runner.warm_sample(rows, masked=True)
        size = history_bucket(1)
        while True:
            runner.init_row(0, [0] * size, size)
            if size >= self.config.max_seq_len:
                break
            size *= 2
        if self.lora_manager is not None:
            self.lora_manager.warm_up()
        if self.warm_ran:
            runner.programs.prove(check)
        self.warm_counts = built + (compile_events.counts() - before)
        self.warm_seconds = time.perf_counter() - start

    def _sample_rows(self) -> list[int]:
        """The sampler's row counts: prefill and decode sample max_batch rows, a
        several-sequence extend one per sequence, a one-sequence extend one."""
        return sorted({self.config.max_batch, self._rows_sequences, 1})

    def _warm_steps(self) -> list[tuple[str, StepInputs, object]]:
        """Every step shape as (kind, idle inputs, pool)."""
        steps: list[tuple[str, StepInputs, object]] = []
        for lora in (False, True) if self.lora_manager is not None else (False,):
            pool = self._pool()
            for bucket in self.config.prefill_buckets():
                steps.append(("prefill", self._idle_inputs(bucket, prefill=True, lora=lora), pool))
                steps.append(("extend", self._idle_inputs(bucket, prefill=False, groups=1, lora=lora), pool))
            e = self._rows_sequences
            for c in self._rows_buckets():
                steps.append(("extend", self._idle_inputs(e * c, prefill=False, groups=e, lora=lora), pool))
            b = self.config.max_batch
            steps.append(("decode", self._idle_inputs(b, prefill=False, groups=b, lora=lora), pool))
        return steps

    def compile_steps(self) -> compile_events.CompileCounts:
        """Compiles every step shape ahead of time (warm-up's first half; a multi-host
        replica's followers run only this, then launch what the leader's warm-up runs) in
        parallel, a thread per core; returns what JAX built for them (compiled, or read from
        the persistent cache), summed over the threads. With a compilation cache, each
        program is compiled from its stored export where an earlier start left one, instead
        of being traced (ModelRunner.programs, program_store.py).

        Each process takes the steps in an order of its own (random): replicas that start
        together over one persistent cache (on one host, or a shared gs:// cache) then
        compile different steps first, and each reads what the others compiled instead of
        compiling everything itself."""
        runner = self.runner
        compile_step = {"prefill": runner.compile_prefill, "extend": runner.compile_extend,
                        "decode": runner.compile_decode}
        # Prompt log-probabilities read a prefill's hidden states (per bucket): a base one's, and
        # an adapter one's where adapters may change the head.
        jobs = [functools.partial(compile_step[kind], inputs, pool,
                                  **({"prompt_logprobs": _reads_head(inputs, pool)} if kind == "prefill" else {}))
                for kind, inputs, pool in self._warm_steps()]
        jobs += [functools.partial(runner.compile_sample, rows, masked=masked)
                 for rows in self._sample_rows() for masked in (False, True)]
        random.SystemRandom().shuffle(jobs)
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="engine-compile",
                                                   initializer=name_native_thread) as compilers:
            return sum(compilers.map(_builds_of, jobs), compile_events.CompileCounts(0, 0))

    @property
    def warm_compiles(self) -> int | None:
        """Executables warm-up built (compiled, or read from the persistent cache)."""
        return None if self.warm_counts is None else self.warm_counts.builds

    @property
    def compiles_after_warmup(self) -> int:
        """Executables built on the engine's loop thread (compiled, or read from the persistent
        cache), counted from JAX's own compile events: after warm-up, none should be."""
        if self._thread is None or self._thread.ident is None:
            return 0
        return compile_events.counts(self._thread.ident).builds - self._loop_builds

    def is_alive(self) -> bool:
        """Whether the loop thread runs (requests would hang if it had died)."""
        return self._thread is not None and self._thread.is_alive()

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stops accepting requests and waits for in-flight ones; True if all finished."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_work() or not self._inbox.empty():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def shutdown(self) -> None:
        """Aborts whatever still runs and stops the loop thread."""
        self._accepting = False
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._grammars is not None:
            self._grammars.close()

    # ---- requests ------------------------------------------------------------------

    def submit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        emit: Callable[[RequestOutput], None],
        *,
        request_id: str | None = None,
        adapter: str | None = None,
        grammar: GrammarMatcher | None = None,
        priority: int = 0,
    ) -> str:
        """Validates and queues a request; `emit` gets its outputs on the loop thread.
        `grammar`: the request's matcher when the caller compiled params.guided already (else
        it is compiled here, on the caller's thread). `priority`: lower is more urgent
        (scheduler.py); not 0 only where config.scheduling_policy is "priority".

        Raises a ServingError (nothing is queued) for a bad prompt, bad parameters, a grammar
        that does not compile or an unknown adapter.
        """
        self._check_accepting()
        params.validate(self.model_config.vocab_size)
        self._check_priority(priority)
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) + params.max_tokens > self.config.max_seq_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} "
                f"exceeds max_seq_len={self.config.max_seq_len}", param="max_tokens",
            )
        if adapter is not None:
            if self.lora_manager is None:
                raise AdapterNotFoundError(
                    f"adapter {adapter!r} requested but this engine serves no adapters "
                    f"(max_loras_per_batch=0)"
                )
            self.lora_manager.check_request(adapter)
        if params.guided is not None and grammar is None:
            grammar = self.grammars.matcher(params.guided)
        request_id = request_id or uuid.uuid4().hex
        seq = Sequence(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            seed=params.resolved_seed(),
            adapter=adapter,
            emit=emit,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
            ),
            eos_token_ids=self._eos,
            grammar=grammar,
            allowed_mask=None if params.allowed_token_ids is None else token_set_mask(
                params.allowed_token_ids, self.model_config.vocab_size),
            bad_words_ids=bad_words_ids(self.tokenizer, params.bad_words),
            priority=priority,
        )
        self._inbox.put(("add", seq))
        self._wake.set()
        return request_id

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
            raise InvalidRequestError(f"priority={priority!r} must be an integer in [-2**31, 2**31)", param="priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority={priority} needs scheduling by priority; this deployment schedules first come, first "
                f"served (scheduling_policy={self.config.scheduling_policy!r})", param="priority")

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise CapacityError("the engine is shutting down and accepts no new requests")

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of requests' grammars for this model's tokenizer (made on first use;
        warm-up makes it, so its tokenizer index builds while the steps compile)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size, self._eos)
            return self._grammars

    def _masks(self, rows: list[tuple[int, Sequence]], n_rows: int) -> np.ndarray | None:
        """The allowed-token bitmask of a step's sampled rows ((row, sequence) pairs), or None
        when none of them has a grammar, allowed_token_ids or a bad word to ban now (the step
        samples with the unmasked program). A row with several may take what all allow; where
        that is nothing, the grammar wins (it alone knows how the output may end)."""
        live = [(i, seq) for i, seq in rows if not seq.finished]
        guided = [(i, seq.grammar) for i, seq in live if seq.grammar is not None]
        limited = [(i, seq.allowed_mask) for i, seq in live if seq.allowed_mask is not None]
        for i, seq in live:
            if seq.bad_words_ids:
                banned = banned_tokens(seq.bad_words_ids, seq.output_ids)
                if banned:
                    keep = ~token_set_mask(sorted(banned), self.model_config.vocab_size)
                    limited.append((i, keep))
        if not guided and not limited:
            return None
        start = time.perf_counter()
        if guided:
            mask = self.grammars.fill_masks(guided, n_rows)
        else:
            mask = np.full((n_rows, mask_words(self.model_config.vocab_size)), -1, np.int32)
        for i, allowed in limited:  # a row may appear twice (allowed ids, banned words)
            both = mask[i] & allowed
            if both.any():
                mask[i] = both
        self.counters["mask_seconds"] += time.perf_counter() - start
        self.counters["masked_rows"] += len({i for i, _ in guided} | {i for i, _ in limited})
        return mask

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            bad = [t for t in ids if t >= self.model_config.vocab_size]
            if bad:  # a tokenizer with more tokens than the model has embeddings
                raise InvalidRequestError(
                    f"the prompt encodes to token ids {bad[:5]} that the model's vocab_size="
                    f"{self.model_config.vocab_size} does not hold (tokenizer and model do not match)",
                    param="prompt",
                )
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids {bad[:5]} outside [0, {self.model_config.vocab_size})", param="prompt",
                )
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(ids) >= self.config.max_seq_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; max_seq_len={self.config.max_seq_len} "
                f"leaves no room to generate", param="prompt",
            )
        return ids

    def abort(self, request_id: str) -> None:
        """Cancels a request wherever it is; its row and adapter slot are freed."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
        priority: int = 0,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; closing the iterator early aborts the request. An
        item carries everything produced since the previous one: outputs that queued up
        while the consumer was busy are merged, so a slow consumer gets fewer, larger items.
        After the first item, one waits for `stream_interval` new tokens and until
        `stream_interval_ms` passed since the item before, unless it finishes the request (or
        an error follows it). ``stream=False`` (a caller that answers only once the request
        ends): the first item, then everything else in one item when the request ends (or
        before the error that ends it)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        def emit(out: RequestOutput) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        # A grammar compiles on the compiler's thread: this event loop serves others meanwhile.
        self._check_accepting()
        self._check_priority(priority)  # before a grammar compiles for it
        grammar = None if params.guided is None else await self.grammars.matcher_async(params.guided)
        request_id = self.submit(prompt, params, emit, request_id=request_id, adapter=adapter, grammar=grammar,
                                 priority=priority)
        finished = False
        held: RequestOutput | None = None  # an error taken while merging: raised after what came before
        interval = self.config.stream_interval if stream else math.inf
        gap_s = self.config.stream_interval_ms / 1e3
        sent_at = 0.0  # the event loop's time of the item before
        sent: int | None = None  # completion tokens yielded so far; None before the first item
        try:
            while True:
                out, held = (held, None) if held is not None else (await outputs.get(), None)
                if out.error is not None:
                    finished = True
                    raise out.error
                parts = [out]
                while not parts[-1].finished:
                    if not outputs.empty():
                        more = outputs.get_nowait()
                    elif sent is not None and parts[-1].completion_tokens - sent < interval:
                        more = await outputs.get()
                    elif sent is not None and (wait_s := sent_at + gap_s - loop.time()) > 0:
                        try:
                            more = await asyncio.wait_for(outputs.get(), wait_s)
                        except asyncio.TimeoutError:
                            break
                    else:
                        break
                    if more.error is not None:
                        held = more
                        break
                    parts.append(more)
                out = parts[0] if len(parts) == 1 else _merge(parts)
                sent, sent_at = out.completion_tokens, loop.time()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def generate_batch(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        adapters: Seq[str | None] | None = None,
        timeout_s: float = 300.0,
        *,
        return_errors: bool = False,
    ) -> list[RequestOutput]:
        """Runs requests to completion from a plain thread; one merged output each. The first
        failed request's error is raised, or with `return_errors` left in its output's `error`."""
        n = len(prompts)
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        adapters = list(adapters) if adapters is not None else [None] * n
        results: list[RequestOutput | None] = [None] * n
        done = threading.Semaphore(0)

        def collector(i: int):
            parts: list[RequestOutput] = []

            def emit(out: RequestOutput) -> None:
                parts.append(out)
                if out.finished or out.error is not None:
                    results[i] = _merge(parts)
                    done.release()

            return emit

        for i in range(n):
            self.submit(prompts[i], params[i], collector(i), adapter=adapters[i])
        for _ in range(n):
            if not done.acquire(timeout=timeout_s):
                raise TimeoutError(f"requests did not finish within {timeout_s}s")
        for r in results:
            if r.error is not None and not return_errors:
                raise r.error
        return results

    def stats(self) -> dict[str, float]:
        """Numbers for health checks and metrics."""
        s = dict(self.counters)
        s.update(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            compiles_after_warmup=self.compiles_after_warmup,
            prefix_cache_query_tokens=self.scheduler.prefix_query_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            preemptions=self.scheduler.preemptions,
            adapter_slot_waits=self.scheduler.adapter_slot_waits,
            adapter_slot_wait_seconds=self.scheduler.adapter_slot_wait_seconds,
            kv_blocks=self.scheduler.pool.usable,
            kv_blocks_free=self.scheduler.pool.num_free,
            kv_blocks_cached=self.scheduler.pool.num_cached,
            kv_block_size=self.scheduler.block_size,
        )
        if self.memory_plan is not None:
            s.update(self.memory_plan.stats())
        return s

    # ---- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        name_native_thread()
        self._loop_builds = compile_events.counts().builds  # thread ids are reused: count from here
        while not self._stopping:
            try:
                self._drain_inbox()
            except Exception:  # never let one bad request stop the loop thread
                logger.exception("engine inbox handling failed")
            if not self.scheduler.has_work():
                self._settle_in_flight()  # its sequences all finished: tokens nobody needs
                self._catch_up_text()
                self._decode_clock = None
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as err:  # a failed step fails the requests that caused it, not the server
                logger.exception("engine step failed")
                self._recover(err)
            self.scheduler.step += 1
        self._catch_up_text()
        for seq in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
            seq.abort()
            self._finish(seq)
        with self._calls_lock:
            self._loop_done = True  # later calls run on their caller's thread
        if self.lora_manager is not None:
            self.lora_manager.set_device_owner(None)
        self._drain_inbox()  # calls handed over before the end

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.counters["requests"] += 1
                self.scheduler.add(item)
            elif kind == "call":
                fn, future = item
                try:
                    future.set_result(fn())
                except Exception as err:  # the caller's error, raised on its thread
                    future.set_exception(err)
            else:
                seq = self.scheduler.find(item)
                if seq is not None:
                    seq.abort()
                    self._finish(seq)

    def _step(self) -> None:
        """One engine step: prompts (packed fresh ones, then chunks of the rest) up to the
        prefill budget, then one decode step of every running sequence past its prompt.
        While a suspect of a failed step is being told apart, the step runs it alone."""
        budget = self.config.prefill_budget
        scheduler = self.scheduler
        self._phase = []
        # Prompts being chunked keep at least half the budget (so a stream of short prompts
        # cannot starve them) and take whatever the fresh prompts leave.
        reserved = min(budget // 2, sum(s.prefill_len - s.computed for s in scheduler.extending))
        # A suspect runs alone once it is admitted; until it can be, the others go on (they
        # may hold the blocks it waits for).
        alone = next((s for s in scheduler.running.values() if s.suspect_steps > 0), None)
        waiting = next((s for s in scheduler.waiting if s.suspect_steps > 0), None)
        admission = Admission()
        if alone is None and waiting is not None:
            admission = self._admit(budget - reserved, only=waiting)
            alone = waiting if admission.placed else None
        if alone is None:
            admission = self._admit(budget - reserved)
        if admission.packed:
            self._prefill(admission.packed, overlap=alone is None)
        extended = self._extend_chunks(budget - sum(s.prefill_len for s in admission.packed), alone)
        scheduler.reserve_decode_blocks()
        decoding = [s for s in scheduler.decoding() if alone is None or s is alone]
        if decoding:
            self._decode(decoding)  # settles the prefill in flight once it is dispatched
            self._settle_prefill()  # (unless its rows all ended on tokens settled first)
        else:
            self._settle_in_flight()
            self._settle_prefill()
            self._catch_up_text()  # no device step to hide it behind
        if alone is not None and (admission.packed or extended or decoding):
            alone.suspect_steps -= 1  # a step it passed alone
            self.counters["isolated_steps"] += 1
        if not (admission.packed or extended or decoding):
            # Waiting on adapter fetches or blocks only: yield the CPU instead of spinning.
            self._wake.wait(timeout=0.005)
            self._wake.clear()

    def _admit(self, budget: int, only: Sequence | None = None) -> Admission:
        """Admits waiting sequences (scheduler.admit) and readies their rows."""
        self._phase = [only] if only is not None else [s for s in self.scheduler.waiting if s.suspect_steps == 0]
        admission = self.scheduler.admit(budget, only=only)
        self._phase = []
        for seq, err in admission.failed:
            self._fail(seq, err)
        for seq in admission.placed:
            if seq.params.penalized:  # the row's penalty state starts from this sequence's tokens
                self.runner.init_row(seq.row, seq.token_ids(), len(seq.prompt_ids))
        return admission

    def _recover(self, err: Exception) -> None:
        """After a step raised: fails the sequence(s) it can be pinned on, makes the rest of
        the step's sequences suspects, and recomputes every running sequence if the KV
        cache went with the step. On a multi-host replica that lost a host, the step's
        sequences all fail with HostLostError."""
        self.counters["failed_steps"] += 1
        err = self.runner.failure_cause(err)
        involved = [s for s in self._phase if not s.finished] or list(self.scheduler.running.values())
        self._phase = []
        self._in_flight = self._prefill_in_flight = None  # their tokens are lost with the step: redone
        for seq in self.scheduler.running.values():
            seq.ahead = 0
        self._catch_up_text()
        if isinstance(err, HostLostError):
            # No request caused it, and no device op can run any more (not even a reset of the
            # cache): the step's requests fail now, the others at their next step.
            for seq in involved:
                self._fail(seq, err)
            return
        suspects = [s for s in involved if s.suspect_steps > 0]
        if len(involved) == 1 or suspects:
            for seq in suspects or involved:
                self._fail(seq, err)
        else:
            logger.warning("a step of %d requests failed; each is run alone to tell which caused it", len(involved))
            for seq in involved:
                seq.suspect_steps = ISOLATION_STEPS
        lost = self.runner.reset_if_lost()  # the step had consumed the cache it was given
        if lost:
            logger.warning("the KV cache was lost with the failed step; running requests are recomputed")
            self.scheduler.forget_cached()
        # Suspects start over from their tokens, one at a time; so does everyone if the cache went.
        redo = [s for s in self.scheduler.running.values() if lost or s.suspect_steps > 0]
        for seq in sorted(redo, key=lambda s: s.order, reverse=True):
            self.scheduler.preempt(seq)  # the oldest ends up first in the queue

    def _settle(self, seq: Sequence, fn: Callable[..., None], *args) -> None:
        """One sequence's host work on a finished step's result; if it raises, that sequence
        alone fails."""
        try:
            fn(*args)
        except Exception as err:
            logger.exception("request %s failed on its step's output", seq.request_id)
            if not seq.closed:  # else its last output was handed over before the failure
                self._fail(seq, err)

    def _prefill(self, seqs: list[Sequence], overlap: bool = True) -> None:
        """Computes fresh sequences packed back to back (each attends to itself only). With
        async_decode and rows decoding, it is dispatched behind the decode step in flight,
        whose tokens are then settled while it computes, and its own first tokens are read once
        the next decode step is dispatched behind it (_settle_prefill): the device goes from
        one step to the next without waiting for the host. Prompt log-probabilities, read from
        its hidden states, keep it synchronous."""
        overlap = (overlap and self.config.async_decode and not any(s.wants_prompt_logprobs for s in seqs)
                   and (self._in_flight is not None or bool(self.scheduler.decoding())))
        if not overlap:
            self._settle_in_flight()
        self._phase = list(seqs)
        total = sum(s.prefill_len for s in seqs)
        bucket = next(b for b in self.config.prefill_buckets() if b >= total)
        tokens = np.zeros(bucket, np.int32)
        positions = np.zeros(bucket, np.int32)
        rows = np.full(bucket, -1, np.int32)
        slots = np.full(bucket, -1, np.int32)
        slot_mapping = np.full(bucket, self.runner.no_slot, np.int32)
        b = self.config.max_batch
        last_index = np.zeros(b, np.int32)
        seq_rows = np.full(b, -1, np.int32)
        sampling_rows: list = [None] * b
        offset = 0
        for i, seq in enumerate(seqs):
            n = seq.prefill_len
            at = slice(offset, offset + n)
            tokens[at] = seq.token_ids(0, n)
            positions[at] = np.arange(n)
            rows[at] = seq.row
            slots[at] = seq.slot
            slot_mapping[at] = self.runner.slot_mapping(seq.blocks, positions[at])
            last_index[i] = offset + n - 1
            seq_rows[i] = seq.row
            sampling_rows[i] = (seq.params, seq.seed, len(seq.output_ids))
            offset += n
        inputs = StepInputs(
            tokens, positions, rows, self.runner.prefill_metadata(slot_mapping, rows),  # rows tell sequences apart
            SamplingBatch.from_rows(sampling_rows, self._eos), last_index, self._lora_info(slots), seq_rows,
        )
        start = time.perf_counter()
        def host_work() -> np.ndarray | None:
            return self._masks(list(enumerate(seqs)), b)

        if overlap:
            pending = self.runner.dispatch_prefill(inputs, self._pool(), host_work)
            self._prefill_in_flight = _PrefillStep(pending, [(seq, seq.preemptions) for seq in seqs], start, total)
            if self._in_flight is not None:  # a failure read now may be either step's
                self._phase = list(seqs) + [seq for seq, _ in self._in_flight.members]
            self._settle_in_flight()  # the decode step before it: its tokens, while the prefill computes
            return
        sampled = self.runner.prefill(inputs, self._pool(), host_work)
        if any(seq.wants_prompt_logprobs for seq in seqs):
            self._read_prompt_logprobs(seqs, tokens)
        self._count_prefill(start)
        self._prefilled(list(enumerate(seqs)), sampled, total)

    def _prefilled(self, members: list[tuple[int, Sequence]], sampled: Sampled, total: int) -> None:
        """A packed prefill's first tokens added to its sequences (sequence i's is token i)."""
        self.counters["prefill_steps"] += 1
        self.counters["prompt_tokens"] += total
        for i, seq in members:
            self.scheduler.computed(seq, seq.prefill_len)
            self._settle(seq, self._first_token, seq, sampled, i)

    def _settle_prefill(self) -> None:
        """Reads the first tokens of the prefill in flight, if any, and adds them; a sequence
        preempted since its dispatch recomputes from its tokens on the host instead. Its time
        runs from its dispatch: the decode steps around it overlap it, so their wall clock goes
        on through it."""
        step, self._prefill_in_flight = self._prefill_in_flight, None
        if step is None:
            return
        self._phase = self._phase + [seq for seq, _ in step.members if seq not in self._phase]
        sampled = step.pending.get()
        self.counters["prefill_seconds"] += time.perf_counter() - step.dispatched
        kept = [(i, seq) for i, (seq, preemptions) in enumerate(step.members) if seq.preemptions == preemptions]
        self._prefilled(kept, sampled, step.tokens)

    def _count_prefill(self, start: float) -> None:
        """Adds a prompt step's wall time since `start`; the next decode step's time starts after it."""
        now = time.perf_counter()
        self.counters["prefill_seconds"] += now - start
        self._decode_clock = now

    def _first_token(self, seq: Sequence, sampled: Sampled, i: int) -> None:
        if seq.params.max_tokens == 0:
            seq.finish_without_tokens()
            self._finish(seq)
        else:
            self._append(seq, sampled, i)

    def _extend_chunks(self, budget: int, alone: Sequence | None = None) -> bool:
        """Computes chunks of extending sequences up to `budget` tokens: the short rests of
        several prompts (after a cached prefix) in one step, then chunks oldest first. With
        `alone`, only that sequence's."""
        ran = False
        short, used = [], 0
        extending = [s for s in self.scheduler.extending if alone is None or s is alone]
        for seq in extending:
            n = seq.prefill_len - seq.computed
            if len(short) == self._rows_sequences:
                break
            if n <= self._rows_chunk and not seq.wants_prompt_logprobs and used + n <= budget:
                short.append(seq)
                used += n
        if len(short) > 1:
            self._extend_rows(short)
            budget -= used
            ran = True
        for seq in [s for s in self.scheduler.extending if s in extending]:
            n = min(seq.prefill_len - seq.computed, budget)
            if n <= 0:
                break
            self._extend(seq, n)
            budget -= n
            ran = True
        return ran

    @property
    def _rows_chunk(self) -> int:
        """The most tokens per sequence of a several-sequence extend step."""
        return max(b for b in self._rows_buckets())

    @property
    def _rows_sequences(self) -> int:
        return min(ROWS_SEQUENCES, self.config.max_batch)

    def _rows_buckets(self) -> tuple[int, ...]:
        return tuple(b for b in self.config.prefill_buckets() if b <= ROWS_CHUNK_MAX) or (16,)

    def _paged_inputs(self, groups: int, c: int, members: list[tuple[int, Sequence, int, int]],
                      sampling_rows: list, last_index: np.ndarray | None = None,
                      seq_rows: np.ndarray | None = None, lora: bool | None = None) -> StepInputs:
        """A paged step of `groups` groups of `c` tokens; member (g, seq, start, n) puts tokens
        [start, start + n) of `seq` in group g, reading and extending its blocks."""
        t = groups * c
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        rows = np.full(t, -1, np.int32)
        slots = np.full(t, -1, np.int32)
        slot_mapping = np.full(t, self.runner.no_slot, np.int32)
        tables = np.zeros((groups, self.scheduler.pages_per_seq), np.int32)
        for g, seq, start, n in members:
            at = slice(g * c, g * c + n)
            ids = seq.token_ids(start, start + n)
            tokens[at] = ids + [-1] * (n - len(ids))  # -1: in flight, on the device (a decode step's)
            positions[g * c:(g + 1) * c] = np.arange(start, start + c)  # the kernels count from the first
            rows[at] = seq.row
            slots[at] = seq.slot
            slot_mapping[at] = self.runner.slot_mapping(seq.blocks, positions[at])
            tables[g] = self.scheduler.block_table[seq.row]
        return StepInputs(
            tokens, positions, rows, self.runner.paged_metadata(slot_mapping, tables),
            SamplingBatch.from_rows(sampling_rows, self._eos), last_index, self._lora_info(slots, lora), seq_rows,
        )

    def _extend_rows(self, seqs: list[Sequence]) -> None:
        """Computes the whole rest of several prompts in one step, C tokens per sequence, and
        samples their next tokens."""
        self._settle_in_flight()
        self._phase = list(seqs)
        rest = [seq.prefill_len - seq.computed for seq in seqs]
        c = next(b for b in self._rows_buckets() if b >= max(rest))
        e = self._rows_sequences
        last_index = np.zeros(e, np.int32)
        seq_rows = np.full(e, -1, np.int32)
        sampling_rows: list = [None] * e
        for i, (seq, n) in enumerate(zip(seqs, rest)):
            last_index[i] = i * c + n - 1
            seq_rows[i] = seq.row
            sampling_rows[i] = (seq.params, seq.seed, len(seq.output_ids))
        members = [(i, seq, seq.computed, n) for i, (seq, n) in enumerate(zip(seqs, rest))]
        inputs = self._paged_inputs(e, c, members, sampling_rows, last_index, seq_rows)
        t0 = time.perf_counter()
        sampled = self.runner.extend(inputs, self._pool(), lambda: self._masks(list(enumerate(seqs)), e))
        self._count_prefill(t0)
        self.counters["extend_steps"] += 1
        for i, (seq, n) in enumerate(zip(seqs, rest)):
            self.counters["prompt_tokens"] += n
            self.scheduler.computed(seq, n)
            self._settle(seq, self._first_token, seq, sampled, i)

    def _extend(self, seq: Sequence, n: int) -> None:
        """Computes tokens [computed, computed + n) of one sequence over its blocks; the last
        chunk samples its next token."""
        self._settle_in_flight()
        self._phase = [seq]
        start = seq.computed
        final = start + n == seq.prefill_len
        bucket = next(b for b in self.config.prefill_buckets() if b >= n)
        inputs = self._paged_inputs(1, bucket, [(0, seq, start, n)], [(seq.params, seq.seed, len(seq.output_ids))],
                                    np.array([n - 1], np.int32), np.array([seq.row if final else -1], np.int32))
        t0 = time.perf_counter()
        sampled = self.runner.extend(inputs, self._pool(), (lambda: self._masks([(0, seq)], 1)) if final else None)
        k = seq.params.prompt_logprobs
        if seq.wants_prompt_logprobs:
            prompt = seq.prompt_ids
            next_tokens = np.zeros(bucket, np.int32)
            ahead = prompt[start + 1 : start + n + 1]  # position t predicts token t + 1
            next_tokens[: len(ahead)] = ahead
            got = self.runner.prompt_logprobs(next_tokens)
            parts = ([None] if start == 0 else []) + [_token_logprob(got, i, k) for i in range(len(ahead))]
            seq.prompt_logprob_parts.extend(parts)
            if final:
                seq.prompt_logprobs = seq.prompt_logprob_parts
        self._count_prefill(t0)
        self.counters["extend_steps"] += 1
        self.counters["prompt_tokens"] += n
        self.scheduler.computed(seq, n)
        if final:
            self._settle(seq, self._first_token, seq, sampled, 0)

    def _read_prompt_logprobs(self, seqs: list[Sequence], tokens: np.ndarray) -> None:
        """Each asking sequence's prompt log-probabilities, from the prefill just run."""
        next_tokens = np.zeros_like(tokens)
        next_tokens[:-1] = tokens[1:]  # position t predicts token t + 1 (within a sequence)
        got = self.runner.prompt_logprobs(next_tokens)
        offset = 0
        for seq in seqs:
            n, k = seq.prefill_len, seq.params.prompt_logprobs
            if seq.wants_prompt_logprobs:
                seq.prompt_logprobs = [None] + [_token_logprob(got, offset + t, k) for t in range(n - 1)]
            offset += n

    def _decode(self, active: list[Sequence]) -> None:
        """One decode step of `active`. With async_decode it is dispatched before the tokens of
        the step before it reach the host: a row whose last token is still on the device (its
        `ahead`) reads it there. Then that step's tokens are settled while this one computes,
        and this one stays in flight for the next call (or _settle_in_flight). Rows whose
        masks depend on their last token (a grammar, bad words) wait for it on the host."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None and any(s.ahead and s.mask_follows_tokens for s in active):
            self._settle_step(prev)  # their masks need the tokens on the host
            prev = None
            active = [s for s in active if not s.finished]  # ended by those tokens
            if not active:
                return
        self._phase = list(active) + ([m[0] for m in prev.members] if prev is not None else [])
        if self._prefill_in_flight is not None:  # a failure of this step may be that prefill's
            self._phase += [seq for seq, _ in self._prefill_in_flight.members]
        b = self.config.max_batch
        sampling_rows: list = [None] * b
        members = []
        for seq in active:
            sampling_rows[seq.row] = (seq.params, seq.seed, len(seq.output_ids) + seq.ahead)
            members.append((seq.row, seq, seq.num_tokens - 1 + seq.ahead, 1))
        inputs = self._paged_inputs(b, 1, members, sampling_rows)

        def while_forward() -> np.ndarray | None:
            # While the device runs this step's forward: the first tokens of a prefill dispatched
            # before it, the text of the step before (a sequence that a stop string finishes
            # there is in this step too; its token from it is dropped when settled), then the
            # grammars' masks for this step's sampling.
            self._settle_prefill()
            self._catch_up_text()
            return self._masks([(seq.row, seq) for seq in active], b)

        step = _DecodeStep(self.runner.dispatch_decode(inputs, self._pool(), while_forward),
                           [(seq, seq.preemptions) for seq in active], time.perf_counter())
        for seq in active:
            seq.ahead += 1
        self.counters["decode_row_steps"] += len(active)
        distinct = len({s.adapter for s in active if s.adapter is not None})
        self.counters["max_batch_adapters"] = max(self.counters["max_batch_adapters"], distinct)
        if prev is not None:
            self._settle_step(prev)
            self._catch_up_text()  # its text, while this step computes
        if self.config.async_decode and not any(s.mask_follows_tokens for s in active):
            self._in_flight = step
        else:
            self._settle_step(step)

    def _settle_in_flight(self) -> None:
        """Waits for the decode step in flight, if any, and settles its tokens. A prompt step
        (prefill, extend) calls it first: on the device it would wait for that step anyway,
        and its wall time would count that step's device time as its own."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._settle_step(step)

    def _settle_step(self, step: "_DecodeStep") -> None:
        """Brings a dispatched decode step's tokens to the host and adds each to its sequence;
        a sequence finished or preempted since the dispatch gives its token up."""
        sampled = step.pending.get()
        now = time.perf_counter()
        # A step's time is wall clock, its host work included: from the step (or prefill) before
        # it, or from its dispatch after an idle spell.
        since = step.dispatched if self._decode_clock is None else self._decode_clock
        self.counters["decode_seconds"] += now - since
        self._decode_clock = now
        self.counters["decode_steps"] += 1
        for seq, preemptions in step.members:
            if seq.preemptions != preemptions:
                continue  # preempted after the dispatch: it recomputes from its tokens on the host
            seq.ahead -= 1
            if seq.finished:  # by its token before (an end token, a stop string) or aborted
                continue
            self.scheduler.computed(seq, 1)
            self._settle(seq, self._append, seq, sampled, seq.row)

    def _append(self, seq: Sequence, sampled: Sampled, i: int) -> None:
        """Adds a sampled token; a sequence its token ids finish is finished now, the text of
        the others waits for the next decode step's dispatch (_catch_up_text)."""
        n = seq.params.logprobs
        logprob = None if n is None else _token_logprob(sampled, i, n)
        seq.add_token(int(sampled.tokens[i]), self.config.max_seq_len, logprob)
        self.counters["generated_tokens"] += 1
        if seq.finished:
            self._finish(seq)
        else:
            self._text_pending.append(seq)

    def _catch_up_text(self) -> None:
        """The text of the tokens added since the last call, and the stream items they make; a
        stop string in it finishes its sequence."""
        pending, self._text_pending = self._text_pending, []
        for seq in pending:
            if not seq.closed and seq.text_pending:
                self._settle(seq, self._emit_text, seq)

    def _emit_text(self, seq: Sequence) -> None:
        seq.catch_up_text()
        if seq.finished:
            self._finish(seq)
        else:
            out = seq.take_output()
            if out is not None:
                _deliver(seq, out)

    def _finish(self, seq: Sequence) -> None:
        seq.catch_up_text()
        self.scheduler.finish(seq)
        self.counters["aborted" if seq.finish_reason.value == "abort" else "finished"] += 1
        out = seq.take_output()
        if out is not None:
            _deliver(seq, out)

    def _fail(self, seq: Sequence, err: Exception) -> None:
        seq.abort()
        self.scheduler.finish(seq, keep_content=False)
        self.counters["failed"] += 1
        if not isinstance(err, ServingError):
            err = RuntimeError(f"request {seq.request_id} failed in the engine: {err}")
        _deliver(
            seq,
            RequestOutput(
                request_id=seq.request_id, text="", token_ids=[], finished=True,
                finish_reason="abort", prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.output_ids), error=err,
            ),
        )

    def _pool(self):
        """The adapter pool; only this thread writes it (the manager hands writes here)."""
        return None if self.lora_manager is None else self.lora_manager.pool

    def _lora_info(self, slots: np.ndarray, lora: bool | None = None):
        """The step's adapter batch, or None for a step of the base model alone: when no
        token uses an adapter (or `lora` is False); `lora` True forces one (warm-up)."""
        if self.lora_manager is None or lora is False:
            return None
        if lora is None and not (slots >= 0).any():
            return None
        # A step holds at most max_batch sequences, so at most that many distinct adapters.
        return self.lora_manager.prepare_lora_batch(slots, self.config.max_batch)

    def _idle_inputs(self, n: int, *, prefill: bool, groups: int | None = None, lora: bool = False) -> StepInputs:
        """A step of `n` padding tokens (warm-up): a packed prefill, or `groups` idle groups;
        with `lora`, the variant that runs the adapter pool."""
        if prefill:
            p = self.config.max_batch
            none = np.full(n, -1, np.int32)
            attn = self.runner.prefill_metadata(np.full(n, self.runner.no_slot, np.int32), none)
            return StepInputs(np.zeros(n, np.int32), np.zeros(n, np.int32), none, attn,
                              SamplingBatch.from_rows([None] * p), np.zeros(p, np.int32),
                              self._lora_info(none, lora), np.full(p, -1, np.int32))
        return self._paged_inputs(groups, n // groups, [], [None] * groups, np.zeros(groups, np.int32),
                                  np.full(groups, -1, np.int32), lora)


@dataclasses.dataclass
class _PrefillStep:
    """A dispatched packed prefill: its first tokens (on the device), each sequence with its
    preemption count then, when it was dispatched, and its prompt tokens."""

    pending: PendingSample
    members: list[tuple[Sequence, int]]
    dispatched: float
    tokens: int


@dataclasses.dataclass
class _DecodeStep:
    """A dispatched decode step: its sampled tokens (on the device), each sequence in it with
    its preemption count then, and when it was dispatched."""

    pending: PendingSample
    members: list[tuple[Sequence, int]]
    dispatched: float


def _largest_of_each_kind(steps: list[tuple[str, StepInputs, object]]) -> list[tuple[str, StepInputs, object]]:
    """The step shapes with the most tokens of each kind: prefill, one-sequence extend,
    several-sequence extend and decode (told apart by kind and sampled rows), each with and
    without adapters."""
    largest: dict[tuple, tuple[str, StepInputs, object]] = {}
    for kind, inputs, pool in steps:
        key = (kind, inputs.sampling.temperature.shape[0], inputs.lora is None)
        if key not in largest or inputs.tokens.shape[0] > largest[key][1].tokens.shape[0]:
            largest[key] = (kind, inputs, pool)
    return list(largest.values())


def _reads_head(inputs: StepInputs, pool) -> bool:
    """Whether prompt log-probabilities after this prefill need a program of their own: a base
    prefill's, or an adapter prefill's when the pool holds lm_head adapters."""
    return inputs.lora is None or (pool is not None and pool.adapts("lm_head"))


def _builds_of(job: Callable[[], None]) -> compile_events.CompileCounts:
    """Runs `job` and returns what JAX built for it on this thread (its compile events)."""
    before = compile_events.counts()
    job()
    return compile_events.counts() - before


def _token_logprob(sampled: Sampled, i: int, n: int) -> TokenLogprob:
    """Row i's token log-probability and its n likeliest alternatives."""
    top = tuple((int(t), float(lp)) for t, lp in zip(sampled.top_ids[i, :n], sampled.top_logprobs[i, :n]))
    return TokenLogprob(float(sampled.logprob[i]), top)


def _deliver(seq: Sequence, out: RequestOutput) -> None:
    """Hands an output to its consumer; a consumer that has gone away never stops the loop."""
    seq.closed = seq.closed or out.finished
    try:
        seq.emit(out)
    except Exception:  # e.g. the caller's event loop is closed after a disconnect
        logger.debug("dropped output of request %s: its consumer is gone", seq.request_id, exc_info=True)


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    last = parts[-1]
    return RequestOutput(
        request_id=last.request_id,
        text="".join(p.text for p in parts),
        token_ids=[t for p in parts for t in p.token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        error=last.error,
        logprobs=None if last.logprobs is None else [lp for p in parts for lp in p.logprobs or ()],
        prompt_logprobs=next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
        prompt_token_ids=next((p.prompt_token_ids for p in parts if p.prompt_token_ids is not None), None),
        cached_tokens=last.cached_tokens,
    )

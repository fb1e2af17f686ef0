"""The peer a user would otherwise run on one machine: transformers + PEFT with every adapter
loaded, behind a small OpenAI-compatible streaming `/v1/completions` server.

    python -m benchmarks.peft_server --model DIR --adapters-dir DIR [--base-name NAME] [--port P]
                                     [--batch-sizes 1 4 16] [--tune-prompt-len 12] [--tune-new-tokens 12]

Each folder of `--adapters-dir` is a PEFT adapter named after the folder. One worker thread
takes whatever requests are waiting (up to the batch size) and runs them as one mixed-adapter
batch through `generate(adapter_names=...)` (PEFT's mixed-batch LoRA), streaming each row's
tokens to its request as they come; new requests wait for the next batch (static batching, as
`generate` does). Greedy, and every answer is exactly `max_tokens` tokens long (as with
`ignore_eos`). At start, each of `--batch-sizes` is timed on a closed batch of mixed adapters
and the fastest in tokens/s is kept; `GET /health` reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

BASE_ADAPTER = "__base__"  # PEFT's adapter_names entry for a row without an adapter


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The completions this server serves: streamed, greedy, exactly max_tokens tokens."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: Literal[0, 0.0] = 0.0
    ignore_eos: Literal[True] = True
    skip_special_tokens: bool = True
    stream: Literal[True]
    stream_options: StreamOptions | None = None


@dataclasses.dataclass
class _Pending:
    adapter: str  # a loaded adapter's name, or BASE_ADAPTER
    prompt: str
    max_tokens: int
    skip_special_tokens: bool
    # ("token", text) | ("done", (prompt tokens, completion tokens)) | ("error", message), from the worker thread
    emit: Callable[[str, object], None]


class _RowStreamer:
    """A generate() streamer that hands each batch row's new token to that row's request, and
    ends a request once it has its max_tokens (the batch runs on for its longest row)."""

    def __init__(self, batch: Sequence[_Pending], decode: Callable[[int, bool], str], prompt_tokens: Sequence[int]):
        self._batch = batch
        self._decode = decode
        self._prompt_tokens = prompt_tokens
        self._emitted = [0] * len(batch)
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first puts the prompt ids
            self._prompt_seen = True
            return
        for i, token in enumerate(value.tolist()):
            p = self._batch[i]
            if self._emitted[i] < p.max_tokens:
                self._emitted[i] += 1
                p.emit("token", self._decode(token, p.skip_special_tokens))
                if self._emitted[i] == p.max_tokens:
                    p.emit("done", (self._prompt_tokens[i], self._emitted[i]))

    def end(self) -> None:
        for i, p in enumerate(self._batch):
            if self._emitted[i] < p.max_tokens:
                p.emit("done", (self._prompt_tokens[i], self._emitted[i]))


class PeftBatcher:
    """Owns the PEFT model: a worker thread runs the waiting requests in mixed-adapter batches."""

    def __init__(self, model_dir: str, adapter_dirs: dict[str, str]):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not adapter_dirs:
            raise ValueError("the PEFT peer needs at least one adapter")
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        (first, first_dir), *rest = adapter_dirs.items()
        model = PeftModel.from_pretrained(base, first_dir, adapter_name=first)
        for name, folder in rest:
            model.load_adapter(folder, adapter_name=name)
        self.model = model.eval()
        self.adapters = frozenset(adapter_dirs)
        self.max_batch = 1
        self.tuning: dict[int, float] = {}  # batch size -> tokens/s, from tune()
        self._queue: queue.Queue[_Pending] = queue.Queue()

    def run_batch(self, batch: Sequence[_Pending]) -> None:
        """One generate over `batch`, each row's tokens streamed to its request."""
        torch = self._torch
        # The tokenizer is used on this thread only: a fast tokenizer set up for padding on one
        # thread and called on another can fail ("Already borrowed").
        inputs = self.tokenizer([p.prompt for p in batch], padding=True, return_tensors="pt")
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        longest = max(p.max_tokens for p in batch)
        with torch.inference_mode():
            self.model.generate(
                **inputs, adapter_names=[p.adapter for p in batch], do_sample=False,
                max_new_tokens=longest, min_new_tokens=longest,  # EOS masked: every row runs its length
                pad_token_id=self.tokenizer.pad_token_id, streamer=_RowStreamer(batch, self._decode, prompt_tokens),
            )

    def _decode(self, token: int, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=skip_special_tokens)

    def submit(self, p: _Pending) -> None:
        self._queue.put(p)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="peft-batcher", daemon=True).start()

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self.run_batch(batch)
            except Exception as e:  # a failed batch fails its requests; the server serves on
                for p in batch:
                    p.emit("error", f"{type(e).__name__}: {e}")

    def tune(self, sizes: Sequence[int], prompt_len: int, new_tokens: int) -> dict[int, float]:
        """Tokens/s of a closed batch of each size (mixed adapters, after one warm-up batch);
        sets max_batch to the fastest and returns them all."""
        names = sorted(self.adapters)
        prompt = "x" * max(prompt_len - 2, 1) + "="  # BOS and '=' are tokens too
        speeds = {}
        for size in sizes:
            batch = [_Pending(names[i % len(names)], prompt, new_tokens, True, _ignore) for i in range(size)]
            self.run_batch(batch)
            start = time.perf_counter()
            self.run_batch(batch)
            speeds[size] = size * new_tokens / (time.perf_counter() - start)
        self.max_batch = max(speeds, key=speeds.get)
        self.tuning = speeds
        return speeds


def _ignore(kind: str, payload: object) -> None:
    """The emit of a tuning row: its tokens are not sent anywhere."""


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(batcher: PeftBatcher, base_name: str):
    """The FastAPI app: POST /v1/completions (streamed) and GET /health."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok", "max_batch": batcher.max_batch, "adapters": len(batcher.adapters),
                "tuning_tokens_per_s": {str(b): s for b, s in batcher.tuning.items()}}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model != base_name and body.model not in batcher.adapters:
            return JSONResponse({"error": {"message": f"model {body.model!r} does not exist", "type":
                                           "invalid_request_error", "param": "model", "code": "model_not_found"}},
                                status_code=404)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: object) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        adapter = BASE_ADAPTER if body.model == base_name else body.model
        batcher.submit(_Pending(adapter, body.prompt, body.max_tokens, body.skip_special_tokens, emit))
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def stream():
            head = {"id": completion_id, "object": "text_completion", "created": int(time.time()),
                    "model": body.model}
            while True:
                kind, payload = await events.get()
                if kind == "token":
                    yield _sse({**head, "choices": [{"index": 0, "text": payload, "finish_reason": None}]})
                elif kind == "error":
                    yield _sse({"error": {"message": payload, "type": "server_error", "param": None,
                                          "code": "generation_failed"}})
                    break
                else:
                    prompt_tokens, completion_tokens = payload
                    yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": {
                            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}})
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder (with its tokenizer)")
    parser.add_argument("--adapters-dir", required=True, help="a folder of PEFT adapter folders")
    parser.add_argument("--base-name", default="demo", help="the model name of requests without an adapter")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--tune-prompt-len", type=int, default=12)
    parser.add_argument("--tune-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    a = parser.parse_args(argv)

    import torch
    import uvicorn

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    folders = sorted(p for p in pathlib.Path(a.adapters_dir).iterdir() if (p / "adapter_config.json").exists())
    batcher = PeftBatcher(a.model, {p.name: str(p) for p in folders})
    speeds = batcher.tune(a.batch_sizes, a.tune_prompt_len, a.tune_new_tokens)
    print("peft tuning: " + " ".join(f"batch {b}: {s:.0f} tok/s" for b, s in speeds.items())
          + f"; serving at batch {batcher.max_batch}", flush=True)
    batcher.start()
    uvicorn.run(make_app(batcher, a.base_name), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()

"""One request's host-side state: tokens, text, stop conditions, its batch row and KV blocks."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import numpy as np

from lora_runtime.engine.grammar import GrammarMatcher
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.model.tokenizer import IncrementalDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the sequence filled max_seq_len
    ABORT = "abort"  # cancelled by the client or the server


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the likeliest tokens there."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), likeliest first


@dataclasses.dataclass
class RequestOutput:
    """What a request produced since its previous output (deltas), plus totals."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: Exception | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked
    # One per prompt token (None for the first, which nothing predicts), in the first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request from arrival to finish; the engine thread alone mutates it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    adapter: str | None
    emit: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    priority: int = 0  # lower is admitted first, and may preempt higher (scheduler.py)
    arrival: int = 0  # engine step at arrival
    queued_at: float = 0.0  # time.monotonic() when it last joined the queue (arrival, or preemption)
    order: int = 0  # arrival order among all sequences (the newest is preempted first)
    row: int | None = None  # batch row while running (its sampling state and block table row)
    slot: int = -1  # adapter slot while running; -1 = no adapter
    blocks: list[int] = dataclasses.field(default_factory=list)  # KV blocks, in position order
    computed: int = 0  # tokens whose K/V are in its blocks
    registered: int = 0  # of those, tokens in full blocks named for prefix sharing
    prefill_len: int = 0  # tokens to compute before decoding (the prompt; all tokens after a preemption)
    cached_tokens: int = 0  # prompt tokens found cached at (first) admission
    kv_key: bytes | None = None  # what its K/V depend on besides tokens: the adapter's content, or none
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # hash chain of its full blocks
    preemptions: int = 0  # times its blocks were taken back to be recomputed later
    suspect_steps: int = 0  # steps it must still pass alone after a failed step it was in (engine.py)
    ahead: int = 0  # its tokens sampled by dispatched decode steps, not yet on the host (engine.py)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set at prefill when asked; [0] is None
    prompt_logprobs_sent: bool = False
    prompt_logprob_parts: list[TokenLogprob | None] = dataclasses.field(default_factory=list)  # chunk by chunk
    text: str = ""
    text_tokens: int = 0  # output tokens whose text is in `text` (catch_up_text)
    emitted_text: int = 0
    emitted_tokens: int = 0
    finish_reason: FinishReason | None = None
    closed: bool = False  # its last output (finished) was handed to its consumer
    grammar: GrammarMatcher | None = None  # where its output is in the grammar it must match
    allowed_mask: np.ndarray | None = None  # i32 bitmask of params.allowed_token_ids (grammar.token_set_mask)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (bad_words.py)
    stop_token: bool = False  # it ended on a stop or end-of-sequence token (which adds no text)
    text_done: bool = False  # its text is final (catch_up_text met its end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Prompt then generated tokens, [start, stop)."""
        n = len(self.prompt_ids)
        stop = self.num_tokens if stop is None else stop
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):stop - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prefill must compute the prompt's log-probabilities (asked and not had
        yet: after a preemption it has them), so every prompt position is computed."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def prefilling(self) -> bool:
        """Whether tokens remain to compute before it decodes (its prompt, or all it had when preempted)."""
        return self.computed < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token: int, max_seq_len: int, logprob: TokenLogprob | None = None) -> None:
        """Adds a sampled token and finishes the sequence on what token ids alone decide: an
        end-of-sequence or stop token id, its grammar's end, max_tokens, max_seq_len. Its text (and a stop
        string in it) waits for catch_up_text, which the engine runs while the device
        computes the next step."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.advance(token)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = FinishReason.STOP
            self.stop_token = True
        elif self.grammar is not None and self.grammar.stopped:
            self.finish_reason = FinishReason.STOP  # the grammar is complete: nothing more may follow
        elif len(self.output_ids) >= p.max_tokens or self.num_tokens >= max_seq_len:
            self.finish_reason = FinishReason.LENGTH

    @property
    def mask_follows_tokens(self) -> bool:
        """Whether the tokens it may take next depend on its last one (a grammar, bad words):
        its mask needs that token on the host."""
        return self.grammar is not None or bool(self.bad_words_ids)

    @property
    def text_pending(self) -> bool:
        """Whether tokens were added whose text catch_up_text has not produced yet."""
        return self.text_tokens < len(self.output_ids)

    def catch_up_text(self) -> None:
        """Detokenizes the tokens added since the last call. A stop string in the text cuts it
        there and finishes the sequence (stop); a finish by token id flushes the detokenizer
        (a stop or end-of-sequence token adds no text)."""
        if self.text_done:
            return
        while self.text_tokens < len(self.output_ids):
            token = self.output_ids[self.text_tokens]
            self.text_tokens += 1
            if self.text_tokens == len(self.output_ids) and self.stop_token:
                self.text += self.detokenizer.flush()  # a stop or end-of-sequence token: no text of its own
                self.text_done = True
                return
            self.text += self.detokenizer.step(token)
            if self.params.stop and self._cut_at_stop_string():
                if self.finish_reason in (None, FinishReason.LENGTH):
                    self.finish_reason = FinishReason.STOP
                self.text_done = True
                return
        if self.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):  # by length, or its grammar's end
            self.text += self.detokenizer.flush()
            self.text_done = True

    def _cut_at_stop_string(self) -> bool:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self.emitted_text - longest)
        hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        at, length = min(hits)
        self.text = self.text[: at + length if self.params.include_stop_str_in_output else at]
        return True

    def finish_without_tokens(self) -> None:
        """max_tokens=0: the prompt was read (its log-probabilities too), nothing is generated."""
        self.finish_reason = FinishReason.LENGTH

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = FinishReason.ABORT

    def take_output(self) -> RequestOutput | None:
        """The new tokens and text since the last call, or None if nothing to say."""
        end = len(self.text)
        if not self.finished and self.params.stop:
            # Hold back a tail that could still grow into a stop string.
            end = max(self.emitted_text, end - (max(len(s) for s in self.params.stop) - 1))
        new_tokens = self.output_ids[self.emitted_tokens :]
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        if not self.finished and not new_tokens and end == self.emitted_text and prompt_logprobs is None:
            return None
        out = RequestOutput(
            request_id=self.request_id,
            text=self.text[self.emitted_text : end],
            token_ids=new_tokens,
            finished=self.finished,
            finish_reason=self.finish_reason.value if self.finished else None,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            logprobs=None if self.params.logprobs is None else self.output_logprobs[self.emitted_tokens :],
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_logprobs is None else list(self.prompt_ids),
            cached_tokens=self.cached_tokens,
        )
        self.emitted_text = end
        self.emitted_tokens = len(self.output_ids)
        return out

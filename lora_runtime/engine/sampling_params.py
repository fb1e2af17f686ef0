"""A request's sampling parameters and their checks (no JAX: the HTTP edge checks them too)."""

from __future__ import annotations

import dataclasses
import secrets

from lora_runtime.engine.grammar import GuidedSpec
from lora_runtime.errors import InvalidRequestError

# Most alternatives a request may ask log-probabilities for (OpenAI's limit too).
MAX_LOGPROBS = 20
# Most token ids min_tokens holds back per row (the EOS ids and the request's stop_token_ids).
MAX_HELD_BACK_IDS = 32
# Most tokens one request may bias (logit_bias), and the bias's bound (OpenAI's: ±100).
MAX_LOGIT_BIAS = 300
# Most bad_words one request may give, and the longest one in characters.
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 64, 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) = no top-k cut
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p times the likeliest (0 = off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n likeliest
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (after the first)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # HF/vLLM: divides positive, multiplies negative logits of seen tokens
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are generated
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), OpenAI's
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be generated (None: any)
    bad_words: tuple[str, ...] = ()  # vLLM's: words whose tokens may not be generated in that order
    guided: GuidedSpec | None = None  # what the output must match (a JSON schema, regex, choice, grammar)

    def __post_init__(self):
        object.__setattr__(self, "guided", GuidedSpec.coerce(self.guided))  # its dict form, as requests carry it

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raises InvalidRequestError naming the first bad field; returns self."""
        if not 0 <= self.max_tokens < 2**31:
            raise InvalidRequestError(f"max_tokens={self.max_tokens} must be in [0, 2**31)", param="max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature={self.temperature} must be in [0, 100]", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p} must be in (0, 1]", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)", param="min_p")
        if not -1 <= self.top_k < 2**31:
            raise InvalidRequestError(f"top_k={self.top_k} must be in [-1, 2**31) (0 or -1 disables it)",
                                      param="top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed={self.seed} must be in [0, 2**63)", param="seed")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name}={value} must be in [0, {MAX_LOGPROBS}]", param=name)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name}={value} must be in [-2, 2]", param=name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]",
                                      param="repetition_penalty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]",
                                      param="min_tokens")
        if self.min_tokens and len(self.stop_token_ids) > MAX_HELD_BACK_IDS - 4:
            raise InvalidRequestError(
                f"min_tokens with {len(self.stop_token_ids)} stop_token_ids: at most {MAX_HELD_BACK_IDS - 4}",
                param="stop_token_ids",
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError(f"stop={list(self.stop)!r} contains an empty string", param="stop")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS}",
                                      param="bad_words")
        if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise InvalidRequestError(f"each of bad_words must be 1-{MAX_BAD_WORD_CHARS} characters, not only "
                                      "whitespace", param="bad_words")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"logit_bias names token {next(t for t in ids if ids.count(t) > 1)} twice",
                                      param="logit_bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}",
                                      param="logit_bias")
        out_of_range = [(t, v) for t, v in self.logit_bias if not -100.0 <= v <= 100.0]
        if out_of_range:
            raise InvalidRequestError(f"logit_bias value {out_of_range[0][1]} for token {out_of_range[0][0]} "
                                      f"must be in [-100, 100]", param="logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids is empty: no token could be generated",
                                      param="allowed_token_ids")
        if vocab_size is not None:
            bad = [t for t in self.allowed_token_ids or () if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"allowed_token_ids {bad[:5]} outside [0, {vocab_size})",
                                          param="allowed_token_ids")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"stop_token_ids {bad} outside [0, {vocab_size})", param="stop_token_ids")
            bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token ids {bad[:5]} outside [0, {vocab_size})",
                                          param="logit_bias")
        return self

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens seen so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def resolved_seed(self) -> int:
        """The request's seed, or a fresh random one: each request gets its own stream."""
        return self.seed if self.seed is not None else secrets.randbits(62)

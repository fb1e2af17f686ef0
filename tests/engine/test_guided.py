"""Guided decoding in the engine: every output of a constrained request matches its grammar
(JSON schemas, regexes, choices, Lark grammars), greedy and sampled, mixed with free rows
whose tokens are those of a batch without grammars; bad grammars are refused at submit;
nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.grammar import GuidedSpec
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.errors import InvalidRequestError
from tests.helpers.checkpoints import save_tiny_llama

SCHEMAS = [
    {  # nested objects, arrays, enums, bounded numbers, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                     "required": ["zip"], "additionalProperties": False},
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["name", "age", "color", "home"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": ["integer", "null"], "minimum": -99, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = EngineConfig(max_batch=4, max_seq_len=256, max_loras_per_batch=0)
    eng = Engine.from_pretrained(str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))), cfg).start()
    yield eng
    eng.shutdown()


def _prompt(engine, i: int) -> list[int]:
    return np.random.default_rng(i).integers(3, engine.model_config.vocab_size, size=6 + i).tolist()


def _params(guided: GuidedSpec | None, *, sampled: bool, seed: int = 0, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if sampled else 0.0, seed=seed, guided=guided)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_validates_against_its_schema(engine, sampled):
    specs = [GuidedSpec("json_schema", json.dumps(s)) for s in SCHEMAS] + [GuidedSpec("json_object")]
    prompts = [_prompt(engine, i) for i in range(len(specs))]
    outs = engine.generate_batch(prompts, [_params(g, sampled=sampled, seed=i) for i, g in enumerate(specs)])
    for out, schema in zip(outs, SCHEMAS + [{"type": "object"}]):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.compiles_after_warmup == 0


def test_regex_choice_and_lark_grammars(engine):
    choices = ['say "yes"', "no\\way", "ünï 東"]
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    specs = [GuidedSpec("regex", r"[a-c]{2,5}-[0-9]{3}", param="guided_regex"),
             GuidedSpec("choice", json.dumps(choices), param="guided_choice"),
             GuidedSpec("grammar", lark, param="guided_grammar"),
             GuidedSpec("grammar", 'root ::= "on" | "off"', param="guided_grammar")]  # GBNF
    for sampled in (False, True):
        outs = engine.generate_batch([_prompt(engine, i) for i in range(4)],
                                     [_params(g, sampled=sampled, seed=7 + i) for i, g in enumerate(specs)])
        assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", outs[0].text)
        assert outs[1].text in choices
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", outs[2].text)
        assert outs[3].text in ("on", "off")


def test_free_rows_beside_constrained_ones_are_unchanged(engine):
    """A grammar constrains its own row only: free rows of the same batch give the tokens they
    give with no grammar in the batch, greedy and seeded."""
    free = [_params(None, sampled=s, seed=3, max_tokens=12) for s in (False, True)]
    prompts = [_prompt(engine, 10), _prompt(engine, 11)]
    alone = [o.token_ids for o in engine.generate_batch(prompts, free)]
    spec = GuidedSpec("json_schema", json.dumps(SCHEMAS[0]))
    mixed = engine.generate_batch(prompts + [_prompt(engine, 12)], free + [_params(spec, sampled=True)])
    assert [o.token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].text), SCHEMAS[0])
    assert engine.stats()["masked_rows"] > 0


@pytest.mark.parametrize(("spec", "message"), [
    (GuidedSpec("json_schema", '{"type": "objekt"}'), "objekt"),
    (GuidedSpec("json_schema", "{not json"), "not JSON"),
    (GuidedSpec("regex", "a(b", param="guided_regex"), "unclosed group"),
    (GuidedSpec("grammar", "start: foo", param="guided_grammar"), "foo"),
    (GuidedSpec("choice", "[]", param="guided_choice"), "list of 1-"),
    (GuidedSpec("json_schema", json.dumps({"enum": ["x" * 70_000]})), "at most"),
])
def test_a_bad_grammar_is_refused_at_submit_and_the_engine_serves_on(engine, spec, message):
    before = engine.stats()["requests"]
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as err:
        engine.submit(_prompt(engine, 0), _params(spec, sampled=False), lambda out: None)
    assert err.value.param == spec.param
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        spec.check()  # the HTTP edge's check (no tokenizer) says the same
    assert engine.stats()["requests"] == before  # nothing was queued
    [out] = engine.generate_batch([_prompt(engine, 1)], [_params(GuidedSpec("json_object"), sampled=False)])
    assert isinstance(json.loads(out.text), dict)


def test_grammars_are_compiled_once_and_cached(engine):
    spec = GuidedSpec("regex", "[0-9]{4}", param="guided_regex")
    compiled = engine.grammars.compiled
    engine.generate_batch([_prompt(engine, i) for i in range(3)], [_params(spec, sampled=True, seed=i) for i in range(3)])
    assert engine.grammars.compiled == compiled + 1
    assert engine.grammars.hits >= 2


def test_masks_are_computed_while_the_forward_runs(engine, monkeypatch):
    """Each constrained decode step: forward dispatched, then the grammars' masks on the host,
    then the masked sampler; a step with no grammar samples without a mask."""
    events: list[str] = []
    launch = engine.runner.programs.call  # every step program goes through it

    def spy(name, fn, args):
        if name in ("decode", "sample"):
            events.append("forward" if name == "decode" else "sample" if args[-1] is None else "masked sample")
        return launch(name, fn, args)

    monkeypatch.setattr(engine.runner.programs, "call", spy)
    fill = engine.grammars.fill_masks
    monkeypatch.setattr(engine.grammars, "fill_masks", lambda *a: (events.append("mask"), fill(*a))[1])
    spec = GuidedSpec("regex", "[0-9]{6}", param="guided_regex")
    engine.generate_batch([_prompt(engine, 3)], [_params(spec, sampled=False)])
    decode = events[events.index("forward"):]
    assert len(decode) >= 6  # two decode steps at least
    assert decode == ["forward", "mask", "masked sample"] * (len(decode) // 3)
    events.clear()
    engine.generate_batch([_prompt(engine, 3)], [_params(None, sampled=False, max_tokens=4)])
    assert "mask" not in events and "masked sample" not in events and "sample" in events


def test_grammars_compile_off_the_engine_loop(engine, monkeypatch):
    """generate() compiles on the compiler's thread (the caller's event loop serves on), submit()
    on its caller's: never on the engine loop."""
    import asyncio
    import threading

    threads: list[str] = []
    matcher = engine.grammars.matcher

    def spy(spec):
        threads.append(threading.current_thread().name)
        return matcher(spec)

    monkeypatch.setattr(engine.grammars, "matcher", spy)

    async def run() -> str:
        spec = GuidedSpec("regex", "[a-z]{3}", param="guided_regex")
        return "".join([o.text async for o in engine.generate(_prompt(engine, 4), _params(spec, sampled=False))])

    assert len(asyncio.run(run())) == 3
    engine.generate_batch([_prompt(engine, 5)], [_params(GuidedSpec("regex", "[x-z]{2}"), sampled=False)])
    assert threads[0].startswith("grammar-compile") and threads[1] == threading.current_thread().name


def test_a_grammar_past_the_work_limits_is_refused_naming_the_limit(engine, monkeypatch):
    import llguidance

    import lora_runtime.engine.grammar as grammar

    monkeypatch.setattr(grammar, "_limits", lambda: llguidance.LLParserLimits(initial_lexer_fuel=10))
    spec = GuidedSpec("regex", "([a-z]{1,50}x){1,20}", param="guided_regex")
    with pytest.raises(InvalidRequestError, match=r"too big \(limit for this grammar: 10\)") as err:
        engine.submit(_prompt(engine, 0), _params(spec, sampled=False), lambda out: None)
    assert err.value.param == "guided_regex"

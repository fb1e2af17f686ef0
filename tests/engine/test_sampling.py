import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_runtime.engine.sampling import SamplingBatch, SamplingParams, sample
from lora_runtime.errors import InvalidRequestError


def _batch(*rows):
    return SamplingBatch.from_rows(list(rows))


@pytest.fixture(scope="module")
def logits():
    return jnp.asarray(np.random.RandomState(0).randn(4, 64), jnp.float32)


def test_greedy_is_argmax(logits):
    b = _batch(*[(SamplingParams(temperature=0.0), s, 0) for s in range(4)])
    np.testing.assert_array_equal(sample(logits, b), np.argmax(logits, -1))


def test_top_k_one_is_argmax_at_any_temperature(logits):
    b = _batch(*[(SamplingParams(temperature=5.0, top_k=1), s, 3) for s in range(4)])
    np.testing.assert_array_equal(sample(logits, b), np.argmax(logits, -1))


def test_tiny_top_p_keeps_only_the_best(logits):
    b = _batch(*[(SamplingParams(temperature=2.0, top_p=1e-6), s, 0) for s in range(4)])
    np.testing.assert_array_equal(sample(logits, b), np.argmax(logits, -1))


def test_top_k_draws_stay_in_the_top_k(logits):
    k = 3
    top = np.argsort(-np.asarray(logits), -1)[:, :k]
    fn = jax.jit(sample)
    for step in range(20):
        b = _batch(*[(SamplingParams(temperature=10.0, top_k=k), 7, step) for _ in range(4)])
        drawn = np.asarray(fn(logits, b))
        assert all(drawn[i] in top[i] for i in range(4))


def test_top_p_draws_stay_in_the_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only.
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None].repeat(4, 0), jnp.float32)
    seen = set()
    for step in range(40):
        b = _batch(*[(SamplingParams(temperature=1.0, top_p=0.7), s, step) for s in range(4)])
        seen |= set(np.asarray(sample(logits, b)).tolist())
    assert seen == {0, 1}


def test_min_p_draws_stay_above_min_p_times_the_likeliest():
    # Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1: min_p=0.5 keeps 0.5 and 0.3 (>= 0.25), and
    # top_p=0.5 then keeps the first of those alone (vLLM's order: the nucleus of what min-p kept).
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None].repeat(4, 0), jnp.float32)
    fn = jax.jit(sample)
    seen, nucleus = set(), set()
    for step in range(40):
        seen |= set(np.asarray(fn(logits, _batch(*[(SamplingParams(temperature=1.0, min_p=0.5), s, step)
                                                    for s in range(4)]))).tolist())
        nucleus |= set(np.asarray(fn(logits, _batch(*[(SamplingParams(temperature=1.0, min_p=0.5, top_p=0.55), s,
                                                        step) for s in range(4)]))).tolist())
    assert seen == {0, 1} and nucleus == {0}
    # min_p=1 keeps the likeliest alone; other rows of the batch are not filtered by it.
    rows = [(SamplingParams(temperature=3.0, min_p=1.0), 1, 0), (SamplingParams(temperature=3.0), 2, 0)]
    wide = set()
    for step in range(40):
        drawn = np.asarray(fn(logits[:2], _batch(*[(p, s, step) for p, s, _ in rows])))
        assert drawn[0] == 0
        wide.add(int(drawn[1]))
    assert len(wide) > 2


def test_seeded_draw_depends_only_on_seed_and_step(logits):
    p = SamplingParams(temperature=1.0)
    a = sample(logits, _batch((p, 11, 5), (p, 12, 5), (p, 13, 5), (p, 14, 5)))
    # Same row content at another batch position, other rows different.
    b = sample(logits[::-1], _batch((p, 14, 5), (p, 99, 0), (p, 98, 1), (p, 11, 5)))
    assert int(a[0]) == int(b[3])
    assert int(a[3]) == int(b[0])


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    logits = jnp.asarray(np.log(probs)[None].repeat(1000, 0), jnp.float32)
    p = SamplingParams(temperature=1.0)
    drawn = np.asarray(sample(logits, _batch(*[(p, s, 0) for s in range(1000)])))
    freq = np.bincount(drawn, minlength=3) / 1000
    np.testing.assert_allclose(freq, probs, atol=0.05)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(top_k=2**31), "top_k"),  # would not fit the sampler's int32 rows
        (dict(max_tokens=2**40), "max_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(500,)), "stop_token_ids"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert e.value.param == field


def test_the_field_an_error_concerns_survives_pickling():
    import pickle

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=2.0).validate()
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is InvalidRequestError and again.param == "top_p" and str(again) == str(e.value)


def test_a_row_draws_the_same_whatever_its_neighbours_ask_for(logits):
    """The sort (top-k/top-p), min-p and the draw run only when some row needs them; a row's token
    must not depend on whether they ran for its neighbours."""
    plain, greedy = SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)
    filtered = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    for seed in range(20):
        alone = sample(logits, _batch((plain, seed, 3), (plain, 7, 0), (plain, 8, 0), (plain, 9, 0)))
        mixed = sample(logits, _batch((plain, seed, 3), (filtered, 7, 0), (greedy, 8, 0), (plain, 9, 0)))
        assert int(alone[0]) == int(mixed[0]) and int(alone[3]) == int(mixed[3])
        assert int(mixed[2]) == int(jnp.argmax(logits[2]))
    all_greedy = sample(logits, _batch(*[(greedy, s, 0) for s in range(4)]))
    assert all_greedy.tolist() == jnp.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("std", [4.0, 1.0])
def test_candidate_filter_keeps_what_a_whole_vocabulary_sort_keeps(std):
    """Top-k/top-p look at the TOP_CANDIDATES likeliest tokens first; the kept set must be
    the one a sort of the whole row gives, for top-k inside and past the candidates."""
    from lora_runtime.engine.sampling import TOP_CANDIDATES, _filter_sorted, _top_k_top_p

    vocab = TOP_CANDIDATES * 3
    rows = [(0, 1.0), (0, 0.9), (0, 0.5), (5, 0.9), (TOP_CANDIDATES, 0.95), (TOP_CANDIDATES + 500, 0.9),
            (0, 0.999), (1, 1.0), (5, 1.0)]
    scaled = jnp.asarray(np.random.RandomState(3).randn(len(rows), vocab) * std, jnp.float32)
    batch = _batch(*[(SamplingParams(temperature=1.0, top_k=k, top_p=p), 0, 0) for k, p in rows])
    got = np.isfinite(np.asarray(_top_k_top_p(scaled, batch)))
    k = jnp.where(batch.top_k > 0, batch.top_k, vocab)
    want = np.isfinite(np.asarray(_filter_sorted(scaled, -jnp.sort(-scaled, axis=-1), k, batch.top_p,
                                                 jax.nn.logsumexp)))
    np.testing.assert_array_equal(got, want)
    assert got[8].sum() == 5 and 1 <= got[3].sum() <= 5 and got[7].sum() == 1 and got[0].all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(repetition_penalty=0.0), r"repetition_penalty=0.0 must be in \(0, 2\]"),
        (dict(repetition_penalty=2.5), r"repetition_penalty=2.5 must be in \(0, 2\]"),
        (dict(max_tokens=4, min_tokens=5), r"min_tokens=5 must be in \[0, max_tokens=4\]"),
        (dict(min_tokens=1, stop_token_ids=tuple(range(29))), "min_tokens with 29 stop_token_ids: at most 28"),
    ],
)
def test_penalty_and_min_tokens_limits(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs).validate()


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    from lora_runtime.engine.sampling import apply_penalties

    logits = jnp.zeros((3, 10), jnp.float32)
    none = jnp.zeros((3, 10), jnp.int32)
    p = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7,))
    ignoring = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    batch = SamplingBatch.from_rows([(p, 0, 1), (p, 0, 2), (ignoring, 0, 0)], eos_token_ids=(2,))
    out = np.asarray(apply_penalties(logits, none, none > 0, batch))
    assert np.isneginf(out[0, [2, 7]]).all() and np.isfinite(np.delete(out[0], [2, 7])).all()
    assert np.isfinite(out[1]).all()  # two tokens generated: nothing held back
    assert np.isneginf(out[2, 7]) and np.isfinite(out[2, 2])  # ignore_eos: EOS is no stop to hold back


def test_logit_bias_adds_to_its_rows_tokens_only():
    from lora_runtime.engine.sampling import apply_penalties

    logits = jnp.asarray(np.random.RandomState(1).randn(3, 10), jnp.float32)
    none = jnp.zeros((3, 10), jnp.int32)
    biased = SamplingParams(logit_bias=((3, 100.0), (5, -2.5)))
    held = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(3,), logit_bias=((3, 100.0),))
    batch = SamplingBatch.from_rows([(biased, 0, 0), None, (held, 0, 0)])
    out = np.asarray(apply_penalties(logits, none, none > 0, batch))
    want = np.asarray(logits).copy()
    want[0, 3] += 100.0
    want[0, 5] -= 2.5
    np.testing.assert_allclose(out[:2], want[:2], rtol=1e-6)
    assert np.isneginf(out[2, 3])  # min_tokens still holds the stop id back, bias or not
    assert int(sample(jnp.asarray(out), batch)[0]) == 3  # greedy follows the bias


@pytest.mark.parametrize(
    "bias, match",
    [
        (((1, 101.0),), r"logit_bias value 101.0 for token 1 must be in \[-100, 100\]"),
        (((1, 1.0), (1, 2.0)), "logit_bias names token 1 twice"),
        (tuple((i, 1.0) for i in range(301)), "logit_bias has 301 tokens; at most 300"),
        (((64, 1.0),), r"logit_bias token ids \[64\] outside \[0, 64\)"),
    ],
)
def test_bad_logit_bias_names_the_field(bias, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        SamplingParams(logit_bias=bias).validate(vocab_size=64)
    assert e.value.param == "logit_bias"


def _sorted_mask(scaled, k, top_p):
    """Per row: the top-k / top-p filter over the whole sorted vocabulary (the oracle)."""
    from lora_runtime.engine.sampling import _filter_sorted

    return _filter_sorted(scaled, -jnp.sort(-scaled, axis=-1), k, top_p, jax.nn.logsumexp)


def test_rows_past_the_candidates_are_sorted_alone_and_match_a_full_sort():
    from lora_runtime.engine import sampling

    vocab = 3 * sampling.TOP_CANDIDATES
    rng = np.random.RandomState(2)
    peaked = rng.randn(9, vocab) * 6.0
    flat = rng.randn(9, vocab) * 0.1
    # Rows 1, 4, 5, 6 and 8 need the whole vocabulary (flat nucleus, or top-k past the
    # candidates): more than one chunk of FULL_SORT_ROWS; the other rows stay on the fast path.
    logits = np.where(np.isin(np.arange(9), [1, 4, 5, 8])[:, None], flat, peaked).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 9
    params[6] = SamplingParams(temperature=1.0, top_k=sampling.TOP_CANDIDATES + 7)
    params[7] = SamplingParams(temperature=1.0, top_k=5, top_p=0.5)
    batch = _batch(*[(p, s, 0) for s, p in enumerate(params)])
    got = np.asarray(jax.jit(sampling._top_k_top_p)(jnp.asarray(logits), batch))
    k = np.where(batch.top_k > 0, np.minimum(batch.top_k, vocab), vocab)
    want = np.asarray(_sorted_mask(jnp.asarray(logits), jnp.asarray(k), jnp.asarray(batch.top_p)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    kept = np.isfinite(got).sum(-1)
    assert kept[1] > sampling.TOP_CANDIDATES and kept[6] == sampling.TOP_CANDIDATES + 7 and kept[7] <= 5


def test_penalties_read_each_logit_rows_batch_row():
    from lora_runtime.engine.sampling import apply_penalties

    logits = jnp.ones((2, 6), jnp.float32)
    counts = jnp.zeros((4, 6), jnp.int32).at[3, 2].set(2)
    p = SamplingParams(frequency_penalty=0.5)
    out = np.asarray(apply_penalties(logits, counts, counts > 0, _batch((p, 0, 0), (p, 0, 0)), jnp.array([0, 3])))
    assert out[0].tolist() == [1.0] * 6 and out[1, 2] == 0.0 and out[1, 3] == 1.0


def test_logprobs_only_for_steps_that_ask():
    from lora_runtime.engine.sampling import step_logprobs

    logits = jnp.asarray(np.random.RandomState(3).randn(3, 50), jnp.float32)
    tokens = jnp.array([1, 2, 3])
    full = step_logprobs(logits, tokens)
    asked = step_logprobs(logits, tokens, jnp.array([False, True, False]))
    np.testing.assert_allclose(asked.top, full.top, rtol=1e-6)
    np.testing.assert_allclose(asked.chosen, full.chosen, rtol=1e-6)
    none = step_logprobs(logits, tokens, jnp.zeros(3, bool))
    assert not np.asarray(none.top).any() and not np.asarray(none.chosen).any()

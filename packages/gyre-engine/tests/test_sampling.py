"""Sampling: logprobs come from the distribution actually sampled from; truncation and penalties."""

from __future__ import annotations

import math

import pytest
from gyre_engine.protocol import ProtocolError, SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server.sampling import SamplerState, sample, validate_params  # noqa: E402

V = 32


def state(seed: int | None = None, prompt: list[int] | None = None, **kw: object) -> SamplerState:
    p = SamplingParams(**kw)  # type: ignore[arg-type]
    return SamplerState(p, V, frozenset({0}), prompt or [], -1 if seed is None else seed)


@settings(max_examples=60, deadline=None)
@given(
    temp=st.floats(0.2, 2.0),
    top_k=st.sampled_from([-1, 1, 3, 10]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    seed=st.integers(0, 1000),
)
def test_logprob_is_of_the_truncated_renormalized_distribution(
    temp: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 3
    st_ = state(seed, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    want = (0, 5, V - 1)
    out = sample(logits.clone(), [st_], [V], [want])
    assert out.top is not None
    support = [(lp, t) for lp, t in out.top[0].top if lp > -math.inf]
    assert math.isclose(sum(math.exp(lp) for lp, _ in support), 1.0, rel_tol=1e-4)  # renormalized
    assert out.tokens[0] in {t for _, t in support}  # sampled inside the kept set
    chosen = dict((t, lp) for lp, t in support)[out.tokens[0]]
    every = {t: lp for lp, t in out.top[0].top}  # top-V: the whole distribution
    assert out.top[0].ids == [every[t] for t in want]  # token_ids_logprob: the same distribution
    assert math.isclose(out.logprobs[0], chosen, rel_tol=1e-5, abs_tol=1e-6)
    if top_k == 1:  # greedy: the plain log-softmax of the logits
        assert out.tokens[0] == int(logits.argmax())
        assert math.isclose(
            out.logprobs[0], float(torch.log_softmax(logits, -1)[0, out.tokens[0]]), rel_tol=1e-5
        )
    elif top_k > 1:
        assert len(support) <= top_k


def test_plain_temperature_logprobs_equal_log_softmax_over_temperature() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    states = [state(i, temperature=0.5) for i in range(3)]
    out = sample(logits.clone(), states, [0, 0, 0])
    expected = torch.log_softmax(logits / 0.5, -1)
    for i in range(3):
        assert math.isclose(out.logprobs[i], float(expected[i, out.tokens[i]]), rel_tol=1e-5)


def test_seeded_rows_repeat_whatever_their_batch_neighbours() -> None:
    logits = torch.zeros(2, V)

    def draws(seed: int, neighbour: int) -> list[int]:
        mine, other = state(seed), state(neighbour)
        return [sample(logits.clone(), [mine, other], [0, 0]).tokens[0] for _ in range(10)]

    assert draws(5, 6) == draws(5, 9)
    assert draws(5, 6) != draws(11, 6)


def test_penalties_bias_and_min_new_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7] = 5.0
    st_ = state(temperature=0.0, logit_bias={"9": 10.0})
    assert sample(logits.clone(), [st_], [0]).tokens == [9]
    st_ = state(temperature=0.0, frequency_penalty=10.0)
    st_.observe(7)
    assert sample(logits.clone(), [st_], [0]).tokens != [7]
    st_ = state(temperature=0.0, repetition_penalty=100.0, prompt=[7])
    assert sample(logits.clone() + 1.0, [st_], [0]).tokens != [7]
    logits[0, 0] = 50.0  # EOS is 0
    st_ = state(temperature=0.0, min_new_tokens=2)
    assert sample(logits.clone(), [st_], [0]).tokens == [7]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"n": 2}, "n must be 1"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"json_schema": "{}"}, "not supported"),
        ({"stop_token_ids": [V]}, "outside the vocabulary"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"beam_width": 4}, "beam_width"),
        # found by fuzzing: '²' made int() raise a bare ValueError (a 500), '٣' (Arabic-Indic 3) was
        # read as token 3, a key of 5,000 digits passes int()'s limit; NaN and infinity were sampled
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias key"),
        ({"logit_bias": {"\u0663": 1.0}}, "logit_bias key"),
        ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias key"),
        ({"logit_bias": {"-0": 1.0}}, "logit_bias key"),
        ({"logit_bias": {"3": math.nan}}, "not a number"),
        ({"temperature": math.nan}, "non-negative finite number"),
        ({"temperature": math.inf}, "non-negative finite number"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
    ],
)
def test_unsupported_or_invalid_values_are_named(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        validate_params(SamplingParams(**kw), V)  # type: ignore[arg-type]


@pytest.mark.parametrize("top_k", [0, -2, -(2**63)])
def test_any_top_k_is_taken_at_temperature_0_where_sglang_makes_it_greedy(top_k: int) -> None:
    validate_params(SamplingParams(temperature=0.0, top_k=top_k), V)
    assert state(3, temperature=0.0, top_k=top_k).greedy
    with pytest.raises(ProtocolError, match=rf"top_k must be -1 \(disable\) or at least 1, got {top_k}\."):
        validate_params(SamplingParams(temperature=1e-6, top_k=top_k), V)  # SGLang's bound: under 1e-6


@pytest.mark.parametrize("top_k", [V, V + 1, 2**31, 2**63, 2**64 - 1])
def test_a_top_k_past_the_vocabulary_keeps_all_of_it(top_k: int) -> None:
    """SGLang takes any top_k >= 1; one at or past the vocabulary's size keeps every token, as -1 does.
    (Found by fuzzing: past the vocabulary the engine thread died on an index out of range, past 2^63 on
    an overflow converting it to a tensor, and the server answered nothing more.)"""
    validate_params(SamplingParams(top_k=top_k), V)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    big = [state(7, temperature=0.8, top_k=top_k), state(8, temperature=0.8, top_k=2)]
    off = [state(7, temperature=0.8), state(8, temperature=0.8, top_k=2)]
    assert big[0].untruncated and big[0].kept == V
    a, b = sample(logits.clone(), big, [V, V]), sample(logits.clone(), off, [V, V])
    assert a.tokens == b.tokens and a.logprobs == b.logprobs and a.top == b.top


def test_gumbel_noise_is_a_pure_function_of_seed_index_and_id() -> None:
    from gyre_engine.server.sampling import gumbel_noise

    seeds = torch.tensor([5, 5, 6, (1 << 61) + 5])
    index = torch.tensor([10, 11, 10, 10])
    a, b = gumbel_noise(seeds, index, 1000), gumbel_noise(seeds.clone(), index.clone(), 1000)
    assert torch.equal(a, b) and a.shape == (4, 1000) and bool(torch.isfinite(a).all())
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2]) and not torch.equal(a[0], a[3])
    assert torch.equal(gumbel_noise(seeds[2:3], index[2:3], 1000)[0], a[2])  # batch-independent
    # Gumbel(0, 1): mean Euler-Mascheroni 0.5772, variance pi^2 / 6
    big = gumbel_noise(torch.arange(64), torch.arange(64) * 3, 4096)
    assert abs(float(big.mean()) - 0.5772) < 0.01 and abs(float(big.var()) - math.pi**2 / 6) < 0.03


def test_gumbel_max_draws_follow_the_distribution() -> None:
    """Draws of `pick` over many (seed, index) keys have the frequencies of the softmax."""
    from gyre_engine.server.sampling import pick

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    logp = torch.log_softmax(logits / 0.7, -1)
    n = 40000
    rows = logp.expand(n, -1)
    toks = pick(rows, torch.ones(n, dtype=torch.bool), torch.arange(n) % 97, torch.arange(n) // 97)
    freq = torch.bincount(toks, minlength=8).double() / n
    assert float((freq - logp.exp().double()).abs().max()) < 0.01
    greedy = pick(rows[:5], torch.zeros(5, dtype=torch.bool), torch.arange(5), torch.arange(5))
    assert greedy.tolist() == [0] * 5


def test_the_captured_head_samples_what_sample_samples() -> None:
    """The head a captured decode step runs (`slots._sampled_head`) equals `sample` on rows without
    truncation or processing: greedy rows and rows at their temperature, token and logprob."""
    from gyre_engine.server.slots import _sampled_head

    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    states = [state(11, temperature=0.7), state(temperature=0.0), state(12, temperature=1.3), state(11)]
    for st_, made in zip(states, [0, 3, 5, 2], strict=True):
        for _ in range(made):
            st_.observe(1)
    temps = torch.tensor([0.7, 1.0, 1.3, 1.0])
    mask = torch.tensor([1, 0, 1, 1])
    seeds = torch.tensor([s.seed for s in states])
    index = torch.tensor([s.next_index for s in states])
    chosen, lp = _sampled_head(logits.clone(), temps, mask, seeds, index)
    out = sample(logits.clone(), states, [0] * 4)
    assert chosen.tolist() == out.tokens
    assert torch.allclose(lp, torch.tensor(out.logprobs), atol=1e-6)

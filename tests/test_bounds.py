"""Pure evidence-bound estimators: exact values, deterministic inequalities, non-finite policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from numpyro_tempering import bounds


def reference(lw: np.ndarray, n: float = 2.0) -> dict:
    """Float64 NumPy reference of every estimator, straight from the definitions."""
    lw = np.asarray(lw, np.float64)
    w = np.exp(lw - lw.max())  # w / max w
    wbar = w / w.sum()
    log_mean_w = np.log(w.mean()) + lw.max()
    return {
        "elbo": lw.mean(),
        "iwae": log_mean_w,
        "cubo": (np.log(np.mean(w**n)) + n * lw.max()) / n,
        "klpq": np.sum(wbar * lw),
        "ess": 1.0 / np.sum(wbar**2),
        "weights": wbar,
    }


# A few particle counts only: every new shape costs a compilation of each estimator.
log_weight_vectors = st.sampled_from([1, 2, 7, 33]).flatmap(
    lambda s: arrays(
        np.float64,
        (s,),
        elements=st.floats(-60.0, 60.0, allow_nan=False, allow_infinity=False, width=64),
    )
)


@settings(max_examples=30, deadline=None)
@given(log_weight_vectors)
def test_deterministic_ordering_of_the_bounds(lw):
    """elbo <= iwae <= cubo_2 <= cubo_3 and iwae <= klpq <= 2 cubo_2 - iwae on any weights."""
    with jax.enable_x64(True):
        x = jnp.asarray(lw)
        e, i = float(bounds.elbo(x)), float(bounds.iwae(x))
        c2, c3 = float(bounds.cubo(x, 2)), float(bounds.cubo(x, 3.5))
        k = float(bounds.klpq(x))
        ess = float(bounds.effective_sample_size(x))
    tol = 1e-9 * (1.0 + np.max(np.abs(lw)))
    assert e <= i + tol
    assert i <= c2 + tol
    assert c2 <= c3 + tol
    assert i <= k + tol
    assert k <= 2 * c2 - i + tol
    assert k <= np.max(lw) + tol
    assert 1.0 - 1e-9 <= ess <= lw.shape[0] * (1.0 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(log_weight_vectors, st.floats(-30.0, 30.0))
def test_values_match_float64_reference_and_are_shift_equivariant(lw, shift):
    with jax.enable_x64(True):
        ref = reference(lw)
        x = jnp.asarray(lw)
        out = {
            "elbo": bounds.elbo(x),
            "iwae": bounds.iwae(x),
            "cubo": bounds.cubo(x, 2.0),
            "klpq": bounds.klpq(x),
            "ess": bounds.effective_sample_size(x),
            "weights": bounds.self_normalised_weights(x),
        }
        for name, value in out.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-10, err_msg=name)
        # log w -> log w + c (rescaling p) shifts the four bounds by c; weights and ESS fixed.
        y = x + shift
        for name in ("elbo", "iwae", "cubo", "klpq"):
            fn = getattr(bounds, name)
            np.testing.assert_allclose(fn(y), fn(x) + shift, rtol=1e-10, atol=1e-9)
        np.testing.assert_allclose(bounds.effective_sample_size(y), out["ess"], rtol=1e-9)


def test_equal_weights_give_equal_bounds_and_full_ess():
    lw = jnp.full((7,), -3.25)
    summary = bounds.summarise(lw, n=3.0)
    for value in (summary.elbo, summary.iwae, summary.cubo, summary.klpq):
        np.testing.assert_allclose(value, -3.25, rtol=1e-6)
    np.testing.assert_allclose(summary.effective_sample_size, 7.0, rtol=1e-6)
    assert int(summary.num_nonfinite) == 0 and summary.num_particles == 7


def test_hand_computed_values():
    lw = jnp.log(jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(bounds.elbo(lw), 0.5 * np.log(3.0), rtol=1e-6)
    np.testing.assert_allclose(bounds.iwae(lw), np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(bounds.cubo(lw, 2), 0.5 * np.log(5.0), rtol=1e-6)
    np.testing.assert_allclose(bounds.cubo(lw, 1), np.log(2.0), rtol=1e-6)  # n = 1 is IWAE
    np.testing.assert_allclose(bounds.klpq(lw), 0.75 * np.log(3.0), rtol=1e-6)
    np.testing.assert_allclose(bounds.effective_sample_size(lw), 1.0 / (1 / 16 + 9 / 16))


def test_batched_input_reduces_over_last_axis():
    rng = np.random.default_rng(0)
    lw = rng.normal(size=(3, 4, 9)) * 5.0
    with jax.enable_x64(True):
        summary = bounds.summarise(jnp.asarray(lw))
    assert summary.cubo.shape == (3, 4) and summary.num_nonfinite.shape == (3, 4)
    for idx in np.ndindex(3, 4):
        ref = reference(lw[idx])
        np.testing.assert_allclose(summary.cubo[idx], ref["cubo"], rtol=1e-12)
        np.testing.assert_allclose(summary.klpq[idx], ref["klpq"], rtol=1e-12)
        np.testing.assert_allclose(summary.effective_sample_size[idx], ref["ess"], rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtype_preserved(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        lw = jnp.linspace(-500.0, 10.0, 11, dtype=dtype)  # large spread: needs log space
        summary = bounds.summarise(lw)
        for value in summary[:-1]:
            if jnp.issubdtype(value.dtype, jnp.floating):
                assert value.dtype == dtype
        ref = reference(np.asarray(lw, np.float64))
        rtol = 1e-12 if dtype == jnp.float64 else 1e-5
        np.testing.assert_allclose(summary.cubo, ref["cubo"], rtol=rtol)
        np.testing.assert_allclose(summary.iwae, ref["iwae"], rtol=rtol)
        assert bool(jnp.isfinite(summary.cubo))
    # integer input is promoted, not truncated
    assert jnp.issubdtype(bounds.iwae(jnp.array([0, 1])).dtype, jnp.floating)


def test_minus_inf_is_a_zero_weight_and_is_counted():
    lw = jnp.array([0.0, -jnp.inf, 0.0, -jnp.inf])
    assert int(bounds.count_nonfinite(lw)) == 2
    np.testing.assert_allclose(bounds.iwae(lw), np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(bounds.cubo(lw, 2), 0.5 * np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(bounds.klpq(lw), 0.0, atol=1e-7)
    np.testing.assert_allclose(bounds.effective_sample_size(lw), 2.0, rtol=1e-6)
    np.testing.assert_allclose(bounds.self_normalised_weights(lw), [0.5, 0, 0.5, 0], atol=1e-7)
    assert bounds.elbo(lw) == -jnp.inf
    # gradients of the estimators stay finite at a zero weight
    grads = all_gradients(lw)
    for name in ("iwae", "cubo", "klpq", "effective_sample_size"):
        assert bool(jnp.all(jnp.isfinite(grads[name]))), name
        assert grads[name][1] == 0 and grads[name][3] == 0, name


ESTIMATORS = ("elbo", "iwae", "cubo", "klpq", "effective_sample_size")


def all_estimates(lw):
    """Every estimator, and the self-normalised weights, of one vector of log weights."""
    out = {name: getattr(bounds, name)(lw) for name in ESTIMATORS}
    out["weights"] = bounds.self_normalised_weights(lw)
    return out


@jax.jit
def all_gradients(lw):
    return {name: jax.grad(getattr(bounds, name))(lw) for name in ESTIMATORS}


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "+inf"])
def test_nan_and_plus_inf_give_nan_everywhere_and_are_counted(bad):
    """NaN in, NaN out; +inf cannot be a weight (q(z_s) > 0 for a drawn z_s): NaN too."""
    for lw in (jnp.array([0.0, bad, 1.0]), jnp.array([bad, -jnp.inf]), jnp.full(2, bad)):
        s = bounds.summarise(lw)
        assert int(s.num_nonfinite) == int(jnp.sum(~jnp.isfinite(lw)))
        for name, value in all_estimates(lw).items():
            assert bool(jnp.all(jnp.isnan(value))), (name, lw)
        for value in s[:5]:
            assert bool(jnp.isnan(value))
        # never a silent (zero or finite) gradient either
        for name, grad in all_gradients(lw).items():
            assert bool(jnp.all(jnp.isnan(grad))), (name, lw, grad)


def test_all_zero_weights_cannot_be_normalised():
    """All -inf: the lower bounds are -inf (trivially true), the upper bounds are nan."""
    s = bounds.summarise(jnp.full((3,), -jnp.inf))
    assert int(s.num_nonfinite) == 3
    assert s.elbo == -jnp.inf and s.iwae == -jnp.inf
    # a -inf CUBO would be the best possible value of a minimised bound
    assert bool(jnp.isnan(s.cubo)) and bool(jnp.isnan(bounds.cubo(jnp.full(3, -jnp.inf), 1)))
    assert bool(jnp.isnan(s.klpq)) and bool(jnp.isnan(s.effective_sample_size))
    assert bool(jnp.all(jnp.isnan(bounds.self_normalised_weights(jnp.full(3, -jnp.inf)))))
    # batched: only the affected row
    s = bounds.summarise(jnp.array([[0.0, 1.0], [-jnp.inf, -jnp.inf]]))
    assert bool(jnp.isfinite(s.cubo[0])) and bool(jnp.isnan(s.cubo[1]))


finite_and_index = st.sampled_from([2, 7, 33]).flatmap(
    lambda s: st.tuples(
        arrays(np.float64, (s,), elements=st.floats(-60.0, 60.0, width=64)),
        st.integers(0, s - 1),
    )
)


@settings(max_examples=25, deadline=None)
@given(finite_and_index, st.sampled_from([np.nan, np.inf]))
def test_property_any_nan_or_plus_inf_anywhere_gives_nan(case, bad):
    lw, index = case
    lw = lw.copy()
    lw[index] = bad
    with jax.enable_x64(True):
        for name, value in all_estimates(jnp.asarray(lw)).items():
            assert bool(jnp.all(jnp.isnan(value))), name


@settings(max_examples=25, deadline=None)
@given(finite_and_index, st.randoms(use_true_random=False))
def test_property_permutation_invariance(case, rng):
    lw, _ = case
    perm = list(range(lw.shape[0]))
    rng.shuffle(perm)
    with jax.enable_x64(True):
        a, b = all_estimates(jnp.asarray(lw)), all_estimates(jnp.asarray(lw[perm]))
    for name in ESTIMATORS:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-12, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(a["weights"][np.asarray(perm)], b["weights"], atol=1e-15)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([2, 7, 33]).flatmap(
        lambda s: st.tuples(
            arrays(np.float64, (s,), elements=st.floats(-60.0, 60.0, width=64)),
            arrays(np.bool_, (s,)),
        )
    )
)
def test_property_minus_inf_is_exactly_a_zero_weight(case):
    """With zero weights among S, each estimate equals its finite-part value, still over S.

    The finite part's values come from the NumPy reference (its sizes vary, and every new
    shape would cost a compilation of each estimator).
    """
    lw, zero = case
    if zero.all():
        zero[0] = False
    S, kept = lw.shape[0], lw[~zero]
    part = reference(kept)
    log_frac = np.log(kept.shape[0] / S)
    with jax.enable_x64(True):
        full = jnp.asarray(np.where(zero, -np.inf, lw))
        out = jax.tree.map(np.asarray, all_estimates(full))
        cubo_35 = np.asarray(bounds.cubo(full, 3.5))
        num_nonfinite = int(bounds.count_nonfinite(full))
    np.testing.assert_allclose(out["iwae"], part["iwae"] + log_frac, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out["cubo"], part["cubo"] + log_frac / 2, rtol=1e-10, atol=1e-10)
    ref_35 = reference(kept, 3.5)["cubo"] + log_frac / 3.5
    np.testing.assert_allclose(cubo_35, ref_35, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out["klpq"], part["klpq"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out["effective_sample_size"], part["ess"], rtol=1e-10)
    np.testing.assert_allclose(np.asarray(out["weights"])[~zero], part["weights"], atol=1e-14)
    assert np.all(np.asarray(out["weights"])[zero] == 0)
    if zero.any():
        assert out["elbo"] == -np.inf
    else:  # the same mean, summed in another order
        np.testing.assert_allclose(out["elbo"], part["elbo"], rtol=1e-12, atol=1e-12)
    assert num_nonfinite == int(zero.sum())


def test_bad_input():
    with pytest.raises(ValueError, match="`log_w`.*scalar"):
        bounds.iwae(jnp.array(1.0))
    with pytest.raises(ValueError, match="no particles"):
        bounds.cubo(jnp.zeros((2, 0)))
    for bad in (0.5, -2.0, float("nan"), jnp.array([2.0, 3.0]), True, "2", None, 2 + 0j):
        with pytest.raises(ValueError, match="`n`"):
            bounds.cubo(jnp.zeros(3), bad)
    with pytest.raises(ValueError, match="`log_w` must be real"):
        bounds.iwae(jnp.array([1.0 + 0j, 2.0]))
    # concrete NumPy / JAX scalars are fine
    for n in (np.float32(2.0), jnp.array(2.0), np.int64(2)):
        np.testing.assert_allclose(
            bounds.cubo(jnp.array([0.0, 1.0]), n), bounds.cubo(jnp.array([0.0, 1.0]), 2.0)
        )


def test_jit_with_traced_order():
    f = jax.jit(bounds.cubo)
    lw = jnp.array([0.1, -0.3, 2.0])
    np.testing.assert_allclose(f(lw, 3.0), reference(np.asarray(lw), 3.0)["cubo"], rtol=1e-6)
    # a traced order that is not a finite real >= 1 cannot raise: it gives nan, with its grad
    for bad in (0.5, -1.0, jnp.inf, jnp.nan):
        assert bool(jnp.isnan(f(lw, bad))), bad
        assert bool(jnp.all(jnp.isnan(jax.grad(f)(lw, bad)))), bad

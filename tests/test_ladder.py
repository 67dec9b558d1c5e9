"""The Ladder value: construction, validation, immutability, pytree, log C and model sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conjugate import normal_log_z
from hypothesis import given, settings
from hypothesis import strategies as st

from numpyro_tempering.handlers import Selection
from numpyro_tempering.ladder import UNCHECKED, Ladder
from numpyro_tempering.partition_function import ModelSizes, log_partition, model_sizes

KEY = jax.random.PRNGKey(3)


def model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 0.5), obs=x)


def test_paper_default_ladder():
    lad = Ladder.geometric()
    t = lad.temperatures
    assert lad.num_temperatures == 100 and t[0] == 1.0 and t[-1] == 10.0
    np.testing.assert_allclose(t[1:] / t[:-1], 10.0 ** (1 / 99), rtol=1e-12)
    np.testing.assert_allclose(lad.weights, 0.01)
    np.testing.assert_allclose(lad.log_prior, np.log(0.01))
    with pytest.warns(DeprecationWarning, match="use Ladder.log_prior"):
        np.testing.assert_allclose(lad.log_weights, lad.log_prior)
    np.testing.assert_allclose(lad.inverse_temperatures, 1 / t)
    assert not lad.has_log_partition and lad.log_c is None and lad.sizes is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperatures=[]), "empty"),
        (dict(temperatures=[1.0, 3.0, 2.0]), r"strictly increasing; got T_2 = 3.0 followed by"),
        (dict(temperatures=[1.0, 2.0, 2.0]), "strictly increasing"),
        (dict(temperatures=[1.5, 2.0]), "must start at T_1 = 1"),
        (dict(temperatures=[1.0, np.inf]), "finite and > 0"),
        (dict(temperatures=[[1.0, 2.0]]), "1-D"),
        (dict(temperatures=[1.0, 2.0], weights=[0.5, 0.6]), "sum to 1"),
        (dict(temperatures=[1.0, 2.0], weights=[1.5, -0.5]), ">= 0"),
        (dict(temperatures=[1.0, 2.0], weights=[1.0]), "has 1 entries but the ladder has 2"),
        (dict(temperatures=[1.0, 2.0], log_c=[0.0, np.nan]), r"`log_c` must be finite.*\[2.0\]"),
        (dict(temperatures=[1.0, 2.0], log_c=[0.0, -np.inf]), "`log_c` must be finite"),
        (dict(temperatures=[1.0, 2.0], log_c=[0.0]), "`log_c` has 1 entries"),
        (dict(temperatures=[1.0, 2.0], stderr=[0.0, 0.1]), "without `log_c`"),
        (dict(temperatures=[1.0, 2.0], log_c=[0.0, 1.0], stderr=[0.0, -1.0]), "stderr"),
    ],
)
def test_bad_ladders(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Ladder(**kwargs)


def test_geometric_errors():
    with pytest.raises(ValueError, match="T_1 = 1"):
        Ladder.geometric(2.0, 10.0, 5)
    with pytest.raises(ValueError, match="start < stop"):
        Ladder.geometric(1.0, 0.5, 5)
    with pytest.raises(ValueError, match="`num` must be a positive integer"):
        Ladder.geometric(1.0, 10.0, 0)
    assert Ladder.geometric(1.0, 10.0, 1).temperatures.tolist() == [1.0]


def test_immutable_and_copy_on_write():
    lad = Ladder([1.0, 2.0])
    with pytest.raises(ValueError, match="read-only"):
        lad.temperatures[0] = 5.0
    with pytest.raises(AttributeError):
        lad.weights = None
    new = lad.with_log_partition_values([0.0, 1.0], stderr=[0.0, 0.1])
    assert lad.log_c is None and new.log_c.tolist() == [0.0, 1.0]
    assert new.temperatures is lad.temperatures or np.all(new.temperatures == lad.temperatures)


def test_missing_log_partition_is_a_clear_error():
    with pytest.raises(ValueError, match="has no log C"):
        Ladder([1.0, 2.0]).arrays()


def test_pytree_round_trip_and_jit():
    lad = Ladder([1.0, 2.0, 4.0], [0.2, 0.3, 0.5]).with_log_partition_values(
        [0.0, 1.0, 2.0],
        sizes=ModelSizes((("data", 3),), (("x", (3,)),)),
        selection=Selection.of(latent="z", joint=True),
    )
    leaves, treedef = jax.tree.flatten(lad)
    assert len(leaves) == 3  # temperatures, weights, log_c (stderr None is no leaf)
    back = jax.tree.unflatten(treedef, leaves)
    assert back.sizes == lad.sizes
    assert back.selection == Selection.of(latent="z", joint=True)  # static: part of treedef
    np.testing.assert_array_equal(back.log_c, lad.log_c)

    @jax.jit
    def expected_inverse_temperature(ladder):
        inv_t, log_pi, _ = ladder.arrays()
        return jnp.sum(jnp.exp(log_pi) * inv_t)

    assert float(expected_inverse_temperature(lad)) == pytest.approx(0.2 + 0.15 + 0.125)


def test_with_log_partition_stores_estimate_and_sizes():
    x = jnp.zeros(4)
    lad = Ladder.geometric(1.0, 10.0, 6).with_log_partition(model, KEY, x, num_samples=8)
    est = log_partition(KEY, model, lad.temperatures, x, num_samples=8)
    np.testing.assert_allclose(lad.log_c, est.log_c)
    np.testing.assert_allclose(lad.stderr, est.stderr)
    exact = 4 * normal_log_z(lad.temperatures, 0.5)
    np.testing.assert_allclose(lad.log_c, exact, rtol=1e-5, atol=1e-5)
    assert lad.sizes == model_sizes(model, x)
    assert lad.selection == Selection()  # the default: the observed sites
    lad.check_sizes(model_sizes(model, x))
    with pytest.raises(ValueError, match=r"plate 'data': model has 5, the ladder's log C was"):
        lad.check_sizes(model_sizes(model, jnp.zeros(5)))
    with pytest.raises(ValueError, match=r"tempered site 'mu': model has \(\)"):
        lad.check_sizes(model_sizes(model, x, latent="mu"))


@pytest.mark.filterwarnings("ignore:log_partition. the Monte Carlo estimate")
def test_with_log_partition_refuses_nonfinite_draws():
    def bad(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.factor("penalty", jnp.where(mu > 0, jnp.nan, 0.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)

    with pytest.raises(ValueError, match="outer draws were non-finite"):
        Ladder([1.0, 2.0]).with_log_partition(
            bad, KEY, jnp.zeros(2), exclude="penalty", num_samples=16, method="prior"
        )


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.floats(1e-3, 5.0), min_size=0, max_size=8),
    raw=st.lists(st.floats(0.01, 1.0), min_size=9, max_size=9),
)
def test_any_increasing_ladder_from_one_is_valid_and_shuffles_are_not(steps, raw):
    temps = np.concatenate([[1.0], 1.0 + np.cumsum(steps)])
    weights = np.asarray(raw[: temps.size]) / np.sum(raw[: temps.size])
    lad = Ladder(temps, weights)
    np.testing.assert_allclose(lad.weights.sum(), 1.0)
    assert lad.num_temperatures == temps.size
    if temps.size > 1:
        with pytest.raises(ValueError):
            Ladder(temps[::-1], weights)


# ---------------------------------------------------------------------------------------
# Trust diagnostics are kept and shown.
def scale_model(x):  # the per-element normaliser depends on the global s: MC over s
    s = numpyro.sample("s", dist.LogNormal(0.2, 0.3))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(0.0, s), obs=x)


def test_ladder_keeps_and_shows_the_diagnostics_of_an_untrusted_estimate():
    with pytest.warns(UserWarning, match=r"cannot be trusted at T = \[.*10\.0\]"):
        lad = Ladder([1.0, 2.0, 10.0]).with_log_partition(
            scale_model, KEY, jnp.zeros(200), method="prior"
        )
    assert lad.num_samples == 100 and lad.ess[0] == pytest.approx(100.0)
    assert np.all(lad.ess[1:] < 2) and np.all(lad.pareto_k[1:] > 0.7)
    assert lad.flagged.tolist() == [False, True, True]
    text = repr(lad)
    assert "stderr=[" in text and "ess=[" in text and "pareto_k=[" in text
    assert "UNTRUSTED at T=[ 2., 10.]" in text
    table = lad.summary().splitlines()
    assert table[0].split() == [
        "T", "weight", "log_c", "stderr", "ess", "stages", "pareto_k", "flagged"
    ]
    assert [row.split()[-1] for row in table[1:]] == ["no", "YES", "YES"]
    # pytree: the diagnostics travel with the ladder
    back = jax.tree.unflatten(*reversed(jax.tree.flatten(lad)))
    np.testing.assert_array_equal(back.ess, lad.ess)
    assert back.num_samples == 100 and back.flagged.tolist() == lad.flagged.tolist()


def test_closed_form_ladder_is_not_flagged_and_diagnostics_need_log_c():
    lad = Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0])
    assert lad.flagged.tolist() == [False, False] and "UNTRUSTED" not in repr(lad)
    with pytest.raises(ValueError, match="`ess` given without `log_c`"):
        Ladder([1.0, 2.0], ess=[1.0, 1.0], num_samples=4)
    with pytest.raises(ValueError, match="`ess` needs `num_samples`"):
        Ladder([1.0, 2.0], log_c=[0.0, 1.0], ess=[1.0, 1.0])


# ---------------------------------------------------------------------------------------
# Sizes: recorded always by with_log_partition; a ladder without them is refused by the
# check (UNCHECKED opts out explicitly).
def test_a_ladder_without_sizes_does_not_skip_the_check():
    sizes = model_sizes(model, jnp.zeros(4))
    with pytest.raises(ValueError, match="does not record the model sizes"):
        Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0]).check_sizes(sizes)
    Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0], sizes=UNCHECKED).check_sizes(sizes)
    with pytest.raises(TypeError, match="`sizes` must be a ModelSizes, UNCHECKED or None"):
        Ladder([1.0, 2.0], log_c=[0.0, 1.0], sizes="yes")


# ---------------------------------------------------------------------------------------
# Per-element log c_n.
def test_element_log_partition_values_and_validation():
    elements = np.array([[0.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    sizes = model_sizes(model, jnp.zeros(3))
    lad = Ladder([1.0, 2.0]).with_log_partition_values(
        element_log_c=elements, plate="data", sizes=sizes
    )
    np.testing.assert_allclose(lad.log_c, [0.0, 1.0])
    assert "element_log_c=(plate 'data', N=3)" in repr(lad)
    lad.require_element_log_partition("data")
    with pytest.raises(ValueError, match="for plate 'data', not 'docs'"):
        lad.require_element_log_partition("docs")
    with pytest.raises(ValueError, match="needs each element's own log c_n"):
        Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.0]).require_element_log_partition(
            "data"
        )
    with pytest.raises(ValueError, match="must add up to `log_c`"):
        Ladder([1.0, 2.0]).with_log_partition_values([0.0, 2.0], element_log_c=elements,
                                                     plate="data")
    with pytest.raises(ValueError, match="needs `plate`"):
        Ladder([1.0, 2.0]).with_log_partition_values(element_log_c=elements)
    with pytest.raises(ValueError, match=r"shape \(M, N\) = \(2, N\)"):
        Ladder([1.0, 2.0]).with_log_partition_values(element_log_c=elements[:1].T.repeat(2, 1),
                                                     plate="data")
    with pytest.raises(ValueError, match="has 3 elements but plate 'data' has 4"):
        Ladder([1.0, 2.0]).with_log_partition_values(
            element_log_c=elements, plate="data", sizes=model_sizes(model, jnp.zeros(4))
        )
    with pytest.raises(ValueError, match="`plate` given without `element_log_c`"):
        Ladder([1.0, 2.0], log_c=[0.0, 1.0], plate="data")


def test_with_log_partition_on_a_plate_stores_the_per_element_values():
    x = jnp.zeros(4)
    lad = Ladder([1.0, 3.0]).with_log_partition(model, KEY, x, num_samples=4, plate="data")
    exact = normal_log_z(lad.temperatures[:, None], 0.5)
    np.testing.assert_allclose(lad.element_log_c, np.repeat(exact, 4, axis=1), atol=1e-5)
    assert lad.plate == "data"
    assert Ladder([1.0, 3.0]).with_log_partition(model, KEY, x, num_samples=4).plate is None

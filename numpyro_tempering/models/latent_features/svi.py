r"""Stochastic (and batch) VI for the latent feature model: four local schemes, three temperings.

A *scheme* is a local step (:mod:`~numpyro_tempering.models.latent_features.local`) plus
where its globals come from (Shah et al., supplement, "Variational Inference Schemes"):

* ``mimno``: Gibbs sweeps on :math:`q_{\rm Mimno}`, the local conditional under the
  moments of q;
* ``mf_ssvi``: the mean-field local ELBO (L-BFGS) at one sample :math:`\beta^{(t)}\sim q`;
* ``titsias_ssvi``: the Titsias local ELBO (L-BFGS) at one sample of q;
* ``gibbs_ssvi``: Gibbs sweeps on the true local conditional at one sample of q;
* ``batch_mf``: batch mean-field VI, closed-form CAVI of all locals under the moments of q.

The SVI schemes visit minibatches of ``batch_size`` points in a random order every pass and
take the natural-gradient step :func:`~numpyro_tempering.models.latent_features.conjugate
.global_step` with :math:`\rho_t = (t + \tau)^{-\kappa}`; ``batch_mf`` does one CAVI update
of every block per pass (locals warm-started from the previous pass).

Tempering (Mandt et al. 2016, Algorithm 1), ``tempering=``:

* ``"none"``: T = 1.
* ``"annealed"``: :math:`T_t` from :func:`numpyro_tempering.schedules.linear` (``t_start``
  to 1 over the first ``anneal_fraction`` of the steps); the local step targets the local
  joint to the power :math:`1/T_t` (eq. 17) and the global statistics are divided by
  :math:`T_t` (eq. 16).
* ``"mvi"``: one temperature per data point. Each point keeps its
  :math:`\bar\beta_i = \mathbb{E}_{q(y_i)}[1/T_{y_i}]` (initially that of the uniform
  :math:`q(y)`, as the paper). When visited: local step at :math:`\bar\beta_i` (eq. 17),
  global step with statistics weighted by :math:`\bar\beta_i` (eq. 16), then :math:`q(y_i)`
  by eq. 18 from :math:`\ell_i = \mathbb{E}[\log p(y_i, \psi_i\mid\beta)]` -- computed by
  :func:`numpyro_tempering.temperatures.temperature_posterior` -- in the order of
  Algorithm 1 (local, global, temperature).

Which log C for MVI
-------------------
With Gamma priors on the precisions, the globally normalised multicanonical joint (eq. 10)
does not exist: :math:`C(T) = \int p(\beta)\prod_i c(T,\beta)\,d\beta` with
:math:`c(T,\beta) \propto \gamma_{obs}^{-D(1-1/T)/2}\gamma_w^{-K(1-1/T)/2}` (the tempered
Gaussians' normalisers) diverges at :math:`\gamma \to 0` as soon as
:math:`N D (1 - 1/T)/2 \ge a_{obs}`, i.e. for every T > 1 at any realistic N. We therefore
use the *locally normalised* multicanonical joint
:math:`p(\beta)\prod_i p(y_i,\psi_i\mid\beta)^{1/T_i}/c(T_i, \beta)`, a proper model for
every temperature assignment, whose mean-field update of :math:`q(y_i)` is eq. 18 with
:math:`\log C(T_m)/N` replaced by :math:`\mathbb{E}_q[\log c(T_m, \beta)]`
(:func:`~numpyro_tempering.models.latent_features.conjugate.local_log_partition`, closed
form), passed to ``temperature_posterior`` as every point's :math:`\log c_i(T_m)` and
rebuilt at every step from the current moments.
With a well-fitting point, :math:`\ell_i/T - \log c(T)` is maximised at T = 1; a point with
normalised squared residual :math:`r > 1` prefers :math:`T \approx r`.

Everything for a scheme runs in one ``jax.jit`` (:func:`make_fit`): passes and steps in
``lax.scan``, the tempering mode, the data and the key are arguments, so the three temperings
and all seeds share one compilation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax, random

from numpyro_tempering import schedules
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.models.latent_features.conjugate import (
    GlobalParams,
    expected_moments,
    global_step,
    global_target,
    local_log_partition,
    point_moments,
    sample_globals,
    sufficient_sums,
)
from numpyro_tempering.models.latent_features.local import (
    LocalStats,
    MeanFieldParams,
    expected_log_lik,
    gibbs_local_stats,
    mean_field_cavi,
    mean_field_init,
    mean_field_local_stats,
    titsias_local_stats,
)
from numpyro_tempering.models.latent_features.model import DEFAULT_PRIOR, Prior, check_prior
from numpyro_tempering.temperatures import temperature_posterior

__all__ = [
    "SCHEMES",
    "TEMPERINGS",
    "FitResult",
    "annealing_temperatures",
    "Settings",
    "fit",
    "local_step",
    "make_fit",
    "mvi_update",
    "step_size",
]

#: scheme -> (local step, globals seen by the local step)
SCHEMES: dict[str, tuple[str, str]] = {
    "mimno": ("gibbs", "expected"),
    "mf_ssvi": ("mean_field", "sampled"),
    "titsias_ssvi": ("titsias", "sampled"),
    "gibbs_ssvi": ("gibbs", "sampled"),
    "batch_mf": ("cavi", "expected"),
}
#: the tempering modes, in the order of their integer codes
TEMPERINGS: tuple[str, ...] = ("none", "annealed", "mvi")


@dataclass(frozen=True)
class Settings:
    """Algorithm settings (hashable: a static argument of the compiled fit).

    ``batch_size``: SVI minibatch; ``num_passes``: passes over the data; ``step_delay``,
    ``step_power``: :math:`\\rho_t = (t + \\tau)^{-\\kappa}`; ``num_sweeps``, ``burn_in``:
    Gibbs; ``local_steps``: L-BFGS iterations on the local ELBOs; ``cavi_sweeps``: batch
    MF's coordinate sweeps per pass; ``t_start``, ``anneal_fraction``: the linear annealing
    schedule; ``ladder_max``, ``ladder_size``: MVI's geometric ladder (1 .. ``ladder_max``).
    """

    batch_size: int = 100
    num_passes: int = 20
    step_delay: float = 1.0
    step_power: float = 0.7
    num_sweeps: int = 10
    burn_in: int = 5
    local_steps: int = 20
    cavi_sweeps: int = 3
    t_start: float = 2.0
    anneal_fraction: float = 0.5
    ladder_max: float = 10.0
    ladder_size: int = 30

    def ladder(self) -> Ladder:
        """MVI's ladder: ``Ladder.geometric(1, ladder_max, ladder_size)`` (uniform weights)."""
        return Ladder.geometric(1.0, self.ladder_max, self.ladder_size)


class FitResult(NamedTuple):
    """``params``: final q over the globals; ``temperature`` (P,): per pass, the mean over
    its steps of the average temperature :math:`1/\\bar\\beta` used; ``inv_temperature``
    (N,): the final per-point :math:`\\bar\\beta_i` (MVI; ones otherwise)."""

    params: GlobalParams
    temperature: jax.Array
    inv_temperature: jax.Array


def step_size(step: jax.typing.ArrayLike, settings: Settings) -> jax.Array:
    """:math:`\\rho_t = (t + \\tau)^{-\\kappa}` (Hoffman et al.'s Robbins-Monro schedule).

    Example:
        >>> float(step_size(0, Settings(step_delay=1.0)))
        1.0
    """
    return (jnp.asarray(step, jnp.result_type(float)) + settings.step_delay) ** (
        -settings.step_power
    )


def local_step(
    scheme: str,
    rng_key: jax.Array,
    y: jax.Array,
    q: GlobalParams,
    inv_temperature: jax.typing.ArrayLike,
    settings: Settings = Settings(),
):
    """The local step of an SVI ``scheme`` on a minibatch: ``(stats, moments)``, where
    ``moments`` are what the local step saw (under q, or of one sample) and what the global
    step must use for the other blocks.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import init_params
        >>> y = jnp.ones((4, 3))
        >>> q = init_params(jax.random.PRNGKey(0), y, 2)
        >>> stats, m = local_step("gibbs_ssvi", jax.random.PRNGKey(1), y, q, 1.0)
        >>> stats.uu.shape
        (4, 2, 2)
    """
    if scheme not in SCHEMES or scheme == "batch_mf":
        raise ValueError(
            f"`scheme` must be one of {[s for s in SCHEMES if s != 'batch_mf']} for an SVI "
            f"local step, got {scheme!r}."
        )
    kind, source = SCHEMES[scheme]
    k_sample, k_local = random.split(rng_key)
    if source == "expected":
        moments = expected_moments(q)
    else:
        moments = point_moments(sample_globals(k_sample, q))
    if kind == "gibbs":
        stats = gibbs_local_stats(k_local, y, moments, inv_temperature,
                                  num_sweeps=settings.num_sweeps, burn_in=settings.burn_in)
    elif kind == "mean_field":
        stats = mean_field_local_stats(y, moments, inv_temperature,
                                       num_steps=settings.local_steps)
    else:
        stats = titsias_local_stats(y, moments, inv_temperature, num_steps=settings.local_steps)
    return stats, moments


def mvi_update(
    y: jax.Array,
    stats: LocalStats,
    moments,
    ladder: Ladder,
) -> jax.Array:
    r"""New :math:`\bar\beta_i = \mathbb{E}_{q(y_i)}[1/T]` per point by eq. 18 (Mandt et al.
    2016), via :func:`~numpyro_tempering.temperatures.temperature_posterior`:
    :math:`q(y_i = m) \propto \pi_m \exp\{\ell_i/T_m - \mathbb{E}\log c(T_m,\beta)\}`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_tempering.models.latent_features import init_params
        >>> y = jnp.ones((4, 3))
        >>> q = init_params(jax.random.PRNGKey(0), y, 2)
        >>> stats, m = local_step("mimno", jax.random.PRNGKey(1), y, q, 1.0)
        >>> mvi_update(y, stats, m, Settings().ladder()).shape
        (4,)
    """
    ell = expected_log_lik(y, stats, moments)  # (B,)
    temps = jnp.asarray(ladder.temperatures, y.dtype)
    log_c = local_log_partition(temps, moments, y.shape[-1])  # (M,), the same for every point
    posterior = temperature_posterior(ell[:, None] / temps, ladder, log_c=log_c)
    return posterior.mean_inverse_temperature


class _State(NamedTuple):
    q: GlobalParams
    inv_temperature: jax.Array  # (N,) MVI's per-point E[1/T]
    local: MeanFieldParams  # batch_mf's warm start (N, K) (dummy (N, 1) otherwise)
    step: jax.Array


def _mode(tempering: str) -> int:
    if tempering not in TEMPERINGS:
        raise ValueError(f"`tempering` must be one of {TEMPERINGS}, got {tempering!r}.")
    return TEMPERINGS.index(tempering)


def _inverse_temperature(mode, temperature, per_point):
    """1, 1/T_t or the per-point E[1/T], selected by the traced tempering code."""
    one = jnp.ones_like(per_point)
    annealed = one / temperature
    return jnp.where(mode == 0, one, jnp.where(mode == 1, annealed, per_point))


def make_fit(
    scheme: str,
    num_data: int,
    num_features: int,
    prior: Prior = DEFAULT_PRIOR,
    settings: Settings = Settings(),
):
    """The compiled fit of ``scheme``:
    ``run(key, y, q0, tempering_code, temperatures, ladder) -> FitResult``.

    ``tempering_code`` is ``TEMPERINGS.index(tempering)``; ``temperatures`` (one per step,
    :func:`annealing_temperatures`) is the annealing schedule; ``ladder`` is MVI's
    :class:`~numpyro_tempering.ladder.Ladder` (a pytree: same number of rungs, any values).
    All of them are traced arguments, so one compilation serves the three temperings, every
    schedule and every seed. ``y``: (``num_data``, D). :func:`fit` does all of this for one
    call.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"`scheme` must be one of {list(SCHEMES)}, got {scheme!r}.")
    check_prior(prior)
    n, k = int(num_data), int(num_features)
    batch = _batch_size(scheme, n, settings)
    steps_per_pass = n // batch

    def svi_step(y_all, mode, ladder, state: _State, inputs):
        idx, key, temperature = inputs
        y = y_all[idx]
        beta = _inverse_temperature(mode, temperature, state.inv_temperature[idx])
        stats, moments = local_step(scheme, key, y, state.q, beta, settings)
        rho = step_size(state.step, settings)
        q = global_step(state.q, prior, y, stats, moments, (n / batch) * beta, rho)
        new_beta = mvi_update(y, stats, moments, ladder)
        inv_t = state.inv_temperature.at[idx].set(new_beta)
        state = _State(q, inv_t, state.local, state.step + 1)
        return state, jnp.mean(1.0 / beta)

    def batch_step(y, mode, ladder, state: _State, temperature):
        moments = expected_moments(state.q)
        beta = _inverse_temperature(mode, temperature, state.inv_temperature)
        stats, local = mean_field_cavi(y, moments, beta, state.local,
                                       num_sweeps=settings.cavi_sweeps)
        q = global_step(state.q, prior, y, stats, moments, beta, 1.0)
        # block coordinate ascent: gamma_obs given the *new* q(Phi)
        fresh = expected_moments(q)
        sums = sufficient_sums(y, stats, fresh, beta)
        target = global_target(prior, sums, fresh, k, y.shape[-1])
        q = q._replace(obs_shape=target.obs_shape, obs_rate=target.obs_rate)
        new_beta = mvi_update(y, stats, moments, ladder)
        state = _State(q, new_beta, local, state.step + 1)
        return state, jnp.mean(1.0 / beta)

    def run(rng_key, y, q0, mode, temperatures, ladder):
        y = jnp.asarray(y)
        if y.shape[0] != n:
            raise ValueError(f"`y` has {y.shape[0]} rows, the fit was built for N = {n}.")
        dtype = y.dtype
        temperatures = jnp.asarray(temperatures, dtype)
        if temperatures.shape != (steps_per_pass * settings.num_passes,):
            raise ValueError(
                f"`temperatures` must have one entry per step, shape "
                f"({steps_per_pass * settings.num_passes},), got {temperatures.shape}."
            )
        if scheme == "batch_mf":
            local0 = mean_field_init(y, expected_moments(q0))
        else:
            local0 = MeanFieldParams(*(jnp.zeros((n, 1), dtype),) * 3)
        inv_t0 = jnp.sum(jnp.asarray(ladder.weights, dtype) / jnp.asarray(ladder.temperatures,
                                                                          dtype))
        state = _State(q0, jnp.full((n,), inv_t0, dtype), local0, jnp.zeros((), jnp.int32))
        per_pass = temperatures.reshape(settings.num_passes, steps_per_pass)

        def one_pass(state, inputs):
            key, temps = inputs
            k_perm, k_steps = random.split(key)
            if scheme == "batch_mf":
                return batch_step(y, mode, ladder, state, temps[0])
            perm = random.permutation(k_perm, n)[: steps_per_pass * batch]
            idx = perm.reshape(steps_per_pass, batch)
            keys = random.split(k_steps, steps_per_pass)
            state, used = lax.scan(lambda s, x: svi_step(y, mode, ladder, s, x), state,
                                   (idx, keys, temps))
            return state, jnp.mean(used)

        keys = random.split(rng_key, settings.num_passes)
        state, used = lax.scan(one_pass, state, (keys, per_pass))
        return FitResult(state.q, used, state.inv_temperature)

    return jax.jit(run)


def _batch_size(scheme: str, num_data: int, settings: Settings) -> int:
    batch = num_data if scheme == "batch_mf" else int(settings.batch_size)
    if not 1 <= batch <= num_data:
        raise ValueError(f"`settings.batch_size` must be in [1, N = {num_data}], got {batch}.")
    return batch


def annealing_temperatures(scheme: str, num_data: int, settings: Settings = Settings()):
    """The annealed temperature of every step: :func:`numpyro_tempering.schedules.linear`
    from ``t_start`` to 1 over the first ``anneal_fraction`` of the steps (one step per pass
    for ``batch_mf``), evaluated with :func:`numpyro_tempering.schedules.trajectory`.

    Example:
        >>> annealing_temperatures("mimno", 100, Settings(batch_size=50, num_passes=2,
        ...                                               t_start=3.0)).tolist()
        [3.0, 2.0, 1.0, 1.0]
    """
    steps = (num_data // _batch_size(scheme, num_data, settings)) * settings.num_passes
    anneal_steps = max(1, int(round(settings.anneal_fraction * steps)))
    schedule = schedules.linear(settings.t_start, 1.0, anneal_steps)
    return schedules.trajectory(schedule, steps)


def fit(
    rng_key: jax.Array,
    y: jax.typing.ArrayLike,
    scheme: str,
    tempering: str = "none",
    q0: GlobalParams | None = None,
    *,
    num_features: int | None = None,
    prior: Prior = DEFAULT_PRIOR,
    settings: Settings = Settings(),
) -> FitResult:
    """Fit q over the globals with ``scheme`` and ``tempering`` (builds and runs
    :func:`make_fit`; give ``q0`` or ``num_features`` for a data-driven start).

    Example:
        >>> import jax
        >>> from numpyro_tempering.models.latent_features import make_toy_data, fit
        >>> from numpyro_tempering.models.latent_features.svi import Settings
        >>> y = make_toy_data(jax.random.PRNGKey(0), 40).y
        >>> res = fit(jax.random.PRNGKey(1), y, "batch_mf", "annealed", num_features=4,
        ...           settings=Settings(num_passes=4, t_start=3.0))
        >>> res.temperature.tolist(), res.params.phi_shift.shape  # T per pass
        ([3.0, 2.0, 1.0, 1.0], (4, 36))
    """
    from numpyro_tempering.models.latent_features.conjugate import init_params

    y = jnp.asarray(y)
    if y.ndim != 2:
        raise ValueError(f"`y` must have shape (N, D), got {y.shape}.")
    mode = _mode(tempering)
    k_init, k_fit = random.split(rng_key)
    if q0 is None:
        if num_features is None:
            raise ValueError("give `q0` or `num_features`.")
        q0 = init_params(k_init, y, num_features, prior)
    run = make_fit(scheme, y.shape[0], q0.num_features, prior, settings)
    temperatures = annealing_temperatures(scheme, y.shape[0], settings)
    return run(k_fit, y, q0, jnp.asarray(mode, jnp.int32), temperatures, settings.ladder())

r"""Tempered log-partition functions :math:`\log C(T)` of any NumPyro model, over a ladder.

The tempered joint of annealed VI (annealed-and-multicanonical-vi, eq. 4) is
:math:`p(\beta)\, p(x, z \mid \beta)^{1/T} / C(T)`, with (variational-tempering supplement,
eq. 1)

.. math::

    C(T) = \int d\beta\, p(\beta) \prod_{n=1}^N \int dx_n\, dz_n\, p(x_n, z_n \mid \beta)^{1/T}.

Annealed VI can ignore :math:`C(T)`; multicanonical VI cannot (eq. 13 and 18): it needs
:math:`\log C(T_m)` for every temperature of its ladder. This module estimates it for any
model, vectorised over the whole ladder, reading the model's structure from its trace:

* **Which factors are tempered**: the sites a :class:`~numpyro_tempering.temper` handler
  selects (``sites`` / ``latent`` / ``exclude``, default: every observed site). The model is
  run under ``temper(model, 1.0, ...)``, which only *marks* them.
* **Tempered sites are integrated in closed form** with the registry of
  :mod:`numpyro_tempering.partition`: a tempered *observed* site contributes
  :math:`\log Z_x(T) = \log\int p(x \mid \text{parents})^{1/T} dx`; a tempered *latent* site
  :math:`z` contributes :math:`\log Z_z(T)` given its parents and is then **drawn from its
  normalised tempered law** :math:`p(z \mid \cdot)^{1/T} / Z_z`, so that its children are
  integrated conditionally on it. This is exact in expectation, because
  :math:`\int p(z)^{1/T} f(z)\, dz = Z_z(T)\, \mathbb{E}_{p^{1/T}/Z_z}[f(z)]`.
* **Untempered latent sites are drawn from the prior** (supplement eq. 2-3: the globals
  :math:`\beta \sim p(\beta)`; and, for LDA, the per-document :math:`\theta_d \sim p(\theta)`,
  eq. 7). An untempered *observed* site (e.g. a prior penalty written as ``numpyro.factor``
  and left out with ``exclude``) is an importance weight :math:`e^{\log p}`.
* **Nested per-plate averaging** (supplement eq. 7): with ``plate="data"`` the latent sites
  outside the plate are *globals* (one draw per outer sample :math:`s`) and those inside it
  are *locals*, redrawn ``num_inner`` times (:math:`k`) independently for every element
  :math:`n` given the globals. With :math:`a_{skn}(T)` the log contribution of element
  :math:`n` (sum of the log normalisers and weights of its sites),

  .. math::

      \log \hat C(T) = \log \frac{1}{S}\sum_s \exp\Big\{\sum_n \log\frac{1}{K}\sum_k
          e^{a_{skn}(T)}\Big\}.

  Given the globals the elements are independent, so the product over :math:`n` of the
  inner means is an unbiased estimate of :math:`\prod_n \mathbb{E}_{z_n}[\cdot]`, and
  :math:`\hat C(T)` is unbiased for :math:`C(T)` (its log is not: the usual Jensen gap,
  which the reported standard error measures). With ``plate=None`` the whole model is one
  element: untempered latents are the globals and the tempered latents are redrawn
  ``num_inner`` times.

Every temperature uses the same random numbers (common random numbers), so the estimated
:math:`\log C(T)` is a smooth function of :math:`T`. :math:`C(1) = 1` for a normalised model
(everything integrates to one), which the estimator reproduces exactly when all tempered
sites are integrated in closed form.

:math:`\log C` depends on the model's *structure and sizes* only, not on the data values:
call the model with data of the right shape (the values are never read, except by
untempered observed sites). Subsampled plates are extrapolated by their scale ``N/B``
(each site's ``scale`` is a multiplicity: the log normaliser is multiplied by it, it is not
part of the power ``1/T``); for an exact value run the model on the full plate.

Also here: the analytic (MAP) approximation of supplement eq. 4 (globals at their prior
mean), the two Jensen bounds of supplement eq. 8, and :class:`ModelSizes`, the sizes a
log C was computed for (checked by the multicanonical objective and handler).

Example:
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro_tempering.log_partition import log_partition
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with numpyro.plate("data", x.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> est = log_partition(jax.random.PRNGKey(0), model, jnp.array([1.0, 4.0]), jnp.zeros(3))
    >>> # closed form: N [(1 - 1/T)/2 log(2 pi) + 1/2 log T]
    >>> [round(float(v), 4) for v in est.log_c]
    [0.0, 4.1471]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.scipy.special import logsumexp
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from numpyro_tempering.engine import _element_log_lik
from numpyro_tempering.handlers import TEMPERED, temper
from numpyro_tempering.partition import Fallback, tempered

__all__ = [
    "JensenBounds",
    "LogPartitionEstimate",
    "ModelSizes",
    "analytic_log_partition",
    "jensen_bounds",
    "log_partition",
    "model_sizes",
]

Selection = str | Collection[str] | Callable[[dict], bool] | None


# -----------------------------------------------------------------------------------------
# Model sizes
# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSizes:
    """The sizes a log-partition function depends on (hashable, comparable).

    Attributes:
        plates: ``((name, full size), ...)`` for every plate of the model, sorted.
        sites: ``((name, shape), ...)`` for every tempered site, sorted; ``shape`` is the
            site's batch + event shape with subsampled plate dimensions restored to the full
            plate size.
    """

    plates: tuple[tuple[str, int], ...]
    sites: tuple[tuple[str, tuple[int, ...]], ...]

    def plate_size(self, name: str) -> int:
        """Full size of plate ``name`` (``ValueError`` naming the plates if unknown)."""
        sizes = dict(self.plates)
        if name not in sizes:
            raise ValueError(f"plate '{name}' is not in the model; its plates are {sorted(sizes)}.")
        return sizes[name]

    def check_matches(self, other: ModelSizes, what: str = "the ladder") -> None:
        """Raise ``ValueError`` describing every difference between ``self`` and ``other``.

        ``self`` is the model being fitted, ``other`` the sizes ``what`` was computed for.
        """
        if self == other:
            return
        problems = []
        for label, mine, theirs in (
            ("plate", dict(self.plates), dict(other.plates)),
            ("tempered site", dict(self.sites), dict(other.sites)),
        ):
            for name in sorted(set(mine) | set(theirs)):
                a, b = mine.get(name), theirs.get(name)
                if a != b:
                    problems.append(
                        f"{label} '{name}': model has {'none' if a is None else a}, "
                        f"{what} was computed for {'none' if b is None else b}"
                    )
        raise ValueError(
            f"{what} was computed for a different model size: " + "; ".join(problems) + ". "
            "Recompute log C for this model (log C depends on the plate sizes and on which "
            "sites are tempered)."
        )


def _full_shape(fn: Any, frames: list, plates: dict[str, int]) -> tuple[int, ...]:
    batch = list(fn.batch_shape)
    for frame in frames:
        idx = len(batch) + frame.dim
        if 0 <= idx < len(batch) and frame.name in plates:
            batch[idx] = plates[frame.name]
    return tuple(int(b) for b in batch) + tuple(int(e) for e in fn.event_shape)


def sizes_from_sites(plates: dict[str, int], sites: list[tuple[str, Any, list]]) -> ModelSizes:
    """:class:`ModelSizes` from full plate sizes and ``(name, fn, cond_indep_stack)`` triples."""
    return ModelSizes(
        plates=tuple(sorted((n, int(s)) for n, s in plates.items())),
        sites=tuple(sorted((n, _full_shape(fn, frames, plates)) for n, fn, frames in sites)),
    )


def _structure_trace(model: Callable, args: tuple, kwargs: dict) -> dict:
    """Trace of one prior run, for its structure only (shapes, plates, marks).

    Run under ``jax.eval_shape``: nothing is computed (or compiled); the values in the
    returned trace are abstract and must not be used.
    """
    out: dict = {}

    def run() -> None:
        out["trace"] = trace(seed(model, 0)).get_trace(*args, **kwargs)

    jax.eval_shape(run)
    return out["trace"]


def _sizes_from_trace(tr: dict) -> ModelSizes:
    plates = {n: int(s["args"][0]) for n, s in tr.items() if s["type"] == "plate"}
    sites = [
        (n, s["fn"], s["cond_indep_stack"])
        for n, s in tr.items()
        if s["type"] == "sample" and s["infer"].get(TEMPERED, False)
    ]
    return sizes_from_sites(plates, sites)


def model_sizes(
    model: Callable,
    *args: Any,
    sites: Selection = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    **kwargs: Any,
) -> ModelSizes:
    """The :class:`ModelSizes` of ``model`` with the given tempering selection.

    Traces the model once abstractly (``jax.eval_shape``: only shapes are read).

    Example:
        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> model_sizes(model, jnp.zeros(3))
        ModelSizes(plates=(('data', 3),), sites=(('x', (3,)),))
    """
    marked = temper(model, 1.0, sites=sites, latent=latent, exclude=exclude)
    return _sizes_from_trace(_structure_trace(marked, args, kwargs))


# -----------------------------------------------------------------------------------------
# The sampling handler
# -----------------------------------------------------------------------------------------


class _tempered_prior(Messenger):
    """Run a (marked) model drawing tempered latents from their tempered laws.

    At a site marked tempered: record ``scale * log Z(T)`` of its distribution given its
    parents and, if latent, replace its distribution by the normalised tempered one (the
    default sampler then draws from it). At an untempered observed site: record
    ``scale * log p(value)`` (an importance weight). Untempered latents are left alone (drawn
    from the prior, or substituted by an outer handler).
    """

    def __init__(self, fn: Callable, temperature: Any, fallback: Fallback = None) -> None:
        self.temperature = temperature
        self.fallback = fallback
        self.records: list[tuple[dict, jax.Array, bool]] = []
        self.plate_sizes: dict[str, int] = {}  # full sizes (frames only carry the subsample)
        super().__init__(fn)

    def __enter__(self):
        self.records = []
        self.plate_sizes = {}
        return super().__enter__()

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "plate":
            self.plate_sizes[msg["name"]] = msg["args"][0]
        if msg["type"] != "sample":
            return
        is_tempered = bool(msg["infer"].get(TEMPERED, False))
        fn = msg["fn"]
        if is_tempered:
            try:
                contribution, law = tempered(fn, self.temperature, fallback=self.fallback)
            except NotImplementedError as err:
                raise NotImplementedError(
                    f"log C: cannot temper site '{msg['name']}' ({type(fn).__name__}): {err}"
                ) from err
            if not msg["is_observed"]:
                msg["fn"] = law
        elif msg["is_observed"]:
            contribution = fn.log_prob(msg["value"])
        else:
            return
        scale = msg.get("scale")
        if scale is not None:
            contribution = scale * contribution
        site = {"name": msg["name"], "fn": fn, "cond_indep_stack": list(msg["cond_indep_stack"])}
        self.records.append((site, contribution, is_tempered))


class _prior_mean(Messenger):
    """Set the given latent sites to the mean of their (prior) distribution."""

    def __init__(self, fn: Callable, is_global: Callable[[dict], bool]) -> None:
        self.is_global = is_global
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg["is_observed"] or not self.is_global(msg):
            return
        fn = msg["fn"]
        if fn.support.is_discrete:
            raise ValueError(
                f"analytic_log_partition: global site '{msg['name']}' is discrete "
                f"({type(fn).__name__}); its prior mean is not a value of the site. Use "
                "log_partition (Monte Carlo over the globals) instead."
            )
        msg["value"] = jnp.broadcast_to(fn.mean, fn.shape())


# -----------------------------------------------------------------------------------------
# Structure
# -----------------------------------------------------------------------------------------


def _in_plate(site: dict, plate: str | None) -> bool:
    return plate is not None and any(f.name == plate for f in site["cond_indep_stack"])


def _global_rule(plate: str | None) -> Callable[[dict], bool]:
    """Whether a latent site is a global (drawn once per outer sample)."""
    if plate is None:
        return lambda msg: not msg["infer"].get(TEMPERED, False)
    return lambda msg: not _in_plate(msg, plate)


def _probe(marked: Callable, args: tuple, kwargs: dict, plate: str | None) -> ModelSizes:
    """Validate the structure of the marked model and return its sizes."""
    tr = _structure_trace(marked, args, kwargs)
    plates = sorted(n for n, s in tr.items() if s["type"] == "plate")
    if plate is not None:
        if plate not in plates:
            raise ValueError(f"plate '{plate}' is not in the model; its plates are {plates}.")
        outside = [
            n
            for n, s in tr.items()
            if s["type"] == "sample" and s["infer"].get(TEMPERED, False) and not _in_plate(s, plate)
        ]
        if outside:
            raise ValueError(
                f"tempered site(s) {outside} are not inside plate '{plate}': nested averaging "
                "over a plate needs every tempered site in that plate (use plate=None)."
            )
    return _sizes_from_trace(tr)


def _marked(model: Callable, sites: Selection, latent: Any, exclude: Any) -> Callable:
    return temper(model, 1.0, sites=sites, latent=latent, exclude=exclude)


def _check_temperatures(temperatures: Any) -> jax.Array:
    temps = np.asarray(temperatures, dtype=np.float64)
    if temps.ndim == 0:
        temps = temps[None]
    if temps.ndim != 1 or temps.size == 0:
        raise ValueError(
            f"`temperatures` must be a non-empty 1-D array, got shape {np.shape(temperatures)}."
        )
    if not np.all(np.isfinite(temps) & (temps > 0)):
        raise ValueError(f"`temperatures` must be finite and > 0, got {temps}.")
    return jnp.asarray(temps, dtype=jnp.result_type(float))


def _check_count(value: int, name: str, minimum: int = 1) -> int:
    if int(value) != value or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


# -----------------------------------------------------------------------------------------
# Nested Monte Carlo
# -----------------------------------------------------------------------------------------


def _contributions(
    marked: Callable,
    temperature: jax.Array,
    key: jax.Array,
    fixed: dict,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    fallback: Fallback,
) -> tuple[jax.Array, jax.Array]:
    """One inner draw at one T: per-element log contributions ``(E,)``, the rest ``()`` and
    the plate's subsampling multiplicity N/B.

    The element contributions are returned *without* the multiplicity N/B of a subsampled
    plate: the nested estimate is (N/B) sum_n log mean_k exp(a_kn), and scaling inside the
    inner log-mean-exp would estimate log E[exp((N/B) a)] instead.
    """
    handler = _tempered_prior(marked, temperature, fallback)
    substitute(seed(handler, key), data=fixed)(*args, **kwargs)
    zero = jnp.zeros((), temperature.dtype)
    elements, rest, multiplicity = zero, zero, jnp.ones((), temperature.dtype)
    for site, value, _ in handler.records:
        if _in_plate(site, plate):
            per_element = _element_log_lik(site, value, plate)
            size = handler.plate_sizes[plate]
            multiplicity = jnp.asarray(size / per_element.shape[-1], temperature.dtype)
            elements = elements + per_element / multiplicity
        elif plate is None:
            elements = elements + jnp.sum(value)
        else:
            rest = rest + jnp.sum(value)
    return jnp.atleast_1d(elements), rest, multiplicity


def _fixed_values(
    marked: Callable, key: jax.Array, args: tuple, kwargs: dict, plate: str | None, at_mean: bool
) -> dict:
    """The outer draw: values of the global latents (and the plates' subsample indices)."""
    is_global = _global_rule(plate)
    fn = _prior_mean(marked, is_global) if at_mean else marked
    tr = trace(seed(fn, key)).get_trace(*args, **kwargs)
    fixed = {}
    for name, site in tr.items():
        if site["type"] == "plate":
            fixed[name] = site["value"]
        elif site["type"] == "sample" and not site["is_observed"] and is_global(site):
            fixed[name] = site["value"]
    return fixed


def _log_mean_exp(x: jax.Array, axis: int) -> jax.Array:
    return logsumexp(x, axis=axis) - math.log(x.shape[axis])


class _Draw(NamedTuple):
    log_c: jax.Array  # (M,) log C estimate given this outer draw
    mean_log: jax.Array  # (M,) sum_n mean_k a_kn (+ rest): for the E-log Jensen bound
    element_log_mean: jax.Array  # (M, E) log mean_k exp(a_kn)
    rest_log_mean: jax.Array  # (M,)


def _draws(
    rng_key: jax.Array,
    marked: Callable,
    temperatures: jax.Array,
    args: tuple,
    kwargs: dict,
    *,
    plate: str | None,
    num_samples: int,
    num_inner: int,
    batch_size: int | None,
    fallback: Fallback,
    at_mean: bool = False,
) -> _Draw:
    """All outer draws, each at every temperature: arrays with leading axis S."""

    def one(key: jax.Array) -> _Draw:
        key_outer, key_inner = random.split(key)
        fixed = _fixed_values(marked, key_outer, args, kwargs, plate, at_mean)

        def run(t: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            return _contributions(marked, t, k, fixed, args, kwargs, plate, fallback)

        inner_keys = random.split(key_inner, num_inner)
        # same inner keys at every temperature (common random numbers)
        el, rest, mult = jax.vmap(jax.vmap(run, (None, 0)), (0, None))(temperatures, inner_keys)
        mult = mult[0, 0]  # N/B, the same for every draw
        element_lme = mult * _log_mean_exp(el, axis=1)  # (M, E), scaled after the average
        rest_lme = _log_mean_exp(rest, axis=1)  # (M,)
        return _Draw(
            log_c=element_lme.sum(-1) + rest_lme,
            mean_log=mult * el.mean(1).sum(-1) + rest.mean(1),
            element_log_mean=element_lme,
            rest_log_mean=rest_lme,
        )

    keys = random.split(rng_key, num_samples)
    return lax.map(one, keys, batch_size=batch_size or num_samples)


def _prepare(
    model: Callable,
    temperatures: Any,
    args: tuple,
    kwargs: dict,
    plate: str | None,
    sites: Selection,
    latent: Any,
    exclude: Any,
) -> tuple[Callable, jax.Array, ModelSizes]:
    marked = _marked(model, sites, latent, exclude)
    temps = _check_temperatures(temperatures)
    sizes = _probe(marked, args, kwargs, plate)
    return marked, temps, sizes


# -----------------------------------------------------------------------------------------
# Public estimators
# -----------------------------------------------------------------------------------------


class LogPartitionEstimate(NamedTuple):
    r"""Monte Carlo estimate of :math:`\log C(T)` at every temperature of a ladder.

    Attributes:
        temperatures: ``(M,)``.
        log_c: ``(M,)`` the estimate :math:`\log \frac1S\sum_s \hat C_s(T)`.
        stderr: ``(M,)`` delta-method Monte Carlo standard error of ``log_c``:
            :math:`\mathrm{sd}(\hat C_s) / (\sqrt{S}\, \overline{\hat C_s})`.
        ess: ``(M,)`` Kish effective sample size of the outer draws
            :math:`(\sum_s \hat C_s)^2 / \sum_s \hat C_s^2` (a small ESS flags heavy tails,
            i.e. a standard error that is itself unreliable).
        num_nonfinite: ``(M,)`` number of outer draws whose log contribution is NaN or
            +inf. These are *not* dropped: ``log_c`` is then NaN/inf, and
            :class:`~numpyro_tempering.ladder.Ladder` refuses it.
        sizes: the :class:`ModelSizes` the estimate is for.
    """

    temperatures: jax.Array
    log_c: jax.Array
    stderr: jax.Array
    ess: jax.Array
    num_nonfinite: jax.Array
    sizes: ModelSizes


def _summarise(log_c_s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Estimate, delta-method SE, ESS and non-finite count from per-draw log C, shape (S, M)."""
    num = log_c_s.shape[0]
    bad = jnp.isnan(log_c_s) | (log_c_s == jnp.inf)
    log_c = logsumexp(log_c_s, axis=0) - math.log(num)
    top = jnp.max(log_c_s, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(log_c_s - top)  # relative weights C_s / max
    mean = w.mean(0)
    var = jnp.sum((w - mean) ** 2, axis=0) / (num - 1)
    stderr = jnp.sqrt(var / num) / mean
    ess = jnp.sum(w, 0) ** 2 / jnp.sum(w**2, 0)
    return log_c, stderr, ess, bad.sum(0)


def log_partition(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    num_samples: int = 100,
    num_inner: int = 1,
    plate: str | None = None,
    sites: Selection = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    batch_size: int | None = None,
    fallback: Fallback = None,
    **kwargs: Any,
) -> LogPartitionEstimate:
    r"""Generic Monte Carlo estimate of :math:`\log C(T)` (supplement eq. 2-3 and 7).

    See the module docstring for the estimator. The cost is
    ``num_samples * num_inner * M`` model runs (vectorised with ``vmap``; ``batch_size``
    outer samples at a time, to bound memory for large models).

    Args:
        rng_key: PRNG key.
        model: the *untempered* NumPyro model.
        temperatures: the ladder, shape ``(M,)`` (any positive values).
        *args: model arguments (data of the right shape; values are not read).
        **kwargs: model keyword arguments (likewise).
        num_samples: number S of outer draws of the globals (>= 2 for a standard error).
        num_inner: number K of inner draws of the locals per outer draw and element.
        plate: name of the plate whose elements are averaged separately (the data plate;
            eq. 7). ``None``: the whole model is one element.
        sites, latent, exclude: which sites are tempered, as in
            :class:`~numpyro_tempering.temper` (default: the observed sites).
        batch_size: outer draws evaluated at once (default: all).
        fallback: passed to :func:`~numpyro_tempering.partition.tempered` for
            distributions without a closed form (``"quadrature"`` or ``"enumerate"``).

    Returns:
        :class:`LogPartitionEstimate`.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):  # Bernoulli: C(T) = E_p[(p^(1/T) + (1 - p)^(1/T))^N]
        ...     p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> est = log_partition(jax.random.PRNGKey(0), model, jnp.array([1.0, 2.0]),
        ...                     jnp.zeros(5), num_samples=1000)
        >>> round(float(est.log_c[0]), 5), bool(est.stderr[1] < 0.01)
        (0.0, True)
    """
    num_samples = _check_count(num_samples, "num_samples", 2)
    num_inner = _check_count(num_inner, "num_inner")
    if batch_size is not None:
        batch_size = _check_count(batch_size, "batch_size")
    marked, temps, sizes = _prepare(
        model, temperatures, args, kwargs, plate, sites, latent, exclude
    )

    @jax.jit
    def run(key: jax.Array, temps: jax.Array) -> tuple[jax.Array, ...]:
        draws = _draws(
            key,
            marked,
            temps,
            args,
            kwargs,
            plate=plate,
            num_samples=num_samples,
            num_inner=num_inner,
            batch_size=batch_size,
            fallback=fallback,
        )
        return _summarise(draws.log_c)

    log_c, stderr, ess, bad = run(rng_key, temps)
    return LogPartitionEstimate(temps, log_c, stderr, ess, bad, sizes)


def analytic_log_partition(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    num_inner: int = 1,
    plate: str | None = None,
    sites: Selection = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    fallback: Fallback = None,
    **kwargs: Any,
) -> jax.Array:
    r"""Analytic (MAP-type) approximation of :math:`\log C(T)`, supplement eq. 4.

    The integral over the globals is replaced by its integrand at
    :math:`\beta^* = \mathbb{E}_{p}[\beta]`, the prior mean (set site by site, so a
    hierarchical global uses the means of its parents):

    .. math::

        \log C(T) \approx \sum_n \log \int dx_n\, dz_n\, p(x_n, z_n \mid \beta^*)^{1/T},

    which for a conditionally conjugate model is eq. 4,
    :math:`N\,(a_l(\beta^*/T) - a_l(\beta^*)/T)` (the printed eq. 4 has the sign flipped).
    Tempered sites are integrated in closed form; latent locals, if any, are still averaged
    by Monte Carlo (``num_inner`` draws, key ``rng_key``), so the result is deterministic
    when the locals are all integrated in closed form. Good for sharply peaked priors and
    large data; a discrete global is an error (its mean is not one of its values).
    Arguments as in :func:`log_partition`; returns an array of shape ``(M,)``.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     p = numpyro.sample("p", dist.Beta(2.0, 6.0))  # prior mean 1/4
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> approx = analytic_log_partition(jax.random.PRNGKey(0), model, jnp.array([2.0]),
        ...                                 jnp.zeros(5))
        >>> round(float(approx[0]), 5) == round(5 * float(jnp.log(0.25**0.5 + 0.75**0.5)), 5)
        True
    """
    num_inner = _check_count(num_inner, "num_inner")
    marked, temps, _ = _prepare(model, temperatures, args, kwargs, plate, sites, latent, exclude)

    @jax.jit
    def run(key: jax.Array, temps: jax.Array) -> jax.Array:
        draws = _draws(
            key,
            marked,
            temps,
            args,
            kwargs,
            plate=plate,
            num_samples=1,
            num_inner=num_inner,
            batch_size=None,
            fallback=fallback,
            at_mean=True,
        )
        return draws.log_c[0]

    return run(rng_key, temps)


class JensenBounds(NamedTuple):
    r"""The two Jensen bounds of supplement eq. 8, generalised to any model.

    With :math:`f_n = \exp a_n` the contribution of element :math:`n` (e.g. a document:
    :math:`(\sum_v (\sum_k \theta_k \beta_{kv})^{1/T})^{N_d}` for LDA):

    Attributes:
        mean_log: :math:`\mathbb{E}_{\beta}\sum_n \mathbb{E}_{z_n}[\log f_n]` (eq. 8, first
            line). A lower bound of :math:`\log C(T)`: Jensen for the concave log, twice.
        log_mean: :math:`\sum_n \log \mathbb{E}_{\beta, z_n}[f_n]` (eq. 8, second line).
            The supplement calls it an *upper* bound, but for exchangeable elements it is a
            **lower** bound too: :math:`C = \mathbb{E}_\beta[g(\beta)^N] \ge
            (\mathbb{E}_\beta\, g)^N` because :math:`x \mapsto x^N` is convex
            (:math:`g = \mathbb{E}_{z}f`); it is the tighter of the two
            (:math:`\log \mathbb{E} \ge \mathbb{E} \log`). Both equal :math:`\log C` when
            :math:`f_n` does not depend on the latents (e.g. Normal likelihoods with known
            scale).
        mean_log_stderr: Monte Carlo standard error of ``mean_log``.
    """

    mean_log: jax.Array
    log_mean: jax.Array
    mean_log_stderr: jax.Array


def jensen_bounds(
    rng_key: jax.Array,
    model: Callable,
    temperatures: jax.typing.ArrayLike,
    *args: Any,
    num_samples: int = 100,
    num_inner: int = 1,
    plate: str | None = None,
    sites: Selection = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    batch_size: int | None = None,
    fallback: Fallback = None,
    **kwargs: Any,
) -> JensenBounds:
    r"""Monte Carlo estimates of the Jensen bounds of supplement eq. 8 (see
    :class:`JensenBounds`; both are lower bounds of :math:`\log C(T)`).

    Same draws and arguments as :func:`log_partition`; memory ``O(S M E)`` for ``E``
    plate elements.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Bernoulli(p), obs=x)
        >>> key, temps = jax.random.PRNGKey(0), jnp.array([3.0])
        >>> b = jensen_bounds(key, model, temps, jnp.zeros(8), num_samples=2000, plate="data")
        >>> c = log_partition(key, model, temps, jnp.zeros(8), num_samples=2000, plate="data")
        >>> bool(b.mean_log[0] < b.log_mean[0] < c.log_c[0])
        True
    """
    num_samples = _check_count(num_samples, "num_samples", 2)
    num_inner = _check_count(num_inner, "num_inner")
    marked, temps, _ = _prepare(model, temperatures, args, kwargs, plate, sites, latent, exclude)

    @jax.jit
    def run(key: jax.Array, temps: jax.Array) -> JensenBounds:
        draws = _draws(
            key,
            marked,
            temps,
            args,
            kwargs,
            plate=plate,
            num_samples=num_samples,
            num_inner=num_inner,
            batch_size=batch_size,
            fallback=fallback,
        )
        log_s = math.log(num_samples)
        log_mean = (logsumexp(draws.element_log_mean, axis=0) - log_s).sum(-1) + (
            logsumexp(draws.rest_log_mean, axis=0) - log_s
        )
        mean_log = draws.mean_log.mean(0)
        se = draws.mean_log.std(0, ddof=1) / math.sqrt(num_samples)
        return JensenBounds(mean_log, log_mean, se)

    return run(rng_key, temps)

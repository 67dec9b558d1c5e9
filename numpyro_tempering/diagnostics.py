r"""How far can a bound on the evidence be trusted? The evidence sandwich, diagnosed with ArviZ.

:func:`evidence_bounds` estimates lower and upper bounds on the log evidence
:math:`\log Z = \log p(x)` for a fitted guide q, each from ``num_replicates`` independent
replicates at every sample size S in ``num_samples``, and says in plain language which of them
can be trusted (Pradier et al. 2019; "Pradier et al., eq. N" below). With
:math:`\log w = \log p(x, z) - \log q(z)`:

* ``elbo`` (lower): :math:`\frac1S \sum_s \log w_s`, :math:`z_s \sim q`;
* ``iwae`` (lower): :math:`\log \frac1S \sum_s w_s`, :math:`z_s \sim q`;
* ``cubo`` (upper): :math:`\frac1n \log \frac1S \sum_s w_s^n`, :math:`z_s \sim q`
  (Pradier et al., eq. 1; order n = ``cubo_order``, default 2);
* ``cubo_prior`` (upper): :math:`\frac1n \log \frac1S \sum_s p(x \mid z_s)^n
  \big(p(z_s)/q(z_s)\big)^{n-1}`, :math:`z_s \sim p(z)` (the prior-sampled sanity
  estimator, Pradier et al., eq. 2);
* ``klpq`` (upper): :math:`\frac1S \sum_s \log w(z_s)`, :math:`z_s \sim p(z \mid x)`
  (Pradier et al., eq. 3: :math:`\log Z + \mathrm{KL}(p \,\|\, q)`).

``cubo_prior`` is the same population quantity as ``cubo`` (for n = 2 exactly eq. 2;
in general :math:`\mathbb{E}_q[w^n] = \mathbb{E}_{p(z)}[p(x\mid z)^n (p(z)/q(z))^{n-1}]`)
estimated with draws from the prior; it is computed only on request (add it to ``bounds``).
The lower bounds hold in expectation (the estimates are stochastic lower bounds:
:math:`P(\widehat{\mathrm{IWAE}} > \log Z + t) \le e^{-t}`); the CUBO *estimates* are biased
low at finite S and can fall below :math:`\log Z` (the paper's main finding); KLpq is an
upper bound whenever its draws come from the exact posterior.

Computation
-----------

* The q draws come from :func:`numpyro_tempering.engine.log_weights` one particle at a time:
  particle i of replicate r at size S uses the key ``fold_in(fold_in(fold_in(k, S), r), i)``
  (k derived from ``rng_key``, one per stream), so the particles do not depend on
  ``chunk_size``, and adding a size to ``num_samples`` does not change the others.
* Particles are evaluated ``chunk_size`` at a time inside a ``lax.scan`` and reduced on the
  fly into running accumulators (sum, running max and rescaled sums for log-sum-exp of
  :math:`c \log w` for :math:`c \in \{1, n, 2, 2n\}`, non-finite counts, the largest
  log-weights for Pareto k-hat). Blocks of 256 particles are reduced first and folded into
  the accumulators one block after the other, so the arithmetic and hence the result do not
  depend on ``chunk_size``. Memory is flat in S: nothing of size S is materialised (S = 10^6
  runs in seconds on a CPU).
* KLpq uses posterior draws: ``posterior_samples`` (a dict of arrays with a leading draw
  axis, or (chain, draw) axes, or an :class:`arviz.InferenceData` whose ``posterior`` group
  has them), else NUTS on the model (with a progress bar; ``mcmc_kwargs``). log q at a draw
  is the guide's density with the draw substituted (so the guide must have a density over
  the model's latent sites: custom guides, :class:`~numpyro.infer.autoguide.AutoNormal`,
  :class:`~numpyro.infer.autoguide.AutoDiagonalNormal`,
  :class:`~numpyro.infer.autoguide.AutoMultivariateNormal`,
  :class:`~numpyro.infer.autoguide.AutoLowRankMultivariateNormal`,
  :class:`~numpyro.infer.autoguide.AutoLaplaceApproximation` (its Laplace posterior,
  ``guide.get_posterior(params)``; the guide itself samples its MAP point), the simplex guides of
  :mod:`numpyro_tempering.guides` except the overcomplete one, and
  :class:`~numpyro.infer.autoguide.AutoGuideList` of these; anything else is refused with
  an error naming the site). Replicate r at size S uses draws ``r*S .. (r+1)*S`` of the
  pool (chain-major) when the pool has ``num_replicates * S`` draws, else S draws
  resampled with replacement (a bootstrap: flagged, since the spread then reflects the pool).
* Pareto k-hat is :func:`arviz.psislw`'s. It depends only on the largest
  :math:`M + 1` of the S log-weights (:math:`M = \lceil\min(S/5, 3\sqrt S)\rceil`), so the
  stream keeps the largest :math:`L = \min(S, 5M)` and passes them to ``psislw`` with
  ``reff = 9L/(M - 1/2)^2``, which makes its tail length M again: the same k-hat as on all S
  weights. k-hat is NaN when the weights are constant to rounding (q is the posterior) or
  S is too small to fit a tail.

Raw log-weights are kept in the report only for the largest S and only the first
``max_stored_log_weights`` (default 10,000) particles of each replicate.

What :attr:`EvidenceReport.flags` says (each a :class:`Flag` with a plain-language message):

* **k-hat** of q's log-weights at the largest S: ELBO and IWAE unreliable when k > 0.7;
  :math:`\mathrm{CUBO}_n`'s estimator (a mean of :math:`w^n`, tail index nk) has a finite
  mean only if k < 1/n and a finite variance only if k < 1/(2n).
* **Drift**: a bound whose replicate interval at a larger S is wider than at a smaller S, or
  shrank far more slowly than the :math:`1/\sqrt S` of a finite-variance estimator, or whose
  median left the smaller-S interval, was overconfident at the smaller S (the paper's
  finding for CUBO).
* **Order violations**: an upper-bound median significantly (2 MCSE) below the best
  lower-bound median; which estimate is suspect and why. With ``log_evidence`` given, also
  bounds on the wrong side of the exact value.
* **Non-finite weights**, counted per bound and size, never averaged away (any NaN or +inf
  makes an estimate NaN; ``-inf`` is a zero weight and is counted but used).
* For KLpq: bootstrap replicates, NUTS divergences and r-hat, draws where q has no density.

All ArviZ-touching code of the package lives in this module (imported lazily).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro import handlers
from numpyro.distributions.transforms import biject_to
from numpyro.infer.util import compute_log_probs

from numpyro_tempering import bounds as _bounds
from numpyro_tempering.engine import log_weights
from numpyro_tempering.engine import point_mass as _point_mass

if TYPE_CHECKING:  # pragma: no cover
    import arviz
    import matplotlib.axes
    import pandas

__all__ = [
    "BOUNDS",
    "BoundWarning",
    "EvidenceReport",
    "Flag",
    "TrainingFlags",
    "evidence_bounds",
    "training_flags",
    "warn_training_flags",
]

#: Names accepted in ``bounds=`` (in display order).
BOUNDS = ("elbo", "iwae", "cubo", "cubo_prior", "klpq")
_LOWER = ("elbo", "iwae")
_UPPER = ("cubo", "cubo_prior", "klpq")
_BLOCK = 256  # particles reduced together before being folded into the accumulators
_STREAMS = {"q": 0, "prior": 1, "klpq": 2}
_REL_TOL = 1e-4  # differences below 1e-4 * (1 + |value|) nats are rounding, not findings


# ---------------------------------------------------------------------------------------------
# Flags and the report
# ---------------------------------------------------------------------------------------------
class Flag(NamedTuple):
    """One finding of :func:`evidence_bounds`; ``str(flag)`` is its plain-language message.

    ``code`` is one of ``"nonfinite"``, ``"khat_lower"``, ``"khat_cubo_mean"``,
    ``"khat_cubo_variance"``, ``"khat_cubo_prior"``, ``"drift_moves"``,
    ``"drift_widens"``, ``"drift_slow"``, ``"order"``, ``"exact"``, ``"klpq_bootstrap"``,
    ``"klpq_infinite"``, ``"mcmc"``.
    """

    code: str
    bound: str | None
    num_samples: int | None
    message: str

    def __str__(self) -> str:
        return self.message


def _label(bound: str, n: float) -> str:
    order = f"{n:g}"
    return {
        "elbo": "ELBO",
        "iwae": "IWAE",
        "cubo": f"CUBO_{order}",
        "cubo_prior": f"CUBO_{order} (prior draws, eq. 2)",
        "klpq": "KLpq",
    }[bound]


@dataclass(frozen=True, eq=False)
class EvidenceReport:
    """Result of :func:`evidence_bounds` (Pradier et al., eq. 1-3).

    Attributes:
        estimates: bound name -> array ``(len(num_samples), num_replicates)`` of estimates.
        num_samples: the sample sizes S, increasing.
        cubo_order: the order n of the CUBO.
        k_hat: bound name -> ``(len(num_samples), num_replicates)`` Pareto k-hat of the
            weights behind the estimate (NaN for KLpq and where undefined).
        ess: bound name -> ``(len(num_samples), num_replicates)`` effective sample size:
            S for the ELBO, Kish ESS of w (IWAE), of :math:`w^n` (CUBO) and of the eq. 2
            integrand (``cubo_prior``), :func:`arviz.ess` of the draws used (KLpq).
        num_nonfinite: bound name -> ``(len(num_samples), num_replicates)`` number of
            non-finite per-draw values (NaN, +inf or -inf) behind each estimate.
        idata: :class:`arviz.InferenceData` with groups ``bounds`` (variable
            ``log_evidence``, dims ``(chain, draw, bound, num_samples)``: one chain whose
            draws are the replicates, so ``az.summary(idata, group="bounds")`` summarises
            each bound over replicates), ``bound_stats`` (``k_hat``, ``ess``,
            ``num_nonfinite``, same dims), ``log_weights`` (raw values at the largest S:
            ``q`` = log w under q, ``prior`` = eq. 2 integrand, ``klpq`` = log w at posterior
            draws; dims ``(chain, draw)`` = (replicate, particle), at most
            ``max_stored_log_weights`` particles each), and, when NUTS ran or an
            InferenceData was given, its ``posterior`` (and ``sample_stats``).
        flags: the findings, :class:`Flag` s (``str(flag)`` is the message); empty when
            nothing is suspect.
        log_evidence: the exact log evidence if it was given, else None.
        mcse: bound name -> ``(len(num_samples),)`` Monte Carlo standard error of the
            replicate median (:func:`arviz.mcse`, ``method="median"``).
    """

    estimates: dict[str, np.ndarray]
    num_samples: tuple[int, ...]
    cubo_order: float
    k_hat: dict[str, np.ndarray]
    ess: dict[str, np.ndarray]
    num_nonfinite: dict[str, np.ndarray]
    idata: Any
    flags: list[Flag] = field(default_factory=list)
    log_evidence: float | None = None
    mcse: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def bounds(self) -> tuple[str, ...]:
        """The bounds estimated, in display order."""
        return tuple(self.estimates)

    def summary(self) -> pandas.DataFrame:
        """One row per (bound, num_samples): replicate median, 5% and 95% quantiles, mean,
        sd, the MCSE of the median (:func:`arviz.mcse`, ``method="median"``, replicates as
        draws), median k-hat, median ESS and the total number of non-finite values.

        With ``log_evidence`` given, a column ``error`` = median - log_evidence.
        """
        import pandas as pd

        rows = []
        for bound, values in self.estimates.items():
            for j, size in enumerate(self.num_samples):
                v = values[j]
                row = {
                    "bound": bound,
                    "num_samples": size,
                    "median": _nanquantile(v, 0.5),
                    "q5": _nanquantile(v, 0.05),
                    "q95": _nanquantile(v, 0.95),
                    "mean": float(np.mean(v)),
                    "sd": float(np.std(v, ddof=1)) if v.size > 1 else math.nan,
                    "mcse": float(self.mcse[bound][j]),
                    "k_hat": _nanmedian(self.k_hat[bound][j]),
                    "ess": _nanmedian(self.ess[bound][j]),
                    "nonfinite": int(np.sum(self.num_nonfinite[bound][j])),
                }
                if self.log_evidence is not None:
                    row["error"] = row["median"] - self.log_evidence
                rows.append(row)
        return pd.DataFrame(rows).set_index(["bound", "num_samples"])

    def plot(
        self,
        log_evidence: float | None = None,
        ax: matplotlib.axes.Axes | None = None,
        bounds: str | Sequence[str] | None = None,
    ) -> matplotlib.axes.Axes:
        """The sandwich: each bound's replicate median and 5-95% interval against S (log
        axis), and a dashed line at the exact log evidence when known (``log_evidence``
        here or in :func:`evidence_bounds`). ``bounds`` selects the bounds drawn (default
        all). Returns the matplotlib Axes.
        """
        import matplotlib.pyplot as plt

        chosen = (self.bounds if bounds is None
                  else (bounds,) if isinstance(bounds, str) else tuple(bounds))
        unknown = [b for b in chosen if b not in self.estimates]
        if unknown:
            raise ValueError(f"`bounds` {unknown} not in this report's {self.bounds}.")

        if ax is None:
            _, ax = plt.subplots(figsize=(6.5, 4.0))
        exact = self.log_evidence if log_evidence is None else _finite(log_evidence,
                                                                       "log_evidence")
        colours = {
            "elbo": "tab:blue",
            "iwae": "tab:cyan",
            "cubo": "tab:red",
            "cubo_prior": "tab:orange",
            "klpq": "tab:purple",
        }
        markers = {"elbo": "v", "iwae": "v", "cubo": "^", "cubo_prior": "^", "klpq": "^"}
        sizes = np.asarray(self.num_samples, dtype=float)
        nb = len(chosen)
        for i, bound in enumerate(chosen):
            values = self.estimates[bound]
            med = np.array([_nanquantile(v, 0.5) for v in values])
            lo = np.array([_nanquantile(v, 0.05) for v in values])
            hi = np.array([_nanquantile(v, 0.95) for v in values])
            shift = 10.0 ** (0.035 * (i - (nb - 1) / 2))
            ax.errorbar(
                sizes * shift,
                med,
                yerr=[med - lo, hi - med],
                fmt=markers[bound],
                color=colours[bound],
                capsize=3,
                label=_label(bound, self.cubo_order),
            )
        if exact is not None:
            ax.axhline(exact, color="k", ls="--", lw=1, label="exact log p(x)")
        ax.set_xscale("log")
        ax.set_xlabel("number of samples S")
        ax.set_ylabel("log p(x): median and 5-95% over replicates")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        return ax

    def __str__(self) -> str:
        import pandas as pd

        with pd.option_context("display.width", 120, "display.max_columns", 20):
            text = self.summary().round(4).to_string()
        findings = "\n".join(f"- {f}" for f in self.flags) or "- none"
        return f"{text}\n\nFindings:\n{findings}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence ArviZ's warnings and log messages (we report findings as flags instead)."""
    import arviz as az

    logger = getattr(az, "_log", None) or logging.getLogger("arviz")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _nanquantile(v: np.ndarray, q: float) -> float:
    """Quantile; NaN if any value is NaN (never dropped); exact for equal (e.g. -inf) values."""
    v = np.asarray(v, dtype=float)
    if np.isnan(v).any():
        return math.nan
    if (v == v.flat[0]).all():
        return float(v.flat[0])
    with np.errstate(invalid="ignore"):
        return float(np.quantile(v, q))


def _nanmedian(v: np.ndarray) -> float:
    v = np.asarray(v, dtype=float)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else math.nan


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------
def _check_sizes(num_samples: int | Sequence[int]) -> tuple[int, ...]:
    sizes = (num_samples,) if np.ndim(num_samples) == 0 else tuple(num_samples)
    out = []
    for s in sizes:
        if isinstance(s, bool) or int(s) != s or s < 1 or s >= 2**31:
            raise ValueError(
                f"`num_samples` must be positive integers below 2**31, got {num_samples!r}."
            )
        out.append(int(s))
    if not out:
        raise ValueError("`num_samples` is empty; give at least one sample size.")
    if len(set(out)) != len(out):
        raise ValueError(f"`num_samples` has repeated sizes: {num_samples!r}.")
    return tuple(sorted(out))


def _check_positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_bounds(names: str | Sequence[str]) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [b for b in names if b not in BOUNDS]
    if unknown or not names:
        raise ValueError(f"`bounds` must be a non-empty subset of {BOUNDS}, got {names!r}.")
    return tuple(b for b in BOUNDS if b in names)


# ---------------------------------------------------------------------------------------------
# Static / dynamic split, so compiled functions are shared between calls
# ---------------------------------------------------------------------------------------------
def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, complex)) and not (
        isinstance(leaf, np.generic) and not np.issubdtype(leaf.dtype, np.inexact)
    )


def _split(tree: Any) -> tuple[list, Any]:
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [jnp.asarray(x) if _is_dynamic(x) else None for x in leaves]
    static = tuple(None if _is_dynamic(x) else x for x in leaves)
    return dynamic, (treedef, static)


def _merge(dynamic: list, structure: Any) -> Any:
    treedef, static = structure
    leaves = [d if s is None else s for d, s in zip(dynamic, static, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


_CACHE: dict[Any, Callable] = {}
_CACHE_SIZE = 64


def _cached(key: Any, build: Callable[[], Callable]) -> Callable:
    try:
        hash(key)
    except TypeError:  # unhashable static argument: compile afresh
        return build()
    fn = _CACHE.get(key)
    if fn is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        fn = _CACHE[key] = build()
    return fn


# ---------------------------------------------------------------------------------------------
# Guides: log q at given values of the model's latent sites
# ---------------------------------------------------------------------------------------------
def _laplace_as_normal(model: Callable, guide: Any, params: dict) -> tuple[Any, dict]:
    """An ``AutoLaplaceApproximation`` samples its MAP point (a point mass); its density is
    the Laplace posterior ``guide.get_posterior(params)``, a multivariate normal over the
    same unconstrained latent: the equivalent ``AutoMultivariateNormal`` and its parameters.
    Any other guide is returned as it is."""
    from numpyro.infer.autoguide import AutoLaplaceApproximation, AutoMultivariateNormal

    if not isinstance(guide, AutoLaplaceApproximation):
        return guide, params
    posterior = guide.get_posterior(params)
    prefix = guide.prefix
    normal = AutoMultivariateNormal(model, prefix=prefix)
    rest = {k: v for k, v in params.items() if not k.startswith(f"{prefix}_")}
    return normal, {**rest, f"{prefix}_loc": posterior.loc,
                    f"{prefix}_scale_tril": posterior.scale_tril}


def _refuse_point_mass(guide: Any) -> None:
    """AutoDelta (also inside an AutoGuideList) has no density: refuse it for every bound."""
    from numpyro.infer.autoguide import AutoDelta, AutoGuideList

    if isinstance(guide, AutoGuideList):
        for sub in guide._guides:
            _refuse_point_mass(sub)
    elif isinstance(guide, AutoDelta):
        raise ValueError(
            "evidence_bounds: the guide is an AutoDelta (a point mass): it has no density, "
            "so log p(x, z) - log q(z) is not an importance weight and no bound on log p(x) "
            "follows from it. Fit a guide with a density (e.g. AutoNormal)."
        )


def _continuous_guides(guide: Any) -> list:
    """AutoContinuous sub-guides whose latent we can invert (guide density is tractable)."""
    from numpyro.infer.autoguide import (
        AutoContinuous,
        AutoDiagonalNormal,
        AutoGuideList,
        AutoLaplaceApproximation,
        AutoLowRankMultivariateNormal,
        AutoMultivariateNormal,
    )

    supported = (
        AutoDiagonalNormal,
        AutoMultivariateNormal,
        AutoLowRankMultivariateNormal,
        AutoLaplaceApproximation,
    )
    if isinstance(guide, AutoGuideList):
        return [g for sub in guide._guides for g in _continuous_guides(sub)]
    _refuse_point_mass(guide)
    if isinstance(guide, AutoContinuous):
        if type(guide) not in supported:
            raise ValueError(
                f"evidence_bounds: {type(guide).__name__} is not supported for KLpq and "
                "cubo_prior, which evaluate log q at given latent values: its density there "
                "is not available in closed form. Supported AutoContinuous guides: "
                f"{[c.__name__ for c in supported]}; or drop 'klpq'/'cubo_prior' from `bounds`."
            )
        return [guide]
    return []


class _GuidePlan(NamedTuple):
    """How to make the guide produce given latent values: site name -> value to substitute."""

    direct: tuple[str, ...]  # model latent sites substituted as they are
    continuous: tuple  # (guide, latent site name, site names) of AutoContinuous sub-guides

    def substitutions(self, z: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        subs = {name: z[name] for name in self.direct}
        for guide, latent, names in self.continuous:
            parts = []
            for name in names:
                site = guide.prototype_trace[name]
                unconstrained = biject_to(site["fn"].support).inv(z[name])
                parts.append(jnp.reshape(unconstrained, -1))
            subs[latent] = jnp.concatenate(parts)
        return subs


def _substituted(guide: Callable, subs: Mapping[str, jax.Array]) -> Callable:
    def fn(msg: dict) -> Any:
        if msg["type"] == "sample" and not msg["is_observed"]:
            return subs.get(msg["name"])
        return None

    return handlers.substitute(guide, substitute_fn=fn)


def _latent_sites(model_trace: Mapping[str, dict]) -> dict[str, dict]:
    return {
        name: site
        for name, site in model_trace.items()
        if site["type"] == "sample" and not site["is_observed"]
    }


def _finite(value: Any, name: str) -> float:
    """``float(value)``, or a ValueError naming ``name`` unless it is a finite number."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = float("nan")
    if not np.isfinite(out):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    return out


def _check_params_given(params: dict, guide_tr: dict, model_tr: dict) -> None:
    """Refuse ``params`` that give some parameters but miss a ``numpyro.param`` site of the
    guide or the model: it would be evaluated at its initial value, silently (a probe passed
    another guide's parameters and got an ELBO of -3.65 for -2.26, with no flag). An empty
    ``params`` asks for the guide as written, at its parameters' initial values."""
    sites = [n for tr in (guide_tr, model_tr) for n, s in tr.items() if s["type"] == "param"]
    missing = sorted(set(sites) - set(params))
    if missing and params:
        raise ValueError(
            f"`params` has no value for the parameter site(s) {missing} of the guide or the "
            f"model (given: {sorted(params)}); they would be evaluated at their initial "
            "values. Pass the fitted parameters, e.g. svi.get_params(state) or "
            "svi_result.params (or {} for the guide as written).")


def _model_trace(model: Callable, params: dict, args: tuple, kwargs: dict, key: jax.Array):
    seeded = handlers.seed(handlers.substitute(model, data=params), key)
    return handlers.trace(seeded).get_trace(*args, **kwargs)


def _guide_trace(guide: Callable, params: dict, args: tuple, kwargs: dict, key: jax.Array):
    seeded = handlers.seed(handlers.substitute(guide, data=params), key)
    return handlers.trace(seeded).get_trace(*args, **kwargs)


def _check_guide_has_density(guide_trace: Mapping[str, dict]) -> None:
    latent = [s for s in guide_trace.values() if s["type"] == "sample" and not s["is_observed"]]
    if latent and all(_point_mass(s["fn"]) for s in latent):
        names = sorted(s["name"] for s in latent)
        raise ValueError(
            f"evidence_bounds: every latent site of the guide ({names}) is a point mass "
            "(Delta): q has no density, so no bound on log p(x) follows from it."
        )


def _plan(
    guide: Callable,
    params: dict,
    args: tuple,
    kwargs: dict,
    latents: Mapping[str, dict],
    key: jax.Array,
) -> _GuidePlan:
    """Plan the substitution of latent values into the guide, and check it gives log q."""
    continuous = []
    covered: set[str] = set()
    for g in _continuous_guides(guide):
        names = tuple(g._init_locs)
        continuous.append((g, f"_{g.prefix}_latent", names))
        covered.update(names)
    plan = _GuidePlan(tuple(n for n in latents if n not in covered), tuple(continuous))
    z = {name: site["value"] for name, site in latents.items()}
    tr = _guide_trace(_substituted(guide, plan.substitutions(z)), params, args, kwargs, key)
    aux = {latent for _, latent, _ in continuous}
    seen = set()
    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        seen.add(name)
        if name in aux or name in covered:
            continue
        if name not in latents:
            raise ValueError(
                f"evidence_bounds: guide site '{name}' is not a latent site of the model (an "
                "auxiliary variable). 'klpq' and 'cubo_prior' need log q at given values of "
                f"the model's latent sites {sorted(latents)}, i.e. q's marginal density, "
                "which this guide does not give (e.g. AutoOvercompleteLogisticNormal). Use "
                "bounds=('elbo', 'iwae', 'cubo') for it, or a guide with a density over the "
                "model's sites."
            )
        if _point_mass(site["fn"]):
            raise ValueError(
                f"evidence_bounds: guide site '{name}' is a point mass (Delta): log q at a "
                "posterior or prior draw is -inf, so KL(p || q) and the eq. 2 estimator are "
                "infinite. Use a guide with a density at this site."
            )
    missing = sorted(set(latents) - seen - covered)
    if missing:
        raise ValueError(
            f"evidence_bounds: model latent sites {missing} are not sampled by the guide; "
            "importance weights p(x, z) / q(z) need q over every latent site."
        )
    return plan


# ---------------------------------------------------------------------------------------------
# Streaming reduction of per-particle values
# ---------------------------------------------------------------------------------------------
class _Acc(NamedTuple):
    n_nan: jax.Array
    n_posinf: jax.Array
    n_neginf: jax.Array
    total: jax.Array  # sum of the finite values
    m: jax.Array  # (4,) running max of c * x, c in (1, n, 2, 2n)
    s: jax.Array  # (4,) sum of exp(c * x - m)
    top: jax.Array  # (L,) largest values (nan/+inf excluded)
    kept: jax.Array  # (keep_pad,) first particles' raw values


def _block_partials(x: jax.Array, valid: jax.Array, scales: jax.Array) -> tuple:
    """Counts, finite sum and per-scale (max, rescaled sum of exp) of one block ``(B,)``."""
    isnan = valid & jnp.isnan(x)
    posinf = valid & (x == jnp.inf)
    neginf = valid & (x == -jnp.inf)
    ok = valid & ~jnp.isnan(x) & (x != jnp.inf)
    xs = jnp.where(ok, x, -jnp.inf)
    total = jnp.sum(jnp.where(valid & jnp.isfinite(x), x, 0.0))
    cx = scales[:, None] * xs[None, :]  # (4, B)
    m = jnp.max(cx, axis=-1)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.sum(jnp.exp(cx - safe[:, None]), axis=-1)
    counts = [jnp.sum(a, dtype=jnp.int32) for a in (isnan, posinf, neginf)]
    return (*counts, total, m, s)


def _fold(acc: _Acc, part: tuple) -> _Acc:
    n_nan, n_posinf, n_neginf, total, mb, sb = part
    m = jnp.maximum(acc.m, mb)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    s = acc.s * jnp.exp(acc.m - safe) + sb * jnp.exp(mb - safe)
    return acc._replace(
        n_nan=acc.n_nan + n_nan,
        n_posinf=acc.n_posinf + n_posinf,
        n_neginf=acc.n_neginf + n_neginf,
        total=acc.total + total,
        m=m,
        s=s,
    )


def _tail_sizes(num_samples: int) -> tuple[int, int]:
    """PSIS tail length M (arviz.psislw, reff = 1) and the number L of top values kept."""
    m = math.ceil(min(num_samples / 5.0, 3.0 * math.sqrt(num_samples)))
    return m, min(num_samples, 5 * m)


def _pow2(k: int) -> int:
    return 1 << max(0, int(k) - 1).bit_length()


def _chunk_size(chunk_size: int, num_samples: int) -> int:
    """Particles per chunk: ``chunk_size`` rounded up to a multiple of the block, or, for a
    smaller S, the next power of two >= S; at least two blocks (XLA inlines a loop of one
    iteration, and its fusion could then change the last bit of a result)."""
    full = -(-chunk_size // _BLOCK) * _BLOCK
    return max(2 * _BLOCK, min(full, _pow2(num_samples)))


def _stream(
    value_fn: Callable[[jax.Array], jax.Array],
    rep_key: jax.Array,
    num_samples: jax.Array,
    chunk: int,
    num_top: int,
    keep_pad: int,
    order: float,
    dtype: Any,
) -> dict[str, jax.Array]:
    """Reduce value_fn(fold_in(rep_key, i)), i < num_samples, chunk by chunk.

    ``num_samples`` may be traced (one compiled program serves every S with the same
    ``chunk``); ``num_top`` >= the number of top values needed, ``keep_pad`` a multiple of
    ``chunk``.
    """
    scales = jnp.asarray([1.0, order, 2.0, 2.0 * order], dtype=dtype)
    nb = chunk // _BLOCK
    zero = jnp.zeros((), jnp.int32)
    acc0 = _Acc(
        zero,
        zero,
        zero,
        jnp.zeros((), dtype),
        jnp.full((4,), -jnp.inf, dtype),
        jnp.zeros((4,), dtype),
        jnp.full((num_top,), -jnp.inf, dtype),
        jnp.zeros((keep_pad,), dtype),
    )
    num_samples = jnp.asarray(num_samples, jnp.int32)

    def block(acc: _Acc, idx: jax.Array) -> tuple[_Acc, jax.Array]:
        # One block of _BLOCK particles: evaluated (vmap) and reduced by the same program
        # whatever the chunk size, and folded into the accumulators in particle order, so
        # the result does not depend on `chunk` bit for bit.
        valid = idx < num_samples
        keys = jax.vmap(lambda i: random.fold_in(rep_key, i))(idx)
        x = jax.vmap(value_fn)(keys).astype(dtype)
        return _fold(acc, _block_partials(x, valid, scales)), x

    def body(c: jax.Array, acc: _Acc) -> _Acc:
        start = c * chunk
        idx = start + jnp.arange(chunk, dtype=jnp.int32)
        acc, x = lax.scan(block, acc, idx.reshape(nb, _BLOCK))
        x = x.reshape(chunk)
        ok = (idx < num_samples) & ~jnp.isnan(x) & (x != jnp.inf)
        candidates = jnp.where(ok, x, -jnp.inf)
        top = lax.top_k(jnp.concatenate([acc.top, candidates]), num_top)[0]
        kept = acc.kept
        if keep_pad:
            kept = lax.cond(
                start < keep_pad,
                lambda k: lax.dynamic_update_slice(k, x, (start,)),
                lambda k: k,
                kept,
            )
        return acc._replace(top=top, kept=kept)

    num_chunks = (num_samples + chunk - 1) // chunk
    acc = lax.fori_loop(0, num_chunks, body, acc0)
    size = num_samples.astype(dtype)
    log_s = jnp.log(size)
    lse = jnp.where(acc.s > 0, acc.m + jnp.log(acc.s), -jnp.inf)
    bad = (acc.n_nan + acc.n_posinf) > 0
    no_weight = ~(acc.s[0] > 0)
    nan = jnp.asarray(jnp.nan, dtype)
    elbo = jnp.where(acc.n_neginf > 0, -jnp.inf, acc.total / size)
    return {
        "elbo": jnp.where(bad, nan, elbo),
        "iwae": jnp.where(bad, nan, lse[0] - log_s),
        "cubo": jnp.where(bad | no_weight, nan, (lse[1] - log_s) / order),
        "ess_1": jnp.where(bad | no_weight, nan, jnp.exp(2 * lse[0] - lse[2])),
        "ess_n": jnp.where(bad | no_weight, nan, jnp.exp(2 * lse[1] - lse[3])),
        "n_nan": acc.n_nan,
        "n_posinf": acc.n_posinf,
        "n_neginf": acc.n_neginf,
        "top": acc.top,
        "kept": acc.kept,
    }


def _q_value(model, guide, params, args, kwargs):
    from numpyro_tempering.objectives.base import checked

    cm, cg = checked(model, guide, "evidence_bounds", require_rsample=False)

    def value(key):
        return log_weights(key, params, cm, cg, args, kwargs).log_w[0]

    return value


def _prior_value(model, guide, params, args, kwargs, plan, order):
    """Log of the eq. 2 integrand n log p(x | z) + (n - 1)(log p(z) - log q(z)), z ~ p(z)."""
    from numpyro_tempering.objectives.base import checked

    def value(key):
        k_prior, k_weight = random.split(key)
        log_probs, tr = compute_log_probs(handlers.seed(model, k_prior), args, kwargs, params)
        latents = _latent_sites(tr)
        log_prior = sum((log_probs[n] for n in latents), start=jnp.zeros(()))
        z = {n: s["value"] for n, s in latents.items()}
        cm, cg = checked(
            model,
            _substituted(guide, plan.substitutions(z)),
            "evidence_bounds",
            require_rsample=False,
        )
        lw = log_weights(k_weight, params, cm, cg, args, kwargs)
        log_joint, log_q = lw.log_joint[0], lw.log_q[0]
        return order * (log_joint - log_q) - log_prior + log_q

    return value


def _build_stream(kind, model, guide, structure, plan, config, dtype):
    chunk, num_top, keep_pad, order = config

    def run(dynamic, rep_keys, num_samples):
        params, args, kwargs = _merge(dynamic, structure)
        if kind == "q":
            value = _q_value(model, guide, params, args, kwargs)
        else:
            value = _prior_value(model, guide, params, args, kwargs, plan, order)
        one = partial(
            _stream,
            value,
            num_samples=num_samples,
            chunk=chunk,
            num_top=num_top,
            keep_pad=keep_pad,
            order=order,
            dtype=dtype,
        )
        return lax.map(one, rep_keys)

    return jax.jit(run)


def _build_pool(model, guide, structure, plan):
    from numpyro_tempering.objectives.base import checked

    def run(rng_key, dynamic, pool):
        params, args, kwargs = _merge(dynamic, structure)

        def value(key, z):
            cm, cg = checked(
                model,
                _substituted(guide, plan.substitutions(z)),
                "evidence_bounds",
                require_rsample=False,
            )
            return log_weights(key, params, cm, cg, args, kwargs).log_w[0]

        size = jax.tree.leaves(pool)[0].shape[0]
        keys = jax.vmap(lambda j: random.fold_in(rng_key, j))(jnp.arange(size, dtype=jnp.int32))
        # blocks of _BLOCK draws at a time: memory independent of the pool size
        return lax.map(lambda a: value(*a), (keys, pool), batch_size=_BLOCK)

    return jax.jit(run)


# ---------------------------------------------------------------------------------------------
# Pareto k-hat (arviz.psislw) from the largest log-weights
# ---------------------------------------------------------------------------------------------
def _pareto_khat(top: Any, num_samples: int, bad: np.ndarray) -> np.ndarray:
    """k-hat of arviz.psislw on all ``num_samples`` weights, from the largest ``L`` of them.

    ``top`` has shape ``(R, >= L)``, each row sorted in decreasing order (L =
    :func:`_tail_sizes`'s); rows with NaN/+inf weights (``bad``), constant weights or too
    short a tail give NaN.
    """
    import arviz as az

    m, num_top = _tail_sizes(num_samples)
    eps = np.finfo(np.asarray(top).dtype).eps
    top = np.asarray(top, dtype=np.float64)[:, :num_top]
    out = np.full(top.shape[0], np.nan)
    reff = 1.0 if num_top == num_samples else 9.0 * num_top / (m - 0.5) ** 2
    for r, row in enumerate(top):
        if bad[r] or not np.isfinite(row.max()) or num_top <= m:
            continue
        ordered = np.sort(row)
        spread = ordered[-1] - ordered[-(m + 1)]
        if not spread > 64 * eps * max(1.0, abs(ordered[-1])):
            continue  # constant to rounding: q is (numerically) the posterior
        with _quiet():
            _, k = az.psislw(row, reff=reff)
        k = float(k)
        out[r] = k if np.isfinite(k) else np.nan
    return out


# ---------------------------------------------------------------------------------------------
# Posterior draws for KLpq
# ---------------------------------------------------------------------------------------------
class _Pool(NamedTuple):
    draws: dict[str, np.ndarray]  # name -> (P, *shape), chain-major
    num_chains: int
    idata: Any  # arviz.InferenceData with the posterior (and sample_stats) or None
    flags: list[Flag]


def _pool_from_dict(samples: Mapping[str, Any], latents: Mapping[str, dict]) -> _Pool:
    missing = sorted(set(latents) - set(samples))
    if missing:
        raise ValueError(
            f"`posterior_samples` has no draws of the model's latent sites {missing} "
            f"(it has {sorted(samples)}); KLpq needs draws of every latent site."
        )
    chains = None
    draws = {}
    for name, site in latents.items():
        value = np.asarray(samples[name])
        site_ndim = np.ndim(site["value"])
        if value.ndim == site_ndim + 1:
            value = value[None]
        elif value.ndim != site_ndim + 2:
            raise ValueError(
                f"`posterior_samples['{name}']` has shape {value.shape}; expected (draws, "
                f"*{np.shape(site['value'])}) or (chains, draws, *{np.shape(site['value'])})."
            )
        if value.shape[2:] != np.shape(site["value"]):
            raise ValueError(
                f"`posterior_samples['{name}']` has event shape {value.shape[2:]}, but the "
                f"model's site has shape {np.shape(site['value'])}."
            )
        if chains is not None and value.shape[:2] != chains:
            raise ValueError(
                "`posterior_samples` sites disagree on (chains, draws): "
                f"'{name}' has {value.shape[:2]}, others {chains}."
            )
        chains = value.shape[:2]
        if value.shape[0] * value.shape[1] == 0:
            raise ValueError(f"`posterior_samples['{name}']` holds no draws (shape "
                             f"{value.shape}); KLpq needs posterior draws.")
        draws[name] = value.reshape((-1,) + value.shape[2:])
    return _Pool(draws, chains[0], None, [])


def _mcmc_flags(idata: Any, names: Sequence[str]) -> list[Flag]:
    import arviz as az

    flags = []
    stats = getattr(idata, "sample_stats", None)
    if stats is not None and "diverging" in stats:
        n_div = int(np.asarray(stats["diverging"]).sum())
        if n_div:
            flags.append(
                Flag(
                    "mcmc",
                    "klpq",
                    None,
                    f"KLpq: the MCMC run behind the posterior draws had {n_div} divergent "
                    "transitions; its draws may miss part of the posterior, and KLpq is an "
                    "upper bound only under exact posterior draws.",
                )
            )
    post = idata.posterior
    if post.sizes.get("chain", 1) > 1 and post.sizes.get("draw", 0) >= 4:
        with _quiet():
            rhat = az.rhat(post, var_names=list(names))
        worst = max(float(np.nanmax(np.asarray(rhat[n]))) for n in names)
        if worst > 1.01:
            flags.append(
                Flag(
                    "mcmc",
                    "klpq",
                    None,
                    f"KLpq: the posterior draws have r_hat up to {worst:.3f} > 1.01: the "
                    "chains disagree, so the draws are not yet from the posterior and KLpq "
                    "may not be an upper bound.",
                )
            )
    return flags


def _posterior_pool(
    posterior_samples: Any,
    latents: Mapping[str, dict],
    model: Callable,
    params: dict,
    args: tuple,
    kwargs: dict,
    key: jax.Array,
    wanted: int,
    mcmc_kwargs: Mapping[str, Any] | None,
    progress_bar: bool,
) -> _Pool:
    import arviz as az

    if posterior_samples is None:
        from numpyro.infer import MCMC, NUTS

        options = {
            "num_warmup": 1000,
            "num_chains": 4,
            "chain_method": "vectorized",
            "progress_bar": progress_bar,
        }
        options.update(mcmc_kwargs or {})
        chains = options["num_chains"]
        options.setdefault("num_samples", max(1, math.ceil(min(wanted, 20_000) / chains)))
        nuts_model = handlers.substitute(model, data=params)
        mcmc = MCMC(NUTS(nuts_model), **options)
        mcmc.run(key, *args, **kwargs)
        idata = az.from_numpyro(mcmc, log_likelihood=False)
        pool = _pool_from_dict(mcmc.get_samples(group_by_chain=True), latents)
        return pool._replace(idata=idata, flags=_mcmc_flags(idata, list(latents)))
    if isinstance(posterior_samples, az.InferenceData):
        if "posterior" not in posterior_samples.groups():
            raise ValueError("`posterior_samples` (InferenceData) has no posterior group.")
        post = posterior_samples.posterior
        samples = {n: post[n].values for n in latents if n in post}
        pool = _pool_from_dict(samples, latents)
        return pool._replace(
            idata=posterior_samples, flags=_mcmc_flags(posterior_samples, list(latents))
        )
    if not isinstance(posterior_samples, Mapping):
        raise TypeError(
            "`posterior_samples` must be a dict of arrays or an arviz.InferenceData, got "
            f"{type(posterior_samples).__name__}."
        )
    pool = _pool_from_dict(posterior_samples, latents)
    post = {n: v.reshape((pool.num_chains, -1) + v.shape[1:]) for n, v in pool.draws.items()}
    idata = az.from_dict(posterior=post)
    # (chain, draw) arrays get the r_hat check too (it was the InferenceData route's only)
    return pool._replace(idata=idata, flags=_mcmc_flags(idata, list(latents)))


def _klpq_replicates(
    values: np.ndarray, num_samples: int, num_replicates: int, key: jax.Array
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], bool]:
    """Replicate estimates, ESS, non-finite counts, the first replicate's draws, bootstrap?"""
    import arviz as az

    size = values.shape[0]
    disjoint = num_replicates * num_samples <= size
    rng = np.random.default_rng(np.asarray(random.key_data(key)).ravel().tolist())
    est = np.empty(num_replicates)
    ess = np.empty(num_replicates)
    nonfinite = np.empty(num_replicates, dtype=np.int64)
    blocks = []
    for r in range(num_replicates):
        if disjoint:
            block = values[r * num_samples : (r + 1) * num_samples]
        else:
            block = values[rng.integers(0, size, num_samples)]
        nonfinite[r] = int(np.sum(~np.isfinite(block)))
        if np.isnan(block).any() or (block == -np.inf).any():
            est[r] = np.nan
        else:
            est[r] = float(np.mean(block))  # +inf (q = 0 at a draw) stays +inf
        if np.isfinite(block).all() and num_samples >= 4:
            with _quiet():
                ess[r] = float(az.ess(block[None, :]))
        else:
            ess[r] = np.nan
        blocks.append(block)
    return est, ess, nonfinite, blocks, not disjoint


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------
def _fmt(size: int) -> str:
    return f"{size:,}"


def _tol(value: float) -> float:
    return _REL_TOL * (1.0 + abs(value)) if np.isfinite(value) else 0.0


def _flags(report: EvidenceReport, nonfinite_kinds: dict) -> list[Flag]:
    flags: list[Flag] = []
    n = report.cubo_order
    sizes = report.num_samples
    est = report.estimates
    med = {b: np.array([_nanquantile(v, 0.5) for v in est[b]]) for b in est}
    lo = {b: np.array([_nanquantile(v, 0.05) for v in est[b]]) for b in est}
    hi = {b: np.array([_nanquantile(v, 0.95) for v in est[b]]) for b in est}
    mcse = report.mcse

    # -- non-finite values -----------------------------------------------------------------
    for b in est:
        for j, size in enumerate(sizes):
            total = int(np.sum(report.num_nonfinite[b][j]))
            if not total:
                continue
            kinds = nonfinite_kinds.get((b, j), {})
            detail = ", ".join(f"{c} {k}" for k, c in kinds.items() if c)
            what = "posterior draws" if b == "klpq" else "particles"
            flags.append(
                Flag(
                    "nonfinite",
                    b,
                    size,
                    f"{_label(b, n)} at S = {_fmt(size)}: {total} of "
                    f"{_fmt(size * est[b].shape[1])} {what} gave a non-finite log-weight "
                    f"({detail}). NaN and +inf make the estimate NaN (they are never "
                    "averaged away); -inf is a zero weight: q puts mass where p(x, z) = 0, "
                    "or the data lie outside the model's support (NumPyro's validation gives "
                    "-inf for an observation that is NaN or out of support: check the data "
                    "when every weight is -inf).",
                )
            )

    # -- Pareto k-hat at the largest S -------------------------------------------------------
    last = len(sizes) - 1
    if any(b in est for b in ("elbo", "iwae", "cubo")):
        b0 = next(b for b in ("elbo", "iwae", "cubo") if b in est)
        k = _nanmedian(report.k_hat[b0][last])
        where = f"Pareto k-hat of q's importance weights is {k:.2f} (S = {_fmt(sizes[last])})"
        if np.isfinite(k) and k > 0.7:
            for b in ("elbo", "iwae"):
                if b in est:
                    flags.append(
                        Flag(
                            "khat_lower",
                            b,
                            sizes[last],
                            f"{_label(b, n)} unreliable: {where} > 0.7. q misses part of the "
                            "posterior, so the lower bound may be far below log p(x) and "
                            "importance weighting converges too slowly to close the gap.",
                        )
                    )
        if "cubo" in est and np.isfinite(k):
            if k >= 1.0 / n:
                flags.append(
                    Flag(
                        "khat_cubo_mean",
                        "cubo",
                        sizes[last],
                        f"{_label('cubo', n)} not estimable: {where} >= 1/n = {1 / n:.2f}: the "
                        f"weights' tail looks heavy enough for w^{n:g} to have an infinite mean "
                        "under q, and then the CUBO being estimated is +inf and every finite-S "
                        "estimate is too low and keeps growing with S (k-hat is an estimate "
                        "too: lognormal weights with a finite CUBO can show it above 1/n); "
                        "either way this estimate cannot be trusted.",
                    )
                )
            elif k >= 1.0 / (2 * n):
                flags.append(
                    Flag(
                        "khat_cubo_variance",
                        "cubo",
                        sizes[last],
                        f"{_label('cubo', n)} unreliable: {where} >= 1/(2n) = "
                        f"{1 / (2 * n):.2f}, so w^{n:g} has infinite variance under q: the "
                        "estimate converges slowly, is biased low, and its replicate "
                        "intervals are overconfident.",
                    )
                )
    if "cubo_prior" in est:
        k = _nanmedian(report.k_hat["cubo_prior"][last])
        if np.isfinite(k) and k > 0.5:
            flags.append(
                Flag(
                    "khat_cubo_prior",
                    "cubo_prior",
                    sizes[last],
                    f"{_label('cubo_prior', n)} unreliable: Pareto k-hat of its prior-sampled "
                    f"integrand is {k:.2f} > 0.5 (S = {_fmt(sizes[last])}): infinite variance"
                    + (" and infinite mean" if k >= 1 else "")
                    + ", so the estimate is biased low and its intervals are overconfident.",
                )
            )

    # -- drift across S ------------------------------------------------------------------------
    for b in est:
        for j in range(len(sizes) - 1):
            s0, s1 = sizes[j], sizes[j + 1]
            if not (np.isfinite(lo[b][j]) and np.isfinite(hi[b][j]) and np.isfinite(med[b][j + 1])):
                continue
            tol = _tol(med[b][j + 1])
            m1, se = med[b][j + 1], mcse[b][j + 1]
            se = se if np.isfinite(se) else 0.0
            outside = max(lo[b][j] - m1, m1 - hi[b][j])
            if outside > 2 * se + tol:
                flags.append(
                    Flag(
                        "drift_moves",
                        b,
                        s0,
                        f"{_label(b, n)} drifts: its median at S = {_fmt(s1)} ({m1:.4f}) is "
                        f"outside its 5-95% interval at S = {_fmt(s0)} [{lo[b][j]:.4f}, "
                        f"{hi[b][j]:.4f}]: the S = {_fmt(s0)} interval was overconfident.",
                    )
                )
            w0, w1 = hi[b][j] - lo[b][j], hi[b][j + 1] - lo[b][j + 1]
            if not np.isfinite(w1) or max(w0, w1) <= tol:
                continue
            expected = w0 * math.sqrt(s0 / s1)
            if w1 > 1.1 * w0 + tol:
                flags.append(
                    Flag(
                        "drift_widens",
                        b,
                        s0,
                        f"{_label(b, n)} interval widens with S: 5-95% width {w0:.4f} at S = "
                        f"{_fmt(s0)} but {w1:.4f} at S = {_fmt(s1)}: the smaller-S interval "
                        "was overconfident (heavy-tailed weights).",
                    )
                )
            elif s1 >= 10 * s0 and w1 > 3 * expected + tol:
                flags.append(
                    Flag(
                        "drift_slow",
                        b,
                        s0,
                        f"{_label(b, n)} interval barely shrinks: 5-95% width {w0:.4f} at S = "
                        f"{_fmt(s0)}, {w1:.4f} at S = {_fmt(s1)}; a finite-variance estimator "
                        f"would shrink to about {expected:.4f}. The intervals are overconfident "
                        "(heavy-tailed weights).",
                    )
                )

    # -- order violations ----------------------------------------------------------------------
    lowers = [(med[b][j], b, j) for b in _LOWER if b in est for j in range(len(sizes))]
    lowers = [x for x in lowers if np.isfinite(x[0])]
    if lowers:
        best, lb, lj = max(lowers)
        for b in _UPPER:
            if b not in est:
                continue
            for j, size in enumerate(sizes):
                u = med[b][j]
                se_u = mcse[b][j] if np.isfinite(mcse[b][j]) else 0.0
                se_l = mcse[lb][lj] if np.isfinite(mcse[lb][lj]) else 0.0
                margin = 2 * math.hypot(se_u, se_l) + _tol(best)
                if not (np.isfinite(u) and u < best - margin):
                    continue
                if b == "klpq":
                    why = (
                        "Suspect the KLpq: it is an upper bound only if its draws come from "
                        "the exact posterior (check the MCMC: r_hat, divergences, multimodality) "
                        "and log q is evaluated correctly at them"
                    )
                else:
                    why = (
                        f"Suspect the {_label(b, n)}: its Monte Carlo estimate is biased low "
                        "at finite S and heavy-tailed weights make it fall below log p(x)"
                    )
                flags.append(
                    Flag(
                        "order",
                        b,
                        size,
                        f"Order violation: upper bound {_label(b, n)} at S = {_fmt(size)} "
                        f"(median {u:.4f}) is below lower bound {_label(lb, n)} at S = "
                        f"{_fmt(sizes[lj])} (median {best:.4f}), beyond Monte Carlo error, so "
                        f"at least one estimate is wrong. {why}; the {_label(lb, n)} is a "
                        "stochastic lower bound (P(estimate > log p(x) + t) <= exp(-t)).",
                    )
                )

    # -- exact value ------------------------------------------------------------------------------
    if report.log_evidence is not None:
        exact = float(report.log_evidence)
        for b in est:
            for j, size in enumerate(sizes):
                m = med[b][j]
                se = mcse[b][j] if np.isfinite(mcse[b][j]) else 0.0
                margin = 2 * se + _tol(exact)
                if not np.isfinite(m):
                    continue
                if b in _UPPER and m < exact - margin:
                    flags.append(
                        Flag(
                            "exact",
                            b,
                            size,
                            f"{_label(b, n)} at S = {_fmt(size)} is not an upper bound here: "
                            f"median {m:.4f} < exact log p(x) = {exact:.4f}.",
                        )
                    )
                if b in _LOWER and m > exact + margin:
                    flags.append(
                        Flag(
                            "exact",
                            b,
                            size,
                            f"{_label(b, n)} at S = {_fmt(size)} is above the exact log p(x) "
                            f"({m:.4f} > {exact:.4f}): a lower bound exceeds it by more than "
                            "Monte Carlo error, so the model, guide or exact value is wrong.",
                        )
                    )
    return flags


# ---------------------------------------------------------------------------------------------
# The main entry point
# ---------------------------------------------------------------------------------------------
def evidence_bounds(
    rng_key: jax.Array,
    model: Callable,
    guide: Callable,
    params: Mapping[str, Any],
    *args: Any,
    num_samples: int | Sequence[int] = (100, 10_000),
    num_replicates: int = 20,
    bounds: str | Sequence[str] = ("elbo", "iwae", "cubo", "klpq"),
    posterior_samples: Mapping[str, Any] | arviz.InferenceData | None = None,
    chunk_size: int = 8192,
    cubo_order: float = 2.0,
    log_evidence: float | None = None,
    max_stored_log_weights: int = 10_000,
    mcmc_kwargs: Mapping[str, Any] | None = None,
    progress_bar: bool = True,
    **kwargs: Any,
) -> EvidenceReport:
    r"""The evidence sandwich: lower and upper bounds on log p(x), replicated, with findings.

    Estimates each bound of ``bounds`` (see the module docstring: ELBO, IWAE, CUBO_n of
    Pradier et al., eq. 1, the prior-sampled eq. 2 estimator ``"cubo_prior"`` and KLpq of
    Pradier et al., eq. 3) ``num_replicates`` times at every S in ``num_samples``, in bounded
    memory, and diagnoses them (Pareto k-hat, interval drift, order violations, non-finite
    weights).

    Args:
        rng_key: PRNG key.
        model: the model (with its observations); it may be tempered.
        guide: the fitted guide.
        params: the guide's (and model's) parameters, e.g. ``svi_result.params``.
        *args: model and guide arguments.
        num_samples: sample size(s) S.
        num_replicates: independent replicates per S (>= 2).
        bounds: subset of ``("elbo", "iwae", "cubo", "cubo_prior", "klpq")``.
        posterior_samples: posterior draws for KLpq: a dict of arrays with a leading draw
            axis (or leading (chain, draw) axes), or an InferenceData with a ``posterior``
            group. ``None``: run NUTS on the model (``mcmc_kwargs`` go to
            :class:`numpyro.infer.MCMC`; defaults 4 vectorised chains, 1000 warm-up steps,
            ``min(num_replicates * max(num_samples), 20000)`` draws in all).
        chunk_size: particles per step of the streaming loop (rounded up to a multiple of
            256, at least 512; smaller when the largest S is smaller). Memory grows with it,
            not with S; the results do not depend on it, bit for bit. Every replicate
            evaluates whole chunks, so a small S costs one chunk.
        cubo_order: the order n > 1 of the CUBO (2 in the paper).
        log_evidence: the exact log p(x), if known: checked against and drawn in ``plot``.
        max_stored_log_weights: raw per-particle values kept per replicate (largest S only).
        mcmc_kwargs: options of the default NUTS run.
        progress_bar: show NUTS's progress bar.
        **kwargs: model and guide keyword arguments.

    Returns:
        An :class:`EvidenceReport`.

    Example:
        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> def guide(x):  # the posterior is N(x/2, 1/2); q is a little too wide
        ...     numpyro.sample("mu", dist.Normal(x / 2, 0.8))
        >>> eps = jax.random.normal(jax.random.PRNGKey(1), (10_000,))
        >>> draws = {"mu": 1.0 + jnp.sqrt(0.5) * eps}  # exact posterior draws for KLpq
        >>> report = evidence_bounds(jax.random.PRNGKey(0), model, guide, {}, 2.0,
        ...                          num_samples=(100, 1000), num_replicates=10,
        ...                          posterior_samples=draws)
        >>> s = report.summary()
        >>> log_z = float(dist.Normal(0.0, jnp.sqrt(2.0)).log_prob(2.0))
        >>> bool(s.loc[("elbo", 1000), "median"] < log_z < s.loc[("klpq", 1000), "median"])
        True
        >>> report.flags
        []
    """
    sizes = _check_sizes(num_samples)
    num_replicates = _check_positive_int(num_replicates, "num_replicates", 2)
    names = _check_bounds(bounds)
    chunk_size = _check_positive_int(chunk_size, "chunk_size")
    max_stored = _check_positive_int(max_stored_log_weights, "max_stored_log_weights", 0)
    if isinstance(cubo_order, bool) or not (1.0 < float(cubo_order) < math.inf):
        raise ValueError(f"`cubo_order` must be a finite number > 1, got {cubo_order!r}.")
    order = float(cubo_order)
    if log_evidence is not None:
        _finite(log_evidence, "log_evidence")
    if not isinstance(params, Mapping):
        raise TypeError(f"`params` must be a dict of parameters, got {type(params).__name__}.")
    params = dict(params)
    guide, params = _laplace_as_normal(model, guide, params)

    k_setup, k_q, k_prior, k_klpq, k_nuts = random.split(rng_key, 5)
    model_tr = _model_trace(model, params, args, kwargs, k_setup)
    latents = _latent_sites(model_tr)
    guide_tr = _guide_trace(guide, params, args, kwargs, k_setup)
    _check_params_given(params, guide_tr, model_tr)
    _check_guide_has_density(guide_tr)
    _refuse_point_mass(guide)
    plan = (
        _plan(guide, params, args, kwargs, latents, k_setup)
        if {"klpq", "cubo_prior"} & set(names)
        else None
    )
    dynamic, structure = _split((params, args, kwargs))
    pool = None
    if "klpq" in names:  # posterior draws first: their errors come before any compilation
        pool = _posterior_pool(
            posterior_samples,
            latents,
            model,
            params,
            args,
            kwargs,
            k_nuts,
            num_replicates * sizes[-1],
            mcmc_kwargs,
            progress_bar,
        )

    estimates: dict[str, np.ndarray] = {}
    k_hat: dict[str, np.ndarray] = {}
    ess: dict[str, np.ndarray] = {}
    nonfinite: dict[str, np.ndarray] = {}
    kinds: dict[tuple[str, int], dict[str, int]] = {}
    stored: dict[str, np.ndarray] = {}
    shape = (len(sizes), num_replicates)

    streams = []
    if {"elbo", "iwae", "cubo"} & set(names):
        streams.append("q")
    if "cubo_prior" in names:
        streams.append("prior")
    for kind in streams:
        base = random.fold_in(k_q if kind == "q" else k_prior, _STREAMS[kind])
        out_est = {b: np.empty(shape) for b in ("elbo", "iwae", "cubo")}
        out_k, out_ess1, out_essn, out_nf = (np.empty(shape) for _ in range(4))
        counts = np.zeros(shape + (3,), dtype=np.int64)
        dtype = _value_dtype(kind, model, guide, params, args, kwargs, plan, order)
        # One compiled program serves every S (S is an argument; compiling costs far more
        # than the at most `chunk` particles a small S evaluates in excess).
        keep = min(sizes[-1], max_stored)
        chunk = _chunk_size(chunk_size, sizes[-1])
        keep_pad = -(-keep // chunk) * chunk
        config = (chunk, _pow2(_tail_sizes(sizes[-1])[1]), keep_pad, order)
        fn = _cached(
            (kind, model, guide, structure, plan, config, jnp.dtype(dtype).name),
            lambda kind=kind, config=config, dtype=dtype: _build_stream(
                kind, model, guide, structure, plan, config, dtype
            ),
        )
        for j, size in enumerate(sizes):
            size_key = random.fold_in(base, size)
            rep_keys = jax.vmap(lambda r, k=size_key: random.fold_in(k, r))(
                jnp.arange(num_replicates)
            )
            res = jax.device_get(fn(dynamic, rep_keys, jnp.asarray(size, jnp.int32)))
            for b in out_est:
                out_est[b][j] = res[b]
            counts[j] = np.stack([res["n_nan"], res["n_posinf"], res["n_neginf"]], -1)
            bad = (res["n_nan"] + res["n_posinf"]) > 0
            out_k[j] = _pareto_khat(res["top"], size, bad)
            out_ess1[j], out_essn[j] = res["ess_1"], res["ess_n"]
            out_nf[j] = counts[j].sum(-1)
            if j == len(sizes) - 1 and keep:
                stored[kind] = np.asarray(res["kept"])[:, :keep]
        if kind == "q":
            targets = {
                "elbo": (out_est["elbo"], np.broadcast_to(np.array(sizes, float)[:, None], shape)),
                "iwae": (out_est["iwae"], out_ess1),
                "cubo": (out_est["cubo"], out_essn),
            }
        else:
            targets = {"cubo_prior": (out_est["iwae"] / order, out_ess1)}
        for b, (values, e) in targets.items():
            if b not in names:
                continue
            estimates[b], ess[b], k_hat[b] = values, np.array(e), out_k
            nonfinite[b] = out_nf
            for j in range(len(sizes)):
                c = counts[j].sum(0)
                kinds[(b, j)] = {"NaN": int(c[0]), "+inf": int(c[1]), "-inf": int(c[2])}

    pool_flags: list[Flag] = []
    pool_idata = None
    if pool is not None:
        pool_idata, pool_flags = pool.idata, list(pool.flags)
        fn = _cached(
            ("klpq", model, guide, structure, plan),
            lambda: _build_pool(model, guide, structure, plan),
        )
        draws = {n: jnp.asarray(v) for n, v in pool.draws.items()}
        values = np.asarray(jax.device_get(fn(k_klpq, dynamic, draws)), dtype=np.float64)
        est_k, ess_k, nf_k = (np.empty(shape) for _ in range(3))
        for j, size in enumerate(sizes):
            rkey = random.fold_in(random.fold_in(k_klpq, _STREAMS["klpq"]), size)
            e, s, nf, blocks, boot = _klpq_replicates(values, size, num_replicates, rkey)
            est_k[j], ess_k[j], nf_k[j] = e, s, nf
            allv = np.concatenate(blocks)
            kinds[("klpq", j)] = {
                "NaN": int(np.isnan(allv).sum()),
                "+inf": int((allv == np.inf).sum()),
                "-inf": int((allv == -np.inf).sum()),
            }
            if boot:
                pool_flags.append(_bootstrap_flag(values, size, num_replicates, pool))
            if j == len(sizes) - 1 and max_stored:
                keep = min(size, max_stored)
                stored["klpq"] = np.stack([blk[:keep] for blk in blocks])
        if np.isposinf(values).any():
            pool_flags.append(
                Flag(
                    "klpq_infinite",
                    "klpq",
                    None,
                    f"KLpq is +inf: q has zero density at {int(np.isposinf(values).sum())} "
                    "posterior draws (its support misses part of the posterior), so "
                    "KL(p || q) is infinite.",
                )
            )
        estimates["klpq"], ess["klpq"], nonfinite["klpq"] = est_k, ess_k, nf_k
        k_hat["klpq"] = np.full(shape, np.nan)

    ordered = {b: estimates[b] for b in BOUNDS if b in estimates}
    idata = _inference_data(ordered, sizes, k_hat, ess, nonfinite, stored, pool_idata, order)
    mcse = _mcse(idata, ordered, sizes)
    report = EvidenceReport(
        estimates=ordered,
        num_samples=sizes,
        cubo_order=order,
        k_hat={b: k_hat[b] for b in ordered},
        ess={b: ess[b] for b in ordered},
        num_nonfinite={b: nonfinite[b] for b in ordered},
        idata=idata,
        log_evidence=None if log_evidence is None else float(log_evidence),
        mcse=mcse,
    )
    report.flags.extend(_flags(report, kinds))
    report.flags.extend(pool_flags)
    return report


def _bootstrap_flag(values, size, num_replicates, pool) -> Flag:
    import arviz as az

    finite = values[np.isfinite(values)]
    chains = pool.num_chains
    usable = finite[: (finite.size // chains) * chains].reshape(chains, -1)
    with _quiet():
        mcse = float(az.mcse(usable)) if usable.shape[1] >= 4 else math.nan
    return Flag(
        "klpq_bootstrap",
        "klpq",
        size,
        f"KLpq at S = {_fmt(size)}: the pool has {_fmt(values.shape[0])} posterior draws, fewer "
        f"than num_replicates x S = {_fmt(num_replicates * size)}, so replicates resample it "
        "with replacement; their spread reflects the pool, whose own Monte Carlo standard "
        f"error is {mcse:.4f}. Pass more draws (posterior_samples or mcmc_kwargs) for "
        "independent replicates.",
    )


def _value_dtype(kind, model, guide, params, args, kwargs, plan, order) -> Any:
    key = random.PRNGKey(0)
    if kind == "q":
        fn = _q_value(model, guide, params, args, kwargs)
    else:
        fn = _prior_value(model, guide, params, args, kwargs, plan, order)
    dtype = jax.eval_shape(fn, key).dtype
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.result_type(float)


def _inference_data(estimates, sizes, k_hat, ess, nonfinite, stored, pool_idata, order):
    import arviz as az
    import xarray as xr

    bound_names = list(estimates)
    num_replicates = next(iter(estimates.values())).shape[1]
    coords = {
        "chain": [0],
        "draw": np.arange(num_replicates),
        "bound": bound_names,
        "num_samples": list(sizes),
    }
    dims = ("chain", "draw", "bound", "num_samples")

    def stack(table):
        arr = np.stack([np.asarray(table[b], dtype=float) for b in bound_names])  # (B, J, R)
        return (dims, arr.transpose(2, 0, 1)[None])

    attrs = {"cubo_order": order, "replicate_dim": "draw"}
    groups = {
        "bounds": xr.Dataset({"log_evidence": stack(estimates)}, coords=coords, attrs=attrs),
        "bound_stats": xr.Dataset(
            {"k_hat": stack(k_hat), "ess": stack(ess), "num_nonfinite": stack(nonfinite)},
            coords=coords,
            attrs=attrs,
        ),
    }
    if stored:
        variables = {}
        for name, arr in stored.items():
            arr = np.asarray(arr, dtype=float)
            variables[name] = xr.DataArray(
                arr,
                dims=("chain", f"draw_{name}"),
                coords={"chain": np.arange(arr.shape[0])},
            ).rename({f"draw_{name}": "draw"})
        lengths = {v.sizes["draw"] for v in variables.values()}
        if len(lengths) == 1:
            ds = xr.Dataset(variables)
            ds = ds.assign_coords(draw=np.arange(next(iter(lengths))))
        else:  # klpq may keep a different number of draws than the particle streams
            n_min = min(lengths)
            ds = xr.Dataset({k: v.isel(draw=slice(0, n_min)) for k, v in variables.items()})
            ds = ds.assign_coords(draw=np.arange(n_min))
        ds.attrs.update({"num_samples": int(sizes[-1]), "chain_is": "replicate"})
        groups["log_weights"] = ds
    idata = az.InferenceData(**groups)
    if pool_idata is not None:
        for group in ("posterior", "sample_stats"):
            if group in pool_idata.groups():
                idata.add_groups({group: getattr(pool_idata, group)})
    return idata


def _mcse(idata: Any, estimates: dict, sizes: tuple[int, ...]) -> dict[str, np.ndarray]:
    import arviz as az

    out = {}
    data = idata.bounds["log_evidence"]
    for b in estimates:
        vals = np.full(len(sizes), np.nan)
        for j, size in enumerate(sizes):
            x = data.sel(bound=b, num_samples=size).values  # (1, R)
            if np.isfinite(x).all() and np.ptp(x) > 0:
                with _quiet():
                    vals[j] = float(az.mcse(x, method="median"))
            elif np.isfinite(x).all():
                vals[j] = 0.0
        out[b] = vals
    return out


# ---------------------------------------------------------------------------------------------
# Cheap checks during CUBO / KLpq training
# ---------------------------------------------------------------------------------------------
class TrainingFlags(NamedTuple):
    r"""Per-step health of an upper-bound objective's weights (all jit-safe arrays).

    Attributes:
        num_nonfinite: number of non-finite log-weights.
        ess_fraction: Kish ESS of :math:`w^n` over S (the weights of CUBO_n's gradient;
            use ``n = 1`` for KLpq's self-normalised weights).
        cubo: the :math:`\mathrm{CUBO}_n` estimate of this step.
        degenerate: ``ess_fraction < min_ess_fraction``: a few particles carry the estimate.
        below_lower_bound: the CUBO estimate is below ``lower_bound`` (an ELBO or IWAE of
            the same model): the upper bound has failed (diverging CUBO).
    """

    num_nonfinite: jax.Array
    ess_fraction: jax.Array
    cubo: jax.Array
    degenerate: jax.Array
    below_lower_bound: jax.Array


def training_flags(
    log_w: jax.typing.ArrayLike,
    n: float = 2.0,
    lower_bound: jax.typing.ArrayLike | None = None,
    min_ess_fraction: float = 0.01,
) -> TrainingFlags:
    r"""Cheap, pure, jit-safe health checks of one training step's log-weights.

    With :math:`\bar w^{(n)} = \mathrm{softmax}(n \log w)` (the weights of the CUBO_n
    gradient, Pradier et al., eq. 1), ``ess_fraction`` = :math:`1 / (S \sum_s (\bar
    w^{(n)}_s)^2)`; a CUBO estimate below a known lower bound (e.g. the ELBO of a warm
    start) cannot be an upper bound (the paper's diverging cold-started CUBO). NaN weights
    make ``degenerate`` and ``below_lower_bound`` False but ``num_nonfinite`` > 0.

    Example:
        >>> import jax.numpy as jnp
        >>> f = training_flags(jnp.array([0.0, 0.0, 0.0, 9.0]), n=2.0, lower_bound=10.0)
        >>> bool(f.degenerate), bool(f.below_lower_bound), round(float(f.ess_fraction), 3)
        (False, True, 0.25)
    """
    log_w = jnp.asarray(log_w)
    cubo = _bounds.cubo(log_w, n)
    ess = _bounds.effective_sample_size(jnp.asarray(n, log_w.dtype) * log_w)
    frac = ess / log_w.shape[-1]
    below = jnp.zeros(cubo.shape, bool) if lower_bound is None else cubo < lower_bound
    return TrainingFlags(
        num_nonfinite=_bounds.count_nonfinite(log_w),
        ess_fraction=frac,
        cubo=cubo,
        degenerate=frac < min_ess_fraction,
        below_lower_bound=below,
    )


class BoundWarning(UserWarning):
    """Warning about an evidence bound during training."""


def warn_training_flags(flags: TrainingFlags, owner: str = "CUBO") -> None:
    """Host-side: issue a :class:`BoundWarning` for each problem in ``flags``.

    Meant for ``jax.debug.callback(warn_training_flags, flags)`` inside a loss.

    Example:
        >>> import warnings, jax.numpy as jnp
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_training_flags(training_flags(jnp.array([0.0, jnp.nan])))
        >>> len(caught)
        1
    """
    # flags may carry batch axes (a vmapped loss): report the worst entry
    nonfinite = int(np.sum(np.asarray(flags.num_nonfinite)))
    if nonfinite:
        warnings.warn(
            f"{owner}: {nonfinite} non-finite log-weights in this step; the loss is NaN or "
            "+inf/-inf there.",
            BoundWarning,
            stacklevel=2,
        )
        return
    below = np.asarray(flags.below_lower_bound)
    if below.any():
        value = float(np.min(np.asarray(flags.cubo)[below]))
        warnings.warn(
            f"{owner}: the CUBO estimate {value:.4f} is below the given lower bound: it is not "
            "an upper bound any more (a diverging CUBO fit; Pradier et al.). Warm-start from "
            "an ELBO fit or use more particles.",
            BoundWarning,
            stacklevel=2,
        )
    degenerate = np.asarray(flags.degenerate)
    if degenerate.any():
        fraction = float(np.min(np.asarray(flags.ess_fraction)[degenerate]))
        warnings.warn(
            f"{owner}: effective sample size is {fraction:.2%} of the particles: a few "
            "weights carry the estimate and its gradient.",
            BoundWarning,
            stacklevel=2,
        )

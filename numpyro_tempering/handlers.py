"""The ``temper`` effect handler: raise chosen sites' densities to the power 1/T.

Annealed VI (Mandt et al. 2016, eq. 4 and 7) tempers the *likelihood* and keeps the prior:

    p(beta, z, x | T) = p(beta) p(x, z | beta)^(1/T) / C(T).

``temper`` implements the unnormalised part of this by replacing the distribution of every
selected sample site by :class:`Tempered` (``log_prob = log_prob_base / T``). The site's
``scale`` is left alone, so tempering composes with everything that reads a site's density:
``Trace_ELBO``, ``TraceEnum_ELBO`` (which requires enumerated sites to share one scalar
scale), ``TraceMeanField_ELBO``, ``log_density``, the MCMC potential and
``numpyro.infer.util.log_likelihood`` (so ``Predictive``'s log-likelihoods are the tempered
ones). Scales from subsampled plates and ``handlers.scale`` multiply the tempered density
as usual; ``temper`` stacks with itself (temperatures multiply).

Which sites are tempered
------------------------
* ``sites=None`` (default): every sample site *the user's model observes*, i.e. the
  likelihood: sites with ``obs=``, sites made observed by ``handlers.condition`` (inside or
  outside ``temper``: both orders give the same density) and ``numpyro.factor`` sites
  written in the model (NumPyro records a factor as an observed site, and factors are how
  custom likelihoods are written). A factor that is really part of the prior (a penalty)
  can be left untempered with ``exclude=("name",)``.
* **Never** sites that NumPyro or another handler adds while processing a model site: the
  log-det-Jacobian factors of MCMC's potential (also those emitted inside
  ``numpyro.contrib.control_flow.scan`` and ``cond``), and the auxiliary sites and factors
  of every reparameteriser (``LocScaleReparam``, ``TransformReparam``, ``CircularReparam``,
  ``NeuTraReparam``, ...), whether ``reparam`` is inside or outside ``temper``. They are
  recognised by their role (emitted while another message is being processed), not by
  their names: :func:`numpyro_tempering.roles.site_role` is the one place that decides. An
  auxiliary site is tempered only if named (``latent="mu_decentered"``).
* Sites in a control-flow body are tempered as the user wrote them: the first steps of an
  enumerated ``scan`` (which NumPyro renames with ``_PREV_`` prefixes) are tempered like the
  rest, and ``latent="z"`` names them too.
* Where NumPyro itself gets a control-flow model wrong, untempered too, ``temper`` raises a
  ``ValueError`` naming the site instead of letting a wrong number through: ``scan`` under
  ``TraceEnum_ELBO`` (which leaves the scan's first step out of the ELBO and sums its time
  dimension as a plate) or under ``infer_discrete`` (which does not support ``scan``), and
  a latent site in a ``cond`` branch under ``replay``, as in every ELBO (NumPyro's ``cond``
  does not replay its branches). A chain written as a loop over
  ``numpyro.contrib.funsor.markov`` works with both, tempered exactly.
* ``latent=("z",)``: additionally temper these latent sites. The paper tempers
  p(x_i, z_i | beta) jointly: tempering the local latents is what flattens the objective for
  discrete locals (e.g. the topic assignments of LDA or the FMM's feature indicators).
  Tempering a latent changes only its density, not how it is sampled (``Predictive`` and
  the prior draw from the untempered distribution); under MCMC the Jacobian of its
  constraining transform is not tempered, as it must not be.
* ``sites=("x", "z")`` or ``sites=callable``: take full control, by names or with a
  predicate ``msg -> bool`` on NumPyro's site message.
* ``joint=True``: where a discrete local has been summed out of the model, so that an
  observed site's distribution is a mixture p(x_n | beta) = sum_k p(x_n, z_n = k | beta)
  (NumPyro's ``MixtureSameFamily``/``MixtureGeneral``, or any distribution with
  ``component_log_probs(value)`` returning log p(x, z = k) on a last axis, or its own
  ``jointly_tempered_log_prob(value, inv_temperature)``), temper the joint before the sum,
  as the paper does: log sum_k p(x_n, z_n = k | beta)^(1/T). Tempering the marginal
  instead gives (1/T) log sum_k p(x_n, z_n = k | beta), a different (flatter-in-z,
  sharper-in-beta) objective. With an *enumerated* local
  (``TraceEnum_ELBO``), ``latent="z"`` is the joint tempering: both p(z) and p(x | z) are
  raised to 1/T before the enumeration sums over z.

Every name given (in ``sites``, ``latent`` or ``exclude``) must exist in the model: a typo is
reported with the list of sample sites that do exist. A model in which nothing is selected
(e.g. ``Predictive`` with the data set to ``None``) is simply not tempered.

What T can be
-------------
* a Python/NumPy number or a concrete array (validated: finite and > 0);
* a traced JAX value, so T can change under ``jax.jit`` / ``jax.vmap`` without retracing; a
  traced T that is not finite and > 0 gives NaN densities (never a finite number);
* an array broadcastable to a site's batch shape (per-datapoint temperatures in a plate);
* a schedule ``step -> T`` (see :mod:`numpyro_tempering.schedules`), validated when the
  handler is built (:func:`~numpyro_tempering.schedules.validate`). The step counter is kept
  in a ``numpyro.mutable`` site (``clock``, a dict ``{"step", "temperature"}``), the one
  piece of state stock :class:`numpyro.infer.SVI` carries from one update to the next. It
  advances by one each time the model runs with a clock value supplied by SVI, so
  ``svi.run`` anneals inside one compiled step. Without SVI's state (``log_density``,
  ``Predictive``) the schedule is read at step 0. MCMC has no optimisation step, so a
  schedule under MCMC is an error. An AutoGuide built on the annealed model
  (``AutoNormal(temper(model, schedule))``) runs the model through ``initialize_model`` as
  MCMC does; there the schedule is read at SVI's clock (step 0 while the guide builds
  itself) and the clock is left for the model's own run to advance, so the guide does not
  change the trajectory (the same holds for AutoDAIS, which runs the model's potential
  inside the guide).

Temperatures below 1 are allowed here when passed explicitly (they sharpen the likelihood);
the schedule constructors refuse them unless asked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro import handlers as _handlers
from numpyro.distributions import (
    Distribution,
    ExpandedDistribution,
    Independent,
    MaskedDistribution,
)
from numpyro.primitives import _PYRO_STACK, Messenger, mutable
from numpyro.util import not_jax_tracer

from numpyro_tempering import schedules as _schedules
from numpyro_tempering.roles import (
    AUXILIARY,
    OBSERVED,
    control_flow_kind,
    emission_depth,
    emitted_within,
    mark_origin,
    running_in,
    running_in_method_of,
    site_role,
)
from numpyro_tempering.schedules import check_temperature

try:  # NumPyro >= 0.19: the handler the MCMC potential substitutes unconstrained values with
    from numpyro.infer.util import _unconstrain_params
except ImportError:  # pragma: no cover - older NumPyro
    _unconstrain_params = None
from numpyro.infer.util import _unconstrain_reparam

__all__ = [
    "temper",
    "Selection",
    "Tempered",
    "JointlyTempered",
    "TEMPERED",
    "DEFAULT_CLOCK",
    "resolve_clocks",
    "stop_param_gradients",
    "stop_sample_gradients",
]

#: Key set to ``True`` in ``msg["infer"]`` for every site a ``temper`` handler tempers.
TEMPERED = "tempered"
#: Key set to ``True`` in ``msg["infer"]`` of the sites a ``multicanonical`` handler absorbed
#: and of its factor (``temper`` refuses them: the ladder's temperatures are their tempering).
MULTICANONICAL = "multicanonical"
#: Name of the mutable site holding a schedule's step counter.
DEFAULT_CLOCK = "_temper_clock"

Selector = Callable[[dict], bool]


def _names(arg: str | Collection[str] | None, what: str) -> frozenset[str]:
    if arg is None:
        return frozenset()
    if isinstance(arg, str):
        return frozenset([arg])
    if callable(arg) or not isinstance(arg, Collection):
        raise TypeError(f"`{what}` must be a site name or site names (strings), got {arg!r}.")
    names = frozenset(arg)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"`{what}` must be site names (strings), got {arg!r}.")
    return names


@dataclass(frozen=True)
class Selection:
    """Which sites are tempered and how: the one value behind ``sites=``, ``latent=``,
    ``exclude=`` and ``joint=`` (see "Which sites are tempered" in the module docstring).

    Every function that tempers a model takes these four keywords, builds a ``Selection``
    once with :meth:`of`, and carries that value; a
    :class:`~numpyro_tempering.ladder.Ladder` records the selection its log C was computed
    for, and the multicanonical objective and handler take it from there (a different one is
    an error: log C depends on it). A ``Selection`` may also be passed as ``sites=``. Names
    given as one string or a collection are stored as a frozenset.

    Attributes:
        sites: ``None`` (the sites the model observes), site names, or a predicate
            ``msg -> bool`` on NumPyro's site message.
        latent: latent site names tempered in addition.
        exclude: site names never tempered.
        joint: temper mixtures over a summed-out local jointly.

    Example:
        >>> Selection.of(latent="z", exclude=["penalty"])
        Selection(sites=observed, latent=('z',), exclude=('penalty',), joint=False)
        >>> Selection.of(Selection.of(joint=True)) == Selection(joint=True)
        True
    """

    sites: frozenset[str] | Selector | None = None
    latent: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    joint: bool = False

    @classmethod
    def of(
        cls,
        sites: str | Collection[str] | Selector | Selection | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
    ) -> Selection:
        """The selection of ``temper``'s keywords (validated); a ``Selection`` given as
        ``sites`` is returned as it is (the other keywords must then be left out)."""
        if isinstance(sites, Selection):
            if latent or exclude or joint:
                raise TypeError(
                    "give either a Selection (as `sites`) or `latent`/`exclude`/`joint`, "
                    f"not both: got {sites} with latent={latent!r}, exclude={exclude!r}, "
                    f"joint={joint!r}."
                )
            return sites
        return cls(sites, latent, exclude, joint)

    def __post_init__(self) -> None:  # normalise: names become frozensets (hashable)
        if isinstance(self.sites, Selection):
            raise TypeError("`sites` is a Selection: use Selection.of(selection) or the value.")
        if not isinstance(self.joint, (bool, np.bool_)):
            raise TypeError(f"`joint` must be True or False, got {self.joint!r}.")
        sites = self.sites
        if not (sites is None or callable(sites)):
            sites = _names(sites, "sites")
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "latent", _names(self.latent, "latent"))
        object.__setattr__(self, "exclude", _names(self.exclude, "exclude"))
        object.__setattr__(self, "joint", bool(self.joint))

    @property
    def names(self) -> frozenset[str]:
        """Every site name the selection mentions (each must exist in the model)."""
        named = self.sites if isinstance(self.sites, frozenset) else frozenset()
        return named | self.latent | self.exclude

    def selects(self, msg: dict, observed: bool, name: str | None = None) -> bool:
        """Whether the model's sample site ``msg`` is tempered; ``observed``: whether the
        site is, or will be made, observed; ``name``: the name the user wrote (default
        ``msg["name"]``; see :func:`numpyro_tempering.roles.site_role`)."""
        name = msg["name"] if name is None else name
        if name in self.exclude:
            return False
        if callable(self.sites):
            chosen = bool(self.sites(msg))
        elif self.sites is not None:
            chosen = name in self.sites
        else:
            chosen = observed
        return chosen or name in self.latent

    def tempers_latent(self, name: str) -> bool:
        """Whether ``name`` is named (not merely observed) as a tempered site."""
        return name in self.latent or (isinstance(self.sites, frozenset) and name in self.sites)

    def __repr__(self) -> str:
        if self.sites is None:
            sites = "observed"
        elif callable(self.sites):
            sites = getattr(self.sites, "__name__", repr(self.sites))
        else:
            sites = repr(tuple(sorted(self.sites)))
        latent, exclude = tuple(sorted(self.latent)), tuple(sorted(self.exclude))
        return (
            f"Selection(sites={sites}, latent={latent}, exclude={exclude}, joint={self.joint})"
        )


def inverse_temperature(temperature: Any) -> Any:
    """1/T; NaN wherever a traced T is not finite and > 0 (a concrete T is checked instead)."""
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        check_temperature(temperature)
        return 1.0 / temperature
    t = jnp.asarray(temperature)
    if not jnp.issubdtype(t.dtype, jnp.floating):
        t = t.astype(jnp.result_type(float))
    if not_jax_tracer(t):
        check_temperature(t)
        return 1.0 / t
    return jnp.where(jnp.isfinite(t) & (t > 0), 1.0 / t, jnp.nan)


def _is_one(beta: Any) -> bool:
    """Whether a concrete inverse temperature is exactly 1 everywhere (nothing to scale)."""
    if isinstance(beta, (int, float)):
        return beta == 1.0
    return not_jax_tracer(beta) and bool(np.all(np.asarray(beta) == 1.0))


class Tempered(Distribution):
    r"""A distribution whose density is raised to the power :math:`\beta = 1/T`.

    ``log_prob(x) = beta * base.log_prob(x)`` (unnormalised in x, like every tempered
    site: Mandt et al. 2016, eq. 4). Sampling, support, shapes and enumeration are the base
    distribution's, so the site keeps working under MCMC (same support and bijection),
    ``Predictive`` (draws from the untempered base) and enumeration (same support). ``beta``
    broadcasts against the batch shape (per-datapoint temperatures).

    Example:
        >>> import numpyro.distributions as dist
        >>> d = Tempered(dist.Normal(0.0, 1.0), 0.5)
        >>> float(d.log_prob(1.0)) == 0.5 * float(dist.Normal(0.0, 1.0).log_prob(1.0))
        True
    """

    arg_constraints: dict = {}
    pytree_data_fields = ("base_dist", "inv_temperature")

    def __init__(self, base_dist: Distribution, inv_temperature: jax.typing.ArrayLike) -> None:
        if isinstance(base_dist, Tempered):  # stacked handlers: the powers multiply
            inv_temperature = base_dist.inv_temperature * inv_temperature
            base_dist = base_dist.base_dist
        self.base_dist = base_dist
        self.inv_temperature = inv_temperature
        super().__init__(base_dist.batch_shape, base_dist.event_shape, validate_args=False)

    @property
    def support(self):
        return self.base_dist.support

    @property
    def has_enumerate_support(self) -> bool:
        return self.base_dist.has_enumerate_support

    @property
    def is_discrete(self) -> bool:
        return self.base_dist.is_discrete

    @property
    def has_rsample(self) -> bool:
        return self.base_dist.has_rsample

    def rsample(self, key, sample_shape=()):
        return self.base_dist.rsample(key, sample_shape)

    def sample(self, key, sample_shape=()):
        return self.base_dist.sample(key, sample_shape)

    def sample_with_intermediates(self, key, sample_shape=()):
        return self.base_dist.sample_with_intermediates(key, sample_shape)

    def enumerate_support(self, expand: bool = True):
        return self.base_dist.enumerate_support(expand=expand)

    def log_prob(self, value, intermediates=None):
        if intermediates is None:
            log_prob = self.base_dist.log_prob(value)
        else:
            log_prob = self.base_dist.log_prob(value, intermediates)
        return self.inv_temperature * log_prob

    @property
    def mean(self):
        return self.base_dist.mean

    @property
    def variance(self):
        return self.base_dist.variance


class JointlyTempered(Distribution):
    """A mixture whose summed-out local is tempered jointly with the data (``temper(joint=True)``).

    ``log_prob(x) = logsumexp(component_log_probs(x) / T, -1)``, where ``component_log_probs``
    are the base distribution's log p(x, z = k) for every value k of the summed-out local
    (Mandt et al. 2016, eq. 4 with p(x_n, z_n | beta)^(1/T)). Unnormalised in x, like every
    tempered site; ``sample`` draws from the untempered base.

    The mixture may sit inside NumPyro's wrappers (a plate's expansion, ``.mask(...)``,
    ``.to_event(...)``): the joint tempering is applied to the mixture and the wrappers
    act on the result as they act on the mixture's own log density (broadcast over the
    plate, masked elements 0, event dimensions summed); ``inner`` holds that rebuilt chain.
    Stacked joint handlers multiply their inverse temperatures, as ``Tempered`` does.

    Example:
        >>> import jax.numpy as jnp, numpyro.distributions as dist
        >>> mix = dist.MixtureSameFamily(dist.Categorical(jnp.array([0.3, 0.7])),
        ...                              dist.Normal(jnp.array([-1.0, 1.0]), 1.0))
        >>> d = JointlyTempered(mix.expand([4]).mask(jnp.array([True, True, False, True])), 0.5)
        >>> lp = d.log_prob(0.2)  # the scalar observation counts once per plate element
        >>> one = jnp.logaddexp(*(0.5 * mix.component_log_probs(0.2)))
        >>> bool(jnp.allclose(lp, jnp.array([1.0, 1.0, 0.0, 1.0]) * one))
        True
    """

    arg_constraints: dict = {}
    pytree_data_fields = ("base", "inv_temperature", "inner")

    def __init__(self, base: Distribution, inv_temperature: jax.typing.ArrayLike) -> None:
        if isinstance(base, JointlyTempered):  # stacked handlers: the powers multiply
            inv_temperature = base.inv_temperature * jnp.asarray(inv_temperature)
            base = base.base
        self.base = base
        self.mixture = mixture_of(base)
        if self.mixture is None:
            raise TypeError(
                f"{type(base).__name__} has no `component_log_probs`: nothing to temper jointly."
            )
        self.inv_temperature = inv_temperature
        self.inner = _joint_chain(base, jnp.asarray(inv_temperature))
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)

    @property
    def support(self):
        return self.base.support

    def sample(self, key, sample_shape=()):
        return self.base.sample(key, sample_shape)

    def log_prob(self, value):
        return self.inner.log_prob(value)


class JointMixture(Distribution):
    """The innermost piece of :class:`JointlyTempered`: a mixture's joint tempered log
    density ``logsumexp(beta * component_log_probs(x), -1)`` (or the mixture's own
    ``jointly_tempered_log_prob(x, beta)``), batch shape the mixture's broadcast with
    ``beta``'s. Not samplable (the site samples from the untempered base)."""

    arg_constraints: dict = {}
    pytree_data_fields = ("mixture", "inv_temperature")

    def __init__(self, mixture: Distribution, inv_temperature: jax.typing.ArrayLike) -> None:
        self.mixture = mixture
        self.inv_temperature = inv_temperature
        batch = jnp.broadcast_shapes(tuple(mixture.batch_shape), jnp.shape(inv_temperature))
        super().__init__(batch, mixture.event_shape, validate_args=False)

    @property
    def support(self):
        return self.mixture.support

    def log_prob(self, value):
        beta = jnp.asarray(self.inv_temperature)
        own = getattr(self.mixture, "jointly_tempered_log_prob", None)
        if own is not None:  # a distribution that tempers its summed-out locals itself
            return own(value, beta)
        beta = beta[..., None] if beta.ndim else beta
        return logsumexp(beta * self.mixture.component_log_probs(value), axis=-1)


def already_tempered(fn: Distribution) -> bool:
    """Whether a site's distribution was raised to a power other than 1 by a ``temper``
    handler (a joint handler at T = 1 leaves a :class:`JointlyTempered` of power 1, which
    changes nothing)."""
    if isinstance(fn, Tempered):
        return True
    return isinstance(fn, JointlyTempered) and not _is_one(fn.inv_temperature)


#: NumPyro's wrappers that :func:`mixture_of` looks through (and :class:`JointlyTempered`
#: rebuilds around the tempered mixture)
_WRAPPERS = (ExpandedDistribution, MaskedDistribution, Independent)


def _joint_chain(fn: Distribution, beta: jax.Array) -> Distribution:
    """``fn``'s wrappers around :class:`JointMixture` of its mixture at ``beta`` (shaped as
    ``fn``'s batch: an ``Independent`` moves it left of its event dimensions)."""
    if isinstance(fn, ExpandedDistribution):
        return _joint_chain(fn.base_dist, beta).expand(fn.batch_shape)
    if isinstance(fn, MaskedDistribution):
        return MaskedDistribution(_joint_chain(fn.base_dist, beta), fn._mask)
    if isinstance(fn, Independent):
        r = fn.reinterpreted_batch_ndims
        inner = _joint_chain(fn.base_dist, jnp.reshape(beta, jnp.shape(beta) + (1,) * r))
        return Independent(inner, r)
    return JointMixture(fn, beta)


def mixture_of(fn: Distribution) -> Distribution | None:
    """The distribution exposing ``component_log_probs`` (or its own
    ``jointly_tempered_log_prob(value, inv_temperature)``, for locals that are not one
    categorical per value, e.g. a topic per word of a document) under NumPyro's wrappers
    (plate expansions, masks, ``to_event``), if any; a :class:`JointlyTempered` site's
    mixture (so that stacked joint handlers multiply)."""
    if isinstance(fn, JointlyTempered):
        return fn.mixture
    while isinstance(fn, _WRAPPERS):
        fn = fn.base_dist
    joint = hasattr(fn, "component_log_probs") or hasattr(fn, "jointly_tempered_log_prob")
    return fn if joint else None


#: NumPyro entry points that get ``scan`` wrong (untempered too) and why: ``temper`` refuses
#: a model with ``scan`` under them rather than return their number.
SCAN_UNSUPPORTED = {
    "TraceEnum_ELBO": (
        "gets wrong even untempered: it finds the model's sites in a run without "
        "enumeration, where the scan's first step is not split off; under enumeration that "
        "step runs under other names (`_PREV_` prefixes), so it is left out of the ELBO; and "
        "the scan's time dimension is summed as a plate, not as a Markov chain (the states "
        "of a hidden Markov model are summed as if independent)."
    ),
    "infer_discrete": (
        "does not support (NumPyro documents this): its backward pass cannot read the "
        "states of a scanned chain ('Could not extract point from -inf')."
    ),
}


def scan_unsupported_consumer() -> str | None:
    """The NumPyro entry point running the model, if it is one that gets ``scan`` wrong
    (a key of :data:`SCAN_UNSUPPORTED`), else ``None``.

    Example:
        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import TraceEnum_ELBO
        >>> seen = []
        >>> def model():
        ...     seen.append(scan_unsupported_consumer())
        ...     numpyro.sample("y", dist.Normal(), obs=0.0)
        >>> _ = TraceEnum_ELBO().loss(jax.random.PRNGKey(0), {}, model, lambda: None)
        >>> seen[-1], scan_unsupported_consumer()
        ('TraceEnum_ELBO', None)
    """
    from numpyro.contrib.funsor.discrete import _sample_posterior
    from numpyro.infer.elbo import get_importance_trace_enum

    if not running_in(get_importance_trace_enum, _sample_posterior):
        return None  # (one walk up the stack in the common case)
    return "TraceEnum_ELBO" if running_in(get_importance_trace_enum) else "infer_discrete"


def _fixes_latents(cond: Any, stack: list) -> bool:
    """Whether the ``condition`` handler ``cond`` holds latent sites at given values rather
    than supplying data: NumPyro's Gibbs-type kernels (``DiscreteHMCGibbs``, ``MixedHMC``,
    ``HMCGibbs``; ``numpyro.infer.gibbs.conditioned``) run the model under
    ``condition(data=values)`` and ``substitute(data=values)`` with one and the same dict,
    to evaluate the density of the other sites given the Gibbs sites. Those sites are
    latent: their prior is not the likelihood, and tempering it would sample another
    posterior (the discrete latent's p(z | theta) raised to 1/T as well)."""
    return any(isinstance(h, _handlers.substitute) and h.data is cond.data for h in stack)


def _inside_autoguide() -> bool:
    """Whether the model runs inside an AutoGuide (building its prototype trace through
    ``initialize_model``, or evaluating the potential as AutoDAIS does), not under MCMC."""
    from numpyro.infer.autoguide import AutoGuide

    return running_in_method_of(AutoGuide)


def _in_svi_init() -> bool:
    """Whether the model runs inside ``SVI.init`` (which takes no step)."""
    from numpyro.infer import SVI

    return running_in_method_of(SVI, "init")


def _in_laplace_transform() -> bool:
    """Whether the model runs inside ``AutoLaplaceApproximation.get_transform`` (its
    Hessian, for ``get_posterior``, ``sample_posterior``, ``median`` and ``quantiles``)."""
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    return running_in_method_of(AutoLaplaceApproximation, "get_transform")


def under_mcmc() -> bool:
    """Whether the model runs inside NumPyro's MCMC potential (unconstrained substitution)."""
    for handler in _PYRO_STACK:
        if _unconstrain_params is not None and isinstance(handler, _unconstrain_params):
            return True
        fn = getattr(handler, "substitute_fn", None)
        if getattr(fn, "func", None) is _unconstrain_reparam:
            return True
    return False


class _resolved_clocks(Messenger):
    """Carry the clocks :func:`resolve_clocks` read outside the particle map: ``values`` maps
    a ``temper`` handler (by ``id``) to its advanced clock ``{"step": step + 1,
    "temperature": T(step)}``."""

    def __init__(self, fn: Callable, values: dict[int, dict]) -> None:
        self.values = values
        super().__init__(fn)


def _resolved_clock(handler: temper) -> dict | None:
    for outer in reversed(_PYRO_STACK):
        if isinstance(outer, _resolved_clocks) and id(handler) in outer.values:
            return outer.values[id(handler)]
    return None


def resolve_clocks(model: Callable, param_map: dict) -> Callable:
    """Read the annealing clocks of ``model`` once, outside any map over particles.

    ``temper(model, schedule)`` evaluates ``T(step)`` when the model runs. An objective that
    maps the model over S particles (``jax.lax.map``, a ``pmap``, or ``jax.vmap``) would then
    evaluate the schedule inside the map, once per particle, although the step is the same
    for all of them. This finds the ``temper`` handlers with a schedule that wrap ``model``
    (the chain of handlers ``model.fn.fn...``), reads each one's clock from ``param_map``
    (SVI's mutable state) and evaluates ``T(step)`` here, once; the handlers then take the
    temperature and the advanced clock from the returned wrapper instead of evaluating the
    schedule. The values are the same numbers (same function of the same step). A handler
    not found this way (applied inside the model's body) or whose clock is not in
    ``param_map`` evaluates its schedule as before.

    Example:
        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> from numpyro_tempering import schedules
        >>> def model():
        ...     numpyro.sample("x", dist.Normal(0.0, 1.0), obs=1.0)
        >>> annealed = temper(model, schedules.linear(10.0, 1.0, 100))
        >>> clock = {"_temper_clock": {"step": jnp.array(50), "temperature": jnp.array(0.0)}}
        >>> wrapped = resolve_clocks(annealed, clock)
        >>> float(wrapped.values[id(annealed)]["temperature"])
        5.5
    """
    values: dict[int, dict] = {}
    fn = model
    while isinstance(fn, Messenger):
        if isinstance(fn, temper) and fn.schedule is not None and id(fn) not in values:
            state = param_map.get(fn.clock)
            if isinstance(state, dict) and "step" in state:
                step = jnp.asarray(state["step"])
                values[id(fn)] = {"step": step + 1, "temperature": fn._at(step)}
        fn = fn.fn
    return _resolved_clocks(model, values) if values else model


class temper(Messenger):
    """Temper the selected sites of a model: log p_i -> log p_i / T.

    Args:
        fn: the model (omit to use as a decorator factory or context manager).
        temperature: T > 0: a number, a (traced) array broadcastable to each selected site's
            batch shape, or a schedule ``step -> T``.
        sites: ``None`` for all sites the model observes (the likelihood, including
            ``numpyro.factor`` sites), a name or collection of names, a predicate on the
            site message, or a whole :class:`Selection`.
        latent: latent site names to temper in addition to the default selection.
        exclude: site names never to temper (e.g. a factor that belongs to the prior).
        joint: temper mixtures over a summed-out local jointly, p(x, z)^(1/T) inside the sum
            (see the module docstring); default ``False`` tempers the site's density.
        clock: name of the mutable site holding a schedule's step counter.

    Example:
        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer.util import log_density
        >>> from numpyro_tempering import temper
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> x = jnp.array(0.5)
        >>> lp_T, _ = log_density(temper(model, 2.0), (x,), {}, {"mu": 0.0})
        >>> prior = dist.Normal(0.0, 1.0).log_prob(0.0)
        >>> lik = dist.Normal(0.0, 1.0).log_prob(x)
        >>> bool(jnp.allclose(lp_T, prior + lik / 2.0))
        True
    """

    def __init__(
        self,
        fn: Callable | None = None,
        temperature: jax.typing.ArrayLike | Callable = 1.0,
        *,
        sites: str | Collection[str] | Selector | Selection | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
        clock: str = DEFAULT_CLOCK,
    ) -> None:
        self.selection = Selection.of(sites, latent, exclude, joint)
        self.schedule = temperature if callable(temperature) else None
        if self.schedule is not None:
            _schedules.validate(self.schedule, name="temperature schedule")
        else:
            check_temperature(temperature)
        if not isinstance(clock, str):
            raise TypeError(f"`clock` must be a site name (str), got {clock!r}.")
        self.temperature = temperature
        self.clock = clock
        self._inv_temperature: Any = None
        self._scan_consumer: str | None = None
        self._seen: set[str] = set()
        self._auxiliary: set[str] = set()
        self._tempered: set[str] = set()
        self._base_depth = 0
        super().__init__(fn)

    # -- selection -----------------------------------------------------------------------
    def role(self, msg: dict) -> tuple[str, str]:
        """``(name, role)`` of the sample site ``msg`` for this handler
        (:func:`numpyro_tempering.roles.site_role`): a site counts as observed if it is, or
        if a ``condition`` handler outside this one will condition it."""
        observed = bool(msg.get("is_observed")) or self._conditioned_outside(msg)
        return site_role(msg, self._base_depth, observed)

    def selects(self, msg: dict) -> bool:
        """Whether this handler tempers the sample site described by ``msg``: never an
        auxiliary site unless named, else as :meth:`Selection.selects` says."""
        name, role = self.role(msg)
        if role == AUXILIARY and not self.selection.tempers_latent(name):
            return False
        return self.selection.selects(msg, role == OBSERVED, name)

    def _outer_handlers(self) -> list:
        for i, handler in enumerate(_PYRO_STACK):
            if handler is self:
                return _PYRO_STACK[:i]
        return []

    def _seen_outside(self, msg: dict, kind: type, stack: list
                      ) -> Iterator[tuple[Any, dict]]:
        """``(handler, message as it sees it)`` for the handlers of type ``kind`` in
        ``stack`` (those outside this one), innermost first: a ``scope`` between them renames
        the site (``a/y``) before they see it, so each is asked with the name it will see (a
        copy of ``msg``)."""
        seen = msg
        for handler in reversed(stack):
            if isinstance(handler, _handlers.scope):
                seen = dict(seen)
                handler.process_message(seen)
            elif isinstance(handler, kind):
                yield handler, seen

    def _conditioned_outside(self, msg: dict) -> bool:
        stack = self._outer_handlers()
        for handler, seen in self._seen_outside(msg, _handlers.condition, stack):
            if handler.data is not None:  # a None value leaves the site latent (NumPyro)
                if seen["name"] in handler.data and _fixes_latents(handler, stack):
                    continue
                if handler.data.get(seen["name"]) is not None:
                    return True
                continue
            if handler.condition_fn is not None and handler.condition_fn(seen) is not None:
                return True
        return False

    def _check_not_reparameterised_outside(self, msg: dict) -> None:
        for handler, seen in self._seen_outside(msg, _handlers.reparam,
                                                self._outer_handlers()):
            config = handler.config
            found = config.get(seen["name"]) if isinstance(config, dict) else config(seen)
            if found is not None:
                raise ValueError(
                    f"temper: latent site '{msg['name']}' is tempered inside a `reparam` "
                    "handler that reparameterises it; the reparameteriser would see the "
                    "tempered distribution. Put `reparam` inside `temper` and temper the "
                    "site it creates (e.g. latent='<name>_decentered'), or do not temper it."
                )

    # -- temperature ---------------------------------------------------------------------
    def _start(self) -> None:
        self._seen = set()
        self._auxiliary = set()
        self._tempered = set()
        self._base_depth = emission_depth(inside_message=False)
        self._scan_consumer = scan_unsupported_consumer()
        if self.schedule is None:
            temperature = self.temperature
        else:
            in_guide = _inside_autoguide()
            if under_mcmc() and not in_guide:
                raise ValueError(
                    "temper: an annealing schedule under MCMC. MCMC has no optimisation step "
                    "for the schedule's clock to follow (it would run at schedule(0) "
                    "throughout); give MCMC a fixed temperature: temper(model, T)."
                )
            resolved = _resolved_clock(self)
            if resolved is None:
                fresh = {"step": jnp.zeros((), jnp.int32), "temperature": self._at(0)}
            else:  # read once per step outside the particle map (resolve_clocks)
                fresh = resolved
            state = mutable(self.clock, fresh)
            if state is None:  # no handler records mutable state: evaluate at step 0
                state = fresh
            if state is fresh and resolved is None and _in_laplace_transform():
                raise ValueError(
                    f"temper: AutoLaplaceApproximation takes its Hessian of the annealed "
                    f"model at the parameters given to get_posterior / get_transform / "
                    f"sample_posterior / median / quantiles, which hold no schedule clock "
                    f"('{self.clock}'), so the Hessian would be that of schedule(0). Pass "
                    f"the SVI state's clock with the parameters: "
                    f"{{**svi.get_params(state), **state.mutable_state}} (or "
                    f"{{**result.params, **result.state.mutable_state}} after svi.run)."
                )
            if resolved is None:
                temperature, advanced = self._at(state["step"]), state["step"] + 1
            else:
                temperature, advanced = resolved["temperature"], resolved["step"]
            if state is not fresh and not in_guide and not _in_svi_init():
                # SVI supplied the clock: advance it for the next update. (An AutoGuide that
                # runs the model, to build itself or for its potential as AutoDAIS does,
                # reads the clock and leaves it to the model's own run; so does SVI.init,
                # which runs the model once to collect the state, with a saved clock when
                # resuming through init_params: advancing it there skipped a step.)
                state["step"] = advanced
                state["temperature"] = temperature
        self._inv_temperature = inverse_temperature(temperature)

    def _at(self, step: jax.typing.ArrayLike) -> jax.Array:
        return jnp.asarray(self.schedule(step), dtype=jnp.result_type(float))

    def __enter__(self):
        out = super().__enter__()
        self._start()
        return out

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            self._check_selection()

    def _check_selection(self) -> None:
        missing = sorted(self.selection.names - self._seen)
        if missing:
            added = sorted(self._auxiliary - self._seen)
            also = (f", and sites added by handlers (a reparameteriser's, a Jacobian), which "
                    f"`latent=` may name: {added}") if added else ""
            raise ValueError(
                f"temper: no sample site named {missing} in the model; its sample sites are "
                f"{sorted(self._seen)}{also}."
            )

    def _refuse_scan(self, msg: dict, name: str) -> None:
        from numpyro.contrib.control_flow.scan import scan_wrapper

        if emitted_within(msg) == "scan" or running_in(scan_wrapper):
            raise ValueError(
                f"temper: site '{name}' is inside `numpyro.contrib.control_flow.scan`, "
                f"which NumPyro's {self._scan_consumer} {SCAN_UNSUPPORTED[self._scan_consumer]}"
                " Write the chain as a Python loop, `for t in "
                "numpyro.contrib.funsor.markov(range(T))`, with one site name per step "
                "(this works tempered, also with `latent=` naming the states), or sum the "
                "states out in the log density NUTS uses, which handles `scan` correctly."
            )

    def _refuse_unreplayed_cond_latent(self, msg: dict, name: str) -> None:
        replays = [h for h in _PYRO_STACK if isinstance(h, _handlers.replay)]
        if not any(msg["name"] in h.trace for h in replays):
            return
        from numpyro.contrib.control_flow.cond import cond_wrapper

        if emitted_within(msg) == "cond" or running_in(cond_wrapper):
            raise ValueError(
                f"temper: latent site '{name}' is in a branch of "
                "`numpyro.contrib.control_flow.cond` run under `replay` (as every ELBO "
                "runs the model against the guide's draw). NumPyro's cond does not pass "
                f"`replay` into its branches: the branch draws '{name}' afresh while the "
                "trace records the guide's value, so the sites that depend on it get "
                "their density at the wrong value, even untempered. Sample it outside "
                "the cond and pass it to the branches, or use NUTS (its potential "
                "substitutes values, which cond supports)."
            )

    def _check_shape(self, msg: dict, beta: Any) -> None:
        if jnp.ndim(beta) == 0:
            return
        batch_shape = tuple(msg["fn"].batch_shape)
        try:
            ok = jnp.broadcast_shapes(jnp.shape(beta), batch_shape) == batch_shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"temper: `temperature` of shape {jnp.shape(beta)} does not broadcast to "
                f"the batch shape {batch_shape} of site '{msg['name']}'."
            )

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "control_flow":  # record the roles of the body's sites where
            # they are emitted (the body runs out of sight; its sites are replayed later)
            marker = partial(mark_origin, within=control_flow_kind(msg))
            msg["kwargs"]["substitute_stack"].append(("substitute", marker))
            return
        if msg["type"] != "sample":
            return
        name, role = self.role(msg)
        if self._scan_consumer is not None:
            self._refuse_scan(msg, name)
        if role != OBSERVED and not msg.get("is_observed"):
            self._refuse_unreplayed_cond_latent(msg, name)
        if role == AUXILIARY and not self.selection.tempers_latent(name):
            self._auxiliary.add(name)
            return  # emitted by a handler (Jacobians, reparameterisers' sites): never
            # tempered unless named (e.g. the decentred site of a LocScaleReparam)
        self._seen.add(name)
        if not self.selection.selects(msg, role == OBSERVED, name):
            return
        if (msg.get("infer") or {}).get(MULTICANONICAL) and not _is_one(self._inv_temperature):
            raise ValueError(
                f"temper: site '{name}' belongs to a multicanonical model (its factor or a "
                "site it absorbed) outside which `temper` was applied: the ladder's "
                "temperatures are its tempering, and tempering it again would scale the "
                "multicanonical density. Apply `temper` to the model inside `multicanonical`, "
                "or use the ladder alone."
            )
        beta = self._inv_temperature
        self._check_shape(msg, beta)
        if not msg.get("is_observed") and self.selection.tempers_latent(name):
            self._check_not_reparameterised_outside(msg)
        if self.selection.joint and mixture_of(msg["fn"]) is not None:
            msg["fn"] = JointlyTempered(msg["fn"], beta)
        elif self.selection.joint and isinstance(msg["fn"], Tempered) and mixture_of(
                msg["fn"].base_dist) is not None:
            raise ValueError(
                f"temper(joint=True): site '{name}' is a mixture that an inner `temper` "
                "handler already tempers marginally (joint=False); its joint cannot be "
                "recovered from the tempered marginal. Give both handlers joint=True (their "
                "temperatures then multiply), or neither."
            )
        elif not _is_one(beta):
            msg["fn"] = Tempered(msg["fn"], beta)
        msg["infer"] = {**(msg.get("infer") or {}), TEMPERED: True}
        self._tempered.add(msg["name"])

    def postprocess_message(self, msg: dict) -> None:
        # ``replay`` (outside the model in every ELBO) replaces ``msg["infer"]`` with a copy of
        # the guide site's after this handler ran: mark that copy again. It is a fresh dict
        # that ``trace`` shares with the recorded site, so marking it in place is what the
        # recorded trace shows.
        if msg["type"] == "sample" and msg["name"] in self._tempered:
            if not msg["infer"].get(TEMPERED):
                msg["infer"][TEMPERED] = True


# ---------------------------------------------------------------------------------------
# Holding samples or parameters fixed (the upper-bound objectives run under these)
# ---------------------------------------------------------------------------------------


class _FixedSample(Distribution):
    """``base`` whose samples carry no gradient; log_prob is base's at the (fixed) value."""

    def __init__(self, base: Distribution) -> None:
        self.base_dist = base
        super().__init__(batch_shape=base.batch_shape, event_shape=base.event_shape)

    @property
    def support(self):
        return self.base_dist.support

    @property
    def has_rsample(self) -> bool:
        return False

    @property
    def is_discrete(self) -> bool:
        return self.base_dist.is_discrete

    def sample_with_intermediates(self, key, sample_shape=()):
        value, _ = self.base_dist.sample_with_intermediates(key, sample_shape)
        # No intermediates: log_prob must be recomputed from the fixed value (e.g. by
        # inverting a TransformedDistribution's transforms), not from differentiable
        # pre-transform samples.
        return jax.lax.stop_gradient(value), []

    def sample(self, key, sample_shape=()):
        return self.sample_with_intermediates(key, sample_shape)[0]

    def log_prob(self, value, intermediates=None):
        return self.base_dist.log_prob(value)


class stop_sample_gradients(Messenger):
    """Hold the latent samples of ``fn`` fixed: no gradient flows through the sampled values.

    Every unobserved sample site draws its value as usual (same RNG, same value) but wrapped
    in ``jax.lax.stop_gradient``, and its recorded log density is the distribution's
    ``log_prob`` at that fixed value, differentiable in the distribution's parameters only.
    (For a ``TransformedDistribution`` the value is mapped back through the inverse
    transforms, so a guide with transforms lacking an inverse, such as IAF flows, raises.)
    Because the model replays these values, ``log p(x, z_s)`` is also at fixed ``z_s``.

    Example:
        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import seed, substitute, trace
        >>> def guide():
        ...     numpyro.sample("z", dist.Normal(numpyro.param("loc", 0.0), 1.0))
        >>> def value(loc):
        ...     g = substitute(seed(stop_sample_gradients(guide), 0), {"loc": loc})
        ...     return trace(g).get_trace()["z"]["value"]
        >>> float(jax.grad(value)(0.0))
        0.0
    """

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and not msg.get("is_observed"):
            msg["fn"] = _FixedSample(msg["fn"])


class stop_param_gradients(Messenger):
    """Hold the ``param`` sites of ``fn`` fixed: their values carry no gradient.

    Each ``numpyro.param`` site of ``fn`` returns its usual value (from SVI's substitution,
    or its initial value) wrapped in ``jax.lax.stop_gradient`` (leaf by leaf for a pytree
    value), so a loss computed from ``fn`` has exactly zero gradient with respect to those
    parameters. Only the wrapped function is affected: the same parameter used by another
    function (a guide) keeps its gradient there.

    NumPyro's :func:`~numpyro.primitives.apply_stack` runs ``process_message`` from the
    innermost handler outwards and ``postprocess_message`` from the outermost inwards, so
    the value an outer ``substitute`` sets (SVI passes parameters this way) is final by the
    time this handler's ``postprocess_message`` runs; the ``param`` primitive then returns
    ``msg["value"]``.

    Example:
        >>> import jax, numpyro, numpyro.distributions as dist
        >>> from numpyro.handlers import substitute
        >>> def model():
        ...     return 3.0 * numpyro.param("sigma", 1.0)
        >>> def value(fn, sigma):
        ...     return substitute(fn, {"sigma": sigma})()
        >>> float(jax.grad(lambda s: value(model, s))(1.0))
        3.0
        >>> float(jax.grad(lambda s: value(stop_param_gradients(model), s))(1.0))
        0.0
    """

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "param":
            msg["value"] = jax.tree.map(jax.lax.stop_gradient, msg["value"])

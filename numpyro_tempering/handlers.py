"""The ``temper`` effect handler: raise chosen sites' densities to the power 1/T.

Annealed VI (Mandt et al., annealed-and-multicanonical-vi, eq. 4 and 7) tempers the
*likelihood* and keeps the prior:

    p(beta, z, x | T) = p(beta) p(x, z | beta)^(1/T) / C(T).

``temper`` implements the unnormalised part of this by multiplying the ``scale`` of the
selected sample sites by 1/T. Every NumPyro consumer of a trace (``Trace_ELBO``,
``log_density``, the MCMC potential, ``Predictive``'s log-likelihoods) reads ``scale``, so
they all see the tempered density. Scales compose multiplicatively, so ``temper`` stacks with
``handlers.scale``, subsampled ``plate`` s and with itself.

Which sites are tempered
------------------------
* ``sites=None`` (default): every *observed* sample site, i.e. the likelihood. This includes
  ``numpyro.factor`` sites, because NumPyro records a factor as an observed site of a
  ``Unit`` distribution and factors are how custom likelihoods are written. A factor that is
  really part of the prior (a penalty, a Jacobian adjustment) can be left untempered with
  ``exclude=("name",)``. Sites made observed by ``handlers.condition`` count as data too.
* ``latent=("z",)``: additionally temper these latent sites. The paper tempers
  p(x_i, z_i | beta) jointly: tempering the local latents is what flattens the objective for
  discrete locals (e.g. the topic assignments of LDA or the FMM's feature indicators).
* ``sites=("x", "z")`` or ``sites=callable``: take full control, by names or with a
  predicate ``msg -> bool`` on NumPyro's site message.
* ``joint=True``: where a discrete local has been summed out of the model, so that an
  observed site's distribution is a mixture p(x_n | beta) = sum_k p(x_n, z_n = k | beta)
  (NumPyro's ``MixtureSameFamily``/``MixtureGeneral``, or any distribution with
  ``component_log_probs(value)`` returning log p(x, z = k) on a last axis), temper the joint
  before the sum, as the paper does: log sum_k p(x_n, z_n = k | beta)^(1/T). Scaling the
  site instead tempers the marginal, (1/T) log sum_k p(x_n, z_n = k | beta), a different
  (flatter-in-z, sharper-in-beta) objective. Selected sites without components are tempered
  through ``scale`` as usual, which is the same thing when there is no local to sum.

Every name given (in ``sites``, ``latent`` or ``exclude``) must exist in the model: a typo is
reported with the list of sample sites that do exist, and a model in which nothing is
selected is an error rather than a silent no-op.

What T can be
-------------
* a Python/NumPy number or a concrete array (validated: finite and > 0);
* a traced JAX value, so T can change under ``jax.jit`` / ``jax.vmap`` without retracing;
* an array broadcastable to a site's batch shape (per-datapoint temperatures in a plate);
* a schedule ``step -> T`` (see :mod:`numpyro_tempering.schedules`). The step counter is
  kept in a ``numpyro.mutable`` site (``clock``, a dict ``{"step", "temperature"}``), the one
  piece of state stock :class:`numpyro.infer.SVI` carries from one update to the next. It
  advances by one each time the model runs with a clock value supplied by SVI, so
  ``svi.run`` anneals inside one compiled step. (NumPyro's ``Trace_ELBO`` drops mutable state
  when ``num_particles > 1``; :class:`~numpyro_tempering.TemperedELBO` keeps it.)

Temperatures below 1 are allowed here when passed explicitly (they sharpen the likelihood);
the schedule constructors refuse them unless asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro.distributions import Distribution, ExpandedDistribution
from numpyro.primitives import Messenger, mutable
from numpyro.util import not_jax_tracer

__all__ = ["temper", "JointlyTempered", "TEMPERED", "DEFAULT_CLOCK"]

#: Key set to ``True`` in ``msg["infer"]`` for every site a ``temper`` handler tempers.
TEMPERED = "tempered"
#: Name of the mutable site holding a schedule's step counter.
DEFAULT_CLOCK = "_temper_clock"

Selector = Callable[[dict], bool]


def _names(arg: str | Collection[str] | None, what: str) -> frozenset[str]:
    if arg is None:
        return frozenset()
    if isinstance(arg, str):
        return frozenset([arg])
    names = frozenset(arg)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"`{what}` must be site names (strings), got {arg!r}.")
    return names


def check_temperature(temperature: Any, name: str = "temperature") -> None:
    """Raise ``ValueError`` if a concrete temperature is not finite and positive."""
    if not not_jax_tracer(temperature):
        return
    value = np.asarray(temperature)
    if value.size == 0:
        raise ValueError(f"`{name}` is empty.")
    if not np.issubdtype(value.dtype, np.number):
        raise TypeError(f"`{name}` must be numeric, got dtype {value.dtype}.")
    if not np.all(np.isfinite(value)) or np.any(value <= 0):
        bad = value[~(np.isfinite(value) & (value > 0))] if value.ndim else value
        raise ValueError(f"`{name}` must be finite and > 0, got {bad}.")


class JointlyTempered(Distribution):
    """A mixture whose summed-out local is tempered jointly with the data (``temper(joint=True)``).

    ``log_prob(x) = logsumexp(component_log_probs(x) / T, -1)``, where ``component_log_probs``
    are the base distribution's log p(x, z = k) for every value k of the summed-out local
    (annealed-and-multicanonical-vi, eq. 4 with p(x_n, z_n | beta)^(1/T)). Unnormalised in x,
    like every tempered site; ``sample`` draws from the untempered base.
    """

    def __init__(self, base: Distribution, inv_temperature: jax.typing.ArrayLike) -> None:
        self.base = base
        self.mixture = mixture_of(base)
        if self.mixture is None:
            raise TypeError(
                f"{type(base).__name__} has no `component_log_probs`: nothing to temper jointly."
            )
        self.inv_temperature = inv_temperature
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)

    @property
    def support(self):
        return self.base.support

    def sample(self, key, sample_shape=()):
        return self.base.sample(key, sample_shape)

    def log_prob(self, value):
        beta = jnp.asarray(self.inv_temperature)
        beta = beta[..., None] if beta.ndim else beta
        return logsumexp(beta * self.mixture.component_log_probs(value), axis=-1)


def mixture_of(fn: Distribution) -> Distribution | None:
    """The distribution exposing ``component_log_probs`` under plate expansions, if any."""
    while isinstance(fn, ExpandedDistribution):
        fn = fn.base_dist
    return fn if hasattr(fn, "component_log_probs") else None


class temper(Messenger):
    """Temper the selected sites of a model: log p_i -> log p_i / T.

    Args:
        fn: the model (omit to use as a decorator factory or context manager).
        temperature: T > 0: a number, a (traced) array broadcastable to each selected site's
            batch shape, or a schedule ``step -> T``.
        sites: ``None`` for all observed sites (the likelihood, including ``numpyro.factor``
            sites), a name or collection of names, or a predicate on the site message.
        latent: latent site names to temper in addition to the default selection.
        exclude: site names never to temper (e.g. a factor that belongs to the prior).
        joint: temper mixtures over a summed-out local jointly, p(x, z)^(1/T) inside the sum
            (see the module docstring); default ``False`` tempers every site through ``scale``.
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
        sites: str | Collection[str] | Selector | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
        clock: str = DEFAULT_CLOCK,
    ) -> None:
        self.joint = bool(joint)
        self.schedule = temperature if callable(temperature) else None
        if self.schedule is not None:
            first = self.schedule(0)
            if not_jax_tracer(first) and (
                np.ndim(first) != 0 or not math.isfinite(float(first)) or float(first) <= 0
            ):
                raise ValueError(
                    f"schedule `temperature` must return a finite scalar > 0; at step 0 it "
                    f"returned {first!r}."
                )
        else:
            check_temperature(temperature)
        self.temperature = temperature
        self._predicate: Selector | None = sites if callable(sites) else None
        self._sites = None if callable(sites) or sites is None else _names(sites, "sites")
        self._latent = _names(latent, "latent")
        self._exclude = _names(exclude, "exclude")
        self.clock = clock
        self._inv_temperature: Any = None
        self._seen: set[str] = set()
        self._num_tempered = 0
        super().__init__(fn)

    # -- selection -----------------------------------------------------------------------
    def selects(self, msg: dict) -> bool:
        """Whether this handler tempers the sample site described by ``msg``."""
        name = msg["name"]
        if name in self._exclude:
            return False
        if self._predicate is not None:
            chosen = bool(self._predicate(msg))
        elif self._sites is not None:
            chosen = name in self._sites
        else:
            chosen = bool(msg.get("is_observed"))
        return chosen or name in self._latent

    # -- temperature ---------------------------------------------------------------------
    def _start(self) -> None:
        self._seen = set()
        self._num_tempered = 0
        if self.schedule is None:
            temperature = self.temperature
        else:
            fresh = {"step": jnp.zeros((), jnp.int32), "temperature": self._at(0)}
            state = mutable(self.clock, fresh)
            if state is None:  # no handler records mutable state: evaluate at step 0
                state = fresh
            temperature = self._at(state["step"])
            if state is not fresh:  # SVI supplied the clock: advance it for the next update
                state["step"] = state["step"] + 1
                state["temperature"] = temperature
        self._inv_temperature = 1.0 / (
            temperature if isinstance(temperature, (int, float)) else jnp.asarray(temperature)
        )

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
        requested = (self._sites or frozenset()) | self._latent | self._exclude
        missing = sorted(requested - self._seen)
        if missing:
            raise ValueError(
                f"temper: no sample site named {missing} in the model; its sample sites are "
                f"{sorted(self._seen)}."
            )
        if self._num_tempered == 0:
            raise ValueError(
                "temper: the model has nothing to temper (no observed site, and no site "
                f"selected by `sites`/`latent`); its sample sites are {sorted(self._seen)}."
            )

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        self._seen.add(msg["name"])
        if not self.selects(msg):
            return
        beta = self._inv_temperature
        if jnp.ndim(beta) > 0:
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
        if self.joint and mixture_of(msg["fn"]) is not None:
            msg["fn"] = JointlyTempered(msg["fn"], beta)
        else:
            msg["scale"] = beta if msg.get("scale") is None else beta * msg["scale"]
        msg["infer"] = {**(msg.get("infer") or {}), TEMPERED: True}
        self._num_tempered += 1

    def postprocess_message(self, msg: dict) -> None:
        # ``replay`` (outside the model in every ELBO) replaces ``msg["infer"]`` with a copy of
        # the guide site's after this handler ran: mark that copy again. It is a fresh dict
        # that ``trace`` shares with the recorded site, so marking it in place is what the
        # recorded trace shows.
        if msg["type"] == "sample" and self.selects(msg):
            msg["infer"][TEMPERED] = True

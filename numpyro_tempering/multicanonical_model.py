r"""The ``multicanonical`` effect handler: the ladder temperature as an exactly marginalised site.

The multicanonical joint (Mandt et al. 2016, eq. 10-11) with the temperature
assignment :math:`y` summed out over the ladder is

.. math::

    p(x, z, \beta) = p(\beta) \sum_{m=1}^M \pi_m\,
        \frac{p(x, z \mid \beta)^{1/T_m}}{C(T_m)},
    \qquad
    \log p = \log p(\beta) + \operatorname{logsumexp}_m\Big(\log\pi_m
        + \frac{\ell(x, z, \beta)}{T_m} - \log C(T_m)\Big),

with :math:`\ell = \log p(x, z \mid \beta)` the tempered group (the sites
:class:`~numpyro_tempering.temper` selects: by default the likelihood). It is a normalised
model (each component integrates to one), so *any* NumPyro inference applies to it:
:class:`~numpyro.infer.Trace_ELBO`, ``log_density``, NUTS.

``multicanonical(model, ladder)`` runs the model under ``temper(model, 1.0, ...)`` to find
the tempered sites, neutralises their own log densities (their distribution is masked with
``False``; they keep temper's mark and get ``infer["multicanonical"] = True``), and adds one
``numpyro.factor`` site (``name``, outside ``temper``, so untempered) with the log-sum-exp
above, plus a ``numpyro.deterministic`` site ``name + "_probs"`` with the exact
conditional :math:`p(y = m \mid x, z, \beta) = \mathrm{softmax}_m(\log\pi_m + \ell/T_m -
\log C(T_m))`: the posterior over the temperature is what ``Predictive`` returns for that
site (average it over posterior draws to get :math:`p(y \mid x)`), or
:meth:`multicanonical.temperature_posterior` at given latent values.

With ``plate="docs"`` each element of the plate has its own temperature, marginalised
separately: :math:`\sum_n \operatorname{logsumexp}_m(\log\pi_m + \ell_n/T_m - \log
c_n(T_m))`, with each element's own :math:`\log c_n` from the ladder's ``element_log_c``
(a ladder without them is refused: an even split :math:`\log C/N` is exact only for
identical elements; see :mod:`numpyro_tempering.objectives.multicanonical`); under
subsampling the plate's subsample indices pick the minibatch's :math:`\log c_n` and the
sum over the minibatch is scaled by :math:`N/B`.

``joint=True`` tempers a mixture whose local is summed out jointly, as
:class:`~numpyro_tempering.temper` does: the component for :math:`T_m` then has
:math:`\log\sum_k p(x, z = k \mid \beta)^{1/T_m}` in place of :math:`\ell / T_m`.

Composition. With nothing tempered in a run (e.g. ``Predictive`` with the data set to
``None``) the handler adds nothing; with tempered latents but no tempered *observed* site it
adds nothing either and warns (the multicanonical density needs the data). Only the user's
sites are tempered (via :class:`~numpyro_tempering.temper`): NumPyro's auxiliary sites,
e.g. the Jacobian factors of MCMC's potential, keep their densities, so NUTS on
``multicanonical(model, ladder)`` samples the multicanonical posterior. The model sizes are
checked against the ladder's (a ladder without sizes is refused), and ``numpyro.param``
sites are refused (they would make the ladder's log C stale).
:func:`numpyro.infer.util.log_likelihood` (and so ``az.from_numpyro``'s log-likelihood group,
``az.loo``, ``az.waic``) on a multicanonical model is a ``ValueError`` naming the observed
sites: their densities enter only through the factor, which does not factorise over
observations, so there is no per-observation log likelihood of this model to report (NumPyro
would return zeros).

Relation to the M-ELBO
----------------------
For a guide :math:`q(\beta, z)`, Trace_ELBO on this model is

.. math::

    \mathcal{L}_{\mathrm{marg}} = \mathbb{E}_q\Big[\log p(\beta) - \log q
        + \operatorname{logsumexp}_m(a_m(\ell))\Big], \quad a_m(\ell) = \log\pi_m +
        \ell/T_m - \log C(T_m),

while the M-ELBO (eq. 13) with the mean-field :math:`q(y) = r` is
:math:`\mathcal{L}_M(r) = \mathbb{E}_q[\log p(\beta) - \log q] + \sum_m r_m(a_m(\mathbb{E}_q
\ell) - \log r_m)`. By Gibbs' inequality :math:`\sum_m r_m (a_m - \log r_m) \le
\operatorname{logsumexp}(a)`, with equality at :math:`r = \mathrm{softmax}(a)`, so the
optimal :math:`r^*` of eq. 18 gives :math:`\mathcal{L}_M(r^*) =
\mathbb{E}_q[\log p(\beta) - \log q] + \operatorname{logsumexp}_m a_m(\mathbb{E}_q\ell)`.
Because log-sum-exp is convex and :math:`a_m` affine in :math:`\ell`, Jensen gives

.. math::

    \mathcal{L}_M(r) \le \mathcal{L}_M(r^*) \le \mathcal{L}_{\mathrm{marg}}
    \le \log p_{\mathrm{mc}}(x) = \log \sum_m \pi_m \frac{\int p(\beta) p(x, z\mid\beta)^{1/T_m}
    dz\, d\beta}{C(T_m)},

with equality in the middle when :math:`\ell` is constant under :math:`q` (the exact
conditional :math:`p(y \mid z, \beta)` does not vary over :math:`q`). The same inequality
holds particle by particle for the Monte Carlo estimators on the same draws. The M-ELBO's
:math:`q(y)` is mean-field -- it depends on :math:`q` only through :math:`\mathbb{E}_q\ell` --
whereas here :math:`y` is integrated exactly per draw. Both reduce to the ordinary ELBO for a
ladder with only :math:`T = 1` (and :math:`\log C(1) = 0`).

Example:
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer.util import log_density
    >>> from numpyro_tempering.ladder import Ladder
    >>> from numpyro_tempering.structure import model_sizes
    >>> from numpyro_tempering.multicanonical_model import multicanonical
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> ladder = Ladder([1.0, 2.0]).with_log_partition_values(
    ...     [0.0, 0.7], sizes=model_sizes(model, 0.5))
    >>> lp, _ = log_density(multicanonical(model, ladder), (0.5,), {}, {"mu": 0.0})
    >>> lik = dist.Normal(0.0, 1.0).log_prob(0.5)
    >>> by_hand = dist.Normal(0.0, 1.0).log_prob(0.0) + jnp.logaddexp(
    ...     jnp.log(0.5) + lik, jnp.log(0.5) + lik / 2 - 0.7)
    >>> bool(jnp.allclose(lp, by_hand))
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.util import log_likelihood
from numpyro.primitives import Messenger

from numpyro_tempering.engine import _element_log_lik
from numpyro_tempering.handlers import (
    MULTICANONICAL,
    TEMPERED,
    JointlyTempered,
    Selection,
    already_tempered,
    temper,
)
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.roles import running_in
from numpyro_tempering.structure import (
    plate_not_found,
    sizes_from_sites,
    stale_params_message,
    subsample_scale,
)
from numpyro_tempering.temperatures import (
    element_log_partition,
    temperature_posterior,
    warn_if_flagged,
)

__all__ = ["multicanonical", "MULTICANONICAL"]


def log_probs_by_temperature(fn: Any, value: Any, inv_t: jax.Array) -> jax.Array:
    r"""A tempered site's log density at every inverse temperature: ``(M, *batch)``.

    ``fn`` as ``temper(model, 1.0, ...)`` left it: :math:`\log p / T_m`, or, for a jointly
    tempered mixture, :math:`\log\sum_k p(x, z = k)^{1/T_m}`.
    """
    if isinstance(fn, JointlyTempered):
        base, beta = fn.base, jnp.asarray(fn.inv_temperature)
        return jax.vmap(lambda b: JointlyTempered(base, b * beta).log_prob(value))(inv_t)
    log_prob = fn.log_prob(value)
    return jnp.reshape(inv_t, (-1,) + (1,) * jnp.ndim(log_prob)) * log_prob


def already_tempered_message(name: str, who: str) -> str:
    """Why a model whose site ``name`` a ``temper`` handler already tempered is refused."""
    return (
        f"{who}: site '{name}' is already tempered by a `temper` handler in the model given "
        "(its density is p^(1/T0)). The ladder's log C(T_m) is the untempered model's, so "
        "the multicanonical density would use it at the wrong temperatures (T0 T_m). Give "
        "the untempered model: the ladder's temperatures are the tempering."
    )


class multicanonical(Messenger):
    r"""Marginalise a ladder temperature into a model (see the module docstring).

    Args:
        fn: the (untempered) model.
        ladder: a :class:`~numpyro_tempering.ladder.Ladder` with ``log_c`` (the whole
            model's) and the model sizes it is for (a run of other sizes raises
            ``ValueError``); with ``plate``, also that plate's ``element_log_c``.
        plate: ``None`` for one temperature, or a plate name for one per element.
        sites, latent, exclude, joint: the tempered group, as in
            :class:`~numpyro_tempering.temper`; by default the ladder's
            :attr:`~numpyro_tempering.ladder.Ladder.selection` (a different one is a
            ``ValueError``).
        name: name of the added factor site (the posterior is at ``name + "_probs"``).
    """

    def __init__(
        self,
        fn: Callable,
        ladder: Ladder,
        *,
        plate: str | None = None,
        sites: str | Collection[str] | Callable | Selection | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
        name: str = "_multicanonical",
    ) -> None:
        if not isinstance(ladder, Ladder):
            raise TypeError(f"`ladder` must be a Ladder, got {type(ladder).__name__}.")
        ladder.require_log_partition()
        if plate is not None:
            ladder.require_element_log_partition(plate)
        warn_if_flagged(ladder, "multicanonical")
        self.ladder = ladder
        self.plate = plate
        self.name = name
        self._records: list[dict] = []
        self._plates: dict[str, tuple[int, int, Any]] = {}
        self._params: list[str] = []
        self.selection = ladder.selection_for(
            Selection.of(sites, latent, exclude, joint), "multicanonical"
        )
        tempered_fn = temper(fn, 1.0, sites=self.selection)
        super().__init__(tempered_fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._records, self._plates, self._params = [], {}, []
        with self:
            out = self.fn(*args, **kwargs)
            self._emit()
        return out

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "param":
            self._params.append(msg["name"])
            return
        if msg["type"] != "sample" or not msg["infer"].get(TEMPERED, False):
            return
        if already_tempered(msg["fn"]):
            raise ValueError(already_tempered_message(msg["name"], "multicanonical"))
        self._records.append(
            {
                "name": msg["name"],
                "fn": msg["fn"],
                "cond_indep_stack": list(msg["cond_indep_stack"]),
                "scale": msg.get("scale"),
                "is_observed": bool(msg["is_observed"]),
                "value": None,
            }
        )
        msg["fn"] = msg["fn"].mask(False)  # its density enters through the factor
        msg["infer"] = {**msg["infer"], MULTICANONICAL: True}

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "plate":  # full size, subsample size and subsample indices
            value = msg["value"]
            self._plates[msg["name"]] = (int(msg["args"][0]), int(jnp.shape(value)[0]), value)
            return
        if msg["type"] != "sample":
            return
        # found by name: ``replay`` (outside, in every ELBO) may have replaced msg["infer"]
        record = next((r for r in self._records if r["name"] == msg["name"]), None)
        if record is not None and record["value"] is None:
            record["value"] = msg["value"]
            # final here: a `condition` outside this handler observes the site after us
            record["is_observed"] = bool(msg["is_observed"])

    def _log_probs(self, inv_t: jax.Array) -> list[jax.Array]:
        out = []
        for r in self._records:
            log_prob = log_probs_by_temperature(r["fn"], r["value"], inv_t)
            out.append(log_prob if r["scale"] is None else r["scale"] * log_prob)
        return out

    def _emit(self) -> None:
        if not self._records:
            return  # nothing tempered (e.g. Predictive without data): nothing to add
        if running_in(log_likelihood):
            observed = sorted(r["name"] for r in self._records if r["is_observed"])
            raise ValueError(
                f"multicanonical: log_likelihood of the observed site(s) {observed} is not "
                "defined for a multicanonical model: their densities enter only through the "
                f"factor '{self.name}' (a log-sum-exp over the ladder that does not factorise "
                "over observations), so NumPyro would report zeros for them, and az.loo/az.waic "
                "would be meaningless. For LOO/WAIC of the target model, compute "
                "numpyro.infer.util.log_likelihood on the model itself (untempered), with "
                "draws from that model's posterior."
            )
        if self._params:
            raise ValueError(stale_params_message(sorted(set(self._params)), "multicanonical"))
        if not any(r["is_observed"] for r in self._records):
            warnings.warn(
                f"multicanonical: no tempered site is observed (tempered latent(s) "
                f"{[r['name'] for r in self._records]} only): the multicanonical density needs "
                "the data, so no factor is added and these sites' densities are left out of "
                "this run (fine for Predictive, wrong for a log density).",
                UserWarning,
                stacklevel=3,
            )
            return
        plates = {n: size for n, (size, _, _) in self._plates.items()}
        sites = [(r["name"], r["fn"], r["cond_indep_stack"]) for r in self._records]
        self.ladder.check_sizes(sizes_from_sites(plates, sites))
        dtype = jnp.result_type(*(jnp.asarray(r["value"]) for r in self._records), float)
        inv_t = jnp.asarray(self.ladder.inverse_temperatures, dtype)
        log_probs = self._log_probs(inv_t)  # each (M, *batch)
        if self.plate is None:
            ell = sum(
                (jnp.sum(lp.reshape(lp.shape[0], -1), axis=-1) for lp in log_probs),
                jnp.zeros_like(inv_t),
            )
            posterior = temperature_posterior(ell, self.ladder)  # eq. 18 at this draw
            total = posterior.log_marginal
        else:
            if self.plate not in self._plates:
                raise plate_not_found(self.plate, self._plates)
            size, subsample, indices = self._plates[self.plate]
            scale = subsample_scale(size, subsample)
            elements = sum(
                jax.vmap(lambda lp, r=r: _element_log_lik(r, lp, self.plate))(lp)
                for r, lp in zip(self._records, log_probs, strict=True)
            )  # (M, B), with the scale N/B
            log_c_n = element_log_partition(self.ladder, size, indices, dtype)  # (B, M)
            posterior = temperature_posterior(elements.T / scale, self.ladder, log_c=log_c_n)
            total = scale * jnp.sum(posterior.log_marginal)
        # numpyro.factor's site, marked: an outer `temper` must not temper it
        unit = dist.Unit(total)
        numpyro.sample(self.name, unit, obs=unit.sample(None),
                       infer={"is_auxiliary": True, MULTICANONICAL: True})
        numpyro.deterministic(self.name + "_probs", posterior.probs)

    def temperature_posterior(
        self,
        values: dict,
        *args: Any,
        rng_key: jax.Array | None = None,
        **kwargs: Any,
    ) -> jax.Array:
        r""":math:`p(y \mid x, z, \beta)` at the given latent ``values`` (a dict by site name):
        shape ``(M,)``, or ``(B, M)`` with a plate. Latents not given are drawn from the
        prior with ``rng_key``.

        Example:
            >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
            >>> from numpyro_tempering.ladder import UNCHECKED, Ladder
            >>> def model():
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=3.0)
            >>> mc = multicanonical(model, Ladder([1.0, 4.0]).with_log_partition_values(
            ...     [0.0, 0.0], sizes=UNCHECKED))
            >>> p = mc.temperature_posterior({"mu": 0.0})  # poor fit: mass on T = 4
            >>> bool(p[1] > p[0])
            True
        """
        key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        tr = trace(substitute(seed(self, key), data=values)).get_trace(*args, **kwargs)
        return tr[self.name + "_probs"]["value"]

r"""The ``multicanonical`` effect handler: the ladder temperature as an exactly marginalised site.

The multicanonical joint (annealed-and-multicanonical-vi, eq. 10-11) with the temperature
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
C(T_m)/N)`, with the per-element share :math:`\log C/N` of the whole model's log C (see
:mod:`numpyro_tempering.objectives.multicanonical`); under subsampling the sum over the
minibatch is scaled by :math:`N/B`.

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
    >>> from numpyro_tempering.multicanonical import multicanonical
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> ladder = Ladder([1.0, 2.0]).with_log_partition_values([0.0, 0.7])
    >>> lp, _ = log_density(multicanonical(model, ladder), (0.5,), {}, {"mu": 0.0})
    >>> lik = dist.Normal(0.0, 1.0).log_prob(0.5)
    >>> by_hand = dist.Normal(0.0, 1.0).log_prob(0.0) + jnp.logaddexp(
    ...     jnp.log(0.5) + lik, jnp.log(0.5) + lik / 2 - 0.7)
    >>> bool(jnp.allclose(lp, by_hand))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpyro
from jax.scipy.special import logsumexp
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from numpyro_tempering.engine import _element_log_lik
from numpyro_tempering.handlers import TEMPERED, temper
from numpyro_tempering.ladder import Ladder
from numpyro_tempering.log_partition import sizes_from_sites

__all__ = ["multicanonical", "MULTICANONICAL"]

#: Key set to ``True`` in ``msg["infer"]`` of the sites a ``multicanonical`` handler absorbed.
MULTICANONICAL = "multicanonical"


class multicanonical(Messenger):
    r"""Marginalise a ladder temperature into a model (see the module docstring).

    Args:
        fn: the (untempered) model.
        ladder: a :class:`~numpyro_tempering.ladder.Ladder` with ``log_c`` (the whole
            model's, computed with the same ``sites``/``latent``/``exclude``). If it records
            model sizes, a run of different sizes raises ``ValueError``.
        plate: ``None`` for one temperature, or a plate name for one per element.
        sites, latent, exclude: the tempered group, as in :class:`~numpyro_tempering.temper`.
        name: name of the added factor site (the posterior is at ``name + "_probs"``).
    """

    def __init__(
        self,
        fn: Callable,
        ladder: Ladder,
        *,
        plate: str | None = None,
        sites: str | Collection[str] | Callable | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        name: str = "_multicanonical",
    ) -> None:
        if not isinstance(ladder, Ladder):
            raise TypeError(f"`ladder` must be a Ladder, got {type(ladder).__name__}.")
        ladder.require_log_partition()
        self.ladder = ladder
        self.plate = plate
        self.name = name
        self._records: list[dict] = []
        self._plates: dict[str, tuple[int, int]] = {}
        super().__init__(temper(fn, 1.0, sites=sites, latent=latent, exclude=exclude))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._records, self._plates = [], {}
        with self:
            out = self.fn(*args, **kwargs)
            self._emit()
        return out

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or not msg["infer"].get(TEMPERED, False):
            return
        self._records.append(
            {
                "name": msg["name"],
                "fn": msg["fn"],
                "cond_indep_stack": list(msg["cond_indep_stack"]),
                "scale": msg.get("scale"),
                "log_prob": None,
            }
        )
        msg["fn"] = msg["fn"].mask(False)  # its density enters through the factor
        msg["infer"] = {**msg["infer"], MULTICANONICAL: True}

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "plate":  # full size and subsample size
            self._plates[msg["name"]] = (int(msg["args"][0]), int(jnp.shape(msg["value"])[0]))
            return
        if msg["type"] != "sample":
            return
        # found by name: ``replay`` (outside, in every ELBO) may have replaced msg["infer"]
        record = next((r for r in self._records if r["name"] == msg["name"]), None)
        if record is None or record["log_prob"] is not None:
            return
        log_prob = record["fn"].log_prob(msg["value"])
        if record["scale"] is not None:
            log_prob = record["scale"] * log_prob
        record["log_prob"] = log_prob

    def _emit(self) -> None:
        plates = {n: size for n, (size, _) in self._plates.items()}
        sites = [(r["name"], r["fn"], r["cond_indep_stack"]) for r in self._records]
        self.ladder.check_sizes(sizes_from_sites(plates, sites))
        dtype = jnp.result_type(*(r["log_prob"] for r in self._records), float)
        inv_t, log_pi, log_c = self.ladder.arrays(dtype)
        if self.plate is None:
            ell = sum((jnp.sum(r["log_prob"]) for r in self._records), jnp.zeros((), dtype))
            logits = log_pi + ell * inv_t - log_c
            total = logsumexp(logits)
        else:
            if self.plate not in self._plates:
                raise ValueError(
                    f"plate '{self.plate}' is not in the model; its plates are "
                    f"{sorted(self._plates)}."
                )
            size, subsample = self._plates[self.plate]
            scale = size / subsample
            elements = sum(
                (_element_log_lik(r, r["log_prob"], self.plate) for r in self._records),
                jnp.zeros((), dtype),
            )
            logits = log_pi + (elements / scale)[:, None] * inv_t - log_c / size
            total = scale * jnp.sum(logsumexp(logits, axis=-1))
        numpyro.factor(self.name, total)
        numpyro.deterministic(self.name + "_probs", jax.nn.softmax(logits, axis=-1))

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
            >>> from numpyro_tempering.ladder import Ladder
            >>> def model():
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=3.0)
            >>> mc = multicanonical(model, Ladder([1.0, 4.0]).with_log_partition_values(
            ...     [0.0, 0.0]))
            >>> p = mc.temperature_posterior({"mu": 0.0})  # poor fit: mass on T = 4
            >>> bool(p[1] > p[0])
            True
        """
        key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        tr = trace(substitute(seed(self, key), data=values)).get_trace(*args, **kwargs)
        return tr[self.name + "_probs"]["value"]

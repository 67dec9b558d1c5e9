"""The tempered ELBO of annealed variational inference (Mandt et al. 2016, eq. 7)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_tempering.handlers import Selection, check_temperature, temper
from numpyro_tempering.objectives.base import EngineELBO

__all__ = ["TemperedELBO"]


class TemperedELBO(EngineELBO):
    r"""Tempered ELBO (Mandt et al. 2016, eq. 7):

    .. math::

        \mathcal{L}_A(q; T) = \mathbb{E}_q[\log p(\beta)] - \mathbb{E}_q[\log q(\beta)]
            + \sum_i \big(\mathbb{E}_q[\log p(x_i, z_i \mid \beta)] / T
            - \mathbb{E}_q[\log q(z_i)]\big).

    The loss SVI minimises is :math:`-\mathcal{L}_A`, estimated with ``num_particles``
    reparameterised particles from the guide (mapped as ``vectorize_particles`` says); the log
    normaliser :math:`\log C(T)` of eq. 4 is constant in q and omitted, as in the paper.

    The temperature comes from one of two places:

    * ``TemperedELBO(temperature=T)`` tempers the model's likelihood (or the sites chosen with
      ``sites``/``latent``/``exclude``/``joint``, as in :class:`~numpyro_tempering.temper`)
      at a fixed or traced T;
    * ``TemperedELBO()`` on a model wrapped with ``temper(model, schedule)`` anneals: the
      schedule's clock lives in SVI's mutable state and advances by one per update, also with
      ``num_particles > 1`` (the clock is the same for every particle, so it is kept; other
      mutable state is ignored with a warning, as Trace_ELBO does). A schedule cannot be
      given to the ELBO itself, because stock SVI only carries state for ``numpyro.mutable``
      sites it sees in the model at ``SVI.init``.

    A drop-in for :class:`numpyro.infer.Trace_ELBO`: the positional arguments are
    Trace_ELBO's, and at T = 1 (or with no temperature on an untempered model) the value,
    gradient and mutable state equal Trace_ELBO's on the same key, with the same warnings
    (model/guide mismatch, discrete latents under SVI). The temperature and the site
    selection are keyword-only, so ``TemperedELBO(3)`` means three particles, as
    ``Trace_ELBO(3)`` does; a float there (``TemperedELBO(4.0)``) is a ``TypeError``.

    Args:
        num_particles: particles S of the Monte Carlo estimate.
        vectorize_particles: ``True`` maps particles with ``jax.vmap``, ``False`` with
            ``jax.lax.map``, or a callable ``(fn, keys) -> outputs`` (e.g.
            ``lambda f, k: jax.pmap(f)(k)``).
        multi_sample_guide: the guide draws several samples at once (a leading sample axis),
            as in Trace_ELBO.
        sum_sites: ``False`` returns the loss as a dict of per-site terms
            :math:`-\mathbb{E}_q[\log p_i - \log q_i]` (tempered sites already divided by T),
            which sum to the loss.
        temperature: T > 0 (number, array broadcastable to the tempered sites, or traced).
        sites, latent, exclude, joint: which sites are tempered, as in ``temper``.

    The engine does not enumerate: a model site marked for parallel enumeration that the
    guide does not sample is refused with a ``ValueError``; for enumerated discrete locals
    use ``numpyro.infer.TraceEnum_ELBO`` on ``temper(model, T)``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import SVI
        >>> from numpyro.infer.autoguide import AutoNormal
        >>> from numpyro_tempering import TemperedELBO, schedules, temper
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> annealed = temper(model, schedules.linear(10.0, 1.0, num_steps=100))
        >>> svi = SVI(annealed, AutoNormal(model), optax.adam(0.1), TemperedELBO())
        >>> result = svi.run(jax.random.PRNGKey(0), 200, jnp.ones(5), progress_bar=False)
        >>> int(result.state.mutable_state["_temper_clock"]["step"])
        200

        At T = 1 it is Trace_ELBO, with Trace_ELBO's positional arguments:

        >>> from numpyro.infer import Trace_ELBO
        >>> def guide(x):
        ...     numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.5), 1.0))
        >>> key, params, x = jax.random.PRNGKey(1), {"m": 0.3}, jnp.ones(5)
        >>> ref = Trace_ELBO(4, False).loss(key, params, model, guide, x)
        >>> out = TemperedELBO(4, False, temperature=1.0).loss(key, params, model, guide, x)
        >>> bool(jnp.allclose(out, ref))
        True
    """

    #: Like Trace_ELBO: discrete latent sites must be sampled by the guide (their gradient has
    #: no score-function term); sites marked for enumeration and absent from the guide are
    #: refused (use ``TraceEnum_ELBO`` on ``temper(model, T)``).
    can_infer_discrete = False

    def __init__(
        self,
        num_particles: int = 1,
        vectorize_particles: bool | Callable = True,
        multi_sample_guide: bool = False,
        sum_sites: bool = True,
        *,
        temperature: jax.typing.ArrayLike | None = None,
        sites: str | Collection[str] | Callable | Selection | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
    ) -> None:
        if isinstance(num_particles, bool) or not isinstance(num_particles, (int, np.integer)):
            raise TypeError(
                "TemperedELBO: `num_particles` (the first positional argument, as in "
                f"Trace_ELBO) must be a positive integer, got {num_particles!r}. The "
                "temperature is keyword-only: TemperedELBO(temperature=T)."
            )
        if num_particles < 1:
            raise ValueError(
                f"TemperedELBO: `num_particles` must be a positive integer, got {num_particles}."
            )
        for name, flag in (("multi_sample_guide", multi_sample_guide), ("sum_sites", sum_sites)):
            if not isinstance(flag, bool):
                raise TypeError(f"TemperedELBO: `{name}` must be True or False, got {flag!r}.")
        if callable(temperature):
            raise TypeError(
                "TemperedELBO(temperature=...) takes a number or array. To anneal, give the "
                "schedule to the model: SVI(temper(model, schedule), guide, optim, "
                "TemperedELBO()), so that its clock lives in SVI's mutable state."
            )
        self.selection = Selection.of(sites, latent, exclude, joint)
        if temperature is not None:
            check_temperature(temperature)
        elif self.selection != Selection():
            temperature = 1.0
        self.temperature = temperature
        self.multi_sample_guide = multi_sample_guide
        self.sum_sites = sum_sites
        super().__init__(num_particles=int(num_particles), vectorize_particles=vectorize_particles)

    def tempered_model(self, model: Callable) -> Callable:
        """The model as this objective sees it (wrapped in ``temper`` if T was given)."""
        if self.temperature is None:
            return model
        return temper(model, self.temperature, sites=self.selection)

    def prepare(self, model: Callable, guide: Callable) -> tuple[Callable, Callable]:
        return self.tempered_model(model), guide

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = self.log_weights(
            rng_key, param_map, model, guide, args, kwargs, per_site=not self.sum_sites
        )
        if self.sum_sites:
            loss = -jnp.mean(weights.log_w)
        else:
            loss = {name: -jnp.mean(v) for name, v in weights.site_log_w.items()}
        return {"loss": loss, "mutable_state": weights.mutable_state}

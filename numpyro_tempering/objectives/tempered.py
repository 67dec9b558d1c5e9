"""The tempered ELBO of annealed variational inference (annealed-and-multicanonical-vi, eq. 7)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
from numpyro.infer.elbo import ELBO

from numpyro_tempering.engine import log_weights
from numpyro_tempering.handlers import check_temperature, temper

__all__ = ["TemperedELBO"]


class TemperedELBO(ELBO):
    r"""Tempered ELBO, eq. 7 of Mandt et al. (annealed-and-multicanonical-vi):

    .. math::

        \mathcal{L}_A(q; T) = \mathbb{E}_q[\log p(\beta)] - \mathbb{E}_q[\log q(\beta)]
            + \sum_i \big(\mathbb{E}_q[\log p(x_i, z_i \mid \beta)] / T
            - \mathbb{E}_q[\log q(z_i)]\big).

    The loss SVI minimises is :math:`-\mathcal{L}_A`, estimated with ``num_particles``
    reparameterised particles from the guide (vectorised with ``jax.vmap``); the log
    normaliser :math:`\log C(T)` of eq. 4 is constant in q and omitted, as in the paper.

    The temperature comes from one of two places:

    * ``TemperedELBO(temperature=T)`` tempers the model's likelihood (or the sites chosen with
      ``sites``/``latent``/``exclude``/``joint``, as in :class:`~numpyro_tempering.temper`)
      at a fixed or traced T;
    * ``TemperedELBO()`` on a model wrapped with ``temper(model, schedule)`` anneals: the
      schedule's clock lives in SVI's mutable state and advances by one per update, also with
      ``num_particles > 1``. A schedule cannot be given to the ELBO itself, because stock SVI
      only carries state for ``numpyro.mutable`` sites it sees in the model at ``SVI.init``.

    At T = 1 the value and gradient equal :class:`numpyro.infer.Trace_ELBO`'s on the same key.

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
    """

    can_infer_discrete = False

    def __init__(
        self,
        temperature: jax.typing.ArrayLike | None = None,
        *,
        sites: str | Collection[str] | Callable | None = None,
        latent: str | Collection[str] = (),
        exclude: str | Collection[str] = (),
        joint: bool = False,
        num_particles: int = 1,
    ) -> None:
        if callable(temperature):
            raise TypeError(
                "TemperedELBO(temperature=...) takes a number or array. To anneal, give the "
                "schedule to the model: SVI(temper(model, schedule), guide, optim, "
                "TemperedELBO()), so that its clock lives in SVI's mutable state."
            )
        if temperature is not None:
            check_temperature(temperature)
        elif sites is not None or latent or exclude:
            temperature = 1.0
        self.temperature = temperature
        self._selection = dict(sites=sites, latent=latent, exclude=exclude, joint=joint)
        super().__init__(num_particles=num_particles)

    def tempered_model(self, model: Callable) -> Callable:
        """The model as this objective sees it (wrapped in ``temper`` if T was given)."""
        if self.temperature is None:
            return model
        return temper(model, self.temperature, **self._selection)

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        weights = log_weights(
            rng_key,
            param_map,
            self.tempered_model(model),
            guide,
            args,
            kwargs,
            num_particles=self.num_particles,
        )
        return {"loss": -jnp.mean(weights.log_w), "mutable_state": weights.mutable_state}

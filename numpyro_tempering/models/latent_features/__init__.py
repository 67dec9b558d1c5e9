r"""Beta-Bernoulli latent features: structured stochastic VI with tempering.

The finite beta-Bernoulli process with a linear-Gaussian likelihood of Shah, Knowles and
Ghahramani (2015; cited as "Shah et al. 2015, supplement,
<section>"), fitted by four local schemes inside stochastic VI and by batch mean-field VI,
each at T = 1, annealed and multicanonically (Mandt et al. 2016, Algorithm 1, eq. 15-18).

* :mod:`.model` -- the NumPyro :func:`model` (usable with ``temper``, MCMC and SVI), data
  (:func:`make_data`, the classic 6 x 6 toy :func:`make_toy_data`) and
  :func:`feature_recovery`.
* :mod:`.conjugate` -- q over the globals (:class:`GlobalParams`), its moments, the
  natural-gradient / CAVI step :func:`global_step` and the tempered local normaliser
  :func:`local_log_partition`.
* :mod:`.local` -- the local steps: Gibbs sweeps (Mimno-SVI, Gibbs-SSVI), mean-field and
  Titsias local ELBOs by gradient steps (MF-SSVI, Titsias-SSVI), mean-field CAVI (batch).
* :mod:`.svi` -- the schemes, the three temperings and the compiled fit.
* :mod:`.evaluate` -- held-out log-likelihood (importance sampling, or exact enumeration for
  small K).

Example:
    >>> import jax
    >>> from numpyro_tempering.models import latent_features as lf
    >>> data = lf.make_toy_data(jax.random.PRNGKey(0), 60)
    >>> q0 = lf.init_params(jax.random.PRNGKey(1), data.y, 4)  # a starting q over the globals
    >>> stats = lf.gibbs_local_stats(jax.random.PRNGKey(2), data.y[:5], lf.expected_moments(q0))
    >>> stats.z.shape  # E[z_ik] under Mimno-SVI's local approximation
    (5, 4)
"""

from numpyro_tempering.models.latent_features.conjugate import (
    GlobalMoments,
    GlobalParams,
    Globals,
    elbo_globals,
    expected_moments,
    global_step,
    init_params,
    local_log_partition,
    point_estimate,
    point_moments,
    prior_params,
    sample_globals,
)
from numpyro_tempering.models.latent_features.evaluate import (
    HeldOut,
    exact_log_lik,
    heldout_log_lik,
    log_joint_collapsed,
)
from numpyro_tempering.models.latent_features.local import (
    LocalStats,
    MeanFieldParams,
    expected_log_lik,
    gibbs_local_stats,
    mean_field_cavi,
    mean_field_elbo,
    mean_field_local_stats,
    titsias_elbo,
    titsias_local_stats,
)
from numpyro_tempering.models.latent_features.model import (
    DEFAULT_PRIOR,
    TOY_FEATURE_NAMES,
    LatentFeatureData,
    Prior,
    feature_recovery,
    make_data,
    make_toy_data,
    model,
    split_heldout,
    toy_features,
)
from numpyro_tempering.models.latent_features.svi import (
    SCHEMES,
    TEMPERINGS,
    FitResult,
    Settings,
    fit,
    make_fit,
)

__all__ = [
    "DEFAULT_PRIOR",
    "SCHEMES",
    "TEMPERINGS",
    "TOY_FEATURE_NAMES",
    "FitResult",
    "GlobalMoments",
    "GlobalParams",
    "Globals",
    "HeldOut",
    "LatentFeatureData",
    "LocalStats",
    "MeanFieldParams",
    "Prior",
    "Settings",
    "elbo_globals",
    "exact_log_lik",
    "expected_log_lik",
    "expected_moments",
    "feature_recovery",
    "fit",
    "gibbs_local_stats",
    "global_step",
    "heldout_log_lik",
    "init_params",
    "local_log_partition",
    "log_joint_collapsed",
    "make_data",
    "make_fit",
    "make_toy_data",
    "mean_field_cavi",
    "mean_field_elbo",
    "mean_field_local_stats",
    "model",
    "point_estimate",
    "point_moments",
    "prior_params",
    "sample_globals",
    "split_heldout",
    "titsias_elbo",
    "titsias_local_stats",
    "toy_features",
]

r"""Temperature ladders for multicanonical variational inference.

Multicanonical VI (annealed-and-multicanonical-vi, section 2.3, eq. 9-11) makes the
temperature a latent variable :math:`y \sim \mathrm{Mult}(\pi)` over a finite ladder
:math:`T_1 = 1 < T_2 < \dots < T_M`; conditional on :math:`y = m` the model is the tempered
joint normalised by :math:`C(T_m)`. A :class:`Ladder` holds everything that is fixed about
this: the temperatures, the prior weights :math:`\pi_m`, and -- once computed --
:math:`\log C(T_m)` with its Monte Carlo standard error and the :class:`ModelSizes` it was
computed for.

:math:`\log C` depends only on the model's structure and sizes, not on the data values, so a
ladder is computed once and reused across fits (and across data sets of the same size)::

    ladder = Ladder.geometric(1.0, 10.0, 100).with_log_partition(model, key, *args)

The paper's default is 100 temperatures from 1 to 10 on an exponential scale with uniform
weights (section 4.1): :meth:`Ladder.geometric` with its defaults.

A ``Ladder`` is immutable (``with_*`` methods return new ladders) and a JAX pytree (its
arrays are leaves, the sizes are static), so it can cross ``jax.jit`` boundaries.

Example:
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro_tempering.ladder import Ladder
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with numpyro.plate("data", x.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> ladder = Ladder.geometric(1.0, 10.0, 5).with_log_partition(
    ...     model, jax.random.PRNGKey(0), jnp.zeros(3))
    >>> ladder.temperatures.round(3).tolist()
    [1.0, 1.778, 3.162, 5.623, 10.0]
    >>> ladder.sizes.plates
    (('data', 3),)
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.util import not_jax_tracer

from numpyro_tempering.log_partition import ModelSizes, Selection, log_partition
from numpyro_tempering.partition import Fallback

__all__ = ["Ladder", "ModelSizes"]

_WEIGHT_TOL = 1e-6


def _concrete(*xs: Any) -> bool:
    return all(x is None or not_jax_tracer(x) for x in xs)


def _vector(value: Any, name: str, size: int | None = None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D array, got shape {arr.shape}.")
    if size is not None and arr.shape[0] != size:
        raise ValueError(
            f"`{name}` has {arr.shape[0]} entries but the ladder has {size} temperatures."
        )
    return arr


def _check_temperatures(temps: np.ndarray) -> None:
    if temps.size == 0:
        raise ValueError("`temperatures` is empty: a ladder needs at least T_1 = 1.")
    if not np.all(np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError(f"`temperatures` must be finite and > 0, got {temps}.")
    if temps[0] != 1.0:
        raise ValueError(
            f"`temperatures` must start at T_1 = 1 (the untempered model, which the "
            f"multicanonical model recovers when conditioned on T = 1); got T_1 = {temps[0]}."
        )
    steps = np.diff(temps)
    if np.any(steps <= 0):
        i = int(np.argmax(steps <= 0))
        raise ValueError(
            f"`temperatures` must be strictly increasing; got T_{i + 1} = {temps[i]} "
            f"followed by T_{i + 2} = {temps[i + 1]}."
        )


def _check_weights(weights: np.ndarray) -> None:
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"`weights` must be finite and >= 0, got {weights}.")
    total = weights.sum()
    if abs(total - 1.0) > _WEIGHT_TOL:
        raise ValueError(f"`weights` must sum to 1 (the prior pi_m), got sum {total}.")


def _check_log_c(log_c: np.ndarray, stderr: np.ndarray | None, temps: np.ndarray) -> None:
    bad = ~np.isfinite(log_c)
    if np.any(bad):
        raise ValueError(
            f"`log_c` must be finite; it is {log_c[bad].tolist()} at temperatures "
            f"{temps[bad].tolist()} (numerical trouble in the log C estimate: check the "
            "model's tempered sites, or the estimate's num_nonfinite)."
        )
    if stderr is not None and (not np.all(np.isfinite(stderr)) or np.any(stderr < 0)):
        raise ValueError(f"`stderr` must be finite and >= 0, got {stderr}.")


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class Ladder:
    r"""An immutable temperature ladder :math:`T_1 = 1 < \dots < T_M` with prior weights.

    Args:
        temperatures: strictly increasing, finite, ``T_1 = 1`` exactly.
        weights: prior :math:`\pi_m` (non-negative, summing to 1); uniform by default.
        log_c: :math:`\log C(T_m)` of the *whole* model (see
            :mod:`numpyro_tempering.log_partition`), or ``None`` until computed.
        stderr: Monte Carlo standard error of ``log_c`` (``None`` if exact / unknown).
        sizes: the :class:`ModelSizes` ``log_c`` was computed for; objectives refuse a
            model of different sizes. ``None`` skips the check.

    Values are stored as float64 NumPy arrays and cast to the working dtype where used.

    Example:
        >>> Ladder([1.0, 2.0, 4.0]).weights.tolist()
        [0.3333333333333333, 0.3333333333333333, 0.3333333333333333]
        >>> Ladder([2.0, 4.0])
        Traceback (most recent call last):
        ...
        ValueError: `temperatures` must start at T_1 = 1 ...
    """

    temperatures: Any
    weights: Any = None
    log_c: Any = None
    stderr: Any = None
    sizes: ModelSizes | None = field(default=None)

    def __post_init__(self) -> None:
        if not _concrete(self.temperatures, self.weights, self.log_c, self.stderr):
            return  # rebuilt under a JAX transformation: validated when constructed
        temps = _vector(self.temperatures, "temperatures")
        _check_temperatures(temps)
        m = temps.size
        if self.weights is None:
            weights = np.full(m, 1.0 / m)
        else:
            weights = _vector(self.weights, "weights", m)
            _check_weights(weights)
        log_c = None if self.log_c is None else _vector(self.log_c, "log_c", m)
        stderr = None if self.stderr is None else _vector(self.stderr, "stderr", m)
        if stderr is not None and log_c is None:
            raise ValueError("`stderr` given without `log_c`.")
        if log_c is not None:
            _check_log_c(log_c, stderr, temps)
        if self.sizes is not None and not isinstance(self.sizes, ModelSizes):
            raise TypeError(f"`sizes` must be a ModelSizes or None, got {type(self.sizes)}.")
        for name, value in (
            ("temperatures", temps),
            ("weights", weights),
            ("log_c", log_c),
            ("stderr", stderr),
        ):
            if value is not None:
                value.setflags(write=False)
            object.__setattr__(self, name, value)

    # -- pytree -------------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple, ModelSizes | None]:
        return (self.temperatures, self.weights, self.log_c, self.stderr), self.sizes

    @classmethod
    def tree_unflatten(cls, sizes: ModelSizes | None, children: tuple) -> Ladder:
        obj = object.__new__(cls)
        for name, value in zip(
            ("temperatures", "weights", "log_c", "stderr"), children, strict=True
        ):
            object.__setattr__(obj, name, value)
        object.__setattr__(obj, "sizes", sizes)
        return obj

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def geometric(
        cls,
        start: float = 1.0,
        stop: float = 10.0,
        num: int = 100,
        *,
        weights: Any = None,
    ) -> Ladder:
        """``num`` temperatures from ``start`` (must be 1) to ``stop`` with equal ratios.

        The paper's default ladder (section 4.1): 100 temperatures from 1 to 10 on an
        exponential scale, uniform weights.

        Example:
            >>> Ladder.geometric(1.0, 100.0, 3).temperatures.tolist()
            [1.0, 10.0, 100.0]
        """
        if int(num) != num or num < 1:
            raise ValueError(f"`num` must be a positive integer, got {num!r}.")
        if num == 1:
            return cls([float(start)], weights)
        if not (np.isfinite(start) and np.isfinite(stop) and 0 < start < stop):
            raise ValueError(f"need 0 < start < stop (finite), got start={start}, stop={stop}.")
        temps = np.geomspace(float(start), float(stop), int(num))
        temps[0], temps[-1] = float(start), float(stop)
        return cls(temps, weights)

    # -- accessors -------------------------------------------------------------------------
    @property
    def num_temperatures(self) -> int:
        """M, the number of rungs."""
        return int(np.shape(self.temperatures)[0])

    @property
    def log_weights(self) -> Any:
        r""":math:`\log \pi_m` (``-inf`` where a weight is 0)."""
        with np.errstate(divide="ignore"):
            return np.log(self.weights) if _concrete(self.weights) else jnp.log(self.weights)

    @property
    def inverse_temperatures(self) -> Any:
        """1 / T_m."""
        return 1.0 / self.temperatures

    @property
    def has_log_partition(self) -> bool:
        """Whether ``log_c`` has been computed or given."""
        return self.log_c is not None

    def arrays(self, dtype: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(1/T, log pi, log C)`` as JAX arrays of ``dtype`` (default float dtype)."""
        self.require_log_partition()
        dtype = jnp.result_type(float) if dtype is None else dtype
        inv_t = jnp.asarray(self.inverse_temperatures, dtype)
        log_pi = jnp.asarray(self.log_weights, dtype)
        return inv_t, log_pi, jnp.asarray(self.log_c, dtype)

    def require_log_partition(self) -> None:
        """Raise ``ValueError`` if ``log_c`` is missing."""
        if self.log_c is None:
            raise ValueError(
                "this ladder has no log C(T): call ladder.with_log_partition(model, key, "
                "*args) (or .with_log_partition_values(log_c)) first; multicanonical VI "
                "needs it (annealed-and-multicanonical-vi eq. 13)."
            )

    def check_sizes(self, sizes: ModelSizes, what: str = "the ladder's log C") -> None:
        """Raise ``ValueError`` if ``sizes`` (of the model being fitted) differ from the
        sizes ``log_c`` was computed for (no check if the ladder has none)."""
        if self.sizes is not None:
            sizes.check_matches(self.sizes, what)

    # -- log C ----------------------------------------------------------------------------
    def with_log_partition_values(
        self,
        log_c: Any,
        stderr: Any = None,
        sizes: ModelSizes | None = None,
    ) -> Ladder:
        """A copy holding the given :math:`\\log C(T_m)` (e.g. a closed form).

        Example:
            >>> lad = Ladder([1.0, 2.0]).with_log_partition_values([0.0, float("nan")])
            Traceback (most recent call last):
            ...
            ValueError: `log_c` must be finite; it is [nan] at temperatures [2.0] ...
        """
        return Ladder(self.temperatures, self.weights, log_c, stderr, sizes)

    def with_log_partition(
        self,
        model: Callable,
        rng_key: jax.Array,
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
    ) -> Ladder:
        """A copy holding log C estimated by
        :func:`~numpyro_tempering.log_partition.log_partition` (same arguments), with its
        standard error and the model sizes.

        The tempering selection (``sites``/``latent``/``exclude``) must be the one the
        objective or handler will use; the tempered site names are part of the sizes.
        """
        est = log_partition(
            rng_key,
            model,
            self.temperatures,
            *args,
            num_samples=num_samples,
            num_inner=num_inner,
            plate=plate,
            sites=sites,
            latent=latent,
            exclude=exclude,
            batch_size=batch_size,
            fallback=fallback,
            **kwargs,
        )
        bad = np.asarray(est.num_nonfinite)
        if np.any(bad):
            temps = np.asarray(self.temperatures)
            raise ValueError(
                f"log C estimate: {bad[bad > 0].tolist()} of {num_samples} outer draws were "
                f"non-finite (NaN or +inf) at temperatures {temps[bad > 0].tolist()}."
            )
        return Ladder(
            self.temperatures,
            self.weights,
            np.asarray(est.log_c),
            np.asarray(est.stderr),
            est.sizes,
        )

    def __repr__(self) -> str:
        temps = np.asarray(self.temperatures) if _concrete(self.temperatures) else None
        span = "traced" if temps is None else f"T={temps[0]:.3g}..{temps[-1]:.3g}"
        return (
            f"Ladder(M={self.num_temperatures}, {span}, "
            f"log_c={'yes' if self.log_c is not None else 'no'}, sizes={self.sizes})"
        )

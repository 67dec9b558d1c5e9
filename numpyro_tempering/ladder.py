r"""Temperature ladders for multicanonical variational inference.

Multicanonical VI (Mandt et al. 2016, section 2.3, eq. 9-11) makes the
temperature a latent variable :math:`y \sim \mathrm{Mult}(\pi)` over a finite ladder
:math:`T_1 = 1 < T_2 < \dots < T_M`; conditional on :math:`y = m` the model is the tempered
joint normalised by :math:`C(T_m)`. A :class:`Ladder` holds everything that is fixed about
this: the temperatures, the prior weights :math:`\pi_m`, and -- once computed --
:math:`\log C(T_m)` with its Monte Carlo diagnostics, the per-element
:math:`\log c_n(T_m)` a per-element temperature needs, and the :class:`ModelSizes` it was
computed for.

:math:`\log C` depends only on the model's structure and sizes, not on the data values, so a
ladder is computed once and reused across fits (and across data sets of the same size)::

    ladder = Ladder.geometric(1.0, 10.0, 100).with_log_partition(model, key, *args)

The paper's default is 100 temperatures from 1 to 10 on an exponential scale with uniform
weights (section 4.1): :meth:`Ladder.geometric` with its defaults.

**Trust.** A Monte Carlo log C can be off by hundreds of nats with a small standard error
(see :mod:`numpyro_tempering.partition_function`). The ladder keeps, per temperature, the
standard error ``stderr`` (across SMC replicates for the default estimator), the effective
sample size ``ess``, the number of SMC stages ``num_stages``, the Pareto :math:`\hat k`
``pareto_k`` (plain Monte Carlo only) and the estimator's own flags (``untrusted``);
``flagged`` marks the temperatures whose estimate cannot be trusted, and the ``repr`` and
:meth:`Ladder.summary` show them. The multicanonical objective
and handler warn when given a ladder with flagged temperatures.

**Sizes.** The objective and handler compare the model they run with the sizes the ladder's
log C was computed for (plate sizes, tempered sites and shapes). A ladder without sizes is
refused there, never silently accepted: :meth:`Ladder.with_log_partition` always records
them; with :meth:`Ladder.with_log_partition_values` give
``sizes=model_sizes(model, *args, ...)``, or ``sizes=UNCHECKED`` to take responsibility.

**Per-element temperatures** (``plate="data"`` in the objective or handler) need the
per-element :math:`\log c_n(T_m)`, shape ``(M, N)`` (``element_log_c``, for the plate
named ``plate``): from ``with_log_partition(..., plate="data")`` on the full plate, or given
(a closed form) to ``with_log_partition_values(element_log_c=..., plate="data")``.

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
    ...     model, jax.random.PRNGKey(0), jnp.zeros(3), plate="data")
    >>> ladder.temperatures.round(3).tolist()
    [1.0, 1.778, 3.162, 5.623, 10.0]
    >>> ladder.sizes.plates, ladder.element_log_c.shape, bool(ladder.flagged.any())
    ((('data', 3),), (5, 3), False)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.util import not_jax_tracer

from numpyro_tempering.handlers import Selection
from numpyro_tempering.partition_function import (
    LogPartitionEstimate,
    flag_untrusted,
    log_partition,
)
from numpyro_tempering.schedules import check_temperature
from numpyro_tempering.structure import ModelSizes

__all__ = ["UNCHECKED", "Ladder"]

_WEIGHT_TOL = 1e-6

#: ``sizes=UNCHECKED``: the user takes responsibility that log C fits the model (no check).
UNCHECKED = "unchecked"

_ARRAYS = (
    "temperatures",
    "weights",
    "log_c",
    "stderr",
    "ess",
    "pareto_k",
    "element_log_c",
    "untrusted",
    "num_stages",
)


_STATIC = ("sizes", "num_samples", "plate", "method", "selection")


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
    check_temperature(temps, "temperatures")
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
            f"{temps[bad].tolist()} (+inf: the tempered model is improper there, e.g. a "
            "heavy-tailed likelihood at a high temperature -- leave those temperatures out; "
            "NaN: numerical trouble in the log C estimate -- check the model's tempered "
            "sites, or the estimate's num_nonfinite)."
        )
    if stderr is not None and (not np.all(np.isfinite(stderr)) or np.any(stderr < 0)):
        raise ValueError(f"`stderr` must be finite and >= 0, got {stderr}.")


def _check_elements(
    element_log_c: np.ndarray, log_c: np.ndarray, plate: Any, sizes: Any, temps: np.ndarray
) -> None:
    m = temps.size
    if element_log_c.ndim != 2 or element_log_c.shape[0] != m:
        raise ValueError(
            f"`element_log_c` must have shape (M, N) = ({m}, N), one row per temperature; "
            f"got {element_log_c.shape}."
        )
    if not isinstance(plate, str):
        raise ValueError(
            f"`element_log_c` needs `plate`, the name of the plate of its N elements; got "
            f"{plate!r}."
        )
    if not np.all(np.isfinite(element_log_c)):
        bad = ~np.all(np.isfinite(element_log_c), axis=1)
        raise ValueError(f"`element_log_c` must be finite; it is not at T = {temps[bad]}.")
    total = element_log_c.sum(axis=1)
    if not np.allclose(total, log_c, rtol=1e-4, atol=1e-3):
        raise ValueError(
            f"`element_log_c` must add up to `log_c` over the elements (log C = sum_n log c_n "
            f"when all elements share a temperature); the sums are {total.tolist()}, log_c is "
            f"{log_c.tolist()}."
        )
    if isinstance(sizes, ModelSizes):
        size = sizes.plate_size(plate)
        if size != element_log_c.shape[1]:
            raise ValueError(
                f"`element_log_c` has {element_log_c.shape[1]} elements but plate '{plate}' "
                f"has {size} in `sizes`."
            )


def _array_repr(value: np.ndarray) -> str:
    return np.array2string(
        np.asarray(value), precision=3, threshold=8, edgeitems=3, separator=", "
    )


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class Ladder:
    r"""An immutable temperature ladder :math:`T_1 = 1 < \dots < T_M` with prior weights.

    Args:
        temperatures: strictly increasing, finite, ``T_1 = 1`` exactly.
        weights: prior :math:`\pi_m` (non-negative, summing to 1); uniform by default.
        log_c: :math:`\log C(T_m)` of the *whole* model (see
            :mod:`numpyro_tempering.partition_function`), or ``None`` until computed.
        stderr: Monte Carlo standard error of ``log_c`` (``None`` if exact / unknown).
        sizes: the :class:`ModelSizes` ``log_c`` was computed for; objectives and the handler
            refuse a model of different sizes, and a ladder with ``sizes=None``.
            ``UNCHECKED`` skips the check (the user vouches for log C).
        ess: effective sample size of the estimate per temperature (needs ``num_samples``).
        pareto_k: Pareto :math:`\hat k` of the estimate per temperature (NaN: unknown).
        num_samples: the number S of outer Monte Carlo draws behind ``ess``.
        element_log_c: per-element :math:`\log c_n(T_m)`, shape ``(M, N)``, adding up to
            ``log_c`` over ``n``; needed by a per-element temperature.
        plate: the plate of ``element_log_c``.
        untrusted: per temperature, whether the estimator flagged ``log_c`` as untrusted
            (stored from the estimate's ``flagged``; when absent, ``flagged`` is recomputed
            from ``ess``/``pareto_k`` by
            :func:`~numpyro_tempering.partition_function.flag_untrusted`).
        num_stages: mean number of tempered-SMC stages per temperature (``method="smc"``).
        method: the estimator behind ``log_c`` (``"smc"``, ``"prior"``), or ``None``.
        selection: the :class:`~numpyro_tempering.handlers.Selection` of tempered sites
            ``log_c`` was computed for (recorded by :meth:`with_log_partition`); the
            multicanonical objective and handler use it (see :meth:`selection_for`).

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
    sizes: ModelSizes | str | None = field(default=None)
    ess: Any = None
    pareto_k: Any = None
    num_samples: int | None = None
    element_log_c: Any = None
    plate: str | None = None
    untrusted: Any = None
    num_stages: Any = None
    method: str | None = None
    selection: Selection | None = None

    def __post_init__(self) -> None:
        if not _concrete(*(getattr(self, n) for n in _ARRAYS)):
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
        ess = None if self.ess is None else _vector(self.ess, "ess", m)
        pareto_k = None if self.pareto_k is None else _vector(self.pareto_k, "pareto_k", m)
        elements = (
            None if self.element_log_c is None else np.asarray(self.element_log_c, np.float64)
        )
        untrusted = (
            None if self.untrusted is None else np.asarray(self.untrusted, bool).reshape(-1)
        )
        if untrusted is not None and untrusted.shape != (m,):
            raise ValueError(f"`untrusted` must have {m} entries, got {untrusted.shape}.")
        num_stages = None if self.num_stages is None else _vector(self.num_stages, "num_stages", m)
        for name, value in (("stderr", stderr), ("ess", ess), ("pareto_k", pareto_k)):
            if value is not None and log_c is None:
                raise ValueError(f"`{name}` given without `log_c`.")
        if elements is not None and log_c is None:
            log_c = elements.sum(axis=-1) if elements.ndim == 2 else None
            if log_c is None:
                raise ValueError(f"`element_log_c` must have shape (M, N), got {elements.shape}.")
        if log_c is not None:
            _check_log_c(log_c, stderr, temps)
        if ess is not None:
            if self.num_samples is None or int(self.num_samples) < 1:
                raise ValueError("`ess` needs `num_samples` (the number of Monte Carlo draws).")
            if np.any(~np.isfinite(ess)) or np.any(ess < 0):
                raise ValueError(f"`ess` must be finite and >= 0, got {ess}.")
        if not (self.selection is None or isinstance(self.selection, Selection)):
            raise TypeError(
                f"`selection` must be a Selection or None, got {type(self.selection)}."
            )
        if not (
            self.sizes is None or self.sizes == UNCHECKED or isinstance(self.sizes, ModelSizes)
        ):
            raise TypeError(
                f"`sizes` must be a ModelSizes, UNCHECKED or None, got {type(self.sizes)}."
            )
        if elements is not None:
            _check_elements(elements, log_c, self.plate, self.sizes, temps)
        elif self.plate is not None:
            raise ValueError("`plate` given without `element_log_c`.")
        for name, value in (
            ("temperatures", temps),
            ("weights", weights),
            ("log_c", log_c),
            ("stderr", stderr),
            ("ess", ess),
            ("pareto_k", pareto_k),
            ("element_log_c", elements),
            ("untrusted", untrusted),
            ("num_stages", num_stages),
        ):
            if value is not None:
                value.setflags(write=False)
            object.__setattr__(self, name, value)
        if self.num_samples is not None:
            object.__setattr__(self, "num_samples", int(self.num_samples))

    # -- pytree -------------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple, tuple]:
        children = tuple(getattr(self, n) for n in _ARRAYS)
        return children, tuple(getattr(self, n) for n in _STATIC)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> Ladder:
        obj = object.__new__(cls)
        for name, value in zip(_ARRAYS, children, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(_STATIC, aux, strict=True):
            object.__setattr__(obj, name, value)
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
    def log_prior(self) -> Any:
        r""":math:`\log \pi_m`, the ladder's prior over the temperatures (``-inf`` where a
        weight is 0)."""
        with np.errstate(divide="ignore"):
            return np.log(self.weights) if _concrete(self.weights) else jnp.log(self.weights)

    @property
    def log_weights(self) -> Any:
        """Deprecated name of :attr:`log_prior` (``DeprecationWarning``)."""
        warnings.warn(
            "Ladder.log_weights is deprecated: it is log pi, the ladder's prior; use "
            "Ladder.log_prior.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.log_prior

    @property
    def inverse_temperatures(self) -> Any:
        """1 / T_m."""
        return 1.0 / self.temperatures

    @property
    def has_log_partition(self) -> bool:
        """Whether ``log_c`` has been computed or given."""
        return self.log_c is not None

    @property
    def flagged(self) -> np.ndarray:
        """Per temperature: whether the Monte Carlo ``log_c`` cannot be trusted (see
        :func:`~numpyro_tempering.partition_function.flag_untrusted`); all ``False`` without
        diagnostics (a given closed form). The estimator's own flags are used when stored
        (``untrusted``)."""
        if self.untrusted is not None and _concrete(self.untrusted):
            return np.asarray(self.untrusted, bool)
        if self.ess is None or not _concrete(self.ess, self.pareto_k):
            return np.zeros(self.num_temperatures, bool)
        return flag_untrusted(self.ess, self.pareto_k, self.num_samples)

    def arrays(self, dtype: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(1/T, log pi, log C)`` as JAX arrays of ``dtype`` (default float dtype)."""
        self.require_log_partition()
        dtype = jnp.result_type(float) if dtype is None else dtype
        inv_t = jnp.asarray(self.inverse_temperatures, dtype)
        log_pi = jnp.asarray(self.log_prior, dtype)
        return inv_t, log_pi, jnp.asarray(self.log_c, dtype)

    def require_log_partition(self) -> None:
        """Raise ``ValueError`` if ``log_c`` is missing."""
        if self.log_c is None:
            raise ValueError(
                "this ladder has no log C(T): call ladder.with_log_partition(model, key, "
                "*args) (or .with_log_partition_values(log_c, sizes=...)) first; "
                "multicanonical VI needs it (Mandt et al. 2016, eq. 13)."
            )

    def require_element_log_partition(self, plate: str) -> None:
        """Raise ``ValueError`` unless the ladder holds per-element log c_n for ``plate``."""
        self.require_log_partition()
        if self.element_log_c is None:
            raise ValueError(
                f"a per-element temperature (plate='{plate}') needs each element's own "
                "log c_n(T) -- an even split log C / N is exact only for identical elements. "
                f"Compute them with ladder.with_log_partition(model, key, *args, "
                f"plate='{plate}') on the full plate, or give them: "
                f"ladder.with_log_partition_values(element_log_c=..., plate='{plate}') "
                "(shape (M, N); for elements known to be identical, "
                "np.repeat(log_c[:, None] / N, N, axis=1))."
            )
        if self.plate != plate:
            raise ValueError(
                f"the ladder's per-element log c_n are for plate '{self.plate}', not "
                f"'{plate}'."
            )

    def check_sizes(self, sizes: ModelSizes, what: str = "the ladder's log C") -> None:
        """Raise ``ValueError`` if ``sizes`` (of the model being fitted) differ from the
        sizes ``log_c`` was computed for, or if the ladder records none (``sizes=None``);
        ``sizes=UNCHECKED`` skips the check."""
        if self.sizes == UNCHECKED:
            return
        if self.sizes is None:
            raise ValueError(
                f"{what} does not record the model sizes it was computed for, so it cannot "
                "be checked against this model (plate sizes, tempered sites). Give them: "
                "ladder.with_log_partition_values(log_c, sizes=model_sizes(model, *args, "
                "sites=..., latent=..., exclude=...)) (numpyro_tempering.partition_function."
                "model_sizes), or sizes=UNCHECKED (numpyro_tempering.ladder) to vouch for "
                "log C yourself."
            )
        sizes.check_matches(self.sizes, what)

    def selection_for(self, selection: Selection, who: str = "MulticanonicalELBO") -> Selection:
        """The tempering selection a multicanonical objective or handler runs with.

        log C depends on which sites are tempered and how, so the ladder's recorded
        :attr:`selection` is the one to use: a default ``selection`` (nothing given) takes
        it, and a different one is a ``ValueError``. A ladder without a recorded selection
        (``with_log_partition_values`` without ``selection=``) uses ``selection``.

        Example:
            >>> from numpyro_tempering.handlers import Selection
            >>> lad = Ladder([1.0]).with_log_partition_values(
            ...     [0.0], sizes=UNCHECKED, selection=Selection.of(joint=True))
            >>> lad.selection_for(Selection())
            Selection(sites=observed, latent=(), exclude=(), joint=True)
            >>> lad.selection_for(Selection.of(latent="z"))
            Traceback (most recent call last):
            ...
            ValueError: MulticanonicalELBO: the ladder's log C was computed for ...
        """
        if self.selection is None or selection == self.selection:
            return selection
        if selection == Selection():
            return self.selection
        raise ValueError(
            f"{who}: the ladder's log C was computed for {self.selection}, but the tempering "
            f"given here is {selection}. log C(T) depends on which sites are tempered and "
            "how, so the multicanonical weights would be wrong: leave sites/latent/exclude/"
            "joint out here (they are taken from the ladder) or recompute the ladder's log C "
            "with this selection."
        )

    # -- log C ----------------------------------------------------------------------------
    def with_log_partition_values(
        self,
        log_c: Any = None,
        stderr: Any = None,
        sizes: ModelSizes | str | None = None,
        *,
        element_log_c: Any = None,
        plate: str | None = None,
        selection: Selection | None = None,
    ) -> Ladder:
        """A copy holding the given :math:`\\log C(T_m)` (e.g. a closed form).

        Args:
            log_c: :math:`\\log C(T_m)`, shape ``(M,)`` (default: the sum of
                ``element_log_c`` over the elements).
            stderr: its standard error, if any.
            sizes: the model sizes it is for (``model_sizes(model, *args, ...)``), or
                ``UNCHECKED``; the objective and handler refuse ``None``.
            element_log_c: per-element :math:`\\log c_n(T_m)`, shape ``(M, N)``.
            plate: the plate of ``element_log_c``.
            selection: the tempered sites it is for (``Selection.of(sites=..., latent=...,
                exclude=..., joint=...)``), if the objective should take them from here.

        Example:
            >>> lad = Ladder([1.0, 2.0]).with_log_partition_values([0.0, float("nan")])
            Traceback (most recent call last):
            ...
            ValueError: `log_c` must be finite; it is [nan] at temperatures [2.0] ...
            >>> lad = Ladder([1.0, 2.0]).with_log_partition_values(
            ...     element_log_c=[[0.0, 0.0], [0.5, 1.5]], plate="data", sizes=UNCHECKED)
            >>> lad.log_c.tolist()
            [0.0, 2.0]
        """
        return Ladder(
            self.temperatures,
            self.weights,
            log_c,
            stderr,
            sizes,
            element_log_c=element_log_c,
            plate=plate,
            selection=selection,
        )

    def with_log_partition(
        self, model: Callable, rng_key: jax.Array, *args: Any, **options: Any
    ) -> Ladder:
        """A copy holding log C estimated by
        :func:`~numpyro_tempering.partition_function.log_partition` at this ladder's
        temperatures: ``options`` are its keyword arguments (``method``, ``plate``, the
        tempering selection ``sites``/``latent``/``exclude``/``joint``, the budgets,
        ``max_stages``, ``progress_bar`` -- a tqdm bar over the rungs, on by default) and the
        model's keyword arguments. It warns about untrusted temperatures. The copy keeps the
        standard error, effective sample size, SMC stages or Pareto :math:`\\hat k`, the
        flags, the model sizes, the tempering :attr:`selection` and, with ``plate`` on the
        full plate, the per-element log c_n.

        The multicanonical objective and handler take the tempering selection from the
        ladder, so it is given once, here.
        """
        est = log_partition(rng_key, model, self.temperatures, *args, **options)
        return self.with_estimate(est)

    def with_estimate(self, est: LogPartitionEstimate) -> Ladder:
        """A copy holding an estimate ``est`` that
        :func:`~numpyro_tempering.partition_function.log_partition` returned for this
        ladder's temperatures (e.g. one run earlier with custom settings): log C, its
        diagnostics and flags, the model sizes and the tempering selection, as
        :meth:`with_log_partition` keeps them. An estimate at other temperatures, or with
        non-finite draws, is a ``ValueError``.

        Example:
            >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
            >>> from numpyro_tempering.partition_function import log_partition
            >>> def model(x):
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
            >>> est = log_partition(jax.random.PRNGKey(0), model, [1.0, 2.0], 0.0,
            ...                     method="prior", num_samples=100)
            >>> lad = Ladder([1.0, 2.0]).with_estimate(est)
            >>> bool(jnp.allclose(lad.log_c, est.log_c)), lad.sizes == est.sizes
            (True, True)
            >>> Ladder([1.0, 3.0]).with_estimate(est)
            Traceback (most recent call last):
            ...
            ValueError: the estimate is for temperatures [1.0, 2.0], not the ladder's [1.0, 3.0].
        """
        temps = np.asarray(self.temperatures)
        theirs = np.asarray(est.temperatures, np.float64)
        if theirs.shape != temps.shape or not np.allclose(theirs, temps, rtol=1e-6, atol=0):
            raise ValueError(
                f"the estimate is for temperatures {theirs.tolist()}, not the ladder's "
                f"{temps.tolist()}."
            )
        if est.divergent is not None and np.any(est.divergent):
            raise ValueError(
                f"log C = +inf at temperatures {temps[np.asarray(est.divergent)].tolist()}: "
                "the tempered model is improper there (a tempered site's normaliser "
                "diverges, e.g. a heavy-tailed likelihood at a high temperature); leave "
                "those temperatures out of the ladder."
            )
        bad = np.asarray(est.num_nonfinite)
        if np.any(bad):
            what = (
                f"{est.replicate_log_c.shape[0]} SMC replicates"
                if est.method == "smc"
                else f"{est.num_samples} outer draws"
            )
            raise ValueError(
                f"log C estimate: {bad[bad > 0].tolist()} of {what} were "
                f"non-finite (NaN or +inf) at temperatures {temps[bad > 0].tolist()}."
            )
        elements = est.element_log_c
        return Ladder(
            self.temperatures,
            self.weights,
            np.asarray(est.log_c),
            np.asarray(est.stderr),
            est.sizes,
            ess=np.asarray(est.ess),
            pareto_k=np.asarray(est.pareto_k),
            num_samples=est.num_samples,
            element_log_c=None if elements is None else np.asarray(elements),
            plate=est.plate,
            untrusted=est.flagged,
            num_stages=None if est.num_stages is None else np.asarray(est.num_stages),
            method=est.method,
            selection=est.selection,
        )

    # -- display --------------------------------------------------------------------------
    def summary(self) -> str:
        """A table, one row per temperature: T, weight, log C, stderr, ESS, number of SMC
        stages, Pareto k and whether the estimate is flagged as untrusted.

        Example:
            >>> print(Ladder([1.0, 2.0]).with_log_partition_values([0.0, 1.5]).summary())
                   T   weight        log_c   stderr      ess   stages  pareto_k  flagged
                   1      0.5            0        -        -        -         -       no
                   2      0.5          1.5        -        -        -         -       no
        """
        m = self.num_temperatures

        def column(values: Any, fmt: str) -> list[str]:
            if values is None:
                return ["-"] * m
            return [format(float(v), fmt) for v in np.asarray(values)]

        flagged = ["YES" if f else "no" for f in self.flagged]
        cols = zip(
            column(self.temperatures, ".4g"),
            column(self.weights, ".3g"),
            column(self.log_c, ".6g"),
            column(self.stderr, ".3g"),
            column(self.ess, ".4g"),
            column(self.num_stages, ".3g"),
            column(self.pareto_k, ".2f"),
            flagged,
            strict=True,
        )
        head = f"{'T':>8} {'weight':>8} {'log_c':>12} {'stderr':>8} {'ess':>8} {'stages':>8} "
        head += f"{'pareto_k':>9} {'flagged':>8}"
        rows = [
            f"{t:>8} {w:>8} {c:>12} {s:>8} {e:>8} {n:>8} {k:>9} {f:>8}"
            for t, w, c, s, e, n, k, f in cols
        ]
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        if not _concrete(*(getattr(self, n) for n in _ARRAYS)):
            return f"Ladder(M={self.num_temperatures}, traced)"
        temps = np.asarray(self.temperatures)
        parts = [f"M={self.num_temperatures}", f"T={temps[0]:.3g}..{temps[-1]:.3g}"]
        if self.log_c is None:
            parts.append("log_c=None")
        else:
            parts.append(f"log_c={_array_repr(self.log_c)}")
            if self.method is not None:
                parts.append(f"method={self.method!r}")
            for name in ("stderr", "ess", "num_stages", "pareto_k"):
                value = getattr(self, name)
                if value is not None:
                    parts.append(f"{name}={_array_repr(value)}")
            flagged = self.flagged
            if np.any(flagged):
                parts.append(f"UNTRUSTED at T={_array_repr(temps[flagged])}")
            if self.element_log_c is not None:
                n = self.element_log_c.shape[1]
                parts.append(f"element_log_c=(plate '{self.plate}', N={n})")
        parts.append(f"sizes={self.sizes}")
        return "Ladder(" + ", ".join(parts) + ")"

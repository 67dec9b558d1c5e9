r"""The structure of a model, read from its trace: one home for what several modules need.

* :class:`ModelSizes` -- the sizes a log-partition function depends on (full plate sizes
  and the tempered sites' shapes), recorded by a :class:`~numpyro_tempering.ladder.Ladder`
  and checked by the multicanonical objective and handler;
* :func:`subsample_scale` -- the multiplicity :math:`N/B` of a subsampled plate;
* :func:`plate_not_found` -- the one error for a plate name the model does not have;
* :func:`structure_trace`, :func:`model_params` -- one abstract run of a model
  (``jax.eval_shape``: nothing is computed) and its ``numpyro.param`` sites;
* :class:`~numpyro_tempering.handlers.Selection` -- which sites are tempered and how
  (re-exported here), among the sites :func:`~numpyro_tempering.roles.site_role` says are
  the user's (never those NumPyro adds: Jacobians, reparameterisers' sites).

Example:
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> def model(x):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with numpyro.plate("data", 10, subsample_size=x.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    >>> model_sizes(model, jnp.zeros(4))  # the full plate size, not the subsample's
    ModelSizes(plates=(('data', 10),), sites=(('x', (10,)),))
    >>> float(subsample_scale(10, 4))
    2.5
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from numpyro.handlers import seed, trace

from numpyro_tempering.handlers import TEMPERED, Selection, temper

__all__ = [
    "ModelSizes",
    "model_params",
    "model_sizes",
    "nothing_tempered",
    "plate_not_found",
    "sizes_from_sites",
    "stale_params_message",
    "structure_trace",
    "subsample_scale",
]

def plate_not_found(plate: str, plates: Iterable[str]) -> ValueError:
    """The error for a plate ``plate`` that is not among the model's ``plates``."""
    return ValueError(f"plate '{plate}' is not in the model; its plates are {sorted(plates)}.")


def subsample_scale(size: Any, subsample: Any) -> jax.Array:
    """:math:`N/B`: the multiplicity of each element of a plate of ``size`` N visited by a
    subsample of ``subsample`` B elements (1 for the full plate)."""
    return jnp.asarray(size / subsample)


@dataclass(frozen=True)
class ModelSizes:
    """The sizes a log-partition function depends on (hashable, comparable).

    Attributes:
        plates: ``((name, full size), ...)`` for every plate of the model, sorted.
        sites: ``((name, shape), ...)`` for every tempered site, sorted; ``shape`` is the
            site's batch + event shape with subsampled plate dimensions restored to the full
            plate size.
    """

    plates: tuple[tuple[str, int], ...]
    sites: tuple[tuple[str, tuple[int, ...]], ...]

    def plate_size(self, name: str) -> int:
        """Full size of plate ``name`` (``ValueError`` naming the plates if unknown)."""
        sizes = dict(self.plates)
        if name not in sizes:
            raise plate_not_found(name, sizes)
        return sizes[name]

    def check_matches(self, other: ModelSizes, what: str = "the ladder") -> None:
        """Raise ``ValueError`` describing every difference between ``self`` and ``other``.

        ``self`` is the model being fitted, ``other`` the sizes ``what`` was computed for.
        """
        if self == other:
            return
        problems = []
        for label, mine, theirs in (
            ("plate", dict(self.plates), dict(other.plates)),
            ("tempered site", dict(self.sites), dict(other.sites)),
        ):
            for name in sorted(set(mine) | set(theirs)):
                a, b = mine.get(name), theirs.get(name)
                if a != b:
                    problems.append(
                        f"{label} '{name}': model has {'none' if a is None else a}, "
                        f"{what} was computed for {'none' if b is None else b}"
                    )
        raise ValueError(
            f"{what} was computed for a different model size: " + "; ".join(problems) + ". "
            "Recompute log C for this model (log C depends on the plate sizes and on which "
            "sites are tempered)."
        )


def _full_shape(fn: Any, frames: list, plates: dict[str, int]) -> tuple[int, ...]:
    batch = list(fn.batch_shape)
    for frame in frames:
        idx = len(batch) + frame.dim
        if 0 <= idx < len(batch) and frame.name in plates:
            batch[idx] = plates[frame.name]
    return tuple(int(b) for b in batch) + tuple(int(e) for e in fn.event_shape)


def sizes_from_sites(plates: dict[str, int], sites: list[tuple[str, Any, list]]) -> ModelSizes:
    """:class:`ModelSizes` from full plate sizes and ``(name, fn, cond_indep_stack)`` triples."""
    return ModelSizes(
        plates=tuple(sorted((n, int(s)) for n, s in plates.items())),
        sites=tuple(sorted((n, _full_shape(fn, frames, plates)) for n, fn, frames in sites)),
    )


def structure_trace(model: Callable, args: tuple, kwargs: dict) -> dict:
    """Trace of one prior run, for its structure only (shapes, plates, marks).

    Run under ``jax.eval_shape``: nothing is computed (or compiled); the values in the
    returned trace are abstract and must not be used.
    """
    out: dict = {}

    def run() -> None:
        out["trace"] = trace(seed(model, 0)).get_trace(*args, **kwargs)

    jax.eval_shape(run)
    return out["trace"]


def sizes_from_trace(tr: dict) -> ModelSizes:
    """:class:`ModelSizes` of a trace whose tempered sites carry ``temper``'s mark."""
    plates = {n: int(s["args"][0]) for n, s in tr.items() if s["type"] == "plate"}
    sites = [
        (n, s["fn"], s["cond_indep_stack"])
        for n, s in tr.items()
        if s["type"] == "sample" and s["infer"].get(TEMPERED, False)
    ]
    return sizes_from_sites(plates, sites)


def model_params(tr: dict) -> list[str]:
    """Names of the ``numpyro.param`` sites of a model trace (sorted)."""
    return sorted(n for n, s in tr.items() if s["type"] == "param")


def nothing_tempered(tr: dict, who: str) -> ValueError:
    """The error for a model trace in which the tempering selection marks no site (e.g. a
    forgotten ``obs=``): log C(T) would be 0 at every T and a temperature would have no
    likelihood to act on, so q(y) would be its prior and a fitted E[T] would mean nothing.

    Example:
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro_tempering.handlers import temper
        >>> def model():
        ...     numpyro.sample("x", dist.Normal(0.0, 1.0))  # obs= forgotten
        >>> print(nothing_tempered(structure_trace(temper(model, 1.0), (), {}), "log C"))
        log C: no site of the model is tempered (its sample sites are ['x'], of which ...
    """
    samples = sorted(n for n, s in tr.items() if s["type"] == "sample")
    observed = sorted(n for n in samples if tr[n]["is_observed"])
    return ValueError(
        f"{who}: no site of the model is tempered (its sample sites are {samples}, of which "
        f"observed {observed}). With nothing tempered log C(T) = 0 at every T and the "
        "temperature has no likelihood to act on (its posterior is its prior). Pass the "
        "data with obs=... (the likelihood, tempered by default), or name the sites to "
        "temper (sites=, latent=)."
    )


def stale_params_message(params: list[str], who: str) -> str:
    """The error for a model whose ``numpyro.param`` sites would make a log C stale."""
    return (
        f"{who}: the model has numpyro.param site(s) {params}. log C(T) depends on their "
        "values, so a log C computed once (a Ladder) is stale as soon as SVI changes them, "
        "and the multicanonical weights exp(l/T - log C(T)) are then wrong without a word. "
        "Make them constants or model arguments (log C is then computed for those values), "
        "or give them a prior (latent sites)."
    )


def model_sizes(
    model: Callable,
    *args: Any,
    sites: Any = None,
    latent: str | Collection[str] = (),
    exclude: str | Collection[str] = (),
    joint: bool = False,
    **kwargs: Any,
) -> ModelSizes:
    """The :class:`ModelSizes` of ``model`` with the given tempering selection.

    Traces the model once abstractly (``jax.eval_shape``: only shapes are read).

    Example:
        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> def model(x):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> model_sizes(model, jnp.zeros(3))
        ModelSizes(plates=(('data', 3),), sites=(('x', (3,)),))
    """
    marked = temper(model, 1.0, sites=Selection.of(sites, latent, exclude, joint))
    return sizes_from_trace(structure_trace(marked, args, kwargs))

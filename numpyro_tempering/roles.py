"""The role of a sample site: the one place that decides what ``temper`` may temper.

A site's *role* is read from how the site came about, never from its name:

* **auxiliary**: the site was emitted while NumPyro's effect-handler stack was processing
  another message, i.e. by a handler (or a reparameteriser a handler calls) rather than by
  the user's model. This covers MCMC's log-det-Jacobian factors (emitted by the
  unconstraining ``substitute`` while it handles the constrained site), the auxiliary
  latent sites and factors of every reparameteriser (``LocScaleReparam``,
  ``TransformReparam``, ``CircularReparam``, ``NeuTraReparam``, ...), in either order of
  ``reparam`` and ``temper``. Auxiliary sites are never tempered: they carry the prior
  (or a change of variables), which tempering keeps.
* **observed**: a site of the user's model that is observed (``obs=``, ``condition``,
  ``numpyro.factor``): the likelihood, tempered by default.
* **latent**: any other site of the user's model (tempered only when named).

Control flow (``numpyro.contrib.control_flow.scan`` and ``cond``) runs its body out of sight
of the handlers outside it and replays the recorded sites afterwards, so the role of a site
inside a body is recorded *where it is emitted*, by a marker that ``temper`` adds to the
control-flow message (as NumPyro's own ``substitute`` and ``condition`` do), and read back
when the site is replayed. The marker also records the site's name before the body's own
renaming: enumerated ``scan`` runs its first steps under a ``scope`` that prefixes
``_PREV_`` to every name; such a site has the role (and, for ``sites=``/``latent=``, the
name) of the site the user wrote.

"Emitted while another message is processed" is read from the interpreter's stack: the
number of active :func:`numpyro.primitives.apply_stack` calls whose message is not a
control-flow message. The message of the user's model is the outermost one.

Example:
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import trace
    >>> from numpyro.infer.util import _unconstrain_params
    >>> from numpyro.primitives import Messenger
    >>> class record(Messenger):  # records every sample site's role as it passes
    ...     roles = {}
    ...     def process_message(self, msg):
    ...         if msg["type"] == "sample":
    ...             self.roles[msg["name"]] = site_role(msg)[1]
    >>> def model():
    ...     tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
    ...     numpyro.sample("y", dist.Normal(0.0, 1.0 / jnp.sqrt(tau)), obs=0.5)
    >>> _ = trace(_unconstrain_params(record(model), {"tau": 0.1})).get_trace()
    >>> record.roles  # MCMC's Jacobian factor is auxiliary
    {'tau': 'latent', '_tau_log_det': 'auxiliary', 'y': 'observed'}
"""

from __future__ import annotations

import sys
from typing import Any

from numpyro.primitives import apply_stack

__all__ = [
    "AUXILIARY",
    "LATENT",
    "OBSERVED",
    "ORIGIN",
    "Origin",
    "control_flow_kind",
    "emitted_within",
    "emission_depth",
    "mark_origin",
    "origin_of",
    "running_in",
    "running_in_method_of",
    "site_role",
]

#: Key in ``msg["infer"]`` holding the :class:`Origin` of a site emitted in a control-flow body.
ORIGIN = "temper_origin"

_APPLY_STACK = apply_stack.__code__


class Origin(tuple):
    """``(name, depth, within)``: the site's name where it was emitted (before any renaming
    by the control-flow body), its emission depth (:func:`emission_depth`) there, and the
    control-flow primitive whose body emitted it (``"scan"``, ``"cond"``, or ``None``)."""

    __slots__ = ()

    def __new__(cls, name: str, depth: int, within: str | None = None) -> Origin:
        return super().__new__(cls, (name, depth, within))

    @property
    def name(self) -> str:
        return self[0]

    @property
    def depth(self) -> int:
        return self[1]

    @property
    def within(self) -> str | None:
        return self[2]


def emission_depth(inside_message: bool = True) -> int:
    """How many messages (other than control-flow ones) NumPyro is processing around the
    current one: 0 while a handler handles a message of the model, 1 or more while it
    handles a message that another handler emitted while handling a message. With
    ``inside_message=False`` (not called from a handler): how many are being processed."""
    depth = -1 if inside_message else 0  # the current message's own apply_stack
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY_STACK:
            msg = frame.f_locals.get("msg")
            if not (isinstance(msg, dict) and msg.get("type") == "control_flow"):
                depth += 1
        frame = frame.f_back
    return max(depth, 0)


def running_in(*functions: Any) -> bool:
    """Whether one of ``functions`` (plain functions or methods) is on the call stack."""
    codes = {getattr(f, "__func__", f).__code__ for f in functions}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def running_in_method_of(cls: type, name: str | None = None) -> bool:
    """Whether a method of an instance of ``cls`` (the one called ``name``, if given) is on
    the call stack (e.g. an AutoGuide building itself, or running the model's potential
    inside the guide)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and (
                name is None or code.co_name == name):
            if isinstance(frame.f_locals.get("self"), cls):
                return True
        frame = frame.f_back
    return False


def control_flow_kind(msg: dict) -> str:
    """``"scan"`` or ``"cond"``: the primitive that sent a ``control_flow`` message.

    Example:
        >>> from numpyro.contrib.control_flow.scan import scan_wrapper
        >>> control_flow_kind({"type": "control_flow", "fn": scan_wrapper})
        'scan'
    """
    from numpyro.contrib.control_flow.scan import scan_wrapper

    return "scan" if msg["fn"] is scan_wrapper else "cond"


def mark_origin(msg: dict, within: str | None = None) -> None:
    """Record the :class:`Origin` of a site emitted in the body of the control-flow
    primitive ``within`` (first marker wins: stacked handlers see the same emission).
    Returns ``None``: substitutes nothing."""
    if msg.get("type") != "sample":
        return None
    infer = msg.get("infer") or {}
    if ORIGIN not in infer:  # a fresh dict: a model may share one ``infer`` between sites
        msg["infer"] = {**infer, ORIGIN: Origin(msg["name"], emission_depth(), within)}
    return None


def emitted_within(msg: dict) -> str | None:
    """The control-flow primitive (``"scan"`` or ``"cond"``) whose body emitted the sample
    site ``msg``, as recorded by :func:`mark_origin`; ``None`` if none recorded it."""
    origin = (msg.get("infer") or {}).get(ORIGIN)
    return None if origin is None else Origin(*origin).within


def origin_of(msg: dict) -> Origin:
    """Where a sample site came from: its recorded :class:`Origin` if it was emitted in a
    control-flow body, else its name and the current :func:`emission_depth`."""
    origin = (msg.get("infer") or {}).get(ORIGIN)
    if origin is not None:
        return Origin(*origin)
    return Origin(msg["name"], emission_depth())


#: The three roles (see the module docstring).
AUXILIARY, OBSERVED, LATENT = "auxiliary", "observed", "latent"


def site_role(msg: dict, base_depth: int = 0, observed: bool | None = None) -> tuple[str, str]:
    """``(name, role)`` of a sample site: the name the user wrote and one of
    :data:`AUXILIARY`, :data:`OBSERVED`, :data:`LATENT`.

    Args:
        msg: NumPyro's message for the site.
        base_depth: the :func:`emission_depth` at which the model itself runs (that of the
            handler asking, when it was entered).
        observed: whether the site is, or will be made, observed (e.g. by a ``condition``
            outside the handler asking); default ``msg["is_observed"]``.
    """
    origin = origin_of(msg)
    if origin.depth > base_depth:
        return origin.name, AUXILIARY
    if observed is None:
        observed = bool(msg.get("is_observed"))
    return origin.name, OBSERVED if observed else LATENT

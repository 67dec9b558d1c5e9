r"""log C(T) of models whose local latents change the per-element contributions, by one
tempered SMC over the globals and the locals jointly (issue 20, scope 5).

With globals :math:`\beta`, locals :math:`z_n` (the latent sites inside ``plate``) and the
per-element log contribution :math:`a_n(\beta, z_n, T)` (the tempered sites' log normalisers
given :math:`z_n`, the registry of :mod:`numpyro_tempering.partition`, plus untempered
observed sites as weights), the tempered partition function (variational-tempering
supplement, eq. 1) is the evidence of a joint target over globals *and* locals,

.. math::

    C(T) = \int d\beta\, p(\beta) \prod_n \int dz_n\, \tilde p(z_n \mid \beta)\,
        e^{a_n(\beta, z_n, T)} = \int \gamma_T(\beta, z), \qquad
    \tilde p(z_n \mid \beta) = p(z_n \mid \beta) \text{ (untempered)},\
        p(z_n \mid \beta)^{1/T} \text{ (tempered latent)}.

A tempered latent local enters as the unnormalised :math:`p^{1/T}` itself, so its normaliser
needs no closed form. Adaptive tempered SMC estimates the evidence without bias (Del Moral
2004, Theorem 7.4.2; Chopin and Papaspiliopoulos 2020, Proposition 16.3): the product of the
stages' mean incremental weights is unbiased for :math:`\int\gamma_T`, whatever the
reference and the MCMC moves, so the mean of R independent replicates is unbiased for
:math:`C(T)` -- unlike the nested Monte Carlo of supplement eq. 7 (``method="prior"``), whose
log is biased low by many nats at realistic N (a log of a mean of products of N inner
means).

**Coordinates and reference.** The state is :math:`(u, \varepsilon)`: ``u`` the globals on
NumPyro's unconstrained space (log-Jacobian in the prior), and per element standardised
locals :math:`\varepsilon_n \in \mathbb R^{d}` with

.. math::

    v_n = v_n^* + B_n (u - u^*) + R_n^{-\top} \varepsilon_n, \qquad
    z_n = \mathrm{biject\_to}(\mathrm{support})(v_n),

an affine map fixed before the run (so the target in these coordinates is
:math:`\gamma_T` times the constant Jacobian :math:`\prod_n |R_n|^{-1}` and the log-Jacobians
of the locals' bijections, and its evidence is still :math:`C(T)`): :math:`(u^*, v^*)` is the
joint mode of :math:`\log\gamma_T` found by damped Newton steps that use the arrow structure
of its Hessian (per-element blocks :math:`H_{nn}` of size :math:`d`, couplings
:math:`H_{nu}`, the globals' block; ``d_g + d`` Hessian-vector products and a Schur
complement per step, never an :math:`(N d)^2` matrix), :math:`R_n R_n^\top = H_{nn}` and
:math:`B_n = -H_{nn}^{-1} H_{nu}` the Gaussian conditional of the locals given the globals.
For a Gaussian :math:`\gamma_T` the :math:`\varepsilon_n` are exactly independent standard
normals. The SMC of :mod:`numpyro_tempering.tempered_smc` then runs on :math:`(u,
\varepsilon)` with the "prior" :math:`p(u)\,\mathcal N(\varepsilon; 0, I)` and the
log-likelihood :math:`\log\gamma_T - \log p(u) - \log\mathcal N(\varepsilon)`, from its
mixture reference: over ``u`` the prior (weight ``prior_weight``) and K Laplace components
(mode :math:`u^*_k`, precision the Schur complement :math:`H_{uu} - \sum_n H_{un} H_{nn}^{-1}
H_{nu}`, inflated), over :math:`\varepsilon` :math:`\mathcal N(0, I)`. The affine map is that
of the Laplace component with the largest Laplace evidence. HMC moves all
:math:`d_g + N d` coordinates (diagonal mass matrix from the particle cloud, step size
adapted as in :mod:`numpyro_tempering.tempered_smc`).

**Starts and checks**, as over the globals alone (:mod:`numpyro_tempering.tempered_smc`),
on the globals' integrand with each element's locals integrated by the Laplace
approximation at their conditional mode (:func:`_laplace_marginal`, used only to look, never
in the estimate): Newton runs also start from its grid maxima (one global) or highest ray
points (several) and the origin, the locals at their conditional modes there
(:func:`_frames`); the tail check flags an integrand still growing far out (log C most
likely +inf); the ray check flags a ray point far above every mode the reference is built
on. A far minority component of a mixture prior was 220 nats low, unflagged, and a
divergent integral 161.6 +- 0.04, unflagged, before (docs/reproductions.md, "The joint
route: the same starts and checks").

**Refused** (the caller falls back to ``method="prior"`` with a warning naming the reason):
discrete locals, a model without continuous globals, ``plate=None``, subsampled plates
(an SMC over one fixed subsample would not be :math:`C(T)`), and locals whose plate axis
cannot be found.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random
from jax.flatten_util import ravel_pytree
from jax.scipy.special import logsumexp
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost
from numpyro.handlers import seed, trace
from numpyro.infer.util import _unconstrain_params, unconstrain_fn
from numpyro.primitives import Messenger

from numpyro_tempering.engine import _element_log_lik
from numpyro_tempering.handlers import TEMPERED
from numpyro_tempering.partition import tempered
from numpyro_tempering.structure import structure_trace
from numpyro_tempering.tempered_smc import (
    NEWTON_STEPS,
    REFERENCE_INFLATION,
    SMCRun,
    SMCSettings,
    _cholesky,
    _precision_factor,
    _rays,
    _smc,
    _solve_lower,
    _solve_upper,
    _Target,
    extra_starts,
    global_log_prior,
    kish,
    map_runs,
    rays_beyond,
    run_size,
    tail_grows,
)

__all__ = ["build_joint_runner", "unsupported"]


def _in_plate(site: dict, plate: str) -> bool:
    return any(f.name == plate for f in site["cond_indep_stack"])


class _Local(NamedTuple):
    name: str
    shape: tuple[int, ...]  # unconstrained shape
    axis: int  # the plate's axis in it
    size: int  # unconstrained coordinates per element


class _Layout(NamedTuple):
    locals_: tuple[_Local, ...]
    num: int  # N, elements of the plate
    dim: int  # d, unconstrained local coordinates per element


def _layout(tr: dict, plate: str, global_names: tuple[str, ...]) -> _Layout | str:
    """The locals' unconstrained layout, or the reason why there is none."""
    num = int(tr[plate]["args"][0])
    out = []
    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"] or name in global_names:
            continue
        if not _in_plate(site, plate):
            continue
        fn = site["fn"]
        if fn.support.is_discrete:
            return f"discrete local latent site '{name}' ({type(fn).__name__})"
        shape = tuple(biject_to(fn.support).inverse_shape(jnp.shape(site["value"])))
        frame = next(f for f in site["cond_indep_stack"] if f.name == plate)
        axis = len(fn.batch_shape) + frame.dim
        if not 0 <= axis < len(shape) or shape[axis] != num:
            return f"local latent site '{name}': no axis of size {num} for plate '{plate}'"
        out.append(_Local(name, shape, axis, math.prod(shape) // num))
    return _Layout(tuple(out), num, sum(loc.size for loc in out))


def unsupported(
    marked: Callable, args: tuple, kwargs: dict, plate: str | None,
    global_names: tuple[str, ...], subsampled: list[str],
) -> str | None:
    """Why the joint SMC cannot serve this model (``None``: it can)."""
    if plate is None:
        return ("plate=None (the joint SMC needs the data plate to tell the locals from the "
                "globals: pass plate=...)")
    if not global_names:
        return "no continuous global latent site"
    if subsampled:
        return f"subsampled plate(s) {subsampled}: run the model on the full plates"
    found = _layout(structure_trace(marked, args, kwargs), plate, global_names)
    return found if isinstance(found, str) else None


class _local_density(Messenger):
    """Run a marked model with the locals set from unconstrained values; record, per site,
    ``scale * log`` of: the locals' (tempered: ``1/T`` times) density with the bijection's
    log-Jacobian; the tempered observed sites' normalisers ``log Z(T)``; the untempered
    observed sites' densities. Globals (substituted outside) and their log-Jacobian factors
    are not recorded."""

    def __init__(self, fn: Callable, temperature: jax.Array, fallback: Any, plate: str,
                 values: dict, skip: frozenset) -> None:
        self.temperature, self.fallback, self.plate = temperature, fallback, plate
        self.values, self.skip = values, skip
        self.records: list[tuple[dict, jax.Array]] = []
        self.proposal: jax.Array = jnp.zeros(())  # the locals' untempered log density
        super().__init__(fn)

    def __enter__(self):
        self.records, self.proposal = [], jnp.zeros(())
        return super().__enter__()

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg["name"] in self.skip:
            return
        fn, name = msg["fn"], msg["name"]
        is_tempered = bool(msg["infer"].get(TEMPERED, False))
        if not msg["is_observed"]:
            if name not in self.values:
                return
            t = biject_to(fn.support)
            v = self.values[name]
            z = t(v)
            msg["value"] = z
            lp = fn.log_prob(z)
            ldj = t.log_abs_det_jacobian(v, z)
            ldj = sum_rightmost(ldj, jnp.ndim(ldj) - jnp.ndim(z) + len(fn.event_shape))
            scale = 1.0 if msg.get("scale") is None else msg["scale"]
            self.proposal = self.proposal + jnp.sum(scale * (lp + ldj))
            if is_tempered:
                lp = lp / self.temperature
            lp = lp + ldj
        elif is_tempered:
            try:
                lp = tempered(fn, self.temperature, fallback=self.fallback)[0]
            except NotImplementedError as err:
                raise NotImplementedError(
                    f"log C: cannot temper site '{name}' ({type(fn).__name__}): {err}"
                ) from err
        else:
            lp = fn.log_prob(msg["value"])
        if msg.get("scale") is not None:
            lp = msg["scale"] * lp
        site = {"name": name, "fn": fn, "cond_indep_stack": list(msg["cond_indep_stack"])}
        self.records.append((site, lp))


class _Joint(NamedTuple):
    init: Callable  # key -> (u (d_g,), V (N, d)): a prior draw, unconstrained
    log_density: Callable  # (u, V, T) -> (log p(u), per-element (N,), rest ())
    prior_log_weight: Callable  # (u, V, T) -> log gamma_T / p(u, V): weight of a prior draw


def _joint(marked: Callable, args: tuple, kwargs: dict, plate: str, fallback: Any,
           global_names: tuple[str, ...], key_fixed: jax.Array) -> _Joint:
    tr = trace(seed(marked, key_fixed)).get_trace(*args, **kwargs)
    layout = _layout(tr, plate, global_names)
    assert not isinstance(layout, str), layout  # unsupported() was asked first
    template = {k: tr[k]["value"] for k in global_names}
    _, unravel = ravel_pytree(unconstrain_fn(seed(marked, key_fixed), args, kwargs, template))
    skip = frozenset(global_names) | {f"_{g}_log_det" for g in global_names}
    num = layout.num

    def flatten(values: dict) -> jax.Array:
        parts = [jnp.moveaxis(values[loc.name], loc.axis, 0).reshape(num, loc.size)
                 for loc in layout.locals_]
        return jnp.concatenate(parts, axis=-1)

    def unflatten(flat: jax.Array) -> dict:
        out, start = {}, 0
        for loc in layout.locals_:
            moved = (num,) + loc.shape[: loc.axis] + loc.shape[loc.axis + 1 :]
            piece = flat[:, start : start + loc.size].reshape(moved)
            out[loc.name] = jnp.moveaxis(piece, 0, loc.axis)
            start += loc.size
        return out

    def init(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        draw = trace(seed(marked, key)).get_trace(*args, **kwargs)
        u = unconstrain_fn(seed(marked, key), args, kwargs,
                           {k: draw[k]["value"] for k in global_names})
        local = {loc.name: biject_to(draw[loc.name]["fn"].support).inv(draw[loc.name]["value"])
                 for loc in layout.locals_}
        return ravel_pytree(u)[0], flatten(local)

    def evaluate(u: jax.Array, flat: jax.Array, temperature: jax.Array) -> tuple:
        handler = _local_density(
            _unconstrain_params(seed(marked, key_fixed), unravel(u)), temperature, fallback,
            plate, unflatten(flat), skip,
        )
        run = trace(handler).get_trace(*args, **kwargs)
        log_p = global_log_prior(run, global_names, u.dtype)
        elements = jnp.zeros((num,), u.dtype)
        rest = jnp.zeros((), u.dtype)
        for site, lp in handler.records:
            if _in_plate(site, plate):
                elements = elements + _element_log_lik(site, lp, plate)
            else:
                rest = rest + jnp.sum(lp)
        return log_p, elements, rest, handler.proposal

    def log_density(u: jax.Array, flat: jax.Array, temperature: jax.Array) -> tuple:
        return evaluate(u, flat, temperature)[:3]

    def prior_log_weight(u: jax.Array, flat: jax.Array, temperature: jax.Array) -> jax.Array:
        _, elements, rest, proposal = evaluate(u, flat, temperature)
        return jnp.sum(elements) + rest - proposal

    return _Joint(init, log_density, prior_log_weight)


# -----------------------------------------------------------------------------------------
# The joint mode and the Laplace pieces (arrow-structured Newton)
# -----------------------------------------------------------------------------------------


class _Frame(NamedTuple):
    u: jax.Array  # (d_g,) mode of the globals
    v: jax.Array  # (N, d) mode of the locals
    prec: jax.Array  # (d_g, d_g) Cholesky factor of the inflated Schur precision
    local_prec: jax.Array  # (N, d, d) Cholesky factors R_n of H_nn
    coupling: jax.Array  # (N, d, d_g) B_n = -H_nn^{-1} H_nu
    log_evidence: jax.Array  # () Laplace approximation of log C(T) at this mode


def _blocks(joint: _Joint, t: jax.Array, u: jax.Array, v: jax.Array) -> tuple:
    """Value, gradient and the arrow blocks of the Hessian of ``-log gamma_T``: the
    Hessian-vector products along the ``d_g`` globals and the ``d`` local coordinates (all
    elements at once) in one vectorised forward-over-reverse pass, whose primal is the
    value and the gradient (one copy of the model's derivatives for XLA to compile)."""

    def neg(uu: jax.Array, vv: jax.Array) -> jax.Array:
        log_p, el, rest = joint.log_density(uu, vv, t)
        value = -(log_p + jnp.sum(el) + rest)
        return jnp.where(jnp.isnan(value), jnp.inf, value)

    d_g, d = u.shape[0], v.shape[1]
    dirs_u = jnp.concatenate([jnp.eye(d_g, dtype=u.dtype), jnp.zeros((d, d_g), u.dtype)])
    dirs_v = jnp.concatenate([jnp.zeros((d_g,) + v.shape, v.dtype),
                              jnp.broadcast_to(jnp.eye(d, dtype=v.dtype)[:, None, :],
                                               (d,) + v.shape)])

    def hvp(du: jax.Array, dv: jax.Array) -> tuple:
        return jax.jvp(jax.value_and_grad(neg, argnums=(0, 1)), (u, v), (du, dv))

    (f, (g_u, g_v)), (_, (t_u, t_v)) = jax.vmap(
        hvp, out_axes=((None, (None, None)), (0, (0, 0))))(dirs_u, dirs_v)
    h_uu = t_u[:d_g].T  # (d_g, d_g)
    h_vu = jnp.moveaxis(t_v[:d_g], 0, -1)  # (N, d, d_g)
    h_vv = jnp.moveaxis(t_v[d_g:], 0, -1)  # (N, d, d): block diagonal over the elements
    return f, g_u, g_v, 0.5 * (h_uu + h_uu.T), h_vu, 0.5 * (h_vv + jnp.swapaxes(h_vv, 1, 2))


def _positive_definite(low: jax.Array) -> jax.Array:
    """Per element: whether a batch of Cholesky factors ``(N, d, d)`` is usable."""
    return jnp.all(jnp.isfinite(low), (1, 2)) & jnp.all(
        jnp.diagonal(low, axis1=1, axis2=2) > 0, -1)


def _chol_solve(low: jax.Array, b: jax.Array) -> jax.Array:
    return _solve_upper(low.T, _solve_lower(low, b))


def _schur(h_uu: jax.Array, h_vu: jax.Array, h_vv: jax.Array) -> tuple:
    """Per-element factors R_n of H_nn, B_n = -H_nn^{-1} H_nu and the Schur complement."""
    low = jax.vmap(_cholesky)(h_vv)  # (N, d, d)
    solve_cols = jax.vmap(lambda r, m: jax.vmap(lambda c: _chol_solve(r, c), 1, 1)(m))
    coupling = -solve_cols(low, h_vu)  # (N, d, d_g)
    schur = h_uu + jnp.einsum("nda,ndb->ab", h_vu, coupling)
    return low, coupling, 0.5 * (schur + schur.T)


#: step fractions tried, per element, by the conditional Newton steps of the locals
LOCAL_STEP_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 1 / 32)
#: conditional Newton steps of the locals before and after the joint Newton steps
LOCAL_POLISH_STEPS = 8
#: longest step of the polish from prior draws (:func:`_conditional_modes`, unconstrained
#: units): where the log density is nearly flat the Newton step is enormous and every
#: fraction of it overshoots into the float range's end (a Gamma(0.5) local drawn at
#: log z = -30: a step of ~1e13), so the element never moved, the joint modes were wrong,
#: and the quadrature's nodes sat in the locals' tails, hundreds of nats off (flagged)
LOCAL_MAX_STEP = 4.0


def _capped_step(dv: jax.Array) -> jax.Array:
    """Per element, ``dv`` (N, d) shortened to at most :data:`LOCAL_MAX_STEP` in its
    largest coordinate; non-finite steps are 0."""
    dv = jnp.where(jnp.isfinite(dv), dv, 0.0)
    size = jnp.max(jnp.abs(dv), axis=-1, keepdims=True)
    return dv * jnp.minimum(1.0, LOCAL_MAX_STEP / jnp.maximum(size, LOCAL_MAX_STEP))


def _local_curvature(joint: _Joint, t: jax.Array, u: jax.Array, v: jax.Array,
                     fallback: jax.Array | None = None) -> tuple:
    """Per element: the gradient ``(N, d)`` of ``a_n`` plus the local's log density in
    ``v_n``, the Cholesky factor of minus its Hessian block (``(N, d, d)``; where that is
    not positive definite ``fallback``, or with ``None`` the factor of the block shifted by
    twice its largest absolute diagonal entry plus 1e-3: for d = 1 the absolute curvature)
    and whether it was. The gradient is the primal of the curvature's forward-over-reverse
    pass (one copy of the derivatives to compile)."""
    d = v.shape[1]
    grad = jax.grad(lambda w: jnp.sum(joint.log_density(u, w, t)[1]))
    cols = [jax.jvp(grad, (v,), (jnp.zeros_like(v).at[:, k].set(1.0),)) for k in range(d)]
    h = -jnp.stack([c[1] for c in cols], -1)
    h = 0.5 * (h + jnp.swapaxes(h, 1, 2))
    low = jax.vmap(_cholesky)(h)
    ok = _positive_definite(low)
    if fallback is None:
        shift = 2.0 * jnp.max(jnp.abs(jnp.diagonal(h, axis1=1, axis2=2)), -1) + 1e-3
        fallback = jax.vmap(_cholesky)(h + shift[:, None, None] * jnp.eye(d, dtype=v.dtype))
        fallback = jnp.where(_positive_definite(fallback)[:, None, None], fallback,
                             jnp.eye(d, dtype=v.dtype))
    return cols[0][0], jnp.where(ok[:, None, None], low, fallback), ok


def _conditional_modes(joint: _Joint, t: jax.Array, u: jax.Array, v: jax.Array, steps: int,
                       fallback: jax.Array | None = None,
                       fractions: tuple[float, ...] = LOCAL_STEP_FRACTIONS) -> jax.Array:
    """``steps`` Newton steps per element towards the locals' conditional modes given ``u``
    (the elements are independent given the globals, so each element takes the largest of
    ``fractions`` of its step that raises its own log density, or stays; where its curvature
    is not positive definite the step is scaled by ``fallback``, default the shifted
    curvature of :func:`_local_curvature`). The fractions' log densities are one vectorised
    evaluation."""

    def el(w: jax.Array) -> jax.Array:
        value = joint.log_density(u, w, t)[1]
        return jnp.where(jnp.isnan(value), -jnp.inf, value)

    def step(_: int, carry: tuple) -> tuple:
        w, f = carry
        g, low, _ = _local_curvature(joint, t, u, w, fallback)
        dv = _capped_step(jax.vmap(_chol_solve)(low, g))
        cands = w + jnp.asarray(fractions, w.dtype)[:, None, None] * dv  # (F, N, d)
        f_c = jax.vmap(el)(cands)  # (F, N)
        better = jnp.isfinite(f_c) & (f_c > f)
        first = jnp.argmax(better, 0)  # the largest fraction that raises the log density
        take = jnp.any(better, 0)
        new_w = jnp.where(take[:, None], jnp.take_along_axis(cands, first[None, :, None], 0)[0], w)
        new_f = jnp.where(take, jnp.take_along_axis(f_c, first[None], 0)[0], f)
        return new_w, new_f

    v = jnp.where(jnp.isfinite(v), v, 0.0)  # e.g. log 0 of a prior draw that underflowed
    v, _ = jax.lax.fori_loop(0, steps, step, (v, el(v)))
    return v


def _joint_mode(joint: _Joint, t: jax.Array, u0: jax.Array, v0: jax.Array,
                steps: int = NEWTON_STEPS, polish: bool = False) -> _Frame:
    """Damped Newton (Levenberg-Marquardt) to the joint mode from ``(u0, v0)``, and the
    Laplace pieces there. With ``polish`` (the quadrature of
    :mod:`numpyro_tempering.local_quadrature`) the locals are first moved to their
    conditional modes given ``u0`` and polished again at the end
    (:func:`_conditional_modes`, per element: one far element would otherwise have every
    joint step refused, since only the globals' Schur complement is damped; not used by the
    joint SMC, where it gave NaN on a Poisson funnel). Element blocks that are not positive
    definite fall back to the unit matrix (their locals are then standardised poorly: more
    SMC stages, no bias)."""
    d_g, (num, d) = u0.shape[0], v0.shape

    def step(i: jax.Array, carry: tuple) -> tuple:
        u, v, f, lam, _ = carry
        f_now, g_u, g_v, h_uu, h_vu, h_vv = _blocks(joint, t, u, v)
        # the locals are eliminated exactly where their blocks are positive definite (else
        # those blocks are damped) and only the globals' Schur complement is damped: damping
        # the full Hessian would shrink the globals' step by the ratio of the element
        # curvature to the (cancelling) marginal one, e.g. N/s^2 to 1
        pd = _positive_definite(jax.vmap(_cholesky)(h_vv))
        eye_d = jnp.eye(d, dtype=u.dtype)
        diag_v = jnp.mean(jnp.abs(jnp.diagonal(h_vv, axis1=1, axis2=2)), -1) + 1.0
        h_vv = jnp.where(pd[:, None, None], h_vv, h_vv + (diag_v * (1.0 + lam))[:, None, None]
                         * eye_d)
        low, coupling, schur = _schur(h_uu, h_vu, h_vv)
        damp = lam * (jnp.mean(jnp.abs(jnp.diag(schur))) + 1.0)
        r_u = g_u + jnp.einsum("nda,nd->a", coupling, g_v)
        du = _chol_solve(_cholesky(schur + damp * jnp.eye(d_g, dtype=u.dtype)), -r_u)
        dv = jax.vmap(_chol_solve)(low, -g_v - jnp.einsum("nda,a->nd", h_vu, du))
        new_u, new_v = u + du, v + dv
        log_p, el, rest = joint.log_density(new_u, new_v, t)
        f_new = -(log_p + jnp.sum(el) + rest)
        ok = (jnp.isfinite(f_new) & (f_new <= f) & jnp.all(jnp.isfinite(new_u))
              & jnp.all(jnp.isfinite(new_v)) & (i < steps))
        return (jnp.where(ok, new_u, u), jnp.where(ok, new_v, v), jnp.where(ok, f_new, f),
                jnp.where(ok, lam / 10, lam * 10), f_now)

    def newton(u: jax.Array, v: jax.Array) -> tuple:
        log_p, el, rest = joint.log_density(u, v, t)
        f0 = -(log_p + jnp.sum(el) + rest)
        f0 = jnp.where(jnp.isnan(f0), jnp.inf, f0)
        lam0 = jnp.asarray(1e-3, u.dtype)
        return jax.lax.fori_loop(0, steps, step, (u, v, f0, lam0, f0))[:3]

    def value(u: jax.Array, v: jax.Array) -> tuple:
        log_p, el, rest = joint.log_density(u, v, t)
        return u, v, -(log_p + jnp.sum(el) + rest)  # per element no worse: f decreases

    def polish_round(carry: tuple, r: jax.Array) -> tuple:
        u, v, _ = carry
        v = _conditional_modes(joint, t, u, v, LOCAL_POLISH_STEPS)
        return jax.lax.cond(r == 0, newton, value, u, v), None

    if polish:  # two rounds, one traced copy of the polish: polish, Newton; polish, value
        zero = jnp.zeros((), u0.dtype)
        (u, v, f), _ = jax.lax.scan(polish_round, (u0, v0, zero), jnp.arange(2))
    else:
        u, v, f = newton(u0, v0)
    _, _, _, h_uu, h_vu, h_vv = _blocks(joint, t, u, v)
    low, coupling, schur = _schur(h_uu, h_vu, h_vv)
    eye_d = jnp.eye(d, dtype=u.dtype)
    ok_n = _positive_definite(low)
    low = jnp.where(ok_n[:, None, None], low, eye_d)
    coupling = jnp.where(ok_n[:, None, None] & jnp.isfinite(coupling), coupling, 0.0)
    prec, ok = _precision_factor(schur, REFERENCE_INFLATION)
    prec = jnp.where(ok, prec, jnp.eye(d_g, dtype=u.dtype))
    log_det = (jnp.sum(jnp.log(jnp.diagonal(low, axis1=1, axis2=2)))
               + jnp.sum(jnp.log(jnp.diag(prec))) + d_g * math.log(REFERENCE_INFLATION))
    log_evidence = -f + 0.5 * (d_g + num * d) * math.log(2 * math.pi) - log_det
    return _Frame(u, v, prec, low, coupling, jnp.where(jnp.isnan(log_evidence), -jnp.inf,
                                                         log_evidence))


def _target(joint: _Joint, frame: _Frame, temperature: jax.Array) -> _Target:
    """The SMC target on ``x = (u, eps)`` (module docstring): prior ``p(u) N(eps; 0, I)``."""
    d_g = frame.u.shape[0]
    num, d = frame.v.shape
    log_2pi = 0.5 * d * math.log(2 * math.pi)
    log_det = jnp.sum(jnp.log(jnp.diagonal(frame.local_prec, axis1=1, axis2=2)), -1)  # (N,)

    def split(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        u, eps = x[:d_g], x[d_g:].reshape(num, d)
        shift = jax.vmap(lambda r, e: _solve_upper(r.T, e))(frame.local_prec, eps)
        v = frame.v + jnp.einsum("nda,a->nd", frame.coupling, u - frame.u) + shift
        return u, eps, v

    def log_normal(eps: jax.Array) -> jax.Array:
        return -0.5 * jnp.sum(eps**2, -1) - log_2pi

    def init(key: jax.Array) -> jax.Array:
        key_u, key_eps = random.split(key)
        u, _ = joint.init(key_u)
        return jnp.concatenate([u, random.normal(key_eps, (num * d,), u.dtype)])

    def log_prior(x: jax.Array) -> jax.Array:
        u, eps, v = split(x)
        return joint.log_density(u, v, temperature)[0] + jnp.sum(log_normal(eps))

    def pieces(x: jax.Array, t: jax.Array) -> tuple:
        u, eps, v = split(x)
        _, el, rest = joint.log_density(u, v, t)
        el = el - log_det - log_normal(eps)
        return jnp.sum(el) + rest, el, rest

    return _Target(init, log_prior, pieces)


def _prior_check(joint: _Joint, key: jax.Array, num_draws: int, t: jax.Array) -> tuple:
    """log of the mean of the weights gamma_T / p of draws from the model's prior (globals
    and locals: plain Monte Carlo, unbiased for C(T), independent of the SMC's standardising
    map, so that it sees what a poor map hides), and their Kish ESS."""
    u, v = jax.vmap(joint.init)(random.split(key, num_draws))
    log_w = jax.lax.map(lambda a: joint.prior_log_weight(*a, t), (u, v), batch_size=64)
    log_w = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    return logsumexp(log_w) - math.log(num_draws), kish(log_w)


def _conditional_start(joint: _Joint, frame: _Frame, t: jax.Array, u: jax.Array) -> jax.Array:
    """The locals' conditional modes given ``u`` (:func:`_conditional_modes`,
    :data:`LOCAL_POLISH_STEPS` steps from ``frame``'s linear predictor)."""
    v0 = frame.v + jnp.einsum("nda,a->nd", frame.coupling, u - frame.u)
    return _conditional_modes(joint, t, u, v0, LOCAL_POLISH_STEPS)


def _laplace_marginal(joint: _Joint, frame: _Frame, t: jax.Array, u: jax.Array) -> jax.Array:
    r""":math:`\log p(u) + \sum_n \log c_n(u, T)` with every :math:`c_n = \int
    \tilde p(v_n\mid u)e^{a_n}dv_n` by the Laplace approximation at the locals' conditional
    mode given ``u`` (:func:`_conditional_start`), :math:`g_n(m_n) + \tfrac d2\log 2\pi -
    \log|R_n|`: the integrand over the globals that the joint route's checks follow (an
    approximation: they ask where it is large and whether it keeps growing, not its value).
    A prior log density of ``+inf`` (an overflow: a proper prior has none) is NaN."""
    v = _conditional_start(joint, frame, t, u)
    log_p, el, rest = joint.log_density(u, v, t)
    _, low, _ = _local_curvature(joint, t, u, v)
    log_det = jnp.sum(jnp.log(jnp.diagonal(low, axis1=1, axis2=2)), -1)  # (N,)
    log_c = el + 0.5 * v.shape[1] * math.log(2 * math.pi) - log_det
    return jnp.where(log_p == jnp.inf, jnp.nan, log_p) + jnp.sum(log_c) + rest


def _marginal_target(joint: _Joint, frame: _Frame) -> _Target:
    """The globals' Laplace marginal (:func:`_laplace_marginal`) as a target over ``u``, for
    the checks and starts of :mod:`numpyro_tempering.tempered_smc` (``pieces`` gives the
    whole :math:`L_T` as its value; its per-element parts are not used)."""

    def log_prior(u: jax.Array) -> jax.Array:
        return joint.log_density(u, frame.v, jnp.ones((), u.dtype))[0]

    def pieces(u: jax.Array, t: jax.Array) -> tuple:
        value = _laplace_marginal(joint, frame, t, u) - log_prior(u)
        return value, value[None], jnp.zeros((), u.dtype)

    return _Target(lambda key: joint.init(key)[0], log_prior, pieces)


def _frames(joint: _Joint, t: jax.Array, starts: tuple, draws: jax.Array) -> _Frame:
    """The joint modes (:func:`_joint_mode`) from the prior ``starts`` and from the starts
    that reach modes no prior draw reaches (the grid's maxima of one global, the rays' highest
    points of several, the origin: :func:`~numpyro_tempering.tempered_smc.extra_starts`, on
    the Laplace marginal over the globals, the locals at their conditional modes), as over
    the globals alone; fields ``(K + extra, ...)``."""
    prior = jax.vmap(lambda u, v: _joint_mode(joint, t, u, v))(*starts)
    best = _best(prior)
    extra_u = extra_starts(_marginal_target(joint, best), t, prior.u, draws)
    extra_v = jax.vmap(lambda u: _conditional_start(joint, best, t, u))(extra_u)
    extra = jax.vmap(lambda u, v: _joint_mode(joint, t, u, v))(extra_u, extra_v)
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), prior, extra)


def _best(frame: _Frame) -> _Frame:
    """The frame of the largest Laplace evidence among a stack of frames."""
    k = jnp.argmax(frame.log_evidence)
    return jax.tree.map(lambda a: a[k], frame)


def _ray_checks(joint: _Joint, frames: _Frame, t: jax.Array, draws: jax.Array) -> tuple:
    r"""On the rays of :func:`~numpyro_tempering.tempered_smc._rays` from the prior draws
    ``draws`` of ``u``, the globals' integrand (:func:`_laplace_marginal`):
    :func:`~numpyro_tempering.tempered_smc.tail_grows` (whether :math:`\log C(T)` is most
    likely :math:`+\infty`: a particle cloud, however large, sees only finite values), and
    its largest value on the rays and at the frames' modes (for
    :func:`~numpyro_tempering.tempered_smc.rays_beyond`: a ray point far above every mode
    the reference is built on lies in a region the SMC was not shown)."""
    rays = _rays(draws)
    # one evaluation site (each is a copy of the model's derivatives in the program): the
    # rays from the best frame's predictor, each mode from its own frame's
    best = jax.tree.map(lambda a: jnp.broadcast_to(a, (rays.shape[0],) + a.shape),
                        _best(frames))
    pairs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), best, frames)
    points = jnp.concatenate([rays, frames.u])
    values = jax.vmap(lambda f, u: _laplace_marginal(joint, f, t, u))(pairs, points)
    finite = jnp.where(jnp.isnan(values), -jnp.inf, values)
    num = rays.shape[0]
    return tail_grows(values[:num]), jnp.max(finite[:num]), jnp.max(finite[num:])


def build_joint_runner(
    marked: Callable, args: tuple, kwargs: dict, plate: str, fallback: Any,
    global_names: tuple[str, ...], settings: SMCSettings, per_element: bool,
) -> Callable:
    """``(key, temperatures) -> SMCRun`` of the joint SMC, every temperature and R
    replicates vectorised (the interface of
    :func:`~numpyro_tempering.tempered_smc.build_runner`)."""

    def run(key: jax.Array, temps: jax.Array) -> SMCRun:
        key_fixed, key_runs = random.split(key)
        joint = _joint(marked, args, kwargs, plate, fallback, global_names, key_fixed)
        key_starts, key_prior = random.split(random.fold_in(key_fixed, 1))
        starts = jax.vmap(joint.init)(random.split(key_starts, settings.num_starts))

        draws = jax.vmap(lambda k: joint.init(k)[0])(
            random.split(random.fold_in(key_starts, 1), 256))
        frames = jax.lax.map(lambda t: _frames(joint, t, starts, draws), temps)  # (M, K', ...)

        def one(k: jax.Array, t: jax.Array, frame: _Frame) -> tuple:
            target = _target(joint, _best(frame), t)
            return _smc(target, settings, k, t, (frame.u, frame.prec), per_element)

        keys = random.split(key_runs, settings.num_replicates)
        first = _target(joint, _best(jax.tree.map(lambda a: a[0], frames)), temps[0])
        size = run_size(first, temps[0], key_fixed, settings.num_particles)
        out = map_runs(one, keys, temps, frames, size)

        prior = jax.lax.map(
            lambda t: _prior_check(joint, key_prior, settings.num_prior_draws, t), temps)
        grows, ray_max, mode_max = jax.lax.map(
            lambda a: _ray_checks(joint, a[1], a[0], draws), (temps, frames))
        return SMCRun(*out, *prior, tail_grows=grows,
                      ray_beyond=rays_beyond(ray_max, mode_max[None], draws.shape[-1]))

    return run

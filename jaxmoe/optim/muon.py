"""Muon for jaxmoe's weight matrices, AdamW for the rest (`optimizer.name: muon`).

Muon (Jordan et al.; Moonlight, Kimi-K2) replaces a matrix's update by its momentum
orthogonalized: a few Newton-Schulz iterations push every singular value of the
(Nesterov) momentum towards 1. The update is not elementwise: it needs each matrix
whole. A parameter tensor here may hold many matrices: a stacked layer axis, a
pipeline's [W, S, per] chunks, an expert axis (each expert's matrices are their
own), and MLP's gate and up projections side by side (`w_gate_up`: two matrices).
`MATRICES` says, per parameter name, how many trailing axes are a matrix's input
and output; every axis in front of them is a batch of matrices.

Numbers: those of `optax.contrib.muon` with Nesterov momentum, its Frobenius
normalisation and quintic coefficients, and `consistent_rms` scaling (Moonlight's
rule: each matrix's update scaled to RMS `muon_rms` x sqrt(max(fan_in, fan_out)),
0.2 by default, so that AdamW's learning rate and weight decay carry over),
decoupled weight decay on what `decay_mask` decays. The embedding, the LM
head, the router, norms and anything `optimizer.adamw_params` names take jaxmoe's
fused AdamW (b1, b2, eps, mu_dtype of the config).

Where a matrix lives split over devices (the ddp step's ZeRO-1 shards), the
caller's `whole_matrices(name, x, view, fn)` applies `fn` to whole matrices and
returns this device's part (`jaxmoe.step.program.DeviceProgram.whole_matrices`); on one
device, or on global arrays, `fn(x)`. `make_muon` builds the optimizer from these pieces
(`jaxmoe.optim.make_optimizer` calls it for `name: muon`).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import OptimizerConfig
from jaxmoe.optim.adamw import StepTerms, adam_direction, ema
from jaxmoe.optim.params import decay_mask, param_name

NS_COEFFS = (3.4445, -4.775, 2.0315)  # optax.contrib.muon's quintic Newton-Schulz step
NS_EPS = 1e-8


class MatrixView(NamedTuple):
    """A parameter as matrices: its last `fan_in_axes` + `fan_out_axes` axes are one
    matrix's input and output (flattened), every axis before them a batch; `halves`:
    the output axis holds two matrices side by side (gate and up)."""

    fan_in_axes: int
    fan_out_axes: int
    halves: bool = False

    def batch_axes(self, ndim: int) -> int:
        return ndim - self.fan_in_axes - self.fan_out_axes


# jaxmoe's weight matrices by parameter name (attention, MLA, MLPs, shared and routed
# experts, the MTP projection); their layer, stage and expert axes are batches
MATRICES = {
    "w_q": MatrixView(1, 2), "w_k": MatrixView(1, 2), "w_v": MatrixView(1, 2),
    "w_o": MatrixView(2, 1),
    "w_q_a": MatrixView(1, 1), "w_q_b": MatrixView(1, 2),
    "w_kv_a": MatrixView(1, 1), "w_kv_b": MatrixView(1, 2),
    "w_gate_up": MatrixView(1, 1, halves=True), "w_down": MatrixView(1, 1),
    "proj": MatrixView(1, 1),
}


def view_of(name: str, p, adamw_params: tuple[str, ...] = ()) -> MatrixView | None:
    """The matrices of the parameter at path `name` ("moe_layers/moe/experts/w_down"),
    or None where AdamW updates it."""
    view = MATRICES.get(name.rsplit("/", 1)[-1])
    if view is None or any(fnmatch.fnmatchcase(name, pattern) for pattern in adamw_params):
        return None
    return view if p.ndim >= view.fan_in_axes + view.fan_out_axes else None


def as_matrices(x: jax.Array, view: MatrixView) -> tuple[jax.Array, Callable]:
    """x as [matrices, fan_in, fan_out] and the function that puts such an array back."""
    batch = view.batch_axes(x.ndim)
    lead = x.shape[:batch]
    fan_in = math.prod(x.shape[batch:batch + view.fan_in_axes])
    fan_out = math.prod(x.shape[batch + view.fan_in_axes:])
    if view.halves:  # [.., I, 2 O] -> [.., 2, I, O]: gate and up, each its own matrix
        m = jnp.moveaxis(x.reshape(*lead, fan_in, 2, fan_out // 2), -2, -3)
        flat = m.reshape(-1, fan_in, fan_out // 2)
        return flat, lambda y: jnp.moveaxis(y.reshape(m.shape), -3, -2).reshape(x.shape)
    flat = x.reshape(-1, fan_in, fan_out)
    return flat, lambda y: y.reshape(x.shape)


def newton_schulz(m_IxO: jax.Array, steps: int, dtype=jnp.float32) -> jax.Array:
    """One matrix's momentum orthogonalized (optax's iteration: Frobenius-normalised,
    the wide orientation, five quintic steps), its products in `dtype` (bfloat16: the
    tensor cores' rate, as Moonlight and Kimi-K2 run it); float32 out."""
    x = m_IxO.astype(jnp.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = (x / (jnp.linalg.norm(x) + NS_EPS)).astype(dtype)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        xxt = x @ x.T
        x = a * x + (b * xxt + c * xxt @ xxt) @ x
    x = x.astype(jnp.float32)
    return x.T if tall else x


def orthogonalized(x: jax.Array, view: MatrixView, steps: int, dtype=jnp.float32) -> jax.Array:
    """Every matrix of x (whole ones: see `whole_matrices`) orthogonalized on its own."""
    flat, back = as_matrices(x, view)
    return back(jax.vmap(lambda m: newton_schulz(m, steps, dtype))(flat))


def rms_scale(shape: tuple[int, ...], view: MatrixView, rms: float) -> float:
    """Moonlight's factor: `rms` x sqrt(max(fan_in, fan_out)) of one matrix."""
    batch = view.batch_axes(len(shape))
    fan_in = math.prod(shape[batch:batch + view.fan_in_axes])
    fan_out = math.prod(shape[batch + view.fan_in_axes:])
    if view.halves:
        fan_out //= 2
    return rms * max(fan_in, fan_out) ** 0.5


def on_one_device(name: str, x: jax.Array, view: MatrixView, fn: Callable) -> jax.Array:
    """`whole_matrices` where every tensor is whole (one device, global arrays)."""
    return fn(x)


class MuonState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    mu: Any  # Muon's momentum for its matrices, Adam's first moment for the rest (mu_dtype)
    nu: Any  # Adam's second moment; a scalar zero for Muon's matrices


def assignment(params, adamw_params: tuple[str, ...] = ()) -> dict[str, str]:
    """Each parameter's optimizer, "muon" or "adamw", by path (printed at start)."""
    return {param_name(path): "muon" if view_of(param_name(path), p, adamw_params) else "adamw"
            for path, p in jax.tree_util.tree_leaves_with_path(params)}


def describe(params, adamw_params: tuple[str, ...] = ()) -> str:
    """One line: which parameters each optimizer updates (printed at a run's start)."""
    got = assignment(params, adamw_params)
    names = {o: sorted(n for n, who in got.items() if who == o) for o in ("muon", "adamw")}
    return "; ".join(f"{o} updates {len(n)}: {', '.join(n)}" for o, n in names.items())


def make_muon(cfg: OptimizerConfig, schedule: optax.Schedule
              ) -> optax.GradientTransformationExtraArgs:
    """Muon + AdamW with `make_optimizer`'s contract (clip, skip, grad_norm), and
    `whole_matrices` (see the module doc) as an update argument."""
    beta, steps, rms = cfg.muon_momentum, cfg.muon_ns_steps, cfg.muon_rms
    ns_dtype = jnp.dtype(cfg.muon_ns_dtype)
    b1, b2, eps, wd = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    mu_dtype = jnp.dtype(cfg.mu_dtype)

    def init(params):
        named = jax.tree_util.tree_leaves_with_path(params)
        vs = [view_of(param_name(path), p, cfg.adamw_params) for path, p in named]
        leaves, tree = jax.tree.flatten(params)
        mu = [jnp.zeros_like(p, mu_dtype) for p in leaves]
        nu = [jnp.zeros((), jnp.float32) if v else jnp.zeros_like(p)
              for p, v in zip(leaves, vs)]
        return MuonState(jnp.zeros([], jnp.int32), tree.unflatten(mu), tree.unflatten(nu))

    def update(grads, state: MuonState, params=None, *, skip=None, grad_norm=None,
               whole_matrices: Callable = on_one_device, **_):
        if params is None:
            raise ValueError("Muon needs params (for weight decay)")
        s = StepTerms.of(cfg, schedule, grads, state.count, skip, grad_norm)
        t = s.t
        named = jax.tree_util.tree_leaves_with_path(params)
        names = [param_name(path) for path, _ in named]
        leaves = [p for _, p in named]
        tree = jax.tree.structure(params)
        g_, m_, v_ = (tree.flatten_up_to(x) for x in (grads, state.mu, state.nu))
        decay = tree.flatten_up_to(decay_mask(params, cfg.no_decay))
        out_u, out_m, out_v = [], [], []
        for name, p, g, m, v, d in zip(names, leaves, g_, m_, v_, decay):
            g = g * s.scale.astype(g.dtype)
            view = view_of(name, p, cfg.adamw_params)
            if view is None:  # AdamW, as `make_optimizer`'s
                m_new, v_new = ema(g, m, s.take, b1), ema(jnp.square(g), v, s.take, b2)
                u = adam_direction(m_new, v_new, s, eps)
                out_m.append(m_new.astype(mu_dtype))
                out_v.append(v_new)
            else:
                m_new = ema(g, m, s.take, beta)
                # Nesterov, bias-corrected as optax's scale_by_muon
                nesterov = (beta * m_new / (1 - beta ** (t + 1))
                            + (1 - beta) * g / (1 - beta ** t))
                # scaled where the matrices are whole: their fan sizes are the full ones
                u = whole_matrices(name, nesterov, view, lambda x, view=view: rms_scale(
                    x.shape, view, rms) * orthogonalized(x, view, steps, ns_dtype))
                out_m.append(m_new.astype(mu_dtype))
                out_v.append(v)
            if d:
                u = u + wd * p
            out_u.append((-s.rate * u).astype(p.dtype))
        return tree.unflatten(out_u), MuonState(s.count, tree.unflatten(out_m),
                                                tree.unflatten(out_v))

    return optax.GradientTransformationExtraArgs(init, update)

"""Pipeline parallelism over the mesh axis `stage`, written as one SPMD program.

The MoE layer stack [Lm, ...] is viewed as [S, Lm / S, ...]; its leading axis is
already split over `stage` by the rules table, so stage s holds exactly layers
s * Lm/S ... (s+1) * Lm/S - 1. All stages advance together under a `vmap` over
that axis: at iteration t, stage s runs micro-batch t - s through its layers.
Shifting the per-stage buffer by one along the stage axis (a collective-permute
between neighbouring stages) hands every activation to the next stage, and
stage 0 takes the next micro-batch. M micro-batches need M + S - 1 iterations
(GPipe); the S - 1 extra ones are the bubble, (S - 1) / (M + S - 1) of the time.
Autodiff of the loop gives the backward pass; with remat on, each iteration
keeps only its input buffer.

Router statistics of iterations where a stage holds no real micro-batch are
masked out, so every MoE layer's losses and loads are those of the real data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.sharding import BATCH_AXES


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Share of stage-iterations that hold no micro-batch in the GPipe schedule."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline(stack, x_BxLxD, positions_BxL, mesh: Mesh, key, remat: str, microbatches: int):
    """Runs the stacked MoE layers as S pipeline stages; returns (x, aux per layer)."""
    from jaxmoe.model.transformer import REMAT_POLICIES, scan_layers

    S, M = mesh.shape["stage"], microbatches
    graphdef, state = nnx.split(stack)
    Lm = jax.tree.leaves(state)[0].shape[0]
    stage_state = jax.tree.map(lambda a: a.reshape(S, Lm // S, *a.shape[1:]), state)
    B, L, D = x_BxLxD.shape
    # Strided split: every micro-batch keeps rows on each data/expert device.
    x_MxbxLxD = x_BxLxD.reshape(B // M, M, L, D).swapaxes(0, 1)
    positions_bxL = positions_BxL[: B // M]
    buffer_spec = NamedSharding(mesh, P("stage", BATCH_AXES))

    def stage_fn(layers, x_bxLxD, k):
        return scan_layers(graphdef, layers, x_bxLxD, positions_bxL, mesh, k, "none")

    run_stages = jax.vmap(stage_fn, in_axes=(0, 0, 0 if key is not None else None),
                          spmd_axis_name="stage")

    def iteration(carry, t):
        buffer_SxbxLxD = carry
        fresh = jax.lax.dynamic_index_in_dim(x_MxbxLxD, jnp.minimum(t, M - 1), keepdims=False)
        buffer_SxbxLxD = buffer_SxbxLxD.at[0].set(fresh)
        buffer_SxbxLxD = jax.lax.with_sharding_constraint(buffer_SxbxLxD, buffer_spec)
        keys = None if key is None else jax.random.split(jax.random.fold_in(key, t), S)
        out_SxbxLxD, aux = run_stages(stage_state, buffer_SxbxLxD, keys)
        valid_S = (t - jnp.arange(S) >= 0) & (t - jnp.arange(S) < M)
        aux = jax.tree.map(
            lambda a: jnp.where(valid_S.reshape((S,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a)),
            aux)
        # stage s's output feeds stage s + 1 next iteration (a collective-permute)
        return jnp.roll(out_SxbxLxD, 1, axis=0), (out_SxbxLxD[S - 1], aux)

    if remat != "none":
        iteration = jax.checkpoint(iteration, policy=REMAT_POLICIES[remat], prevent_cse=False)
    init = jnp.zeros((S,) + x_MxbxLxD.shape[1:], x_BxLxD.dtype)
    _, (last_TxbxLxD, aux) = jax.lax.scan(iteration, init, jnp.arange(M + S - 1))
    y_MxbxLxD = last_TxbxLxD[S - 1:]  # micro-batch m leaves the last stage at t = m + S - 1
    y_BxLxD = y_MxbxLxD.swapaxes(0, 1).reshape(B, L, D)
    # aux: [iterations, S, Lm/S, ...] -> sums over micro-batches, per layer [Lm, ...]
    aux = jax.tree.map(lambda a: jnp.sum(a, 0).reshape((Lm,) + a.shape[3:]), aux)
    for mean_key in ("balance_loss", "z_loss"):
        aux[mean_key] = aux[mean_key] / M
    return y_BxLxD, aux

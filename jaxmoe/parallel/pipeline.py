"""Pipeline parallelism over the mesh axis `stage`, written as one SPMD program.

The MoE layers are cut into S x V chunks of Lm / (S V) layers; chunk v * S + s
runs on stage s (V virtual stages per device; V = 1 is GPipe). The stacked
weights are stored device-major, [S, V, Lm / (S V), ...] flattened (`layer_order`
maps storage to model order), so the leading axis, split over `stage` by the
rules table, puts exactly its own chunks on each device.

All stages advance together under a `vmap` over that axis: at iteration t,
stage s runs copy k = t - s, i.e. micro-batch k mod M in round k // M, through
its chunk of that round. Shifting the per-stage buffer by one along the stage
axis (a collective-permute between neighbouring stages) hands every activation
to the next stage. Stage 0 reads micro-batch t mod M from a circular store that
the last stage writes back into, so M >= S micro-batches go round V times in
V M + S - 1 iterations: the bubble shrinks from (S - 1) / (M + S - 1) to
(S - 1) / (V M + S - 1). Autodiff of the loop gives the backward pass. With remat on, each
iteration keeps only its stages' input buffer (not the weights it sliced for its
round, nor the store, whose reads and writes are linear), and recomputing an
iteration rematerialises its layers one at a time again.

Router statistics of iterations where a stage holds no real micro-batch are
masked out, so every MoE layer's losses and loads are those of the real data.
A layer count that does not split evenly is padded with pass-through slots at
the end of the model (`Config.moe_layer_slots`), masked the same way.

`pipeline` is that program on global arrays (XLA partitions it: fsdp, eval,
the API); `device_pipeline` is the same schedule written for one device inside
the ddp step's `shard_map`: the device runs only its own stage, and the shift
to the next stage is an explicit cyclic `ppermute` over `stage` whose
transpose carries the cotangents back, so no gradient is reduced in the loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax import lax

from jaxmoe.model.transformer import REMAT_POLICIES, layer_order, scan_layers
from jaxmoe.sharding import BATCH_AXES


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of stage-iterations that hold no micro-batch."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def pipeline(stack, x_BxLxD, positions_BxL, layout, key, remat: str, microbatches: int,
             virtual_stages: int = 1, num_layers: int | None = None):
    """Runs the stacked MoE layers as S pipeline stages; returns (x, aux per layer).

    aux comes back in model layer order. num_layers: the real layers; stored slots
    past it (in model order) pass activations through. layout: the auto-sharded
    layout whose mesh has the `stage` axis.
    """
    mesh = layout.mesh
    S, M, V = mesh.shape["stage"], microbatches, virtual_stages
    graphdef, state = nnx.split(stack)
    Lm = jax.tree.leaves(state)[0].shape[0]
    per = Lm // (S * V)
    stage_state = jax.tree.map(lambda a: a.reshape(S, V, per, *a.shape[1:]), state)
    real = Lm if num_layers is None else num_layers
    active_SxVxper = jnp.asarray(layer_order(Lm, S, V).reshape(S, V, per) < real)
    B, L, D = x_BxLxD.shape
    # Strided split: every micro-batch keeps rows on each data/expert device.
    store_MxbxLxD = x_BxLxD.reshape(B // M, M, L, D).swapaxes(0, 1)
    positions_bxL = positions_BxL[: B // M]
    buffer_spec = NamedSharding(mesh, P("stage", BATCH_AXES))

    def stage_fn(chunks_V, active_Vxper, round_, x_bxLxD, k):
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, round_, keepdims=False)  # noqa: E731
        return scan_layers(graphdef, jax.tree.map(pick, chunks_V), x_bxLxD, positions_bxL,
                           layout, k, remat, active_N=None if real == Lm else pick(active_Vxper))

    run_stages = jax.vmap(stage_fn, in_axes=(0, 0, 0, 0, 0 if key is not None else None),
                          spmd_axis_name="stage")
    # Only the stages' computation is recomputed: checkpointing the whole iteration
    # would keep the carried store, [M, B/M, L, D], once per iteration.
    if remat != "none":  # else every iteration would keep its chunk's sliced weights
        run_stages = jax.checkpoint(run_stages, policy=REMAT_POLICIES[remat], prevent_cse=False)

    def iteration(carry, t):
        buffer_SxbxLxD, store = carry
        fresh = jax.lax.dynamic_index_in_dim(store, t % M, keepdims=False)
        buffer_SxbxLxD = buffer_SxbxLxD.at[0].set(fresh)
        buffer_SxbxLxD = jax.lax.with_sharding_constraint(buffer_SxbxLxD, buffer_spec)
        copy_S = t - jnp.arange(S)
        valid_S = (copy_S >= 0) & (copy_S < V * M)
        round_S = jnp.clip(copy_S // M, 0, V - 1)
        keys = None if key is None else jax.random.split(jax.random.fold_in(key, t), S)
        out_SxbxLxD, aux = run_stages(stage_state, active_SxVxper, round_S, buffer_SxbxLxD, keys)
        aux = jax.tree.map(
            lambda a: jnp.where(valid_S.reshape((S,) + (1,) * (a.ndim - 1)), a, jnp.zeros_like(a)),
            aux)
        last = copy_S[S - 1]
        store = jnp.where(valid_S[S - 1],
                          jax.lax.dynamic_update_index_in_dim(store, out_SxbxLxD[S - 1], last % M, 0),
                          store)
        # stage s's output feeds stage s + 1 next iteration (a collective-permute)
        return (jnp.roll(out_SxbxLxD, 1, axis=0), store), (aux, round_S)

    init = (jnp.zeros((S,) + store_MxbxLxD.shape[1:], x_BxLxD.dtype), store_MxbxLxD)
    (_, store), (aux, round_TxS) = jax.lax.scan(iteration, init, jnp.arange(V * M + S - 1))
    y_BxLxD = store.swapaxes(0, 1).reshape(B, L, D)  # the store ends holding round V-1's outputs
    # aux [T, S, per, ...] -> summed into its (stage, round) chunk -> model layer order
    stage_TxS = jnp.broadcast_to(jnp.arange(S), round_TxS.shape)

    def per_layer(a):
        chunks = jnp.zeros((S, V) + a.shape[2:], a.dtype).at[stage_TxS, round_TxS].add(a)
        return chunks.swapaxes(0, 1).reshape((Lm,) + a.shape[3:])[:real]

    aux = jax.tree.map(per_layer, aux)
    for mean_key in ("balance_loss", "z_loss"):
        aux[mean_key] = aux[mean_key] / M
    return y_BxLxD, aux


def device_pipeline(stack, x_bxLxD, positions_bxL, layout, key, remat: str, microbatches: int,
                    virtual_stages: int = 1, num_layers: int | None = None):
    """One device's share of `pipeline`, inside a `shard_map` over every mesh axis.

    stack: this device's stored slots (its V chunks of `per` layers, device-major);
    x: its own rows. Returns (x, aux): x is the model's output on the last stage
    (the only stage whose loss counts: `DeviceLayout.ce_share`), and aux holds
    this stage's layers at their model-order positions and zeros elsewhere, so
    sums over `stage` give every layer once.
    """
    mesh = layout.mesh
    S, M, V = mesh.shape["stage"], microbatches, virtual_stages
    s = lax.axis_index("stage")
    graphdef, state = nnx.split(stack)
    per = jax.tree.leaves(state)[0].shape[0] // V
    Lm = S * V * per
    chunks = jax.tree.map(lambda a: a.reshape(V, per, *a.shape[1:]), state)
    real = Lm if num_layers is None else num_layers
    active_Vxper = jnp.asarray(layer_order(Lm, S, V).reshape(S, V, per) < real)[s]
    b, L, D = x_bxLxD.shape
    # the same strided split as `pipeline`
    store_MxmxLxD = x_bxLxD.reshape(b // M, M, L, D).swapaxes(0, 1)
    positions_mxL = positions_bxL[: b // M]
    to_next = [(i, (i + 1) % S) for i in range(S)]

    def stage_fn(chunks_V, round_, x_in, k):
        pick = lambda a: lax.dynamic_index_in_dim(a, round_, keepdims=False)  # noqa: E731
        return scan_layers(graphdef, jax.tree.map(pick, chunks_V), x_in, positions_mxL,
                           layout, k, remat, active_N=None if real == Lm else pick(active_Vxper))

    # Only the stage's computation is recomputed: checkpointing the whole iteration
    # would keep the carried store, [M, b/M, L, D], once per iteration.
    if remat != "none":  # else every iteration would keep its chunk's sliced weights
        stage_fn = jax.checkpoint(stage_fn, policy=REMAT_POLICIES[remat], prevent_cse=False)

    def iteration(carry, t):
        inbox_mxLxD, store = carry
        # Stage 0 files the last stage's output of copy t - S (it arrived in the
        # inbox) as the next round's input, then takes copy t's input.
        arrived = t - S
        filed = jnp.where((s == 0) & (arrived >= 0),
                          inbox_mxLxD, lax.dynamic_index_in_dim(store, arrived % M, keepdims=False))
        store = lax.dynamic_update_index_in_dim(store, filed, arrived % M, 0)
        fresh = lax.dynamic_index_in_dim(store, t % M, keepdims=False)
        x_in = jnp.where(s == 0, fresh, inbox_mxLxD)
        copy = t - s
        valid = (copy >= 0) & (copy < V * M)
        round_ = jnp.clip(copy // M, 0, V - 1)
        k = None if key is None else jax.random.split(jax.random.fold_in(key, t), S)[s]
        out_mxLxD, aux = stage_fn(chunks, round_, x_in, k)
        aux = jax.tree.map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), aux)
        # The last stage keeps its outputs: after the final round, the model's output.
        kept = jnp.where((s == S - 1) & valid, out_mxLxD,
                         lax.dynamic_index_in_dim(store, copy % M, keepdims=False))
        store = lax.dynamic_update_index_in_dim(store, kept, copy % M, 0)
        return (lax.ppermute(out_mxLxD, "stage", to_next), store), (aux, round_)

    init = (jnp.zeros_like(store_MxmxLxD[0]), store_MxmxLxD)
    (_, store), (aux, round_T) = lax.scan(iteration, init, jnp.arange(V * M + S - 1))
    y_bxLxD = store.swapaxes(0, 1).reshape(b, L, D)

    def per_layer(a_Txper):  # -> this stage's (round, layer) slots -> model order
        own = jnp.zeros((V,) + a_Txper.shape[1:], a_Txper.dtype).at[round_T].add(a_Txper)
        every = jnp.zeros((S,) + own.shape, own.dtype)
        every = lax.dynamic_update_index_in_dim(every, own, s, 0)
        return every.swapaxes(0, 1).reshape((Lm,) + a_Txper.shape[2:])[:real]

    aux = jax.tree.map(per_layer, aux)
    for mean_key in ("balance_loss", "z_loss"):
        aux[mean_key] = aux[mean_key] / M
    return y_bxLxD, aux

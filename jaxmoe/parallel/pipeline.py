"""Pipeline parallelism over the mesh axis `stage`, written as one SPMD program.

The Lm MoE layers are cut into S x W chunks of `per` = ceil(Lm / (S W)) layers;
chunk c = v * S + s runs on stage s in round v (W virtual stages per device;
W = 1 is GPipe). The stacked weights are kept as [W, S, per, ...] (`StageStack`):
flattened, that is model order, then the padding that makes the chunks equal
(pass-through slots at the end of the model, their compute wasted). The rules
table splits the S dimension over `stage`, so each device holds exactly its own
chunks and nothing is reordered, ever.

At iteration t, stage s runs copy k = t - s, i.e. micro-batch k mod M in round
k // M, through its chunk of that round, and hands its output to stage s + 1.
Stage 0 reads micro-batch t mod M from a circular store that the last stage
writes back into, so M >= S micro-batches go round W times in W M + S - 1
iterations: the bubble shrinks from (S - 1) / (M + S - 1) to (S - 1) / (W M + S - 1).
Autodiff of the loop gives the backward pass. With remat on, each iteration keeps
only its stages' layer inputs (not the weights it sliced for its round, nor the
store, whose reads and writes are linear), and the backward pass recomputes each
layer once from its input.

Router statistics of iterations where a stage holds no real micro-batch, and of
padding slots, are masked out, so every MoE layer's losses and loads are those of
the real data, in model order.

`pipeline` is that program on global arrays (XLA partitions it: fsdp and the
API): all stages advance together under a `vmap` over the stage dimension, and a
roll along it (a collective-permute) hands activations on. `device_pipeline` is
the same schedule for one device inside the ddp step's `shard_map`: it runs only
its own stage, and the hand-on is an explicit cyclic `ppermute` over `stage`
whose transpose carries the cotangents back, so no gradient is reduced in the loop.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.model.attention import MAX_STATS, unmeasured
from jaxmoe.model.mx_weights import mx_copies, with_mx_copies
from jaxmoe.model.moe import MEAN_STATS
from jaxmoe.model.remat import REMAT_POLICIES, keeping_layer_inputs
from jaxmoe.model.transformer import map_moe_stack, scan_layers
from jaxmoe.parallel.ddp import Sharded
from jaxmoe.parallel.sharding import BATCH_AXES


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of stage-iterations that hold no micro-batch."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


class StageStack(NamedTuple):
    """The MoE stack as stages hold it: [W, S, per, ...] (shape letters W, S, Lp),
    model order when flattened."""

    virtual: int  # W: chunks per stage
    stages: int  # S
    per: int  # layers per chunk

    @classmethod
    def of(cls, num_layers: int, stages: int, virtual: int = 1) -> StageStack:
        return cls(virtual, stages, -(-num_layers // (stages * virtual)))

    @property
    def slots(self) -> int:
        return self.virtual * self.stages * self.per

    def stored(self, a: jax.Array) -> jax.Array:
        """[Lm, ...] in model order -> [W, S, per, ...], zero padding after the last layer
        (a numpy array stays one: host-side weights are laid out without compiling)."""
        xp = np if isinstance(a, np.ndarray) else jnp
        pad = self.slots - a.shape[0]
        a = xp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a
        return a.reshape(self.virtual, self.stages, self.per, *a.shape[1:])

    def model(self, a: jax.Array, num_layers: int) -> jax.Array:
        """[W, S, per, ...] -> [Lm, ...] in model order, padding dropped."""
        return a.reshape(self.slots, *a.shape[3:])[:num_layers]

    def stage_major(self) -> np.ndarray:
        """The stack's slots stage by stage ([S, W, per] flattened): slot (s, v, j) holds
        model layer (v S + s) per + j, so each stage's chunks are contiguous."""
        s, v, j = np.meshgrid(np.arange(self.stages), np.arange(self.virtual),
                              np.arange(self.per), indexing="ij")
        return ((v * self.stages + s) * self.per + j).reshape(-1)

    def real(self, num_layers: int) -> jax.Array:
        """bool [W, S, Lp]: which slots hold a layer of the model (the rest pad)."""
        return jnp.arange(self.slots).reshape(self.virtual, self.stages, self.per) < num_layers


def held(stack: StageStack | None, tree):
    """A model-order tree (params, buffers, a gradient of them) as stages hold it: each
    MoE leaf [Lm, ...] as [W, S, per, ...] (None: as the model has it)."""
    return tree if stack is None else map_moe_stack(stack.stored, tree)


def in_model_order(stack: StageStack | None, tree, num_layers: int):
    """`held`'s inverse: every MoE leaf [Lm, ...] in model order."""
    return tree if stack is None else map_moe_stack(lambda a: stack.model(a, num_layers), tree)


def _stage_fn(graphdef, positions_bxL, layout, remat: str, padded: bool):
    """One stage's work for one iteration: its chunk of round `round_` over x."""

    def stage_fn(chunks_W, real_WxLp, round_, x_bxLxD, key):
        pick = lambda a: lax.dynamic_index_in_dim(a, round_, keepdims=False)  # noqa: E731
        return scan_layers(graphdef, jax.tree.map(pick, chunks_W), x_bxLxD, positions_bxL,
                           layout, key, remat, active_N=pick(real_WxLp) if padded else None,
                           unroll=True)

    # Only the stages' computation is checkpointed: checkpointing the whole iteration
    # would keep the carried store, [M, b/M, L, D], once per iteration; without this
    # checkpoint every iteration would keep its chunk's sliced weights. It keeps
    # each layer's input, so the backward pass recomputes each layer once (from
    # its input), not the stage and then each layer again.
    if remat != "none":
        stage_fn = jax.checkpoint(stage_fn, policy=keeping_layer_inputs(REMAT_POLICIES[remat]),
                                  prevent_cse=False)
    return stage_fn


def _copies(t, s, M: int, W: int):
    """At iteration t, stage s runs copy t - s: (valid, its micro-batch, its round)."""
    copy = t - s
    return (copy >= 0) & (copy < W * M), copy % M, jnp.clip(copy // M, 0, W - 1)


def per_layer(aux, round_, stage, stack: StageStack, num_layers: int, M: int):
    """Per-iteration aux [T, (S,) per, ...] (stage-batched or one stage's) summed into
    each (round, stage) chunk (or, for a maximum, its largest taken), in model order;
    round_ and stage: [T, (S)]. Balance and z losses are averaged over the M
    micro-batches."""

    def one(key, a):
        shape = (stack.virtual, stack.stages) + a.shape[round_.ndim:]
        chunks = unmeasured(key, jnp.zeros(shape, a.dtype))
        at = chunks.at[round_, stage]
        chunks = at.max(a) if key in MAX_STATS else at.add(a)
        return chunks.reshape((stack.slots,) + a.shape[round_.ndim + 1:])[:num_layers]

    out = {k: one(k, a) for k, a in aux.items()}
    for mean_key in MEAN_STATS:
        out[mean_key] = out[mean_key] / M
    return out


@jax.named_scope("pipeline")
def pipeline(stack, x_BxLxD, positions_BxL, layout, key, remat: str, microbatches: int,
             num_layers: int):
    """Runs the stage-held MoE stack as S pipeline stages on global arrays; returns
    (x, aux per layer in model order). layout: the auto-sharded layout whose mesh has
    the `stage` axis; `stack.stages` its stage count."""
    graphdef, state = nnx.split(stack)
    layers = layout.stack
    S, M, W = layers.stages, microbatches, layers.virtual
    stage_state = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), state)  # [S, W, per, ...]
    real_SxWxLp = jnp.swapaxes(layers.real(num_layers), 0, 1)
    B, L, D = x_BxLxD.shape
    # Strided split: every micro-batch keeps rows on each data/expert device.
    store_MxbxLxD = x_BxLxD.reshape(B // M, M, L, D).swapaxes(0, 1)
    buffer_spec = NamedSharding(layout.mesh, P("stage", BATCH_AXES))
    stage_fn = _stage_fn(graphdef, positions_BxL[: B // M], layout, remat,
                         layers.slots > num_layers)
    run_stages = jax.vmap(stage_fn, in_axes=(0, 0, 0, 0, 0 if key is not None else None),
                          spmd_axis_name="stage")
    stages_S = jnp.arange(S)

    def iteration(carry, t):
        buffer_SxbxLxD, store = carry
        fresh = lax.dynamic_index_in_dim(store, t % M, keepdims=False)
        buffer_SxbxLxD = jax.lax.with_sharding_constraint(buffer_SxbxLxD.at[0].set(fresh),
                                                          buffer_spec)
        valid_S, micro_S, round_S = _copies(t, stages_S, M, W)
        keys = None if key is None else jax.random.split(jax.random.fold_in(key, t), S)
        out_SxbxLxD, aux = run_stages(stage_state, real_SxWxLp, round_S, buffer_SxbxLxD, keys)
        aux = {k: jnp.where(valid_S.reshape((S,) + (1,) * (a.ndim - 1)), a, unmeasured(k, a))
               for k, a in aux.items()}
        store = jnp.where(valid_S[S - 1], lax.dynamic_update_index_in_dim(
            store, out_SxbxLxD[S - 1], micro_S[S - 1], 0), store)
        # stage s's output feeds stage s + 1 next iteration (a collective-permute)
        return (jnp.roll(out_SxbxLxD, 1, axis=0), store), (aux, round_S)

    init = (jnp.zeros((S,) + store_MxbxLxD.shape[1:], x_BxLxD.dtype), store_MxbxLxD)
    (_, store), (aux, round_TxS) = lax.scan(iteration, init, jnp.arange(W * M + S - 1))
    y_BxLxD = store.swapaxes(0, 1).reshape(B, L, D)  # the store ends holding round W-1's outputs
    stage_TxS = jnp.broadcast_to(stages_S, round_TxS.shape)
    return y_BxLxD, per_layer(aux, round_TxS, stage_TxS, layers, num_layers, M)


@jax.named_scope("pipeline")
def device_pipeline(stack, x_bxLxD, positions_bxL, layout, key, remat: str, microbatches: int,
                    num_layers: int):
    """One device's share of `pipeline`, inside a `shard_map` over every mesh axis.

    stack: this device's chunks, [W, 1, per, ...]. Returns (x, aux): x is the model's
    output on the last stage (the only stage whose loss counts:
    `DeviceLayout.output_share`), and aux holds this stage's layers at their
    model-order positions and nothing elsewhere (`attention.unmeasured`), so sums (or
    maxima) over `stage` give every layer once.

    Leaves that arrive as their ZeRO-1 shards (`ddp.Sharded`: the ddp step defers their
    gather here) are gathered round by round: the iterations run as W scans, scan v
    (from iteration v M) the first to need round v's chunk and the last to need round
    v - 1's; round 0 is gathered before the first, and scan v gathers round v + 1 in
    M parts, one per iteration, beside its stages' compute. Autodiff turns each
    gather into its gradient's reduce-scatter in the same iteration of the backward
    pass, where that round's gradient is complete.
    """
    graphdef, state = nnx.split(stack)
    layers = layout.stack
    S, M, W = layers.stages, microbatches, layers.virtual
    s = lax.axis_index("stage")
    real_WxLp = jnp.take(layers.real(num_layers), s, axis=1)
    b, L, D = x_bxLxD.shape
    store_MxmxLxD = x_bxLxD.reshape(b // M, M, L, D).swapaxes(0, 1)  # the same strided split
    stage_fn = _stage_fn(graphdef, positions_bxL[: b // M], layout, remat,
                         layers.slots > num_layers)
    to_next = [(i, (i + 1) % S) for i in range(S)]

    def iteration(chunks, first, gather, carry, t):
        inbox_mxLxD, store = carry
        # Stage 0 files the last stage's output of copy t - S (it arrived in the
        # inbox) as the next round's input, then takes copy t's input.
        arrived = t - S
        filed = jnp.where((s == 0) & (arrived >= 0),
                          inbox_mxLxD, lax.dynamic_index_in_dim(store, arrived % M, keepdims=False))
        store = lax.dynamic_update_index_in_dim(store, filed, arrived % M, 0)
        fresh = lax.dynamic_index_in_dim(store, t % M, keepdims=False)
        x_in = jnp.where(s == 0, fresh, inbox_mxLxD)
        valid, micro, round_ = _copies(t, s, M, W)
        k = None if key is None else jax.random.split(jax.random.fold_in(key, t), S)[s]
        held = jax.tree.leaves(chunks)[0].shape[0]
        out_mxLxD, aux = stage_fn(chunks, real_WxLp[first:first + held],
                                  jnp.clip(round_ - first, 0, held - 1), x_in, k)
        aux = {k: jnp.where(valid, a, unmeasured(k, a)) for k, a in aux.items()}
        # The last stage keeps its outputs: after the final round, the model's output.
        kept = jnp.where((s == S - 1) & valid, out_mxLxD,
                         lax.dynamic_index_in_dim(store, micro, keepdims=False))
        store = lax.dynamic_update_index_in_dim(store, kept, micro, 0)
        carry = (lax.ppermute(out_mxLxD, "stage", to_next), store)
        return carry, (aux, round_, gather(t % M))

    carry = (jnp.zeros_like(store_MxmxLxD[0]), store_MxmxLxD)
    sharded = lambda a: isinstance(a, Sharded)  # noqa: E731
    if not any(sharded(a) for a in jax.tree.leaves(state, is_leaf=sharded)):
        chunks = jax.tree.map(lambda a: a[:, 0], state)  # [W, per, ...]
        carry, (aux, round_T, _) = lax.scan(
            functools.partial(iteration, chunks, 0, lambda part: {}), carry,
            jnp.arange(W * M + S - 1))
    else:
        rounds = _rounds(state, layout, M)
        per_round = []
        for v in range(W):  # scan v: iterations v M .. (v + 1) M - 1, the last to the end
            first = max(v - 1, 0)
            chunks = jax.tree.map(lambda *r: jnp.stack(r), *rounds[first:v + 1])
            gather = rounds[v + 1] if v + 1 < W else lambda part: {}
            ts = jnp.arange(v * M, (v + 1) * M if v < W - 1 else W * M + S - 1)
            carry, (*ys, parts) = lax.scan(functools.partial(iteration, chunks, first, gather),
                                           carry, ts)
            per_round.append(ys)
            if v + 1 < W:
                rounds[v + 1] = rounds[v + 1].joined(parts)
        aux, round_T = jax.tree.map(lambda *a: jnp.concatenate(a), *per_round)
    store = carry[1]
    y_bxLxD = store.swapaxes(0, 1).reshape(b, L, D)
    return y_bxLxD, per_layer(aux, round_T, jnp.broadcast_to(s, round_T.shape), layers,
                               num_layers, M)


class _Gathering:
    """A round of the stage's chunks gathered in `parts` parts: called with a part's
    index it gathers that part of every `Sharded` leaf whose last axis divides into
    them; `joined` assembles the round from the parts (gathering the other `Sharded`
    leaves whole) and readies it for the layers."""

    def __init__(self, state, layout, parts: int):
        self.leaves, self.tree = jax.tree.flatten(state, is_leaf=lambda a: isinstance(a, Sharded))
        self.layout, self.parts = layout, parts
        self.split = [i for i, a in enumerate(self.leaves)
                      if isinstance(a, Sharded) and a.shard.shape[-1] % parts == 0]

    def __call__(self, part) -> dict:
        return {i: self.leaves[i].gathered_part(part, self.parts) for i in self.split}

    def joined(self, parts_N: dict):
        whole = [self.leaves[i].joined(parts_N[i]) if i in parts_N else
                 a.gathered() if isinstance(a, Sharded) else a for i, a in enumerate(self.leaves)]
        return ready(jax.tree.unflatten(self.tree, whole), self.layout)


def ready(round_state, layout):
    """A round's gathered weights as the layers compute with them (their MXFP8 copies)."""
    with jax.named_scope("working_copy"):  # the weights' quantisation, as the step's
        copies = mx_copies(round_state, layout.cfg)
    return with_mx_copies(round_state, copies, layout.cfg, layout.kernels)


def _rounds(state, layout, parts: int) -> list:
    """Round 0 ready (its `Sharded` leaves gathered now), and rounds 1 .. W - 1 as
    `_Gathering`s; every leaf without its stage axis: [per, ...]."""
    W = layout.stack.virtual
    one = [jax.tree.map(lambda a: a.at(v).at(0) if isinstance(a, Sharded) else a[v, 0], state,
                        is_leaf=lambda a: isinstance(a, Sharded)) for v in range(W)]
    whole = jax.tree.map(lambda a: a.gathered() if isinstance(a, Sharded) else a, one[0],
                         is_leaf=lambda a: isinstance(a, Sharded))
    return [ready(whole, layout)] + [_Gathering(r, layout, parts) for r in one[1:]]

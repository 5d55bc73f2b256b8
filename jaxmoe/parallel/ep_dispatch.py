"""Expert-parallel dispatchers: tokens travel to the experts that own them.

Experts are split over the mesh axis "expert": R ranks with El = E / R local
experts each, global expert e = rank * El + local_e. Tokens are split over the
batch axes ("data", "expert"), so every device holds Tl = T / (data * R) tokens
and their routing. Each dispatcher is a per-device function (`EXPERT_PARALLEL`) that
moves the Tl * K routed copies to the ranks owning their experts, runs the local
experts and brings the outputs back to be combined with the gates. Every expert
has room for `moe.capacity_factor` x its uniform share of rows; copies past it
are dropped, first choices last, and counted. Where the devices have a grouped
GEMM (`Kernels.grouped_gemm`: NVIDIA GPUs, bf16 experts) the received rows are
packed expert after expert and the GEMM does exactly the kept rows' work
(`expert_rows_ffn`); elsewhere (CPU, MXFP8 experts) it runs over fixed
per-expert buffers [El, C, D] as one batched GEMM (`expert_ffn`), padding
included. They take the local dispatchers' arguments and run
where the `expert` axis is bound: inside the ddp step's `shard_map`, or inside the
one a layout with the global view opens (`jaxmoe.parallel.layout`), so neither the
router nor the expert weights change.

- `alltoall`: a capacity C per (source device, expert), fixed [R, El, C, D] send
  blocks and `all_to_all`: the wire carries the padding too.
- `ragged`: a capacity per expert pooled over the R sources of its group, so one
  source's burst fills room another left; `ragged_all_to_all` moves only the kept
  rows, each written straight into its row of the receiver's buffer. On CPU the
  exchange runs on a padded stand-in lowering (`ragged_cpu`), exact but O(R x N),
  for tests; GPU programs keep the real op.
- `allgather`: the same pooled buffers, filled locally after gathering the expert
  group's tokens; the outputs go home by `psum_scatter`.

Each runs its exchanges under the named scopes `exchange_out` and `exchange_back`
(the expert GEMMs under `expert_gemms`) and names the buffers it receives the same
way for the remat policies (`jaxmoe.model.remat`).

All routing metadata (slots, counts, offsets) is computed and used on device.
The stage axis is absent from every spec: these functions run replicated over it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import MoEConfig
from jaxmoe.ops.kernels import Kernels
from jaxmoe.model.dispatch import (Dispatched, buffer_slots, capacity, combine_rows, gather_rows,
                                   packed_rows_count, packed_slots, routed_copies)
from jaxmoe.model.experts import ExpertWeights, expert_ffn, expert_rows_ffn, row_alignment
from jaxmoe.ops.mx_grouped import padded_groups
from jaxmoe.model.remat import EXCHANGE_BACK, EXCHANGE_OUT
from jaxmoe.model.router import Routing
from jaxmoe.parallel.ragged_cpu import install_cpu_lowering


def prepare(name: str, kernels: Kernels) -> None:
    """What dispatcher `name` needs before it is traced for `kernels`' devices: where
    they lack the ragged exchange (XLA:CPU), `ragged`'s padded stand-in (`ragged_cpu`)."""
    if name == "ragged" and not kernels.native_ragged_exchange:
        install_cpu_lowering()


# ------------------------------------------------------------------ alltoall


def alltoall(x_TlxD, routing: Routing, w_local: ExpertWeights, cfg: MoEConfig,
             kernels: Kernels) -> Dispatched:
    """Capacity-bounded EP with row-wise placement; `dropped` counts this device's.

    Each copy is written straight into its slot [dest rank, local expert, row] of
    the send buffer. Since e = rank * El + local_e, that is the local `grouped`
    layout [E * C, D] viewed as [R, El, C, D], so the received buffer is already
    grouped per local expert: no sort or scatter after the exchange. C is the
    capacity per (source device, expert), so drops are decided, and counted, at
    the source before anything moves.
    """
    expert_TlxK, gate_TlxK, R = routing.expert_TxK, routing.gate_TxK, lax.axis_size("expert")
    E, K = cfg.num_experts, cfg.top_k
    El = E // R
    Tl, D = x_TlxD.shape
    C = capacity(Tl, K, E, cfg.capacity_factor)
    expert_N, token_N = routed_copies(expert_TlxK)
    slot_N, kept_N = buffer_slots(expert_N, E, C)
    with jax.named_scope("exchange_out"):
        send_RxElxCxD = gather_rows(x_TlxD, slot_N, token_N, E * C).reshape(R, El, C, D)
        # recv[r] holds what source rank r sent for my El experts.
        recv_RxElxCxD = checkpoint_name(
            lax.all_to_all(send_RxElxCxD, "expert", 0, 0, tiled=True), EXCHANGE_OUT)
    if grouped := kernels.grouped_gemm(cfg, D):
        # the received blocks' kept rows, packed expert after expert (sources in order)
        sent_E = jnp.minimum(jnp.zeros((E,), jnp.int32).at[expert_N].add(1), C)
        rows_RxEl = lax.all_to_all(sent_E.reshape(R, El), "expert", 0, 0, tiled=True)
        align = row_alignment(grouped)
        pack_RElC = packed_rows(rows_RxEl, C, align)
        received, rows = R * El * C, packed_rows_count(El, R * C, align)
        x_RElCxD = gather_rows(recv_RxElxCxD.reshape(received, D), pack_RElC,
                               jnp.arange(received, dtype=jnp.int32), rows)
        y_RElCxD = expert_rows_ffn(w_local, x_RElCxD, rows_RxEl.sum(0), kernels, grouped, cfg)
        y_RxElxCxD = jnp.concatenate([y_RElCxD, jnp.zeros((1, D), y_RElCxD.dtype)])[pack_RElC]
        y_RxElxCxD = y_RxElxCxD.reshape(R, El, C, D)
    else:
        x_ElxRCxD = recv_RxElxCxD.transpose(1, 0, 2, 3).reshape(El, R * C, D)
        y_ElxRxCxD = expert_ffn(w_local, x_ElxRCxD, cfg, kernels).reshape(El, R, C, D)
        y_RxElxCxD = y_ElxRxCxD.transpose(1, 0, 2, 3)
    with jax.named_scope("exchange_back"):
        back_RxElxCxD = checkpoint_name(lax.all_to_all(
            y_RxElxCxD, "expert", 0, 0, tiled=True), EXCHANGE_BACK)
        y_TlxD = combine_rows(back_RxElxCxD.reshape(E * C, D), slot_N, gate_TlxK.T)
    return Dispatched(y_TlxD, jnp.sum(~kept_N, dtype=jnp.int32))


def packed_rows(rows_RxEl: jax.Array, C: int, align: int = 1) -> jax.Array:
    """Where each row of a received [R, El, C] block goes when packed for the grouped
    GEMM: local expert l's rows follow those of the experts before it (from a multiple
    of `align`), source after source; the first rows_RxEl[s, l] rows of block (s, l)
    are kept, the others map to the out-of-range row `packed_rows_count(El, R C,
    align)`. Flat, [R * El * C]."""
    R, El = rows_RxEl.shape
    total_El = rows_RxEl.sum(0)
    padded_El = padded_groups(total_El, align)
    start_RxEl = (jnp.cumsum(padded_El) - padded_El)[None] + jnp.cumsum(rows_RxEl, 0) - rows_RxEl
    row_C = jnp.arange(C, dtype=jnp.int32)
    packed = start_RxEl[:, :, None] + row_C
    past = packed_rows_count(El, R * C, align)
    return jnp.where(row_C < rows_RxEl[:, :, None], packed, past).reshape(-1)


# ------------------------------------------------------------------ allgather


def allgather(x_TlxD, routing: Routing, w_local: ExpertWeights, cfg: MoEConfig,
              kernels: Kernels) -> Dispatched:
    """EP without a data-dependent exchange: gather, compute local, reduce-scatter.

    Every device sees the expert group's Tg = R * Tl tokens and packs the copies
    routed to its El experts into [El, C, D] buffers, C pooled over the group's
    tokens (as `ragged`'s); copies of other ranks' experts are theirs to run. Each
    token's output is then the sum over ranks, which `psum_scatter` delivers to its
    owner. `dropped` counts this rank's experts' overflow, over the whole group.
    """
    expert_TlxK, gate_TlxK, R = routing.expert_TxK, routing.gate_TxK, lax.axis_size("expert")
    E, K = cfg.num_experts, cfg.top_k
    El = E // R
    Tl, D = x_TlxD.shape
    C = capacity(R * Tl, K, E, cfg.capacity_factor)
    with jax.named_scope("exchange_out"):
        x_TgxD = checkpoint_name(lax.all_gather(x_TlxD, "expert", tiled=True), EXCHANGE_OUT)
        expert_TgxK = lax.all_gather(expert_TlxK, "expert", tiled=True)
        gate_TgxK = lax.all_gather(gate_TlxK, "expert", tiled=True)
    # source by source, each one's copies k-major: the order `ragged` fills its buffers in
    expert_RxN, token_RxN = jax.vmap(routed_copies)(expert_TgxK.reshape(R, Tl, K))
    expert_N = expert_RxN.reshape(-1)
    token_N = (token_RxN + Tl * jnp.arange(R, dtype=jnp.int32)[:, None]).reshape(-1)
    local_N = expert_N - lax.axis_index("expert") * El
    mine_N = (local_N >= 0) & (local_N < El)
    # other ranks' copies queue in an extra bucket El, never computed
    bucket_N = jnp.where(mine_N, local_N, El)
    rows = El * C
    if grouped := kernels.grouped_gemm(cfg, D):  # the bucket El comes last: packing skips it
        align = row_alignment(grouped)
        slot_N, kept_N, bucket_rows = packed_slots(bucket_N, El + 1, C, align)
        rows_El = bucket_rows[:El]
        rows = packed_rows_count(El, C, align)
    else:
        slot_N, kept_N = buffer_slots(bucket_N, El + 1, C)
    slot_N = jnp.where(mine_N & kept_N, slot_N, rows)  # past the buffers: the zero row
    x_ElCxD = gather_rows(x_TgxD, slot_N, token_N, rows)
    if grouped:
        y_ElCxD = expert_rows_ffn(w_local, x_ElCxD, rows_El, kernels, grouped, cfg)
    else:
        y_ElCxD = expert_ffn(w_local, x_ElCxD.reshape(El, C, D), cfg, kernels).reshape(El * C, D)
    slot_KxTg = slot_N.reshape(R, K, Tl).transpose(1, 0, 2).reshape(-1)  # combine's k-major order
    y_TgxD = combine_rows(y_ElCxD, slot_KxTg, gate_TgxK.T)
    with jax.named_scope("exchange_back"):
        y_TlxD = checkpoint_name(
            lax.psum_scatter(y_TgxD, "expert", scatter_dimension=0, tiled=True), EXCHANGE_BACK)
    return Dispatched(y_TlxD, jnp.sum(mine_N & ~kept_N, dtype=jnp.int32))


# ------------------------------------------------------------------ ragged


class RaggedPlan(NamedTuple):
    """`ragged_all_to_all` arguments for both directions, and this rank's drops.

    Slices are per global expert e = dest * El + local_e (E slices, El per rank).
    A receiver's buffer is [El, C] rows: local expert l's rows start at l * C,
    with the source ranks in order inside (row-wise placement), so it is already
    the batched GEMM's input. Forward arrays are indexed by e (sent) or by
    src * El + local_e (received); the backward ones swap the roles.
    """

    forward: tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # in_off, send, out_off, recv
    backward: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    dropped: jax.Array  # int32: this rank's copies past their expert's C rows
    rows_El: jax.Array  # int32: the rows this rank's experts receive, each


def ragged_plan(counts_RxE: jax.Array, rank: jax.Array, El: int, C: int,
                packed: bool = False, align: int = 1) -> RaggedPlan:
    """Offsets and sizes for one rank, from every rank's per-expert copy counts.

    counts_RxE[s, e]: copies on source rank s routed to expert e. A sender's
    buffer is sorted by expert, so its slice e starts at the running sum of its
    counts. Expert e's C rows are filled by the sources in rank order: source s's
    copies start at the sum of the lower sources' counts, and those that start
    past C are dropped (the rest of the slice is not sent). `packed`: the receiver's
    experts' rows follow each other with no room between (for the grouped GEMM);
    expert l's rows then start after the rows of the experts before it, at a multiple
    of `align`.
    """
    R, E = counts_RxE.shape
    counts_RxE = counts_RxE.astype(jnp.int32)
    start_RxE = jnp.cumsum(counts_RxE, axis=1) - counts_RxE  # in each sender's sorted buffer
    c_RxRxEl = counts_RxE.reshape(R, R, El)  # [src, dest, local expert]
    place_RxRxEl = jnp.cumsum(c_RxRxEl, axis=0) - c_RxRxEl  # row in the expert's C
    kept_RxRxEl = jnp.clip(C - place_RxRxEl, 0, c_RxRxEl)
    rows_RxEl = kept_RxRxEl.sum(0)  # [dest, local expert]
    padded_RxEl = padded_groups(rows_RxEl, align)
    start_RxEl = (jnp.cumsum(padded_RxEl, 1) - padded_RxEl if packed else
                  jnp.broadcast_to(jnp.arange(El, dtype=jnp.int32) * C, (R, El)))
    # receiver-side row; a slice that sends nothing points at row 0
    row_RxRxEl = jnp.where(kept_RxRxEl > 0, start_RxEl[None] + place_RxRxEl, 0)
    to_me = (slice(None), rank)  # [src, dest=rank, :]
    forward = (start_RxE[rank], kept_RxRxEl[rank].reshape(E), row_RxRxEl[rank].reshape(E),
               kept_RxRxEl[to_me].reshape(E))
    backward = (row_RxRxEl[to_me].reshape(E), kept_RxRxEl[to_me].reshape(E),
                start_RxE.reshape(R, R, El)[to_me].reshape(E), kept_RxRxEl[rank].reshape(E))
    dropped = jnp.sum(counts_RxE[rank]) - jnp.sum(kept_RxRxEl[rank])
    return RaggedPlan(forward, backward, dropped, rows_RxEl[rank])


# What `ragged`'s exchanges find in the rows nothing is sent to: a zero, but -0.0, not
# 0.0. The backward pass makes +0.0 buffers of the same shapes (the exchanges'
# transposes, the gathers' scatter-adds); XLA merges equal buffers, then copies the
# merged one for each exchange that writes into it in place (benchmarks/RESULTS.md,
# "The ragged exchange's buffers").
EXCHANGE_BUFFER_FILL = -0.0


def ragged(x_TlxD, routing: Routing, w_local: ExpertWeights, cfg: MoEConfig,
           kernels: Kernels) -> Dispatched:
    """EP that moves only the routed rows, into per-expert buffers pooled over sources.

    Copies are sorted by expert (hence by destination rank), every rank's
    per-expert counts are all-gathered (R * E ints), and each rank derives the
    exchange offsets from them (`ragged_plan`). Each local expert has C rows for
    the whole group's copies, C = capacity_factor x its uniform share R * Tl * K / E,
    and no buffer grows with R: the receive buffer is [El * C, D] and the returned
    one [Tl * K, D]. With a grouped GEMM the experts' rows are packed and it does the
    kept rows' work; over buffers, capacity_factor x the routed rows'.
    Copies that find no room come back as zero rows (they add nothing).
    """
    expert_TlxK, gate_TlxK, R = routing.expert_TxK, routing.gate_TxK, lax.axis_size("expert")
    E, K = cfg.num_experts, cfg.top_k
    El = E // R
    Tl, D = x_TlxD.shape
    N = Tl * K
    C = capacity(R * Tl, K, E, cfg.capacity_factor)
    expert_N, token_N = routed_copies(expert_TlxK)
    order_N = jnp.argsort(expert_N, stable=True)
    slot_N = jnp.zeros((N,), jnp.int32).at[order_N].set(jnp.arange(N, dtype=jnp.int32))
    counts_E = jnp.zeros((E,), jnp.int32).at[expert_N].add(1)
    grouped = kernels.grouped_gemm(cfg, D)
    align = row_alignment(grouped) if grouped else 1
    rows = packed_rows_count(El, C, align)
    with jax.named_scope("exchange_out"):
        plan = ragged_plan(lax.all_gather(counts_E, "expert"), lax.axis_index("expert"), El, C,
                           packed=grouped is not None, align=align)
        send_NxD = gather_rows(x_TlxD, slot_N, token_N, N)
        # The exchange's result has its output buffer's type, so the buffers are
        # made like the rows sent (device-varying): an invariant one would make
        # autodiff sum the result's cotangent over the devices.
        recv_ElCxD = checkpoint_name(lax.ragged_all_to_all(
            send_NxD, jnp.full_like(send_NxD, EXCHANGE_BUFFER_FILL, shape=(rows, D)),
            *plan.forward, axis_name="expert"), EXCHANGE_OUT)
    if grouped:
        y_ElCxD = expert_rows_ffn(w_local, recv_ElCxD, plan.rows_El, kernels, grouped, cfg)
    else:
        y_ElCxD = expert_ffn(w_local, recv_ElCxD.reshape(El, C, D), cfg, kernels).reshape(El * C, D)
    with jax.named_scope("exchange_back"):
        back_NxD = checkpoint_name(lax.ragged_all_to_all(
            y_ElCxD, jnp.full_like(send_NxD, EXCHANGE_BUFFER_FILL), *plan.backward,
            axis_name="expert"), EXCHANGE_BACK)
        y_TlxD = combine_rows(back_NxD, slot_N, gate_TlxK.T)
    return Dispatched(y_TlxD, plan.dropped)


# ------------------------------------------------------------------ registry

# by name: per-device functions with the local dispatchers' signature, run where the
# `expert` axis is bound (the ddp step's shard_map, or `GlobalLayout.dispatch`'s)
EXPERT_PARALLEL = {"alltoall": alltoall, "allgather": allgather, "ragged": ragged}

"""Expert-parallel dispatchers: tokens travel to the experts that own them.

Experts are split over the mesh axis "expert": R ranks with El = E / R local
experts each, global expert e = rank * El + local_e. Tokens are split over the
batch axes ("data", "expert"), so every device holds Tl = T / (data * R) tokens
and their routing. Each dispatcher is a per-device function (`PER_DEVICE`) that
moves the Tl * K routed copies to the ranks owning their experts, runs the local
experts and brings the outputs back to be combined with the gates. The ddp step
calls it inside its own `shard_map`; for a caller with the global view
(`EP_DISPATCHERS`) it is wrapped in one, so neither the router nor the expert
weights change.

- `alltoall`: capacity-bounded, fixed [R, El, C, D] buffers and `all_to_all`.
- `allgather`: dropless; gathers the expert group's tokens, runs the local
  experts on all of them, `psum_scatter`s each device its own tokens back.
- `ragged` (for GPU): dropless; `ragged_all_to_all` moves only the routed rows
  and the local experts run as `ragged_dot` group GEMMs. XLA:CPU lacks the
  exchange, so on CPU it runs on a padded stand-in lowering (`ragged_cpu`),
  exact but O(R x N), for tests.

Each runs its exchanges under the named scopes `exchange_out` and `exchange_back`
(the expert GEMMs under `expert_gemms`) and names the buffers it receives the same
way for the remat policies (`jaxmoe.model.remat`).

All routing metadata (slots, counts, offsets) is computed and used on device.
The stage axis is absent from every spec: these functions run replicated over it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.config import MoEConfig
from jaxmoe.model.dispatch import Dispatched, buffer_slots, capacity, combine_rows, gather_rows
from jaxmoe.model.experts import ExpertWeights, expert_ffn, swiglu_experts
from jaxmoe.model.remat import EXCHANGE_BACK, EXCHANGE_OUT
from jaxmoe.model.router import Routing
from jaxmoe.ops.mx import mx_ragged_linear
from jaxmoe.parallel.ragged_cpu import install_cpu_lowering
from jaxmoe.sharding import BATCH_AXES

TOKENS = P(BATCH_AXES)  # leading token dim split over ("data", "expert")
EXPERTS = P("expert")  # leading expert dim split over "expert"; fsdp's D split is re-gathered
_IN_SPECS = (TOKENS, TOKENS, TOKENS, ExpertWeights(EXPERTS, EXPERTS))


def _ep_layout(cfg: MoEConfig, mesh: Mesh | None, name: str) -> tuple[int, int]:
    """(R, El) for an expert-parallel dispatcher, with the errors a user can act on."""
    if mesh is None:
        raise ValueError(f"moe.dispatcher: {name!r} is expert-parallel and needs a device mesh "
                         f"(got mesh=None); use 'grouped' or 'dense' without one")
    R = mesh.shape["expert"]
    if cfg.num_experts % R:
        raise ValueError(f"moe.num_experts: {cfg.num_experts} experts cannot be split "
                         f"over mesh.expert={R}")
    return R, cfg.num_experts // R


def prepare(name: str, mesh: Mesh) -> None:
    """What dispatcher `name` needs before it is traced on `mesh`: on a CPU mesh,
    `ragged`'s padded stand-in exchange (see `ragged_cpu`)."""
    if name == "ragged" and mesh.devices.flat[0].platform == "cpu":
        install_cpu_lowering()


def _global(name: str):
    """The per-device dispatcher `name` for a caller holding global arrays: one
    `shard_map` over the mesh, drops summed over the batch."""
    per_device = PER_DEVICE[name]

    def dispatcher(x_TxD, routing: Routing, w: ExpertWeights, cfg: MoEConfig,
                   mesh: Mesh | None = None) -> Dispatched:
        R, _ = _ep_layout(cfg, mesh, name)
        prepare(name, mesh)

        def local(x_TlxD, expert_TlxK, gate_TlxK, w_local):
            out = per_device(x_TlxD, expert_TlxK, gate_TlxK, w_local, cfg, R)
            return out._replace(dropped=lax.psum(out.dropped, BATCH_AXES))

        return jax.shard_map(local, mesh=mesh, in_specs=_IN_SPECS,
                             out_specs=Dispatched(TOKENS, P()), check_vma=True)(
            x_TxD, routing.expert_TxK, routing.gate_TxK, w)

    return dispatcher


# ------------------------------------------------------------------ alltoall


def alltoall_per_device(x_TlxD, expert_TlxK, gate_TlxK, w_local: ExpertWeights, cfg: MoEConfig,
                        R: int) -> Dispatched:
    """Capacity-bounded EP with row-wise placement; `dropped` counts this device's.

    Each copy is written straight into its slot [dest rank, local expert, row] of
    the send buffer. Since e = rank * El + local_e, that is the local `grouped`
    layout [E * C, D] viewed as [R, El, C, D], so the received buffer is already
    grouped per local expert: no sort or scatter after the exchange. C is the
    capacity per (source device, expert), so drops are decided, and counted, at
    the source before anything moves.
    """
    E, K = cfg.num_experts, cfg.top_k
    El = E // R
    Tl, D = x_TlxD.shape
    C = capacity(Tl, K, E, cfg.capacity_factor)
    expert_N = expert_TlxK.T.reshape(-1)  # k-major, like grouped: first choices keep priority
    token_N = jnp.tile(jnp.arange(Tl, dtype=jnp.int32), K)
    slot_N, kept_N = buffer_slots(expert_N, E, C)
    with jax.named_scope("exchange_out"):
        send_RxElxCxD = gather_rows(x_TlxD, slot_N, token_N, E * C).reshape(R, El, C, D)
        # recv[r] holds what source rank r sent for my El experts.
        recv_RxElxCxD = checkpoint_name(
            lax.all_to_all(send_RxElxCxD, "expert", 0, 0, tiled=True), EXCHANGE_OUT)
    x_ElxRCxD = recv_RxElxCxD.transpose(1, 0, 2, 3).reshape(El, R * C, D)
    y_ElxRxCxD = expert_ffn(w_local, x_ElxRCxD, cfg).reshape(El, R, C, D)
    with jax.named_scope("exchange_back"):
        back_RxElxCxD = checkpoint_name(lax.all_to_all(
            y_ElxRxCxD.transpose(1, 0, 2, 3), "expert", 0, 0, tiled=True), EXCHANGE_BACK)
        y_TlxD = combine_rows(back_RxElxCxD.reshape(E * C, D), slot_N, gate_TlxK.T)
    return Dispatched(y_TlxD, jnp.sum(~kept_N, dtype=jnp.int32))


# ------------------------------------------------------------------ allgather


def allgather_per_device(x_TlxD, expert_TlxK, gate_TlxK, w_local: ExpertWeights, cfg: MoEConfig,
                         R: int) -> Dispatched:
    """Dropless EP without a data-dependent exchange: gather, compute local, reduce-scatter.

    Every device sees the expert group's Tg = R * Tl tokens and runs its El
    experts densely over them, weighted by the gates (zero for copies routed
    elsewhere). Per-expert buffers with the worst-case capacity Tg would cost the
    same El * Tg rows plus a gather, so dense is the cheaper form. Each token's
    output is then the sum over ranks, which `psum_scatter` delivers to its owner.
    """
    El = cfg.num_experts // R
    with jax.named_scope("exchange_out"):
        x_TgxD = checkpoint_name(lax.all_gather(x_TlxD, "expert", tiled=True), EXCHANGE_OUT)
        expert_TgxK = lax.all_gather(expert_TlxK, "expert", tiled=True)
        gate_TgxK = lax.all_gather(gate_TlxK, "expert", tiled=True)
    # Local expert index; other ranks' experts fall outside [0, El) and one-hot to zero.
    local_TgxK = expert_TgxK - lax.axis_index("expert") * El
    gates_TgxEl = jnp.einsum("tk,tke->te", gate_TgxK, jax.nn.one_hot(local_TgxK, El))
    y_ElxTgxD = expert_ffn(w_local, jnp.broadcast_to(x_TgxD, (El,) + x_TgxD.shape), cfg)
    y_TgxD = jnp.einsum("etd,te->td", y_ElxTgxD, gates_TgxEl.astype(x_TgxD.dtype))
    with jax.named_scope("exchange_back"):
        y_TlxD = checkpoint_name(
            lax.psum_scatter(y_TgxD, "expert", scatter_dimension=0, tiled=True), EXCHANGE_BACK)
    return Dispatched(y_TlxD, jnp.zeros((), jnp.int32))


# ------------------------------------------------------------------ ragged


class RaggedPlan(NamedTuple):
    """`ragged_all_to_all` arguments for both directions, and the local group sizes.

    Slices are per global expert e = dest * El + local_e (E slices, El per rank),
    so a receiver's buffer can be laid out grouped by local expert, with the
    source ranks in order inside each group, which is what `ragged_dot` needs.
    Forward arrays are indexed by e (sent) or by src * El + local_e (received);
    the backward ones swap the roles.
    """

    forward: tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # in_off, send, out_off, recv
    backward: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    group_sizes_El: jax.Array  # rows per local expert in this rank's receive buffer


def ragged_plan(counts_RxE: jax.Array, rank: jax.Array, El: int) -> RaggedPlan:
    """Offsets and sizes for one rank, from every rank's per-expert copy counts.

    counts_RxE[s, e]: copies on source rank s routed to expert e. A sender's
    buffer is sorted by expert, so its slice e starts at the running sum of its
    counts. On receiver r, local expert l's group starts after the rows of all
    lower local experts (from every source), and source s's rows follow those of
    the lower sources: `output_offsets` are these receiver-side positions.
    """
    R, E = counts_RxE.shape
    counts_RxE = counts_RxE.astype(jnp.int32)
    start_RxE = jnp.cumsum(counts_RxE, axis=1) - counts_RxE  # in each sender's sorted buffer
    c_RxRxEl = counts_RxE.reshape(R, R, El)  # [src, dest, local expert]
    group_RxEl = jnp.sum(c_RxRxEl, axis=0)  # [dest, local expert]
    group_start_RxEl = jnp.cumsum(group_RxEl, axis=1) - group_RxEl
    place_RxRxEl = group_start_RxEl[None] + jnp.cumsum(c_RxRxEl, axis=0) - c_RxRxEl
    to_me = (slice(None), rank)  # [src, dest=rank, :]
    forward = (start_RxE[rank], counts_RxE[rank], place_RxRxEl[rank].reshape(E),
               c_RxRxEl[to_me].reshape(E))
    backward = (place_RxRxEl[to_me].reshape(E), c_RxRxEl[to_me].reshape(E),
                start_RxE.reshape(R, R, El)[to_me].reshape(E), counts_RxE[rank])
    return RaggedPlan(forward, backward, group_RxEl[rank])


def ragged_ffn(w: ExpertWeights, x_MxD: jax.Array, group_sizes_El: jax.Array,
               cfg: MoEConfig | None = None) -> jax.Array:
    """`expert_ffn` on rows grouped contiguously by expert (rows past the groups are unused)."""
    dt = x_MxD.dtype
    if cfg is not None and cfg.expert_precision == "mxfp8":
        matmul = functools.partial(mx_ragged_linear, group_sizes_G=group_sizes_El,
                                   scale_rule=cfg.mxfp8_scale)
    else:
        matmul = lambda x, w: lax.ragged_dot(x, w.astype(dt), group_sizes_El)  # noqa: E731
    return swiglu_experts(matmul, w, x_MxD)


def ragged_per_device(x_TlxD, expert_TlxK, gate_TlxK, w_local: ExpertWeights, cfg: MoEConfig,
                      R: int) -> Dispatched:
    """Dropless EP that moves only the routed rows.

    Copies are sorted by expert (hence by destination rank), every rank's
    per-expert counts are all-gathered (R * E ints), and each rank derives the
    exchange offsets from them (`ragged_plan`). The receive buffer has the static
    worst-case size R * Tl * K rows: every source could route every copy here.
    On a CPU mesh the exchange lowers to `ragged_cpu`'s padded all_to_all (XLA:CPU
    has no ragged-all-to-all; the caller installs it); GPU programs keep the real op.
    """
    E, K = cfg.num_experts, cfg.top_k
    El = E // R
    Tl, D = x_TlxD.shape
    N = Tl * K
    expert_N = expert_TlxK.T.reshape(-1)
    token_N = jnp.tile(jnp.arange(Tl, dtype=jnp.int32), K)
    order_N = jnp.argsort(expert_N, stable=True)
    slot_N = jnp.zeros((N,), jnp.int32).at[order_N].set(jnp.arange(N, dtype=jnp.int32))
    counts_E = jnp.zeros((E,), jnp.int32).at[expert_N].add(1)
    with jax.named_scope("exchange_out"):
        plan = ragged_plan(lax.all_gather(counts_E, "expert"), lax.axis_index("expert"), El)
        send_NxD = gather_rows(x_TlxD, slot_N, token_N, N)
        # The exchange's result has its output buffer's type, so the buffers are
        # zeros_like the rows sent (device-varying): an invariant one would make
        # autodiff sum the result's cotangent over the devices.
        recv_MxD = checkpoint_name(lax.ragged_all_to_all(
            send_NxD, jnp.zeros_like(send_NxD, shape=(R * N, D)), *plan.forward,
            axis_name="expert"), EXCHANGE_OUT)
    y_MxD = ragged_ffn(w_local, recv_MxD, plan.group_sizes_El, cfg)
    with jax.named_scope("exchange_back"):
        back_NxD = checkpoint_name(lax.ragged_all_to_all(
            y_MxD, jnp.zeros_like(y_MxD, shape=(N, D)), *plan.backward, axis_name="expert"),
            EXCHANGE_BACK)
        y_TlxD = combine_rows(back_NxD, slot_N, gate_TlxK.T)
    return Dispatched(y_TlxD, jnp.zeros((), jnp.int32))


# ------------------------------------------------------------------ registry

PER_DEVICE = {"alltoall": alltoall_per_device, "allgather": allgather_per_device,
              "ragged": ragged_per_device}
EP_DISPATCHERS = {name: _global(name) for name in PER_DEVICE}

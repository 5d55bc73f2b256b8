"""Where a forward pass runs on a mesh: the layouts that turn a mesh into what the
model and its loss ask (`jaxmoe.model.layout`, whose `LocalLayout` answers for one
device and which the layouts here extend): which kernels the mesh's devices run
(attention, MXFP8, the ragged exchange: read from the devices, not the host's),
which positions its tokens hold and how attention reaches the rest of their
sequences (a chunk of each under `context`: `jaxmoe.parallel.context`), pin
activations to the batch split, run an MoE layer's dispatch (the expert-parallel
dispatchers join the local ones here), total a per-shard router statistic, run the
stacked MoE layers (a scan, or a pipeline over `stage` of the stack held as
`StageStack` chunks), and, for the loss, which rows run outside the MoE stack and
what part of the output this program holds (with pipeline stages, the last stage's
output, or each stage's share of it: `StageRowsLayout`).

Where the training state lives and what the step does to it is the program's
(`jaxmoe.step.program`), which holds one of these.

- `GlobalLayout`: the model sees global arrays and XLA partitions the program
  (fsdp, and the pure-function API with `mesh=`). Expert-parallel dispatchers
  open their own `shard_map`.
- `DeviceLayout`: the model runs inside the ddp step's `shard_map` on one
  device's rows, its dense replicas and its slice of the experts (and, with
  pipeline stages, its stage's layers); dispatchers are called as per-device
  functions whose collectives name the `expert` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.config import Config, MoEConfig, check_expert_split
from jaxmoe.model.dispatch import LOCAL, Dispatched
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout, choose_dispatcher
from jaxmoe.model.router import Routing
from jaxmoe.model.transformer import scan_layers
from jaxmoe.ops.kernels import Kernels
from jaxmoe.parallel import context, ep_dispatch, sharding
from jaxmoe.parallel.ddp import Sharded
from jaxmoe.parallel.pipeline import StageStack, device_pipeline, pipeline, ready
from jaxmoe.parallel.sharding import BATCH_AXES, TOKEN_AXES, axis_size


def dispatch_on_mesh(x_TxD, routing, weights, cfg: MoEConfig, mesh: Mesh | None) -> Dispatched:
    """`cfg.dispatcher` for a caller holding global arrays (None: one device)."""
    return layout_for(None, mesh).dispatch(x_TxD, routing, weights, cfg)


class GlobalLayout(LocalLayout):
    """The auto-sharded program's view: global arrays, placed by sharding rules."""

    dispatchers = {**LOCAL, **ep_dispatch.EXPERT_PARALLEL}

    def __init__(self, mesh: Mesh, cfg: Config | None = None):
        """cfg: the model's config, needed to run its MoE stack (a single MoE layer
        needs only the mesh)."""
        self.cfg, self.mesh = cfg, mesh
        self.kernels = Kernels.of_mesh(mesh)  # what the mesh's devices run
        self.batch_shards = mesh.shape["data"] * mesh.shape["expert"]
        S = mesh.shape["stage"]
        # how pipeline stages hold the MoE stack; None: as the model has it, [Lm, ...]
        self.stack = None if cfg is None or S == 1 or not cfg.num_moe_layers else \
            StageStack.of(cfg.num_moe_layers, S, cfg.pipeline.virtual_stages)

    # -- what the model asks

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return sharding.constrain_batch(x, self.mesh)

    def dispatch(self, x_TxD, routing: Routing, weights, cfg: MoEConfig) -> Dispatched:
        """The chosen per-device dispatcher in a `shard_map` over the batch (and, for an
        expert-parallel one, the experts over `expert`); drops summed over the batch."""
        dispatcher = choose_dispatcher(self.dispatchers, cfg)
        expert_parallel = cfg.dispatcher not in LOCAL
        if expert_parallel:
            check_expert_split(cfg.num_experts, self.mesh.shape["expert"])
            ep_dispatch.prepare(cfg.dispatcher, self.kernels)
        elif self.mesh.shape["data"] * self.mesh.shape["expert"] == 1:
            # one batch shard: a shard_map would only wrap the expert weights and their
            # gradients in copies at every layer
            return dispatcher(x_TxD, routing, weights, cfg, self.kernels)

        def local(x_TlxD, expert_TlxK, gate_TlxK, w):  # each device its own tokens
            out = dispatcher(x_TlxD, Routing(expert_TlxK, gate_TlxK, None, None, None), w, cfg,
                             self.kernels)
            return out._replace(dropped=lax.psum(out.dropped, BATCH_AXES))

        tokens = P(BATCH_AXES)
        experts = jax.tree.map(lambda _: P("expert") if expert_parallel else P(), weights)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(tokens, tokens, tokens, experts),
                             out_specs=Dispatched(tokens, P()))(
            x_TxD, routing.expert_TxK, routing.gate_TxK, weights)

    _pipeline = staticmethod(pipeline)  # the schedule on global arrays

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        """`model`'s MoE layers over x: a pipeline of the stored stack when `stage` > 1,
        else a scan in model order. Returns x and the per-layer aux in model order."""
        if self.stack is not None:
            return self._pipeline(model.moe_layers, x_BxLxD, positions_BxL, self, key, remat,
                                  self.cfg.pipeline.stage_microbatches, self.cfg.num_moe_layers)
        return model.scan_moe_layers(x_BxLxD, positions_BxL, self, key, remat)


class DeviceLayout(GlobalLayout):
    """Inside a `shard_map` over every mesh axis: one device's share of everything."""

    def __init__(self, mesh: Mesh, cfg: Config):
        super().__init__(mesh, cfg)
        if cfg.num_moe_layers:
            ep_dispatch.prepare(cfg.moe.dispatcher, self.kernels)
        self.batch_shards = 1  # a device's rows are one shard
        self.context = axis_size(mesh, context.AXIS)  # devices each sequence is split over

    def positions(self, batch: int, length: int) -> jax.Array:
        """This device's chunk of positions under `context` (whole sequences without)."""
        positions_BxL = super().positions(batch, length)
        return positions_BxL + context.chunk_offset(length) if self.context > 1 else positions_BxL

    def sequence_length(self, length: int) -> int:
        return length * self.context

    def attend(self, attention, q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd) -> jax.Array:
        if self.context == 1:
            return attention(q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd)
        return context.attend_across(attention, q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd,
                                     self.context)

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return x

    def sequence_total(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, context.AXIS) if self.context > 1 else x

    def batch_total(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, TOKEN_AXES)

    def dispatch(self, x_TxD, routing: Routing, weights, cfg: MoEConfig) -> Dispatched:
        """Already inside the step's `shard_map`: the per-device dispatcher itself."""
        return choose_dispatcher(self.dispatchers, cfg)(x_TxD, routing, weights, cfg,
                                                        self.kernels)

    def output_share(self, x: jax.Array) -> jax.Array:
        """With pipeline stages only the last stage holds the model's output."""
        S = self.mesh.shape["stage"]
        return x if S == 1 else jnp.where(lax.axis_index("stage") == S - 1, x, 0.0)

    _pipeline = staticmethod(device_pipeline)  # one device's stage of the schedule

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        """As the global layout's; without stages, a stack whose leaves arrive as their
        ZeRO-1 shards (`ddp.Sharded`: the ddp step defers their gather here) runs as a
        scan that gathers the next layer's weights (and makes their MXFP8 copies) while
        a layer computes: the step's gather and, by its transpose, its gradient's
        reduce-scatter, a layer at a time beside the compute."""
        graphdef, state = model.moe_stack()
        sharded = lambda a: isinstance(a, Sharded)  # noqa: E731
        if self.stack is not None or not any(map(sharded, jax.tree.leaves(state,
                                                                           is_leaf=sharded))):
            return super().run_moe_stack(model, x_BxLxD, positions_BxL, key, remat)
        state = jax.tree.map(lambda a: a.per_layer() if sharded(a) else a, state,
                             is_leaf=sharded)

        def fetch(layer_state):
            with jax.named_scope("working_copy"):
                whole = jax.tree.map(lambda a: a.gathered() if sharded(a) else a, layer_state,
                                     is_leaf=sharded)
            return ready(whole, self)

        return scan_layers(graphdef, state, x_BxLxD, positions_BxL, self, key, remat,
                           fetch=fetch)

    def output_sum(self, x: jax.Array) -> jax.Array:
        """The part of a sum over the output's tokens (a router count of a layer after
        the pipeline) this device contributes: the last stage's, as `output_share`."""
        return self.output_share(x)

    def output_max(self, x: jax.Array) -> jax.Array:
        """As `output_sum`, for a maximum: the last stage's (-inf elsewhere)."""
        S = self.mesh.shape["stage"]
        return x if S == 1 else jnp.where(lax.axis_index("stage") == S - 1, x, -jnp.inf)


class StageRowsLayout(DeviceLayout):
    """A device's layout for the training loss under pipeline stages: what runs
    outside the pipeline (the embedding, the dense layers in front, the LM head and
    the loss, the multi-token prediction modules) runs on this stage's 1 / S of the
    device's rows, not on all of them on every stage. The rows are gathered over
    `stage` into the pipeline (stage 0 reads them) and its output, the last stage's,
    is scattered back over `stage` after it: two [b, L, D] collectives a pass, where
    every stage would otherwise repeat that work S times (DeepSeek-V3's 3 dense
    layers, 129k-token head and MTP module: ~30% of its step on 8 stages).

    The pipeline itself runs in `inside`, the plain device layout: its MoE layers
    see the whole rows of the device, and their batch totals span `TOKEN_AXES`;
    layers outside it (the MTP modules') hold tokens that also differ over `stage`."""

    def __init__(self, inside: DeviceLayout):
        self.__dict__.update(inside.__dict__)
        self.inside = inside
        self.stages = self.mesh.shape["stage"]

    def rows_outside_stack(self, rows_bxN: jax.Array) -> jax.Array:
        """This stage's contiguous 1 / S of the device's rows."""
        part = rows_bxN.shape[0] // self.stages
        return lax.dynamic_slice_in_dim(rows_bxN, lax.axis_index("stage") * part, part, axis=0)

    def run_moe_stack(self, model, x_bxLxD, positions_bxL, key, remat: str):
        with jax.named_scope("stage_rows"):
            x_all = lax.all_gather(x_bxLxD, "stage", axis=0, tiled=True)
        b, L = x_all.shape[:2]
        y_all, aux = self.inside.run_moe_stack(model, x_all, self.inside.positions(b, L), key,
                                               remat)
        with jax.named_scope("stage_rows"):  # the last stage's output, a part to each stage
            last = jnp.where(lax.axis_index("stage") == self.stages - 1, y_all,
                             jnp.zeros((), y_all.dtype))
            return lax.psum_scatter(last, "stage", scatter_dimension=0, tiled=True), aux

    def batch_total(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, (*TOKEN_AXES, "stage"))

    def output_share(self, x: jax.Array) -> jax.Array:
        """A mean over this stage's rows: 1 / S of the mean over the device's."""
        return x / self.stages

    def output_sum(self, x: jax.Array) -> jax.Array:
        return x

    def output_max(self, x: jax.Array) -> jax.Array:
        return x


def layout_for(cfg: Config | None, mesh: Mesh | None) -> LocalLayout:
    """The auto-sharded layout of `mesh`; without one, one device's."""
    return LOCAL_LAYOUT if mesh is None else GlobalLayout(mesh, cfg)

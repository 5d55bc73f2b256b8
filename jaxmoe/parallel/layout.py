"""Where the model runs: the one object that turns a mesh into what the model does.

The training step asks a layout where every tensor lives (the rules table of
`mesh.parallelism`, ZeRO-1, the batch split, and, with pipeline stages, the MoE
stack held as [W, S, per, ...] chunks: `StageStack`, model order when flattened)
The model never sees the
mesh: it asks its layout eight things (`jaxmoe.model.layout`, whose `LocalLayout`
answers them for one device and which the layouts here extend): which kernels its
devices run (`kernels`: attention, MXFP8, the ragged exchange, read from the mesh's
devices, not the host's), which positions its tokens hold and how attention reaches
the rest of their sequences (a chunk of each under `context`:
`jaxmoe.parallel.context`), which of its rows it runs outside the MoE stack (in
the training loss under a pipeline, a stage's share: `StageRowsLayout`), pin
activations to the batch split, run an MoE layer's dispatch (the expert-parallel
dispatchers join the local ones here), total a per-shard router statistic over
the batch or the sequence, run the stacked MoE layers (a scan, or a pipeline over
`stage`), and weigh what it computed from its output, the loss or a row's score
(with pipeline stages, the last stage's output, or each stage's share of it).

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
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.config import Config, MoEConfig, check_expert_split
from jaxmoe.model.dispatch import LOCAL, Dispatched
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.router import Routing
from jaxmoe.model.transformer import in_moe_stack, map_moe_stack
from jaxmoe.ops.kernels import Kernels
from jaxmoe.parallel import context, ep_dispatch, sharding
from jaxmoe.parallel.pipeline import StageStack, device_pipeline, pipeline
from jaxmoe.parallel.sharding import BATCH_AXES, TOKEN_AXES, axis_size


def dispatch_on_mesh(x_TxD, routing, weights, cfg: MoEConfig, mesh: Mesh | None) -> Dispatched:
    """`cfg.dispatcher` for a caller holding global arrays (None: one device)."""
    return layout_for(None, mesh).dispatch(x_TxD, routing, weights, cfg)


class GlobalLayout(LocalLayout):
    """The auto-sharded program's view: global arrays, placed by sharding rules."""

    dispatchers = {**LOCAL, **ep_dispatch.EXPERT_PARALLEL}

    def __init__(self, mesh: Mesh, cfg: Config | None = None):
        """cfg: the model's config, needed to run its MoE stack and to place the
        training state (a single MoE layer needs only the mesh)."""
        self.cfg, self.mesh = cfg, mesh
        self.kernels = Kernels.of_mesh(mesh)  # what the mesh's devices run
        self.batch_shards = mesh.shape["data"] * mesh.shape["expert"]
        S = mesh.shape["stage"]
        # how pipeline stages hold the MoE stack; None: as the model has it, [Lm, ...]
        self.stack = None if cfg is None or S == 1 or not cfg.num_moe_layers else \
            StageStack.of(cfg.num_moe_layers, S, cfg.pipeline.virtual_stages)

    # -- where the training state and the batch live

    def stored(self, tree):
        """A model-order tree (params, buffers, a gradient of them) as this layout keeps
        it: with pipeline stages, each MoE leaf [Lm, ...] as [W, S, per, ...]."""
        return tree if self.stack is None else map_moe_stack(self.stack.stored, tree)

    def in_model_order(self, tree):
        """`stored`'s inverse: every MoE leaf [Lm, ...] in model order."""
        if self.stack is None:
            return tree
        return map_moe_stack(lambda a: self.stack.model(a, self.cfg.num_moe_layers), tree)

    def _specs(self, abs_tree: nnx.State) -> nnx.State:
        """The rules table's specs of a model-order tree, for its `stored` form: a MoE
        leaf's (layers, ...) spec becomes (None, layers, None, ...) over [W, S, per]."""
        specs = sharding.state_specs(abs_tree, sharding.RULES[self.cfg.mesh.parallelism])
        if self.stack is None:
            return specs

        def stage_view(path, var):
            if not in_moe_stack(path):
                return var
            layers, *rest = var.get_value()
            return var.replace(P(None, layers, None, *rest))

        return jax.tree_util.tree_map_with_path(stage_view, specs,
                                                is_leaf=lambda x: isinstance(x, nnx.Variable))

    def param_specs(self, abs_params: nnx.State) -> nnx.State:
        """Where the (stored) parameters are used, from the model-order abstract
        parameters: `mesh.parallelism`'s rules table."""
        return self._specs(abs_params)

    def buffer_specs(self, abs_buffers: nnx.State) -> nnx.State:
        return self._specs(abs_buffers)

    def optimizer_specs(self, abs_params: nnx.State, use: nnx.State) -> nnx.State:
        """Where each parameter's optimizer state lives (`use`: where the parameter
        is used): its ZeRO-1 split over the axes holding copies of it, when on."""
        if not self.cfg.mesh.zero1:
            return use
        return jax.tree.map(lambda p, s: sharding.zero1_spec(s, p.shape, self.mesh),
                            abs_params, use, is_leaf=lambda x: isinstance(x, P))

    @property
    def batch_sharding(self) -> NamedSharding:
        return sharding.batch_sharding(self.mesh)

    # -- what the model asks

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return sharding.constrain_batch(x, self.mesh)

    def own_share(self, a_Lmx: jax.Array) -> jax.Array:
        """Per-MoE-layer values [Lm, ...] in model order (e.g. router bias updates) as
        this program holds the layers: all of them, stored as the stack is."""
        return a_Lmx if self.stack is None else self.stack.stored(a_Lmx)

    def dispatch(self, x_TxD, routing: Routing, weights, cfg: MoEConfig) -> Dispatched:
        """The chosen per-device dispatcher in a `shard_map` over the batch (and, for an
        expert-parallel one, the experts over `expert`); drops summed over the batch."""
        dispatcher = self.dispatcher(cfg)
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
        return self.dispatcher(cfg)(x_TxD, routing, weights, cfg, self.kernels)

    def output_share(self, x: jax.Array) -> jax.Array:
        """With pipeline stages only the last stage holds the model's output."""
        S = self.mesh.shape["stage"]
        return x if S == 1 else jnp.where(lax.axis_index("stage") == S - 1, x, 0.0)

    def own_share(self, a_Lmx: jax.Array) -> jax.Array:
        """This device's share of per-MoE-layer values [Lm, ...]: its stage's chunks,
        [W, 1, per, ...] (zeros in padding slots)."""
        if self.stack is None:
            return a_Lmx
        return lax.dynamic_slice_in_dim(self.stack.stored(a_Lmx), lax.axis_index("stage"), 1,
                                        axis=1)

    _pipeline = staticmethod(device_pipeline)  # one device's stage of the schedule

    def output_sum(self, x: jax.Array) -> jax.Array:
        """The part of a sum over the output's tokens (a router count of a layer after
        the pipeline) this device contributes: the last stage's, as `output_share`."""
        return self.output_share(x)

    def output_max(self, x: jax.Array) -> jax.Array:
        """As `output_sum`, for a maximum: the last stage's (-inf elsewhere)."""
        S = self.mesh.shape["stage"]
        return x if S == 1 else jnp.where(lax.axis_index("stage") == S - 1, x, -jnp.inf)

    def rows_split_over_stages(self, rows: int) -> DeviceLayout:
        """The layout for a loss over `rows` rows a device: with pipeline stages and rows
        that divide among them, one (`StageRowsLayout`) whose stages share the work
        outside the pipeline instead of each doing all of it; else this one."""
        S = self.mesh.shape["stage"]
        if self.stack is None or rows % S:
            return self
        return StageRowsLayout(self)


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

    def own_rows(self, rows_bxN: jax.Array) -> jax.Array:
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

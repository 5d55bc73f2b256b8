"""Where the model runs: the one object that turns a mesh into what the model does.

The training step asks a layout where every tensor lives (the rules table of
`mesh.parallelism`, ZeRO-1, the batch split) and checks the config against the
mesh through it. The model never sees the mesh. It takes a layout (or None:
the default device, local dispatchers) and asks it six things: which kernels
its devices run (`kernels`: attention, MXFP8, the ragged exchange, read from the
mesh's devices, not the host's), pin activations to the batch split, run an MoE
layer's dispatch, total a per-shard router statistic over the batch, run the
stacked MoE layers (a scan, or a pipeline over `stage`), and weigh the loss it
computed (with pipeline stages, only the last stage's output counts).

- `GlobalLayout`: the model sees global arrays and XLA partitions the program
  (fsdp, eval, the pure-function API with `mesh=`). Expert-parallel dispatchers
  open their own `shard_map`.
- `DeviceLayout`: the model runs inside the ddp step's `shard_map` on one
  device's rows, its dense replicas and its slice of the experts (and, with
  pipeline stages, its stage's layers); dispatchers are called as per-device
  functions whose collectives name the `expert` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe import sharding
from jaxmoe.config import Config, ConfigError, MoEConfig
from jaxmoe.kernels import Kernels
from jaxmoe.model.dispatch import LOCAL_DISPATCHERS, Dispatched, get_dispatcher
from jaxmoe.model.transformer import scan_layers, stored_layer_order
from jaxmoe.parallel import ep_dispatch
from jaxmoe.parallel.pipeline import device_pipeline, pipeline
from jaxmoe.sharding import BATCH_AXES


def dispatch_on_mesh(x_TxD, routing, weights, cfg: MoEConfig, mesh: Mesh | None) -> Dispatched:
    """`cfg.dispatcher` for a caller holding global arrays (None: one device)."""
    if cfg.dispatcher not in LOCAL_DISPATCHERS:  # refuses mesh=None, naming the key
        return ep_dispatch.EP_DISPATCHERS[cfg.dispatcher](x_TxD, routing, weights, cfg, mesh)
    dispatcher = get_dispatcher(cfg.dispatcher)
    kernels = Kernels.default() if mesh is None else Kernels.of_mesh(mesh)
    if mesh is None or mesh.shape["data"] * mesh.shape["expert"] == 1:
        # one batch shard: a shard_map would only wrap the expert weights and
        # their gradients in copies at every layer
        return dispatcher(x_TxD, routing, weights, cfg, kernels)

    def local(x, r, w):  # each device packs its own tokens
        out = dispatcher(x, r, w, cfg, kernels)
        return out._replace(dropped=lax.psum(out.dropped, BATCH_AXES))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES), P(BATCH_AXES), P()),
                         out_specs=Dispatched(P(BATCH_AXES), P()))(x_TxD, routing, weights)


class GlobalLayout:
    """The auto-sharded program's view: global arrays, placed by sharding rules."""

    def __init__(self, mesh: Mesh, cfg: Config | None = None):
        """cfg: the model's config, needed to run its MoE stack and to place the
        training state (a single MoE layer needs only the mesh)."""
        self.cfg, self.mesh = cfg, mesh
        self.kernels = Kernels.of_mesh(mesh)  # what the mesh's devices run
        self.batch_shards = mesh.shape["data"] * mesh.shape["expert"]

    # -- where the training state and the batch live

    def check_training(self) -> None:
        """The config's shape checks that need this mesh; run before compiling."""
        sharding.check_divisibility(self.cfg, self.mesh)

    def param_specs(self, abs_params: nnx.State) -> nnx.State:
        """Where the parameters are used: `mesh.parallelism`'s rules table."""
        return sharding.state_specs(abs_params, sharding.RULES[self.cfg.mesh.parallelism])

    def buffer_specs(self, abs_buffers: nnx.State) -> nnx.State:
        return sharding.state_specs(abs_buffers, sharding.RULES[self.cfg.mesh.parallelism])

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

    def batch_total(self, x: jax.Array) -> jax.Array:
        """A statistic summed over this program's tokens is already global."""
        return x

    def ce_share(self, ce: jax.Array) -> jax.Array:
        """The part of the cross-entropy this program contributes: all of it."""
        return ce

    def stored_slots(self) -> np.ndarray | jax.Array:
        """Model-order index of each MoE slot this program holds (all of them)."""
        return stored_layer_order(self.cfg)

    def dispatch(self, x_TxD, routing, weights, cfg: MoEConfig) -> Dispatched:
        return dispatch_on_mesh(x_TxD, routing, weights, cfg, self.mesh)

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        """`model`'s MoE layers over x: a pipeline of the stored stack when `stage` > 1,
        else a scan in model order. Returns x and the per-layer aux in model order."""
        if self.mesh.shape["stage"] > 1:
            pipe = self.cfg.pipeline
            return pipeline(model.moe_layers, x_BxLxD, positions_BxL, self, key, remat,
                            pipe.stage_microbatches, pipe.virtual_stages, self.cfg.num_moe_layers)
        graphdef, state = model.moe_stack()
        return scan_layers(graphdef, state, x_BxLxD, positions_BxL, self, key, remat)


class DeviceLayout(GlobalLayout):
    """Inside a `shard_map` over every mesh axis: one device's share of everything."""

    def __init__(self, mesh: Mesh, cfg: Config):
        super().__init__(mesh, cfg)
        if cfg.num_moe_layers:
            ep_dispatch.prepare(cfg.moe.dispatcher, self.kernels)
        if cfg.num_moe_layers and cfg.moe.dispatcher in LOCAL_DISPATCHERS \
                and mesh.shape["expert"] > 1:
            raise ConfigError(f"moe.dispatcher: {cfg.moe.dispatcher!r} runs every expert on "
                              f"each device, but mesh.expert={mesh.shape['expert']} splits "
                              "them; use alltoall, allgather or ragged")
        self.batch_shards = 1  # a device's rows are one shard

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return x

    def batch_total(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, BATCH_AXES)

    def dispatch(self, x_TxD, routing, weights, cfg: MoEConfig) -> Dispatched:
        if cfg.dispatcher in LOCAL_DISPATCHERS:
            return get_dispatcher(cfg.dispatcher)(x_TxD, routing, weights, cfg, self.kernels)
        return ep_dispatch.PER_DEVICE[cfg.dispatcher](
            x_TxD, routing.expert_TxK, routing.gate_TxK, weights, cfg, self.mesh.shape["expert"],
            self.kernels)

    def ce_share(self, ce: jax.Array) -> jax.Array:
        """With pipeline stages only the last stage holds the model's output."""
        S = self.mesh.shape["stage"]
        return ce if S == 1 else jnp.where(lax.axis_index("stage") == S - 1, ce, 0.0)

    def stored_slots(self) -> np.ndarray | jax.Array:
        """This device's MoE slots: its stage's row of the stored layout."""
        order = stored_layer_order(self.cfg)
        S = self.mesh.shape["stage"]
        return order if S == 1 else jnp.asarray(order.reshape(S, -1))[lax.axis_index("stage")]

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        if self.mesh.shape["stage"] > 1:
            pipe = self.cfg.pipeline
            return device_pipeline(model.moe_layers, x_BxLxD, positions_BxL, self, key, remat,
                                   pipe.stage_microbatches, pipe.virtual_stages,
                                   self.cfg.num_moe_layers)
        graphdef, state = model.moe_stack()
        return scan_layers(graphdef, state, x_BxLxD, positions_BxL, self, key, remat)


def layout_for(cfg: Config, mesh: Mesh | None) -> GlobalLayout | None:
    """The auto-sharded layout of `mesh` (None stays None: one device)."""
    return None if mesh is None else GlobalLayout(mesh, cfg)

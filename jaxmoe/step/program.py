"""Where the step runs: the auto-sharded program (fsdp) or one device's program inside
a `shard_map` over the whole mesh (ddp).

A program answers the step, a layout (`jaxmoe.parallel.layout`) the forward pass
inside it: the program holds the layout its model runs with, places the training
state, and does what the step does to the state around the forward pass. Every step
makes the working copy of the parameters, sums the gradients over the accumulation
slices and reduces them, totals the losses and stats, takes the norm and the finite
check, lets the optimizer update the parameters the program owns, then gathers
them. What differs between the two programs is each of those verbs; the step's body
(`jaxmoe.step.build.make_train_step`) is written once against them. Where the state
lives is the same for both (`Program`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.config import Config
from jaxmoe.model.attention import MAX_STATS
from jaxmoe.model.moe import MEAN_STATS
from jaxmoe.model.transformer import in_moe_stack
from jaxmoe.ops.vma import vary
from jaxmoe.optim.muon import on_one_device
from jaxmoe.optim.params import param_name
from jaxmoe.parallel import sharding
from jaxmoe.parallel import context, ddp
from jaxmoe.parallel.layout import DeviceLayout, GlobalLayout, StageRowsLayout
from jaxmoe.parallel.pipeline import held, in_model_order
from jaxmoe.parallel.sharding import BATCH_AXES, TOKEN_AXES
from jaxmoe.step.checks import check_optimizer


# per-shard means among the losses' aux: totalled over shards, they are divided by their count
SHARD_MEANS = (*MEAN_STATS, "mtp_ce")


class Program:
    """Where the training state lives, the same for both programs: the parameters and
    buffers where `mesh.parallelism`'s rules table puts them (with pipeline stages
    the MoE stack held as its stages hold it, [W, S, per, ...]: `StageStack`), the
    optimizer state (and, with bf16 compute, the fp32 masters) in ZeRO-1 shards over
    each tensor's replica axes, the batch split over the batch axes."""

    def __init__(self, cfg: Config, layout: GlobalLayout, abs_params: nnx.State):
        """abs_params: the model's abstract parameters, in model order."""
        self.cfg, self.layout, self.mesh, self.stack = cfg, layout, layout.mesh, layout.stack
        self.loss_layout = layout  # what the training loss's forward runs with
        self.use_specs = self._specs(abs_params)  # where each (held) parameter is used
        # where its optimizer state lives
        self.shard_specs = self._zero1_specs(jax.eval_shape(self.stored, abs_params))
        check_optimizer(cfg, self.mesh, abs_params, self.shard_specs)

    def stored(self, tree):
        """A model-order tree (params, buffers, a gradient of them) as the state holds it."""
        return held(self.stack, tree)

    def in_model_order(self, tree):
        """`stored`'s inverse."""
        return in_model_order(self.stack, tree, self.cfg.num_moe_layers)

    def own_layers(self, a_Lmx: jax.Array) -> jax.Array:
        """Per-MoE-layer values [Lm, ...] in model order (router bias updates, QK-clip
        factors) as this program holds the layers: all of them, held as the stack is."""
        return a_Lmx if self.stack is None else self.stack.stored(a_Lmx)

    def buffer_specs(self, abs_buffers: nnx.State) -> nnx.State:
        return self._specs(abs_buffers)

    @property
    def batch_sharding(self) -> NamedSharding:
        return sharding.batch_sharding(self.mesh)

    def _specs(self, abs_tree: nnx.State) -> nnx.State:
        """The rules table's specs of a model-order tree, for its held form: a MoE
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

    def _zero1_specs(self, abs_stored: nnx.State) -> nnx.State:
        """Each parameter's ZeRO-1 split over the axes holding copies of it, when on."""
        if not self.cfg.mesh.zero1:
            return self.use_specs
        return jax.tree.map(lambda p, s: sharding.zero1_spec(s, p.shape, self.mesh),
                            abs_stored, self.use_specs, is_leaf=lambda x: isinstance(x, P))


class AutoProgram(Program):
    """fsdp: one program on global arrays; XLA places the reductions (inside the
    accumulation loop, as it chooses)."""

    def __init__(self, cfg: Config, mesh: Mesh, abs_params: nnx.State):
        super().__init__(cfg, GlobalLayout(mesh, cfg), abs_params)

    def start(self, step_key, batch_BxLn, extra: int = 1):
        return step_key, self.own_rows(batch_BxLn, extra)

    def own_rows(self, batch_BxN, extra: int = 1):
        return batch_BxN

    def per_row(self, x_B, every: bool = False):
        return x_B

    def working(self, params):
        return working_copy(self.cfg, self.mesh, params, self.use_specs)

    def reduce(self, grads):
        return jax.tree.map(lambda g: g.astype(jnp.float32) / self.cfg.train.accumulation_steps,
                            grads)

    def totals(self, loss, ce, aux):
        return loss, ce, aux

    def norm(self, grads):
        return optax.tree.norm(grads)

    def own(self, params):
        return params

    def gathered(self, params):
        return params

    def tokens(self, rows_BxLn, extra: int = 1) -> int:
        return rows_BxLn.shape[0] * (rows_BxLn.shape[1] - extra)

    whole_matrices = staticmethod(on_one_device)  # global arrays: every matrix is whole

    @staticmethod
    def own_part(name: str, x):  # global arrays: the whole tensor is the program's
        return x


class DeviceProgram(Program):
    """ddp: one device's program inside a `shard_map` over the whole mesh.

    Each device runs the model on its own rows with its dense replicas and its
    experts (and stage); gradients accumulate locally and are reduced once at the
    end, into the ZeRO-1 shards (`jaxmoe.parallel.ddp`), where the optimizer
    updates them; the new shards are gathered once.
    """

    def __init__(self, cfg: Config, mesh: Mesh, abs_params: nnx.State):
        super().__init__(cfg, DeviceLayout(mesh, cfg), abs_params)
        self.loss_layout = self._loss_layout()
        self.plans = ddp.reductions(self.use_specs, self.shard_specs, mesh)
        self.sharded_master = sharded_master(cfg)
        self.context = sharding.axis_size(self.mesh, "context")
        # devices holding different tokens: what the losses and gradients average over
        self.n_shards = math.prod(sharding.axis_size(self.mesh, a) for a in TOKEN_AXES)
        self.deferred = jax.tree_util.tree_map_with_path(self._defers, self.plans)
        self.plan_of = {param_name(path): r for path, r in jax.tree_util.tree_leaves_with_path(
            self.plans, is_leaf=lambda x: isinstance(x, ddp.Reduction))}

    def _loss_layout(self) -> DeviceLayout:
        """With pipeline stages and a loss slice's rows that divide among them, a layout
        whose stages share the work outside the pipeline instead of each doing all of
        it (`StageRowsLayout`); else the device layout."""
        rows = self.cfg.train.batch_size // math.prod(self.mesh.shape[a] for a in BATCH_AXES)
        if self.stack is None or rows // self.cfg.train.accumulation_steps % self.stack.stages:
            return self.layout
        return StageRowsLayout(self.layout)

    def own_layers(self, a_Lmx: jax.Array) -> jax.Array:
        """This device's share of per-MoE-layer values [Lm, ...]: its stage's chunks,
        [W, 1, per, ...] (zeros in padding slots)."""
        if self.stack is None:
            return a_Lmx
        return lax.dynamic_slice_in_dim(self.stack.stored(a_Lmx), lax.axis_index("stage"), 1,
                                        axis=1)

    def _defers(self, path, r: ddp.Reduction) -> bool:
        """Whether a parameter reaches the model as its ZeRO-1 shard, for a circular
        pipeline to gather round by round (`device_pipeline`), or a layer scan layer
        by layer (`DeviceLayout.run_moe_stack`), and reduce its gradient in the same
        loop: a MoE-stack tensor split only by ZeRO-1 over all its replica axes, along
        an axis within a chunk or a layer, in a step of one slice that reduces in the
        compute dtype. With more slices the gradient is complete only after the
        last, and the loop of each would reduce it again."""
        cfg = self.cfg
        if self.stack is not None and (cfg.pipeline.virtual_stages == 1
                                       or cfg.pipeline.schedule == "1f1b"):
            return False  # GPipe (one round) or 1F1B (every round in turn): gathered before
        stacked = 2 if self.stack is not None else 1  # [W, S, per, ...] or [Lm, ...]
        return (in_moe_stack(path) and self.sharded_master
                and cfg.train.accumulation_steps == 1
                and cfg.train.grad_reduce_dtype == cfg.model.compute_dtype
                and bool(r.scatter_axes) and r.dim >= stacked
                and all(self.mesh.shape[a] == 1 for a in r.sum_axes))

    def start(self, step_key, rows_bxLn, extra: int = 1):
        # own router jitter
        key = jax.random.fold_in(step_key, jax.lax.axis_index(TOKEN_AXES))
        return key, self.own_rows(rows_bxLn, extra)

    def own_rows(self, rows_bxN, extra: int = 1):
        """This device's part of its rows: under `context` its chunk of their positions
        (and the `extra` tokens after it, `tokens_after`). Rows, like the
        weights, vary over every axis (stage included), so that no use of a weight
        implies a reduction of its gradient."""
        if self.context > 1:
            rows_bxN = context.own_chunk(rows_bxN, (rows_bxN.shape[1] - extra) // self.context,
                                         extra)
        return vary(rows_bxN, ("stage", "context"))

    def per_row(self, x_b, every: bool = False):
        """A per-row value from the stage that holds the model's output (`output_share`
        zeroed it elsewhere), over the row's chunks: their sum, or (`every`, for 0/1
        flags) whether every chunk's is 1."""
        x_b = jax.lax.psum(x_b, "stage")
        return jax.lax.pmin(x_b, "context") if every else jax.lax.psum(x_b, "context")

    def working(self, params):
        """Cast, then (ZeRO-1 bf16 masters) gathered, then per device: made once a step;
        the deferred shards as they are (`ddp.Sharded`)."""
        working = cast_matrices(params, self.cfg.model.compute_dtype)

        def place(w, r, deferred):
            if deferred:
                return ddp.Sharded(w, r)
            return ddp.to_per_device(ddp.gather_shards(w, r) if self.sharded_master else w, r)

        return jax.tree.map(place, working, self.plans, self.deferred)

    def reduce(self, grads):
        scale = 1.0 / (self.n_shards * self.cfg.train.accumulation_steps)
        grads = cast_matrices(grads, self.cfg.train.grad_reduce_dtype)  # float32: no-op

        def reduced(r, deferred, g):  # a deferred shard's gradient arrives reduced
            g = g.shard if deferred else ddp.reduce_gradient(g, r)
            return g.astype(jnp.float32) * scale

        return jax.tree.map(reduced, self.plans, self.deferred, grads)

    def totals(self, loss, ce, aux):
        # over every axis: stages hold disjoint layers (zeros elsewhere) and the
        # last stage's loss, or a share of it each (`output_share`)
        total = lambda v: ddp.psum_everywhere(v, self.mesh.axis_names)  # noqa: E731
        largest = lambda v: lax.pmax(vary(v, self.mesh.axis_names), self.mesh.axis_names)  # noqa: E731
        aux = {k: largest(v) if k in MAX_STATS else
               total(v) / (self.n_shards if k in SHARD_MEANS else 1) for k, v in aux.items()}
        return total(loss) / self.n_shards, total(ce) / self.n_shards, aux

    def norm(self, grads):
        return ddp.global_norm(grads, self.plans, self.mesh)

    def own(self, params):
        return params if self.sharded_master else jax.tree.map(ddp.own_shard, params, self.plans)

    def gathered(self, params):
        return params if self.sharded_master else jax.tree.map(ddp.gather_shards, params,
                                                               self.plans)

    def tokens(self, rows_bxLn, extra: int = 1) -> int:
        return self.n_shards * rows_bxLn.shape[0] * (rows_bxLn.shape[1] - extra)

    def own_part(self, name: str, x):
        """This device's ZeRO-1 part of x, a value of parameter `name`'s shape or one
        that broadcasts against it (size 1 along the split: all of it)."""
        r = self.plan_of[name]
        return x if not r.scatter_axes or x.shape[r.dim] == 1 else ddp.own_shard(x, r)

    def whole_matrices(self, name: str, x, view, fn):
        """fn of the whole matrices of `x`, this device's ZeRO-1 part of parameter
        `name`'s update (Muon's orthogonalization): this device's part of the result.

        Each matrix is orthogonalized whole, once, by one device: where ZeRO-1 split
        a batch of matrices (layers, experts, a pipeline's chunks), each device holds
        whole ones already and nothing moves; where it split the matrices
        themselves, an all-to-all deals the batch out instead (each device then
        holds its 1/n of the matrices, whole), and a second brings the results
        back. A batch that does not divide among the n devices (one dense layer's
        matrix, say) is padded with zero matrices to one that does (their
        orthogonalization is zero, and is dropped)."""
        r = self.plan_of[name]
        batch = view.batch_axes(x.ndim)
        if not r.scatter_axes or r.dim < batch:
            return fn(x)
        n = math.prod(self.mesh.shape[a] for a in r.scatter_axes)
        count = math.prod(x.shape[:batch])
        padded = -(-count // n) * n
        split = 1 + r.dim - batch  # the split axis of [count, matrix axes...]
        flat = x.reshape(count, *x.shape[batch:])
        if padded > count:
            flat = jnp.concatenate([flat, jnp.zeros((padded - count, *flat.shape[1:]), x.dtype)])
        dealt = lax.all_to_all(flat, r.scatter_axes, 0, split, tiled=True)
        back = lax.all_to_all(fn(dealt), r.scatter_axes, split, 0, tiled=True)
        return back[:count].reshape(x.shape)


def working_copy(cfg: Config, mesh: Mesh, params: nnx.State, specs: nnx.State) -> nnx.State:
    """Matrices cast to the compute dtype and placed where they are used; norms and
    the router stay fp32. The identity for fp32 compute."""
    if cfg.model.compute_dtype == "float32":
        return params
    return jax.tree.map(lambda p, spec: jax.lax.with_sharding_constraint(
        p, NamedSharding(mesh, spec)), cast_matrices(params, cfg.model.compute_dtype), specs,
        is_leaf=lambda x: isinstance(x, P))


def cast_matrices(params, dtype):
    """Matrices in `dtype`; norms, biases and the router stay fp32 whatever the
    compute dtype."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p if _stays_fp32(path, p) else p.astype(dtype), params)


def _stays_fp32(path, p) -> bool:
    return p.ndim < 2 or "router" in jax.tree_util.keystr(path)


def sharded_master(cfg: Config) -> bool:
    """Whether the fp32 master weights live in ZeRO-1 shards (see `state_shardings`)."""
    return cfg.mesh.zero1 and cfg.model.compute_dtype != "float32"

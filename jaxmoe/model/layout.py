"""What the model asks of where it runs, answered for one device without a mesh.

The model never sees a mesh: every call takes a layout and asks it eight things
(which kernels its devices run, which positions its tokens hold and how attention
reaches the rest of their sequence, which of its rows it runs outside the MoE
stack, pin activations to the batch split, run an MoE layer's dispatch, total a
per-shard router statistic over the batch or the sequence, run the stacked MoE
layers, and weigh what it computed from its output).
`LocalLayout` is the answer on one device: the default device's kernels, whole
sequences, the local dispatchers, the call's tokens as the whole batch, the MoE
stack as one scan in model order. The layouts of a mesh (`jaxmoe.parallel.layout`)
extend it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.model.dispatch import LOCAL, Dispatched, Dispatcher
from jaxmoe.ops.kernels import Kernels


class LocalLayout:
    mesh = None
    stack = None  # how pipeline stages hold the MoE stack; None: [Lm, ...], model order
    batch_shards = 1  # the call's tokens are one batch shard
    dispatchers: dict[str, Dispatcher] = LOCAL  # what `moe.dispatcher` may name here

    @functools.cached_property
    def kernels(self) -> Kernels:
        """The default device's: where a program given no mesh runs."""
        return Kernels.default()

    def dispatcher(self, cfg: MoEConfig) -> Dispatcher:
        """The one place a dispatcher is chosen: `moe.dispatcher` among this layout's."""
        if cfg.dispatcher not in self.dispatchers:
            raise ValueError(f"moe.dispatcher: {cfg.dispatcher!r} is expert-parallel and needs "
                             "a device mesh (`mesh=` in the API, a mesh in the config for "
                             f"training); without one use {' or '.join(map(repr, LOCAL))}")
        return self.dispatchers[cfg.dispatcher]

    def dispatch(self, x_TxD, routing, weights, cfg: MoEConfig) -> Dispatched:
        return self.dispatcher(cfg)(x_TxD, routing, weights, cfg, self.kernels)

    def positions(self, batch: int, length: int) -> jax.Array:
        """int32 [batch, length]: the positions in their sequences of the call's tokens
        (here whole sequences: 0 .. length - 1)."""
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def sequence_length(self, length: int) -> int:
        """The length of the sequences whose `length` positions the call holds (here
        whole sequences: `length`)."""
        return length

    def attend(self, attention, q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd) -> jax.Array:
        """attention(q, k, v), causal over whole sequences, for this call's positions."""
        return attention(q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd)

    def constrain_batch(self, x: jax.Array) -> jax.Array:
        return x

    def sequence_total(self, x: jax.Array) -> jax.Array:
        """A statistic summed over the call's tokens of each sequence, over the whole
        sequences (they are whole here)."""
        return x

    def batch_total(self, x: jax.Array) -> jax.Array:
        """A statistic summed over this program's tokens is already global."""
        return x

    def output_share(self, x: jax.Array) -> jax.Array:
        """The part of a value of the model's output (the loss, a row's score) this
        program contributes: all of it."""
        return x

    def output_sum(self, x: jax.Array) -> jax.Array:
        """The part of a sum over the output's tokens (a router count of a layer after
        the MoE stack) this program contributes: all of it."""
        return x

    def output_max(self, x: jax.Array) -> jax.Array:
        """The part of a maximum over the output's tokens (a layer's largest attention
        logit after the MoE stack) this program contributes: all of it."""
        return x

    def own_rows(self, rows_BxN: jax.Array) -> jax.Array:
        """The rows this program runs outside the MoE stack: all of them."""
        return rows_BxN

    def rows_split_over_stages(self, rows: int) -> LocalLayout:
        """The layout for a training loss over `rows` rows (`jaxmoe.parallel.layout`'s
        splits the work outside a pipeline over its stages): this one."""
        return self

    def own_share(self, a_Lmx: jax.Array) -> jax.Array:
        """Per-MoE-layer values [Lm, ...] in model order, as this program holds them."""
        return a_Lmx

    def stored(self, tree):
        """A model-order tree as this layout keeps it: as it is."""
        return tree

    def in_model_order(self, tree):
        return tree

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        """`model`'s MoE layers over x, one scan in model order; x and the per-layer aux."""
        return model.scan_moe_layers(x_BxLxD, positions_BxL, self, key, remat)


LOCAL_LAYOUT = LocalLayout()

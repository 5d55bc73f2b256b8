"""What a forward pass asks of where it runs, answered for one device without a mesh.

A layout answers a forward pass; the program around it (`jaxmoe.step.program`)
answers the training step: where the state lives and how its gradients are reduced.

The model never sees a mesh: it asks its layout nine things (which kernels its
devices run, which positions its tokens hold, the length of their sequences and how
attention reaches the rest of them, pin activations to the batch split, run an MoE
layer's dispatch, total a per-shard router statistic over the sequence or the batch,
and run the stacked MoE layers). The loss and the scoring steps ask four more about
the model's output: which rows this program runs outside the MoE stack, and the
part of a mean, a sum and a maximum over the output it contributes.

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


def choose_dispatcher(dispatchers: dict[str, Dispatcher], cfg: MoEConfig) -> Dispatcher:
    """The one place a dispatcher is chosen: `moe.dispatcher` among a layout's."""
    if cfg.dispatcher not in dispatchers:
        raise ValueError(f"moe.dispatcher: {cfg.dispatcher!r} is expert-parallel and needs "
                         "a device mesh (`mesh=` in the API, a mesh in the config for "
                         f"training); without one use {' or '.join(map(repr, LOCAL))}")
    return dispatchers[cfg.dispatcher]


class LocalLayout:
    mesh = None
    stack = None  # how pipeline stages hold the MoE stack; None: [Lm, ...], model order
    batch_shards = 1  # the call's tokens are one batch shard
    dispatchers: dict[str, Dispatcher] = LOCAL  # what `moe.dispatcher` may name here

    # -- what the model asks

    @functools.cached_property
    def kernels(self) -> Kernels:
        """The default device's: where a program given no mesh runs."""
        return Kernels.default()

    def dispatch(self, x_TxD, routing, weights, cfg: MoEConfig) -> Dispatched:
        return choose_dispatcher(self.dispatchers, cfg)(x_TxD, routing, weights, cfg,
                                                        self.kernels)

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

    def run_moe_stack(self, model, x_BxLxD, positions_BxL, key, remat: str):
        """`model`'s MoE layers over x, one scan in model order; x and the per-layer aux."""
        return model.scan_moe_layers(x_BxLxD, positions_BxL, self, key, remat)

    # -- what the loss and the scoring steps ask of the model's output

    def rows_outside_stack(self, rows_BxN: jax.Array) -> jax.Array:
        """The rows this program runs outside the MoE stack: all of them."""
        return rows_BxN

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


LOCAL_LAYOUT = LocalLayout()

"""One training step of a config on its mesh, and its comparison with one device's:
what the sharding tests hold every split to (the losses, the gradients the first
moment holds, the load metrics, held-out scores and the router biases)."""

import math

import chex
import jax
import numpy as np

from jaxmoe.parallel.sharding import AXES, make_mesh
from jaxmoe.step import build_steps

from model_order import in_model_order

B1 = 0.9  # the optimizer's b1: the first moment after one step is (1 - b1) x the gradient
# (per EP rank: a reference with one rank has rank load 1 whatever the split)
LOADS = ("expert_load", "load_max_over_mean", "dead_experts",
         "balance_loss_layer", "balance_cov", "dead_score_mass", "topk_margin", "z_loss")


def batch(cfg):
    """The config's one batch of token rows, from a fixed seed."""
    return np.random.default_rng(0).integers(0, 256, (cfg.train.batch_size,
                                                     cfg.train.seq_len + 1), dtype=np.int32)


def first_step(cfg):
    """One step from the seed's parameters: (metrics, gradients in model order, the
    held-out scores of the batch)."""
    devices = jax.devices()[:math.prod(getattr(cfg.mesh, a) for a in AXES)]
    steps = build_steps(cfg, make_mesh(cfg.mesh, devices))
    state = steps.init(jax.random.PRNGKey(0))
    rows = jax.device_put(batch(cfg), steps.batch_sharding)
    mask = jax.device_put(np.ones((cfg.train.batch_size, cfg.train.seq_len), bool),
                          steps.batch_sharding)
    scores = jax.device_get(steps.eval_step(state.params, state.buffers, rows, mask))
    state, metrics = steps.train_step(state, rows)
    grads = jax.tree.map(lambda m: m / (1 - B1), jax.device_get(state.opt_state.mu))
    return (jax.device_get(metrics), in_model_order(grads, cfg), scores,
            in_model_order(jax.device_get(state.buffers), cfg))


def grads_close(got, want):
    """Reordered fp32 sums: a gradient sums the batch's 256 tokens' terms, and attention
    sums over up to 32 positions, in another order when split; each sum is off by at
    most ~n x 2^-24 of its terms' magnitude (n <= 256: 1.5e-5), which the tensor's
    largest gradient bounds. A chunk attending to the wrong positions, or a missing
    or doubled reduction, is off by far more (the companions)."""
    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    jax.tree.map(close, got, want)


def matches(got, want):
    (metrics, grads, scores, buffers), (want_metrics, want_grads, want_scores, want_buffers) = \
        got, want
    for k in ("loss", "ce", "grad_norm", "balance_loss"):
        np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, err_msg=k)
    # the load metrics: from integer counts (exact) and score sums (fp32, reordered)
    for k in LOADS:
        np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(scores["logprob"], want_scores["logprob"], rtol=1e-5)
    chex.assert_trees_all_equal(buffers, want_buffers)  # bias nudges from the global counts
    grads_close(grads, want_grads)

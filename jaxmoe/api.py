"""The model as pure functions over plain pytrees.

    params = jaxmoe.init(config, key)                    # nested dict of arrays
    logits_BxLxV, aux = jaxmoe.apply(params, tokens_BxL, config)
    y_BxLxD, aux = jaxmoe.moe_layer(moe_params, x_BxLxD, config)

`params` mirrors the module tree: `embed` [V, D], `head` [D, V], `final_norm`,
and the stacks `dense_layers` / `moe_layers`, whose leaves carry a leading
layers axis. With `moe.expert_bias` it holds the router's selection bias
(`moe_layers.moe.router.bias`), which gets no gradient: the training step
moves it outside the optimizer. Everything here composes with `jax.jit`,
`jax.grad`, `jax.vmap` and `shard_map`; the Flax modules stay inside.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxmoe import checkpoint
from jaxmoe.config import Config, config_from_dict, dropless as make_dropless
from jaxmoe.model.dispatch import LOCAL
from jaxmoe.model.moe import MoE
from jaxmoe.model.transformer import Transformer, init_stds
from jaxmoe.parallel.layout import layout_for
from jaxmoe.parallel.pipeline import held
from jaxmoe.step import check_shapes

Params = dict[str, Any]


def _new_moe(cfg: Config, rngs: nnx.Rngs) -> MoE:
    return MoE(cfg.model.d_model, cfg.moe, *init_stds(cfg.model), rngs)


@functools.lru_cache(maxsize=32)
def _abstract(cfg: Config, part: str) -> tuple[nnx.GraphDef, Params]:
    new = {"model": lambda: Transformer.of(cfg, nnx.Rngs(0)),
           "moe": lambda: _new_moe(cfg, nnx.Rngs(0))}[part]
    graphdef, state = nnx.split(nnx.eval_shape(new))
    return graphdef, state.to_pure_dict()


@functools.lru_cache(maxsize=32)
def _init_fn(cfg: Config, part: str):
    new = {"model": lambda key: Transformer.of(cfg, nnx.Rngs(params=key)),
           "moe": lambda key: _new_moe(cfg, nnx.Rngs(params=key))}[part]
    return jax.jit(lambda key: nnx.state(new(key)).to_pure_dict())


def check_params(params: Params, cfg: Config, part: str = "model") -> None:
    """Raises ValueError naming the first leaf missing, extra or of the wrong shape."""
    check_shapes(params, _abstract(cfg, part)[1], "params")


def check_tokens(tokens_BxL: jax.Array, cfg: Config) -> None:
    """Shape and dtype always; the id range too when the values are known (outside jit)."""
    shape, dtype = jnp.shape(tokens_BxL), jnp.result_type(tokens_BxL)
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"tokens: expected a non-empty int array [batch, length], got shape "
                         f"{shape} (one sequence: tokens[None])")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens: expected integer token ids, got dtype {dtype}")
    if not isinstance(tokens_BxL, jax.core.Tracer):
        ids = np.asarray(tokens_BxL)
        lo, hi, V = int(ids.min()), int(ids.max()), cfg.model.vocab_size
        if lo < 0 or hi >= V:
            raise ValueError(f"tokens: ids must be in [0, model.vocab_size={V}), "
                             f"got min {lo}, max {hi}")


def init(config: Config, key: jax.Array) -> Params:
    """Fresh parameters: the same values the training job starts from with this key."""
    return _init_fn(config, "model")(key)


def to_module(params: Params, config: Config) -> Transformer:
    """The nnx Transformer holding `params`, for those who want the module."""
    check_params(params, config)
    return nnx.merge(_abstract(config, "model")[0], params)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "remat"))
def _apply(params, tokens_BxL, config, key, mesh, remat):
    layout = layout_for(config, mesh)
    params = held(layout.stack, params)  # a mesh with pipeline stages runs the stack as they hold it
    return nnx.merge(_abstract(config, "model")[0], params)(tokens_BxL, layout=layout, key=key,
                                                            remat=remat)


def apply(params: Params, tokens_BxL: jax.Array, config: Config, *, key: jax.Array | None = None,
          mesh: Mesh | None = None, remat: str = "none") -> tuple[jax.Array, dict]:
    """fp32 logits [B, L, V] and aux, the MoE layers' router statistics stacked per layer:
    balance_loss and z_loss [Lm] (unscaled), counts [Lm, E], dropped [Lm],
    prob_sums [Lm, E], margin_sum [Lm]; empty without MoE layers. With
    `optimizer.qk_clip` set, also max_logit [num_layers, H]: each layer's heads'
    largest attention logits (`jaxmoe.model.attention.max_logits`).

    `key` turns on router jitter; `mesh` is needed by the expert-parallel dispatchers.
    """
    check_tokens(tokens_BxL, config)
    check_params(params, config)
    return _apply(params, tokens_BxL, config, key, mesh, remat)


def init_moe_layer(config: Config, key: jax.Array) -> Params:
    """Parameters of one MoE feed-forward of width model.d_model: router, experts
    (and the shared expert if configured)."""
    return _init_fn(config, "moe")(key)


def moe_layer(params: Params, x_BxLxD: jax.Array, config: Config, *, key: jax.Array | None = None,
              mesh: Mesh | None = None) -> tuple[jax.Array, dict]:
    """The MoE feed-forward alone: router -> dispatch -> experts -> combine.

    Returns y [B, L, D] in x's dtype and aux (balance_loss, z_loss, counts,
    dropped, prob_sums, margin_sum, for this call's tokens). Inside a user's
    `shard_map`, call it per shard with a local dispatcher (`grouped` or `dense`)
    and no mesh; outside one, the expert-parallel dispatchers take the mesh.
    """
    D = config.model.d_model
    if jnp.ndim(x_BxLxD) != 3 or jnp.shape(x_BxLxD)[-1] != D:
        raise ValueError(f"x: expected [batch, length, model.d_model={D}], got shape "
                         f"{jnp.shape(x_BxLxD)}")
    check_params(params, config, "moe")
    return _moe_layer(params, x_BxLxD, config, key, mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def _moe_layer(params, x_BxLxD, config, key, mesh):
    return nnx.merge(_abstract(config, "moe")[0], params)(x_BxLxD, layout_for(config, mesh), key)


def moe_layer_params(params: Params, config: Config, layer: int) -> Params:
    """The `layer`-th MoE layer's parameters (0-based among the MoE layers, model order)."""
    n = config.num_moe_layers
    if not 0 <= layer < n:
        raise ValueError(f"layer: {layer} is not in [0, {n}) (the model has {n} MoE layers)")
    return jax.tree.map(lambda a: a[layer], params["moe_layers"]["moe"])


def local_config(config: Config, dropless: bool = True) -> Config:
    """The same model on one device, layers in model order, with local MoE dispatch:
    dropless by default (`grouped` with room for every copy, E / K x the uniform
    share, so a token's output never depends on the others in its batch);
    `dropless=False` keeps the training capacity factor (and its drops)."""
    overrides = ["mesh.data=1", "mesh.expert=1", "mesh.stage=1",
                 "pipeline.virtual_stages=1", "pipeline.stage_microbatches=1"]
    if config.num_moe_layers and (dropless or config.moe.dispatcher not in LOCAL):
        overrides.append("moe.dispatcher=grouped")
    local = config_from_dict(config.to_dict(), overrides)
    return make_dropless(local) if dropless else local


def load_params(path: str | Path, step: int | None = None,
                dropless: bool = True) -> tuple[Params, Config]:
    """Parameters (with router biases) and config of a training checkpoint.

    `path`: a run directory, its checkpoints/ directory, or one step's directory;
    the latest step unless `step` (or a step directory) says otherwise. The
    returned config is `local_config(saved, dropless)`, and MoE layers are in
    model order, so `apply(params, tokens, config)` runs as is: dropless, as
    `generate` and `jaxmoe.load_hf` are, unless `dropless=False` asks for the
    training capacity.
    """
    directory, found = checkpoint.locate(path)
    weights, saved, _, _ = checkpoint.load_weights(directory, found if step is None else step)
    return jax.device_get(weights.to_pure_dict()), local_config(saved, dropless)

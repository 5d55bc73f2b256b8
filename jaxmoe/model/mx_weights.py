"""Which weights a step computes with in MXFP8, and their copies for the step.

Routed experts' weight stacks with `moe.expert_precision: mxfp8`; with
`model.projection_precision: mxfp8` the dense projections too: attention's query, key,
value and output projections, MLA's LoRA and up-projections, the dense layers' MLPs
and the shared experts. The embedding, the LM head, the router and multi-token
prediction's joining projection stay in the compute dtype. Both follow
`moe.mxfp8_scale` and `moe.mxfp8_weight_grad`.

The copies are made once per optimizer step (`mx_copies`), outside every loop, or
where a weight is gathered from its ZeRO-1 shards inside one (a pipeline's round, the
layer scan's next layer) right after that gather; they are attached to the working
copy the layers read (`with_mx_copies`), so that no micro-batch or pass quantises a
weight again; the GEMMs still return the weights' gradients.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.mx import MXProjection, MXWeight, Options, quantize_projection, quantize_weight

EXPERT_WEIGHTS = ("w_gate_up", "w_down")  # under "experts": [E, I, O]
# the projections by name, under the modules that hold them: (input axes, output axes)
# as stored; the call sites contract the input axes (`jaxmoe.model.layers.project`)
PROJECTIONS = {"w_q": (1, 2), "w_k": (1, 2), "w_v": (1, 2), "w_o": (2, 1),
               "w_q_a": (1, 1), "w_q_b": (1, 2), "w_kv_a": (1, 1), "w_kv_b": (1, 2),
               "w_gate_up": (1, 1), "w_down": (1, 1)}
PROJECTION_MODULES = ("attn", "mlp", "shared")


def _kind(path) -> str | None:
    names = [getattr(k, "key", None) for k in path]
    if len(names) < 2:
        return None
    if names[-2] == "experts" and names[-1] in EXPERT_WEIGHTS:
        return "expert"
    if names[-2] in PROJECTION_MODULES and names[-1] in PROJECTIONS:
        return "projection"
    return None


def _precisions(cfg) -> set[str]:
    kinds = {"expert"} if cfg.moe.expert_precision == "mxfp8" else set()
    return kinds | ({"projection"} if cfg.model.projection_precision == "mxfp8" else set())


def mx_copies(params: nnx.State, cfg) -> dict[str, MXWeight]:
    """The MXFP8 copies of every weight of `params` (model or working copy, any layer
    layout) that `cfg` (a Config) computes in MXFP8, by path; {} where none does."""
    kinds, rule, out = _precisions(cfg), cfg.moe.mxfp8_scale, {}
    if not kinds:
        return out

    def take(path, v):  # a leaf still to be gathered (a ZeRO-1 shard) is quantised once whole
        kind, w = _kind(path), v.get_value()
        if kind in kinds and isinstance(w, jax.Array):
            key = jax.tree_util.keystr(path)
            out[key] = (quantize_weight(w, rule)._replace(w=None) if kind == "expert" else
                        quantize_projection(w, *PROJECTIONS[path[-1].key], rule))
        return v

    jax.tree_util.tree_map_with_path(take, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return out


def with_mx_copies(params: nnx.State, copies: dict[str, MXWeight], cfg,
                   kernels: Kernels) -> nnx.State:
    """`params` whose weights carry their `mx_copies`: an expert stack as the `MXWeight`
    the expert GEMMs read, a projection as an `MXProjection` (its GEMMs native on
    `kernels` where they have a block-scaled GEMM)."""
    if not copies:
        return params
    options = Options(cfg.moe.mxfp8_scale, cfg.moe.mxfp8_weight_grad, kernels.native_mxfp8)

    def attach(path, v):
        key = jax.tree_util.keystr(path)
        if key not in copies:
            return v
        weight = copies[key]._replace(w=v.get_value())
        return v.replace(weight if _kind(path) == "expert" else MXProjection(weight, options))

    return jax.tree_util.tree_map_with_path(attach, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))

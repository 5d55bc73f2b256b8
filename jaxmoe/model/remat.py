"""What a checkpointed layer keeps for the backward pass (`train.remat`).

The model tags the tensors worth keeping with `checkpoint_name`; each policy
saves some of them (and `matmuls` some unnamed dots too), and the backward pass
recomputes the rest of the layer from the layer's input.

Names, per layer:
- `attention_qkv`: the q, k and v projections, before QK-norm and RoPE (their
  backward needs these inputs; the elementwise ops are cheap to redo).
- `attention_out`: the attention core's output, before the output projection.
  Attention's own backward needs q, k, v and the probabilities, which a fused
  kernel recomputes from q, k and v anyway; the projected output alone would
  spare only the output projection, so both sides of the core are named.
- `router_logits`: fp32 router logits [T, E]. No policy saves them (the router
  matmul is small and the routing is recomputed from it cheaply).
- `expert_gate_up`, `expert_down`: the outputs of the two expert GEMMs, for every
  dispatcher (the batched einsum or its MXFP8 form).
- `exchange_out`, `exchange_back`: the buffers an expert-parallel dispatcher
  receives: the routed rows at the expert ranks, and the expert outputs back at
  the token ranks (`allgather`: the gathered tokens, the reduce-scattered outputs).
- `layer_input`: each layer's input in a scan of checkpointed layers; what an
  enclosing checkpoint (a pipeline stage) keeps, so that the backward pass runs
  each layer's forward once more, not twice (`keeping_layer_inputs`).
"""

from __future__ import annotations

import jax

ATTENTION_QKV = "attention_qkv"
ATTENTION_OUT = "attention_out"
ROUTER_LOGITS = "router_logits"
EXPERT_GATE_UP = "expert_gate_up"
EXPERT_DOWN = "expert_down"
EXCHANGE_OUT = "exchange_out"
EXCHANGE_BACK = "exchange_back"
LAYER_INPUT = "layer_input"

_ATTENTION = (ATTENTION_QKV, ATTENTION_OUT)
_EXPERT_GEMMS = (EXPERT_GATE_UP, EXPERT_DOWN)
_policies = jax.checkpoint_policies

# remat name -> jax.checkpoint policy ("none" runs without jax.checkpoint)
REMAT_POLICIES = {
    "full": None,  # keep only the layer's input
    # dots without batch dimensions (projections, router, dense MLP) and the expert
    # GEMMs, which JAX's rule alone would recompute: a batched einsum has a batch
    # dimension
    "matmuls": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable,
                                                 _policies.save_only_these_names(*_EXPERT_GEMMS)),
    # the backward redoes attention and the exchanges, not the GEMMs
    "save_expert_gemms": _policies.save_only_these_names(*_EXPERT_GEMMS),
    # the backward redoes the scores (for the probabilities), the output
    # projection, the router and the whole dispatch
    "save_attention": _policies.save_only_these_names(*_ATTENTION),
    # the backward redoes attention and the gate/up GEMM, but no exchange: two
    # collectives fewer per layer than `full`
    "save_exchange": _policies.save_only_these_names(EXCHANGE_OUT, EXCHANGE_BACK),
    # what save_expert_gemms and save_attention keep, moved to pinned host memory
    # between the passes; XLA:CPU lowers the moves to nothing (its device memory is
    # host memory), so there this equals keeping them on the device
    "offload": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=_EXPERT_GEMMS + _ATTENTION,
        offload_src="device", offload_dst="pinned_host"),
}


def keeping_layer_inputs(policy):
    """The policy of a checkpoint around a scan of layers checkpointed with `policy`:
    it keeps each layer's input and what `policy` keeps, so the backward pass
    recomputes each layer from its input alone, not the scan to reach it."""
    inputs = _policies.save_only_these_names(LAYER_INPUT)
    if policy is None:
        return inputs

    # an offloading policy answers with more than a bool, which save_from_both_policies
    # refuses; `inputs` answers True or False, so asked first, its False defers to
    # `policy`'s answer (an offload, a recompute: objects that are always true)
    def both(prim, *args, **params):
        return inputs(prim, *args, **params) or policy(prim, *args, **params)

    return both

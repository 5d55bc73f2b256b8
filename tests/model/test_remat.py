"""Remat policies by name (`train.remat`): what each keeps for the backward pass and
what the backward recomputes, for the grouped, alltoall and ragged dispatchers on
8 fake devices, and that none of them changes the loss or the gradients."""

import collections
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import Literal

from jaxmoe.config import ConfigError, TrainConfig, config_from_dict
from jaxmoe.model import remat
from jaxmoe.model.transformer import Transformer
from jaxmoe.parallel.layout import layout_for
from jaxmoe.parallel.sharding import make_mesh

TOKENS = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
# per layer: q, k, v projections and the core's output; both expert GEMMs' outputs;
# the two received buffers of an expert-parallel exchange
ATTENTION = {remat.ATTENTION_QKV: 3, remat.ATTENTION_OUT: 1}
EXPERT_GEMMS = {remat.EXPERT_GATE_UP: 1, remat.EXPERT_DOWN: 1}
EXCHANGE = {remat.EXCHANGE_OUT: 1, remat.EXCHANGE_BACK: 1}
DOTS = {"dot_general": 5}  # unbatched dots: q, k, v and output projections, router logits
NAMES = set(ATTENTION) | set(EXPERT_GEMMS) | set(EXCHANGE) | {remat.ROUTER_LOGITS}


def _kept_names(dispatcher: str) -> dict[str, dict[str, int]]:
    """What each policy saves of one MoE layer: named tensors ("host:" when offloaded)
    and unnamed dots."""
    ep = dispatcher != "grouped"
    return {
        "full": {},
        "matmuls": {**DOTS, **EXPERT_GEMMS},
        "save_expert_gemms": EXPERT_GEMMS,
        "save_attention": ATTENTION,
        "save_exchange": EXCHANGE if ep else {},
        "offload": {f"host:{k}": n for k, n in {**ATTENTION, **EXPERT_GEMMS}.items()},
        # JAX's unbatched-dots rule alone: the batched expert einsums are not kept
        "jax_dots": DOTS,
    }


@functools.cache
def _model(dispatcher: str, precision: str = "compute"):
    """(loss(params, remat), params): one MoE layer on a (data 2, expert 4) mesh."""
    cfg = config_from_dict({
        "model": {"d_model": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2},
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 2.0,
                "dispatcher": dispatcher, "expert_precision": precision},
        "mesh": {"data": 2, "expert": 4}})
    mesh = make_mesh(cfg.mesh)
    graphdef, params, rest = nnx.split(Transformer.of(cfg, nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, remat_name):
        logits, aux = nnx.merge(graphdef, params, rest)(
            TOKENS[:, :-1], layout=layout_for(cfg, mesh), remat=remat_name)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()
        return ce + 0.01 * jnp.mean(aux["balance_loss"]) + 0.001 * jnp.mean(aux["z_loss"])

    return loss, params


@pytest.fixture
def jax_dots(monkeypatch):
    monkeypatch.setitem(remat.REMAT_POLICIES, "jax_dots",
                        jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def _source(jaxpr, var, where: str = "") -> str:
    """What produced `var`, an output of `jaxpr`: a checkpoint name, followed into the
    scan, shard_map and jit bodies that hand it out, through moves to host memory
    ("host:") and JAX's reduce_precision marks on saved values; else a primitive."""
    if isinstance(var, Literal):
        return "literal"
    eqn = next((e for e in jaxpr.eqns if var in e.outvars), None)
    if eqn is None:
        return "input"
    prim = eqn.primitive.name
    if prim == "name":
        return where + eqn.params["name"]
    if prim == "device_put" and "Host" in str(eqn.params["devices"]):
        return _source(jaxpr, eqn.invars[0], "host:")
    if prim == "reduce_precision":
        return _source(jaxpr, eqn.invars[0], where)
    inner = eqn.params.get("jaxpr")
    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's, or a Jaxpr
    if inner is not None and len(inner.outvars) == len(eqn.outvars):
        return _source(inner, inner.outvars[eqn.outvars.index(var)], where)
    return where + prim


def _kept(dispatcher: str, remat_name: str, precision: str = "compute") -> dict[str, int]:
    """The residuals the backward pass reads (`jax.ad_checkpoint.saved_residuals`'
    method, followed into the layer scan and the dispatcher's shard_map), counted
    by name; unnamed ones only when they are dots."""
    loss, params = _model(dispatcher, precision)
    jaxpr, (_, vjp_fn) = jax.make_jaxpr(
        lambda p: jax.vjp(lambda q: loss(q, remat_name), p), return_shape=True)(params)
    residuals = jaxpr.jaxpr.outvars[-len(jax.tree.leaves(vjp_fn)):]
    kept = collections.Counter(_source(jaxpr.jaxpr, v) for v in residuals)
    return {k: n for k, n in kept.items()
            if k.removeprefix("host:") in NAMES or k == "dot_general"}


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@functools.cache
def _gradient_program(dispatcher: str, remat_name: str) -> tuple[dict[str, int], set[str]]:
    """Dots of the training gradient per named scope, attention and expert GEMMs,
    and every scope name in the program."""
    loss, params = _model(dispatcher)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, remat_name)))(params).jaxpr
    dots, scopes = collections.Counter(), set()
    for eqn in _eqns(jaxpr):
        stack = str(eqn.source_info.name_stack).split("/")
        scopes.update(stack)
        if eqn.primitive.name == "dot_general":
            dots.update(s for s in ("attention", "expert_gemms") if s in stack)
    return dots, scopes


def _recomputed(dispatcher: str, remat_name: str) -> dict[str, int]:
    """Dots the backward pass recomputes: those beyond the program without remat."""
    dots, _ = _gradient_program(dispatcher, remat_name)
    base, _ = _gradient_program(dispatcher, "none")
    return {k: dots[k] - base[k] for k in ("attention", "expert_gemms")}


@pytest.mark.parametrize("dispatcher", ["grouped", "alltoall", "ragged"])
def test_each_policy_keeps_its_named_tensors(dispatcher, jax_dots):
    want = _kept_names(dispatcher)
    got = {name: _kept(dispatcher, name) for name in want}
    assert got == want
    # JAX's unbatched-dots rule keeps no expert GEMM output (a batched einsum, for
    # every dispatcher); `matmuls` adds them by name
    assert not set(got["jax_dots"]) & set(EXPERT_GEMMS)
    assert set(EXPERT_GEMMS) <= set(got["matmuls"])


@pytest.mark.parametrize("dispatcher", ["grouped", "ragged"])
def test_mxfp8_expert_gemm_outputs_are_kept(dispatcher):
    """The MXFP8 GEMMs (a custom VJP around the einsum) carry the same names."""
    assert _kept(dispatcher, "save_expert_gemms", "mxfp8") == EXPERT_GEMMS


def test_what_the_backward_pass_recomputes(jax_dots):
    """Dots recomputed per layer: `full` redoes attention's six (three projections, scores, probabilities x values, output
    projection) and both expert GEMMs."""
    want = {
        "full": {"attention": 6, "expert_gemms": 2},
        "jax_dots": {"attention": 2, "expert_gemms": 2},  # scores and P x V; the GEMMs
        "matmuls": {"attention": 2, "expert_gemms": 0},
        "save_expert_gemms": {"attention": 6, "expert_gemms": 0},
        # the scores (the backward needs the probabilities) and the output
        # projection (the residual stream needs its output)
        "save_attention": {"attention": 2, "expert_gemms": 2},
        # with both buffers kept, only the gate/up GEMM (SwiGLU's backward needs its output)
        "save_exchange": {"attention": 6, "expert_gemms": 1},
        "offload": {"attention": 2, "expert_gemms": 0},
    }
    assert {name: _recomputed("ragged", name) for name in want} == want


def test_named_scopes_reach_the_program():
    _, scopes = _gradient_program("ragged", "save_exchange")
    assert {"attention", "router", "dispatch", "exchange_out", "expert_gemms",
            "exchange_back"} <= scopes


def test_policies_give_the_loss_and_gradients_of_no_remat():
    """alltoall (it has every named tensor), in one compiled program: `matmuls` (a mixed
    policy), `save_exchange` (names on collectives) and `offload` (host moves, saving
    the names of save_expert_gemms and save_attention); `full` is checked against no
    remat in test_model and test_pipeline."""
    loss, params = _model("alltoall")
    names = ["matmuls", "save_exchange", "offload"]
    runs = jax.jit(lambda p: [jax.value_and_grad(functools.partial(loss, remat_name=n))(p)
                              for n in ["none"] + names])(params)
    (ref_loss, ref_grads), rest = runs[0], runs[1:]
    # teeth: the gradients are far from zero
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads)) > 1e-3
    for name, (value, grads) in zip(names, rest):
        # the same ops, recomputed: XLA may only reorder fp32 sums of a few hundred
        # terms (rounding ~ sqrt(n) 2^-24 relative to their size)
        assert float(value) == pytest.approx(float(ref_loss), rel=1e-6), name
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()), err_msg=name), grads, ref_grads)


def test_every_configurable_name_has_a_policy():
    names = typing.get_args(typing.get_type_hints(TrainConfig)["remat"])
    assert set(names) == {"none"} | set(remat.REMAT_POLICIES)
    assert config_from_dict({"train": {"remat": "offload"}}).train.remat == "offload"
    with pytest.raises(ConfigError, match="^train.remat"):
        config_from_dict({"train": {"remat": "save_everything"}})

"""MXFP8 projections (`model.projection_precision`): each projection's GEMMs pinned to
the float64 reference of its flattened operands (tests/mx_reference.py), the copies
covering exactly the projections the key names, and the model's loss and gradients
through them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mx_reference as ref
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.model.layers import project
from jaxmoe.model.mx_weights import mx_copies, with_mx_copies
from jaxmoe.model.transformer import Transformer
from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.mx import MXProjection, Options, quantize_projection


@pytest.mark.parametrize("spec, x_shape, w_shape, inputs", [
    ("bld,dhk->blhk", (2, 32, 64), (64, 3, 32), 1),  # a query projection
    ("blhk,hkd->bld", (2, 32, 3, 32), (3, 32, 64), 2),  # an output projection
])
def test_projection_pinned_to_reference(spec, x_shape, w_shape, inputs):
    """Forward: x and w blocked along the contracted I (w's input axes flattened). Input
    gradient: dy and w along the flattened outputs O. Weight gradient: bf16 operands.
    Each within fp32 accumulation of the reference; an unquantised operand or the
    wrong block axis is not."""
    rng = np.random.default_rng(7)
    I, O = int(np.prod(w_shape[:inputs])), int(np.prod(w_shape[inputs:]))
    T = int(np.prod(x_shape)) // I
    # channel magnitudes 2^-8 .. 2^8 that cancel in each product: with them which values
    # share a block (the block axis) decides which lose bits
    u_I, v_O = (2.0 ** rng.integers(-8, 9, n) for n in (I, O))
    x = (rng.normal(size=(T, I)) * u_I).astype(np.float32).reshape(x_shape)
    w = (rng.normal(size=(I, O)) / u_I[:, None] * v_O).astype(np.float32).reshape(w_shape)
    y_shape = x_shape[:len(x_shape) - inputs] + w_shape[inputs:]
    dy = (rng.normal(size=(T, O)) / v_O).astype(np.float32).reshape(y_shape)

    def f(x_, w_):
        mx = MXProjection(quantize_projection(w_, inputs, len(w_shape) - inputs)._replace(w=w_),
                          Options())
        return project(spec, x_, mx)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    assert y.shape == y_shape and dx.shape == x.shape and dw.shape == w.shape
    x2, w2 = x.reshape(-1, I), w.reshape(I, -1)
    dy2 = dy.reshape(-1, w2.shape[1])
    fq = ref.fake_quantize
    xq, wq = fq(x2, 1), fq(w2, 0)
    ref.assert_pinned(np.asarray(y).reshape(-1, w2.shape[1]), xq @ wq,
                      ref.gemm_tolerance(xq, wq), {
                          "x unquantised": x2.astype(np.float64) @ wq,
                          "w blocked along O": xq @ fq(w2, 1)})
    dyq, wt = fq(dy2, 1), fq(w2, 1).T
    ref.assert_pinned(np.asarray(dx).reshape(-1, I), dyq @ wt, ref.gemm_tolerance(dyq, wt), {
        "dy unquantised": dy2.astype(np.float64) @ wt, "w blocked along I": dyq @ fq(w2, 0).T})
    xb, dyb = ref.bf16_round(x2).T, ref.bf16_round(dy2)
    ref.assert_pinned(np.asarray(dw).reshape(I, -1), xb @ dyb, ref.gemm_tolerance(xb, dyb), {
        "MXFP8 weight gradient": fq(x2, 0).T @ fq(dy2, 0)})
    w64 = jnp.ones((64, 64))  # x narrower than the weight its copies were made of
    with pytest.raises(ValueError, match="does not contract"):
        project("bld,df->blf", jnp.ones((1, 4, 32)),
                MXProjection(quantize_projection(w64, 1, 1)._replace(w=w64), Options()))


def _cfg(projection="mxfp8", **model):
    return config_from_dict({
        "model": {"vocab_size": 256, "d_model": 64, "num_layers": 3, "num_heads": 2,
                  "num_kv_heads": 1, "head_dim": 32, "num_dense_layers": 1, "mlp_hidden": 64,
                  "mtp_layers": 1, "projection_precision": projection, **model},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "shared_expert_hidden": 32,
                "dispatcher": "dense"},
        "train": {"batch_size": 4, "seq_len": 32}})


MLA = {"attention": "mla", "qk_norm": "none", "num_heads": 2, "num_kv_heads": 2, "q_lora_rank": 32,
       "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32}


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_copies_cover_exactly_the_projections(attention):
    """Every attention (and MLA) projection, dense MLP and shared expert has copies, stacked
    as the layers are and flattened to [I, O]; the embedding, LM head, router, routed
    experts (bf16 here) and MTP's joining projection do not. Companion: without the key
    there are no copies."""
    cfg = _cfg(**(MLA if attention == "mla" else {}))
    params = nnx.state(Transformer.of(cfg, nnx.Rngs(0)), nnx.Param)
    copies = mx_copies(params, cfg)
    names = {tuple(k.strip("[]'").split("']['")[-2:]) for k in copies}
    attn = ({"w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_o"} if attention == "mla"
            else {"w_q", "w_k", "w_v", "w_o"})
    assert names == ({("attn", n) for n in attn}
                     | {(m, n) for m in ("mlp", "shared") for n in ("w_gate_up", "w_down")})
    # each stack's copies once: dense, MoE and the MTP module's layers
    assert len(copies) == 3 * len(attn) + 6
    leaves = {jax.tree_util.keystr(p): v.get_value() for p, v in
              jax.tree_util.tree_flatten_with_path(
                  params, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]}
    for key, c in copies.items():
        w = leaves[key]
        name = key.strip("[]'").split("']['")[-1]
        out = 1 if name in ("w_o", "w_gate_up", "w_down", "w_q_a", "w_kv_a") else 2
        O = int(np.prod(w.shape[w.ndim - out:]))
        I = int(np.prod(w.shape[w.ndim - out - (2 if name == "w_o" else 1):w.ndim - out]))
        assert c.w is None and c.forward.shape[-2:] == (O, I) and c.dgrad.shape[-2:] == (I, O)
    assert mx_copies(params, _cfg("compute", **(MLA if attention == "mla" else {}))) == {}


def test_model_through_mxfp8_projections():
    """The loss and every projection's gradient through the copies: close to the compute
    dtype's and not equal to it, and so the other weights' (MXFP8 rounds each operand by
    up to 2^-4 relative: errors of a few % that leave a gradient's direction within
    cos 0.98, 20% of its norm)."""
    cfg = _cfg()
    model = Transformer.of(cfg, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
    copies = mx_copies(params, cfg)

    def loss(p, mx):
        attached = with_mx_copies(p, copies, cfg, Kernels.default()) if mx else p
        logits, aux = nnx.merge(graphdef, attached, rest)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    (l_mx, g_mx), (l_ref, g_ref) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, m)
                                    for m in (True, False))
    assert l_mx != l_ref and abs(float(l_mx) - float(l_ref)) < 0.02 * float(l_ref)
    flat_mx, checked = dict(jax.tree_util.tree_flatten_with_path(g_mx)[0]), 0
    for path, g in jax.tree_util.tree_flatten_with_path(g_ref)[0]:
        a, b = np.ravel(flat_mx[path]), np.ravel(g)
        if not np.any(b):
            continue  # MTP's: this loss does not reach them
        cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        assert cos > 0.98, (jax.tree_util.keystr(path), cos)
        checked += jax.tree_util.keystr(path).removesuffix(".value") in copies
        assert np.any(a != b)
    assert checked == len([k for k in copies if not k.startswith("['mtp")])


def test_uneven_projections_are_refused():
    """Blocks of 32 along every projection's inputs and outputs: a kv_lora_rank plus RoPE
    key of 48 is named, nothing else; with MXFP8 weight gradients, along the rows too."""
    with pytest.raises(ConfigError, match="model.projection_precision.*w_kv_a"):
        _cfg(**{**MLA, "kv_lora_rank": 16})
    _cfg("compute", **{**MLA, "kv_lora_rank": 16})  # bf16 takes any width
    # MXFP8 weight gradients block a call's rows by 32
    grad = {"moe": {"num_experts": 4, "expert_hidden": 32, "mxfp8_weight_grad": True},
            "model": {"d_model": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
                      "projection_precision": "mxfp8"}}
    with pytest.raises(ConfigError, match="moe.mxfp8_weight_grad.*seq_len.*40"):
        config_from_dict({**grad, "train": {"batch_size": 4, "seq_len": 40}})
    config_from_dict({**grad, "train": {"batch_size": 4, "seq_len": 64}})

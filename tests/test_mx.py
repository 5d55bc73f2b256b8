"""MXFP8 quantisation: error within the documented bounds, special values."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.mx import BLOCK, dequantize, fake_quantize, quantize


def _check_bounds(x):
    q, s = quantize(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu
    assert s.shape == x.shape[:-1] + (x.shape[-1] // BLOCK,)
    y = np.asarray(dequantize(q, s))
    scale = 2.0 ** (np.asarray(s).view(np.uint8).astype(np.float64) - 127)  # e8m0: biased exponent
    X = np.repeat(scale, BLOCK, axis=-1)
    normal = np.abs(x) / X >= 2.0 ** -6
    rel = np.abs(y - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-7
    assert (np.abs(y - x)[~normal] <= 2.0 ** -10 * X[~normal] + 1e-45).all()
    # the scale is a power of two that maps the block max to at most 448, never saturating
    amax = np.abs(x).reshape(*x.shape[:-1], -1, BLOCK).max(-1)
    assert (amax / scale <= 448).all() and (amax / scale > 224).all()
    return rel.max()


def test_random_heavy_tailed_and_tiny():
    rng = np.random.default_rng(0)
    for x in [rng.normal(size=(64, 256)),
              rng.standard_t(df=1.5, size=(64, 256)) * 1e3,  # heavy tails
              rng.normal(size=(64, 256)) * 1e-30]:  # tiny magnitudes
        worst = _check_bounds(x.astype(np.float32))
        assert worst > 2.0 ** -7  # the bound is close to what happens: not a vacuous test


def test_zero_nan_inf_blocks():
    x = np.ones((2, 64), np.float32)
    x[0, :32] = 0.0  # all-zero block
    x[1, 3] = np.nan
    x[1, 40] = np.inf
    y = np.asarray(fake_quantize(jnp.asarray(x)))
    assert (y[0, :32] == 0).all() and (y[0, 32:] == 1).all()
    assert np.isnan(y[1]).all()  # both blocks of row 1 hold a NaN or an Inf
    _, s = quantize(jnp.asarray(x))
    bits = np.asarray(s).view(np.uint8)
    assert bits[0, 0] == 0 and bits[1, 0] == 255 and bits[1, 1] == 255  # 2^-127, NaN, NaN


def test_axis_and_shape_errors():
    x = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32)
    a = np.asarray(fake_quantize(jnp.asarray(x), axis=0))
    b = np.asarray(fake_quantize(jnp.asarray(x.T), axis=-1)).T
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(jnp.ones((4, 48)))


def test_mx_linear_error_against_float64():
    from jaxmoe.ops.mx import mx_linear
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 64, 128)).astype(np.float32)
    w = (rng.normal(size=(4, 128, 96)) / np.sqrt(128)).astype(np.float32)
    ref = np.einsum("eck,ekn->ecn", x.astype(np.float64), w.astype(np.float64))
    y = np.asarray(mx_linear(jnp.asarray(x), jnp.asarray(w), False), np.float64)
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    # e4m3 keeps 3 mantissa bits: per-operand rounding up to 2^-4, ~2^-5.5 rms
    assert 0.005 < rel < 0.05, rel


def _expert_grads(cfg, mesh=None):
    import jax
    from jaxmoe.model.dispatch import get_dispatcher
    from jaxmoe.model.experts import ExpertWeights
    from jaxmoe.model.router import route
    ks = jax.random.split(jax.random.key(0), 4)
    T, D, F, E = 64, 64, 64, 8
    x = jax.random.normal(ks[0], (T, D))
    logits = jax.random.normal(ks[1], (T, E))
    w = ExpertWeights(jax.random.normal(ks[2], (E, D, 2 * F)) / 8, jax.random.normal(ks[3], (E, F, D)) / 8)

    def loss(x, w):
        out = get_dispatcher(cfg.dispatcher)(x, route(logits, cfg), w, cfg, mesh)
        return jnp.sum(jnp.sin(out.y_TxD))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def test_mxfp8_experts_gradients_track_bf16_and_work_under_ep():
    import dataclasses
    import jax
    from jaxmoe.config import MeshConfig, MoEConfig
    from jaxmoe.sharding import make_mesh
    base = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, capacity_factor=4.0,
                     dispatcher="grouped")
    mx = dataclasses.replace(base, expert_precision="mxfp8")
    (v_mx, g_mx), (_, g_ref) = _expert_grads(mx), _expert_grads(base)
    for a, b in zip(jax.tree.leaves(g_mx), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
        cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        assert cos > 0.99 and 0.001 < np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1
    # expert parallel: MXFP8 blocks run along each row's D, so where a token is computed
    # does not change what it sees
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    v_ep, g_ep = _expert_grads(dataclasses.replace(mx, dispatcher="alltoall"), mesh)
    assert float(v_ep) == pytest.approx(float(v_mx), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), g_ep, g_mx)


@pytest.mark.slow
def test_mxfp8_training_tracks_bf16(tmp_path):
    from jaxmoe.config import config_from_dict
    from jaxmoe.data import load_corpus
    from jaxmoe.train import train
    corpus = load_corpus("stdlib", None, 256, 64)
    losses = {}
    for precision in ("compute", "mxfp8"):
        cfg = config_from_dict({
            "model": {"d_model": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "compute_dtype": "bfloat16"},
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64,
                    "expert_precision": precision},
            "train": {"steps": 60, "batch_size": 16, "seq_len": 64, "eval_every": 0,
                      "eval_batches": 4, "run_dir": str(tmp_path / precision)},
            "optimizer": {"warmup_steps": 5}, "logging": {"progress": False}})
        losses[precision] = train(cfg, corpus)["heldout_loss"]
    assert losses["mxfp8"] == pytest.approx(losses["compute"], abs=0.05)  # the stated margin
    assert losses["mxfp8"] != losses["compute"]  # and it is a different computation


def test_mxfp8_ragged_ffn_matches_grouped_buffers():
    import dataclasses
    import jax
    from jaxmoe.config import MoEConfig
    from jaxmoe.model.experts import ExpertWeights, expert_ffn
    from jaxmoe.parallel.ep_dispatch import ragged_ffn
    cfg = MoEConfig(num_experts=3, expert_hidden=32, expert_precision="mxfp8")
    ks = jax.random.split(jax.random.key(3), 3)
    w = ExpertWeights(jax.random.normal(ks[0], (3, 32, 64)) / 6, jax.random.normal(ks[1], (3, 32, 32)) / 6)
    sizes = [5, 0, 11]
    x = jax.random.normal(ks[2], (16, 32))
    gs = jnp.asarray(sizes, jnp.int32)

    def ragged_loss(x, w):
        return jnp.sum(jnp.sin(ragged_ffn(w, x, gs, cfg)))

    def buffer_loss(x, w):  # the same rows, one expert at a time
        total, start = 0.0, 0
        for e, n in enumerate(sizes):
            if n:
                we = ExpertWeights(w.w_gate_up_ExDx2F[e:e + 1], w.w_down_ExFxD[e:e + 1])
                total += jnp.sum(jnp.sin(expert_ffn(we, x[None, start:start + n], cfg)))
            start += n
        return total

    (v, (dx, dw)) = jax.value_and_grad(ragged_loss, (0, 1))(x, w)
    (v_ref, (dx_ref, dw_ref)) = jax.value_and_grad(buffer_loss, (0, 1))(x, w)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)  # MXFP8 input gradient
    # bf16 weight gradients (the ragged one is also rounded to bf16 on output)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2), dw, dw_ref)
    got = (v, (dx, dw))
    plain = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(ragged_ffn(
        w, x, gs, dataclasses.replace(cfg, expert_precision="compute")))), (0, 1))(x, w)
    assert abs(float(plain[0]) - float(got[0])) > 1e-4  # MXFP8 really changed the numbers

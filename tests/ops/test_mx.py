"""MXFP8 pinned to an independent NumPy reading of the OCP MX spec (tests/mx_reference.py):
quantisation bit for bit under both scale rules, GEMMs and gradients within fp32
accumulation error of the reference-quantised operands, tight enough that a GEMM
with an unquantised operand, a wrong block axis, the other scale rule or bf16
operands fails."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mx_reference as ref
from jaxmoe.ops.mx import BLOCK, dequantize, fake_quantize, mx_bmm, mx_linear, quantize

RULES = ref.RULES
F32_MAX = float(np.finfo(np.float32).max)


def _anchored(values, anchor=448.0):
    """Blocks of 31 values plus one `anchor`: with amax = 448 both rules pick X = 1, so
    the elements are the values themselves."""
    v = np.asarray(values, np.float64)
    v = np.concatenate([v, np.zeros(-len(v) % 31)]).reshape(-1, 31)
    return np.concatenate([np.full((len(v), 1), anchor), v], axis=1)


def _scaled_blocks(rng, amax, n=32):
    """One block per entry of amax, uniform in [-1, 1] times it, holding +-amax itself."""
    b = rng.uniform(-1, 1, (len(amax), n))
    b[:, 0] = np.where(np.arange(len(amax)) % 2, -1.0, 1.0)
    return b * np.asarray(amax, np.float64)[:, None]


def _midpoints():
    """The exact ties: halfway between neighbouring e4m3 values >= 0, subnormals included."""
    grid = ref.e4m3_value(np.arange(0x7F, dtype=np.uint8))
    return (grid[:-1] + grid[1:]) / 2


def _nonfinite_rows(rng, rows=512):
    """Rows of ones with one NaN (or, every fourth row, an Inf) somewhere in a block."""
    x = np.ones((rows, 64))
    cols = rng.integers(0, 64, rows)
    x[np.arange(rows), cols] = np.where(np.arange(rows) % 4 == 3, np.inf, np.nan)
    return x


def _random_bits(rng, shape=(512, 64)):
    """Any float32 bit pattern: NaNs of either sign and any payload, Infs, subnormals."""
    bits = rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)
    with np.errstate(invalid="ignore"):  # signalling NaNs widen quietly
        return bits.view(np.float32).astype(np.float64)


def _cases():
    rng = np.random.default_rng(0)
    mid = _midpoints()
    ties = _anchored(np.concatenate([mid, -mid, mid * (1 + 2.0 ** -20), mid * (1 - 2.0 ** -20)]))
    tiny_exps = [-110, -117, -119, -120, -125, -127, -130, -140, -149]
    return {
        "normal": rng.normal(size=(16, 256)),
        "heavy_tailed": rng.standard_t(1.5, size=(16, 256)) * 1e3,
        # ties at their own scale and moved by powers of two (the scale must not disturb them)
        "ties": np.concatenate([ties, ties * 2.0 ** -40, ties * 2.0 ** 60]),
        # amax / 2^floor(log2 amax) above 1.75: the spec's rule saturates these blocks
        "saturating": _scaled_blocks(rng, [449, 464, 479.9, 480, 500, 511.9, 464 * 2.0 ** -30,
                                           510 * 2.0 ** 40, 1.76, 1.99 * 2.0 ** -100]),
        "subnormal_results": _anchored(rng.uniform(-1, 1, 124) * 2.0 ** rng.integers(-12, -5, 124)),
        "zeros": np.stack([np.zeros(64), -np.zeros(64), np.r_[np.zeros(32), np.ones(32)]]),
        "nonfinite": np.stack([np.r_[np.nan, np.ones(63)], np.r_[np.ones(40), np.inf, np.ones(23)],
                               np.r_[-np.inf, np.ones(31), np.full(32, np.nan)]]),
        # enough rows for XLA:CPU to vectorise the block max (its float max drops NaN)
        "nonfinite_rows": _nonfinite_rows(rng),
        # any float32 bit pattern: NaNs of either sign and payload, Infs, subnormals
        "random_bits": _random_bits(rng),
        "tiny": np.concatenate([_scaled_blocks(rng, 2.0 ** np.array(tiny_exps, float)),
                                [np.full(32, 2.0 ** -127), np.full(32, 2.0 ** -149)]]),
        "huge": np.concatenate([_scaled_blocks(rng, [2.0 ** 100, 2.0 ** 120, 2.0 ** 127, F32_MAX]),
                                [np.full(32, -F32_MAX), np.r_[F32_MAX, np.ones(31)],
                                 # v / X below float32's normals (and its subnormals)
                                 np.r_[F32_MAX, 2.0 ** -20, -2.0 ** -140, 1e-30, np.ones(28)]]]),
    }


CASES = _cases()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", list(CASES))
def test_quantize_matches_reference_bits(case, rule):
    x = CASES[case].astype(np.float32)
    q, s = quantize(jnp.asarray(x), scale_rule=rule)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu
    assert s.shape == x.shape[:-1] + (x.shape[-1] // BLOCK,)
    q_ref, s_ref = ref.quantize(x, rule=rule)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref)
    # every MXFP8 value up to float32's max is a float32, and dequantize gives it exactly
    # (rounding at fp32's max under "ceil" reaches 2^128, which overflows to Inf)
    with np.errstate(over="ignore"):
        expected = ref.dequantize(q_ref, s_ref).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(q, s)), expected)


def test_cases_reach_what_they_are_named_for():
    q, _ = ref.quantize(_anchored(_midpoints()).astype(np.float32))
    assert (q[:, 1:].ravel()[:126] & 1 == 0).all()  # every tie went to the even code
    q, s = ref.quantize(CASES["saturating"].astype(np.float32), rule="floor")
    assert ((q & 0x7F) == 0x7E).sum() >= 10  # every block's max rounded or clipped to 448
    q, _ = ref.quantize(CASES["subnormal_results"].astype(np.float32))
    assert ((q & 0x78) == 0).sum() > 50  # exponent field 0: subnormal or zero elements
    _, s = ref.quantize(CASES["tiny"].astype(np.float32), rule="floor")
    assert (s == 0).sum() >= 5 and (s > 0).any()  # clamped at 2^-127, and not only
    _, s = ref.quantize(CASES["nonfinite"].astype(np.float32))
    np.testing.assert_array_equal(s, [[255, 119], [119, 255], [255, 255]])  # ones: 2^-8


def test_reference_e4m3_rounding_agrees_with_ml_dtypes():
    """The reference's integer rounding against a third implementation of the cast."""
    rng = np.random.default_rng(1)
    v = rng.normal(size=20000) * 2.0 ** rng.integers(-14, 10, 20000)
    v = np.concatenate([v, np.arange(-600, 600, 0.125), CASES["ties"].ravel()])
    expected = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(ref.e4m3_bits(v), expected)


def test_rules_differ_where_the_spec_saturates():
    block = np.zeros(32, np.float32)
    block[:3] = [500.0, -3 * 2.0 ** -11, 1.0]
    (qf, sf), (qc, sc) = (quantize(jnp.asarray(block), scale_rule=r) for r in ("floor", "ceil"))
    yf, yc = np.asarray(dequantize(qf, sf)), np.asarray(dequantize(qc, sc))
    # floor: X = 2^(8 - 8) = 1 and 500 saturates to 448; ceil: X = 2, 500 -> 250 -> 256
    assert np.asarray(sf).view(np.uint8)[0] == 127 and np.asarray(sc).view(np.uint8)[0] == 128
    assert yf[0] == 448.0 and yc[0] == 512.0
    # ceil's price: one binade less at the bottom (-1.5 * 2^-10 keeps a value only under floor)
    assert yf[1] == -2.0 ** -9 and yc[1] == 0.0
    # on random data the rules part exactly on the blocks whose max has mantissa above 1.75
    x = np.random.default_rng(2).normal(size=(64, 256)).astype(np.float32)
    e_floor, e_ceil = (np.asarray(quantize(jnp.asarray(x), scale_rule=r)[1]).view(np.uint8)
                       .astype(int) for r in ("floor", "ceil"))
    mantissa = 2 * np.frexp(np.abs(x).reshape(64, -1, BLOCK).max(-1))[0]  # in [1, 2)
    np.testing.assert_array_equal(e_ceil - e_floor, mantissa > 1.75)
    assert 0.1 < (mantissa > 1.75).mean() < 0.3


def test_axis_rule_and_shape_errors():
    x = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32)
    q, s = quantize(jnp.asarray(x), axis=0)
    q_ref, s_ref = ref.quantize(x, axis=0)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), s_ref)
    b = np.asarray(fake_quantize(jnp.asarray(x.T), axis=-1)).T
    np.testing.assert_array_equal(np.asarray(fake_quantize(jnp.asarray(x), axis=0)), b)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(jnp.ones((4, 48)))
    with pytest.raises(ValueError, match="scale rule 'spec'"):
        quantize(jnp.ones((4, 32)), scale_rule="spec")


# ---------------------------------------------------------------- GEMMs and gradients


def _spread(rng, n):
    """Per-channel magnitudes 2^-8 .. 2^8: with them a block of 32 spans more than e4m3's
    2^14 between its smallest subnormal and its max, so which values share a block
    (the block axis, the scale rule) decides which of them lose bits or vanish."""
    return 2.0 ** rng.integers(-8, 9, n)


@pytest.mark.parametrize("rule", RULES)
def test_mx_bmm_pinned_to_reference_operands(rule):
    rng = np.random.default_rng(3)
    u_K = _spread(rng, 128)  # cancels in every product a_k b_k
    a = (rng.normal(size=(2, 16, 128)) * u_K).astype(np.float32)
    b = (rng.normal(size=(2, 32, 128)) / u_K).astype(np.float32)
    got = mx_bmm(jnp.asarray(a), jnp.asarray(b), jnp.float32, rule)
    fa, fb = ref.fake_quantize(a, -1, rule), ref.fake_quantize(b, -1, rule)
    other = "floor" if rule == "ceil" else "ceil"
    fq_other = lambda v: ref.fake_quantize(v, -1, other)  # noqa: E731

    def gemm(a_, b_):
        return np.einsum("bmk,bnk->bmn", a_, b_)

    ref.assert_pinned(got, gemm(fa, fb), ref.gemm_tolerance(fa, np.swapaxes(fb, 1, 2)), {
        "a unquantised": gemm(a.astype(np.float64), fb),
        "b unquantised": gemm(fa, b.astype(np.float64)),
        "b blocked along N": gemm(fa, ref.fake_quantize(b, 1, rule)),
        "bf16 operands": gemm(ref.bf16_round(a), ref.bf16_round(b)),
    })
    # the other rule changes only the blocks whose max has a mantissa above 1.75
    err = np.abs(gemm(fq_other(a), fq_other(b)) - gemm(fa, fb))
    assert (err > ref.gemm_tolerance(fa, np.swapaxes(fb, 1, 2))).mean() > 0.25


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mxfp8_weight_grad", [False, True])
def test_mx_linear_forward_and_gradients_pinned(mxfp8_weight_grad, rule):
    """Forward x @ w: x and w blocked along K. Input gradient dy @ w^T: dy and w along N.
    Weight gradient x^T @ dy over the rows C: bf16 operands, or MXFP8 blocked along C."""
    E, C, K, N = 2, 64, 64, 96
    rng = np.random.default_rng(4)
    u_K, v_N, r_C = _spread(rng, K), _spread(rng, N), _spread(rng, C)
    # channel scales that cancel in the products of each of the three GEMMs
    x = (rng.normal(size=(E, C, K)) * u_K * r_C[:, None]).astype(np.float32)
    w = (rng.normal(size=(E, K, N)) / u_K[:, None] * v_N).astype(np.float32)
    dy = (rng.normal(size=(E, C, N)) / v_N / r_C[:, None]).astype(np.float32)
    y, vjp = jax.vjp(lambda x_, w_: mx_linear(x_, w_, mxfp8_weight_grad, rule),
                     jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    fq = lambda a, axis: ref.fake_quantize(a, axis, rule)  # noqa: E731
    f64 = lambda a: a.astype(np.float64)  # noqa: E731

    fwd = lambda a, b: np.einsum("eck,ekn->ecn", a, b)  # noqa: E731
    ref.assert_pinned(y, fwd(fq(x, 2), fq(w, 1)), ref.gemm_tolerance(fq(x, 2), fq(w, 1)), {
        "x unquantised": fwd(f64(x), fq(w, 1)),
        "w unquantised": fwd(fq(x, 2), f64(w)),
        "w blocked along N": fwd(fq(x, 2), fq(w, 2)),
    })

    bwd_x = lambda a, b: np.einsum("ecn,ekn->eck", a, b)  # noqa: E731
    dy_q, w_q = fq(dy, 2), fq(w, 2)
    ref.assert_pinned(dx, bwd_x(dy_q, w_q), ref.gemm_tolerance(dy_q, np.swapaxes(w_q, 1, 2)), {
        "bf16 input gradient": bwd_x(ref.bf16_round(dy), ref.bf16_round(w)),
        "w blocked along K": bwd_x(dy_q, fq(w, 1)),
        "dy unquantised": bwd_x(f64(dy), w_q),
    })

    bwd_w = lambda a, b: np.einsum("eck,ecn->ekn", a, b)  # noqa: E731
    mx = (fq(x, 1), fq(dy, 1))  # blocked along C
    bf16 = (ref.bf16_round(x), ref.bf16_round(dy))
    wrong_axes = (fq(x, 2), fq(dy, 2))
    if mxfp8_weight_grad:
        expected, wrong = mx, {"bf16 weight gradient": bf16, "blocked along K and N": wrong_axes}
    else:
        expected, wrong = bf16, {"MXFP8 weight gradient": mx, "fp32 operands": (f64(x), f64(dy))}
    tol = ref.gemm_tolerance(np.swapaxes(expected[0], 1, 2), expected[1])
    ref.assert_pinned(dw, bwd_w(*expected), tol, {k: bwd_w(*v) for k, v in wrong.items()})


def test_config_reaches_the_expert_gemms():
    """moe.mxfp8_scale and moe.mxfp8_weight_grad act in expert_ffn exactly as the same
    arguments passed to the MX GEMM directly, and each setting matters."""
    from jaxmoe.config import MoEConfig
    from jaxmoe.model.experts import ExpertWeights, expert_ffn
    ks = jax.random.split(jax.random.key(5), 3)
    w = ExpertWeights(jax.random.normal(ks[0], (2, 32, 64)) / 6,
                      jax.random.normal(ks[1], (2, 32, 32)) / 6)
    x_ExCxD = jax.random.normal(ks[2], (2, 32, 32))

    def cfg(**kw):
        return MoEConfig(num_experts=2, expert_hidden=32, expert_precision="mxfp8", **kw)

    def swiglu(matmul, w, x):
        gate, up = jnp.split(matmul(x, w.w_gate_up_ExDx2F), 2, axis=-1)
        return matmul(jax.nn.silu(gate) * up, w.w_down_ExFxD)

    @functools.partial(jax.jit, static_argnums=0)
    def outputs(rule):  # (via the config, direct)
        return (expert_ffn(w, x_ExCxD, cfg(mxfp8_scale=rule)),
                swiglu(lambda a, b: mx_linear(a, b, False, rule), w, x_ExCxD))

    by_rule = {rule: outputs(rule) for rule in RULES}
    for got, direct in by_rule.values():
        np.testing.assert_array_equal(got, direct)
    assert all(np.any(a != b) for a, b in zip(*by_rule.values()))  # the rules differ

    def loss(f):
        return jax.grad(lambda w: jnp.sum(jnp.sin(f(w))))

    @functools.partial(jax.jit, static_argnums=0)
    def weight_grads(flag):  # (via the config, direct)
        return (loss(lambda w: expert_ffn(w, x_ExCxD, cfg(mxfp8_weight_grad=flag)))(w),
                loss(lambda w: swiglu(lambda a, b: mx_linear(a, b, flag), w, x_ExCxD))(w))

    by_flag = {flag: weight_grads(flag) for flag in (False, True)}
    for got, direct in by_flag.values():
        jax.tree.map(np.testing.assert_array_equal, got, direct)
    for a, b in zip(jax.tree.leaves(by_flag[False][0]), jax.tree.leaves(by_flag[True][0])):
        assert np.any(a != b)  # MXFP8 weight gradients differ from bf16 ones


def _expert_grads(cfg, mesh=None):
    from jaxmoe.parallel.layout import dispatch_on_mesh
    from jaxmoe.model.experts import ExpertWeights
    from jaxmoe.model.router import route
    ks = jax.random.split(jax.random.key(0), 4)
    T, D, F, E = 64, 64, 64, 8
    x = jax.random.normal(ks[0], (T, D))
    logits = jax.random.normal(ks[1], (T, E))
    w = ExpertWeights(jax.random.normal(ks[2], (E, D, 2 * F)) / 8, jax.random.normal(ks[3], (E, F, D)) / 8)

    def loss(x, w):
        out = dispatch_on_mesh(x, route(logits, cfg), w, cfg, mesh)
        return jnp.sum(jnp.sin(out.y_TxD))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("dispatcher", ["alltoall", "ragged"])
def test_mxfp8_experts_under_ep_match_one_device(dispatcher):
    """MXFP8 blocks run along each row's D, so where a token is computed does not change
    what it sees: EP over 4 expert ranks gives the grouped result."""
    from jaxmoe.config import MeshConfig, MoEConfig
    from jaxmoe.parallel.sharding import make_mesh
    mx = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, capacity_factor=4.0,
                   dispatcher="grouped", expert_precision="mxfp8")
    v_mx, g_mx = _expert_grads(mx)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    v_ep, g_ep = _expert_grads(dataclasses.replace(mx, dispatcher=dispatcher), mesh)
    assert float(v_ep) == pytest.approx(float(v_mx), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), g_ep, g_mx)


@pytest.mark.slow
def test_mxfp8_training_tracks_bf16(tmp_path):
    """60 steps of a tiny model: MXFP8 experts, and MXFP8 experts and projections, end
    within the stated margin of bf16's held-out loss, and each is a different computation."""
    from jaxmoe.config import config_from_dict
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.train import train
    corpus = load_corpus("stdlib", None, 256, 64)
    losses = {}
    for name, experts, projections in (("compute", "compute", "compute"),
                                       ("experts", "mxfp8", "compute"),
                                       ("all", "mxfp8", "mxfp8")):
        cfg = config_from_dict({
            "model": {"d_model": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "compute_dtype": "bfloat16", "projection_precision": projections},
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64,
                    "expert_precision": experts},
            "train": {"steps": 60, "batch_size": 16, "seq_len": 64, "eval_every": 0,
                      "eval_batches": 4, "run_dir": str(tmp_path / name)},
            "optimizer": {"warmup_steps": 5}, "logging": {"progress": False}})
        losses[name] = train(cfg, corpus)["heldout_loss"]
    for name in ("experts", "all"):
        assert losses[name] == pytest.approx(losses["compute"], abs=0.05)  # the stated margin
    assert len(set(losses.values())) == 3  # and they are different computations

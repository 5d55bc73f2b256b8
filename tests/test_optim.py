"""The fused AdamW: same numbers as optax's chained AdamW, a real skip, half the
traffic; the learning-rate schedules by their formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmoe.config import OptimizerConfig
from jaxmoe.optim import learning_rate_schedule, make_optimizer
from jaxmoe.step import apply_gradients

CFG = OptimizerConfig(learning_rate=1e-2, warmup_steps=3, schedule="cosine", grad_clip=1.0,
                      weight_decay=0.1)
STEPS = 20


def _params(scale=1.0):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"w": jax.random.normal(k1, (16, 8)) * scale, "norm": jax.random.normal(k2, (8,)),
            "experts": jax.random.normal(k3, (4, 8, 8))}


def _optax_reference(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(cfg, STEPS), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay,
                        mask=lambda ps: jax.tree.map(lambda p: p.ndim >= 2, ps))
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw


def _grads(i, scale):
    return jax.tree.map(lambda p: jnp.sin(p * (i + 1)) * scale, _params())


@pytest.mark.parametrize("grad_scale", [0.01, 30.0], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_matches_optax_adamw(grad_scale, clip):
    cfg = OptimizerConfig(**{**CFG.__dict__, "grad_clip": clip})
    ours, ref = make_optimizer(cfg, STEPS), _optax_reference(cfg)
    p_ours = p_ref = _params()
    s_ours, s_ref = ours.init(p_ours), ref.init(p_ref)
    for i in range(6):
        g = _grads(i, grad_scale)
        # odd steps hand over the norm the train step has already computed
        norm = {"grad_norm": optax.tree.norm(g)} if i % 2 else {}
        u, s_ours = jax.jit(functools.partial(ours.update, **norm))(g, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, u)
        u, s_ref = jax.jit(ref.update)(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), p_ours, p_ref)
    # and the parameters did move, by more than the tolerance
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), p_ours, _params())
    assert min(jax.tree.leaves(moved)) > 1e-3
    if clip and grad_scale > clip:  # the clip changed the result: without it, optax differs
        unclipped = _optax_reference(OptimizerConfig(**{**CFG.__dict__, "grad_clip": 0.0}))
        p, st = _params(), unclipped.init(_params())
        for i in range(6):
            u, st = unclipped.update(_grads(i, grad_scale), st, p)
            p = optax.apply_updates(p, u)
        gap = max(float(jnp.max(jnp.abs(a - b) / (jnp.abs(b) + 1e-3)))
                  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_ours)))
        assert gap > 1e-3


def test_skip_changes_nothing_where_optax_would_poison_the_state():
    ours, ref = make_optimizer(CFG, STEPS), _optax_reference(CFG)
    p = _params()
    s = ours.init(p)
    u, s = ours.update(_grads(0, 0.1), s, p)
    p = optax.apply_updates(p, u)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(1, 0.1))
    u, s2 = jax.jit(lambda g, s, p: ours.update(g, s, p, skip=jnp.bool_(True)))(bad, s, p)
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(u))
    assert int(s2.count) == int(s.count) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), (s2.mu, s2.nu), (s.mu, s.nu))
    # without the skip the same gradients poison the moments (ours and optax's alike)
    _, s3 = ours.update(bad, s, p)
    assert not bool(jnp.isfinite(s3.mu["w"]).all())
    _, r = ref.update(bad, ref.init(p), p)
    assert not bool(jnp.isfinite(r[1][0].mu["w"]).all())


def test_tuple_containers_and_integer_skip():
    """Parameters held in tuples keep their own moments; skip=1 means skip."""
    params = (jnp.ones((3, 2)), 2 * jnp.ones(3))
    grads = (jnp.full((3, 2), 0.1), jnp.full(3, 5.0))
    cfg = OptimizerConfig(**{**CFG.__dict__, "grad_clip": 0.0})
    ours, ref = make_optimizer(cfg, STEPS), _optax_reference(cfg)
    u, s = ours.update(grads, ours.init(params), params)
    r, _ = ref.update(grads, ref.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u, r)
    assert s.mu[0].shape == (3, 2) and s.nu[1].shape == (3,)
    u, s2 = ours.update(grads, s, params, skip=1)
    assert int(s2.count) == 1 and all(float(jnp.max(jnp.abs(x))) == 0 for x in u)


def test_needs_params():
    tx = make_optimizer(CFG, STEPS)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(_grads(0, 1.0), tx.init(_params()), None)


def _compiled_bytes(fn, *args) -> float:
    analysis = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return analysis["bytes accessed"]


def test_fused_update_moves_less_memory_than_the_chained_one():
    """With the skip-on-non-finite that a train step needs, the chained optax form
    recomputes the moments in the parameter update and copies the donated moment
    buffers; the fused one reads and writes each tensor once per output."""
    params = {"experts": jnp.ones((8, 256, 512)), "w": jnp.ones((512, 512))}
    grads = jax.tree.map(lambda p: p * 0.01, params)
    ours, ref = make_optimizer(CFG, STEPS), _optax_reference(CFG)

    def fused(p, s, g):  # the train step's own update
        return apply_gradients(ours, p, s, g, jnp.float32(0))[:2]

    def chained(p, s, g):
        finite = jnp.isfinite(optax.tree.norm(g))
        u, new_s = ref.update(g, s, p)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        return jax.tree.map(keep, (optax.apply_updates(p, u), new_s), (p, s))

    ratio = (_compiled_bytes(fused, params, ours.init(params), grads)
             / _compiled_bytes(chained, params, ref.init(params), grads))
    # parameter, gradient and both moments read, three written, the clip norm: ~11
    # tensor passes against ~19-21 for the chained form
    assert ratio < 0.7, ratio


# --- schedules: warmup 0 -> peak over warmup_steps, then cosine, wsd or constant

PEAK, FLOOR_RATIO, TOTAL, WARM = 0.8, 0.25, 100, 10
FLOOR = PEAK * FLOOR_RATIO


def _schedule(kind, warmup=WARM, **kw):
    cfg = OptimizerConfig(learning_rate=PEAK, min_lr_ratio=FLOOR_RATIO, warmup_steps=warmup,
                          schedule=kind, **kw)
    fn = learning_rate_schedule(cfg, TOTAL)
    return lambda s: float(fn(jnp.int32(s)))


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor():
    lr = _schedule("wsd", decay_fraction=0.2)
    D = round(TOTAL * 0.2)  # decay steps at the end: 80 .. 100
    for s in (0, 1, 5, 9):  # linear warmup from 0
        assert lr(s) == pytest.approx(PEAK * s / WARM, rel=1e-6)
    for s in (WARM, 11, 50, TOTAL - D):  # warmup ends exactly at WARM; flat until the decay
        assert lr(s) == pytest.approx(PEAK, rel=1e-6)
    for s in (TOTAL - D + 1, 90, TOTAL - 1, TOTAL):  # linear to the floor, reached at TOTAL
        assert lr(s) == pytest.approx(PEAK - (PEAK - FLOOR) * (s - (TOTAL - D)) / D, rel=1e-6)
    assert lr(TOTAL) == pytest.approx(FLOOR, rel=1e-6) and lr(TOTAL + 50) == pytest.approx(FLOOR)


def test_constant_is_peak_after_warmup_and_schedules_differ_where_they_should():
    wsd, cos, const = _schedule("wsd"), _schedule("cosine"), _schedule("constant")
    for s in (0, 3, 7):  # the same warmup for all
        assert wsd(s) == cos(s) == const(s) == pytest.approx(PEAK * s / WARM, rel=1e-6)
    for s in (WARM, 40, TOTAL - 1, TOTAL, 10 * TOTAL):
        assert const(s) == pytest.approx(PEAK, rel=1e-6)
    # mid-run, cosine has already fallen halfway where wsd is still flat:
    # cosine(55) = FLOOR + (PEAK - FLOOR) * (1 + cos(pi * 45 / 90)) / 2
    assert cos(55) == pytest.approx((PEAK + FLOOR) / 2, rel=1e-6)
    assert wsd(55) == pytest.approx(PEAK, rel=1e-6)
    # at the end both reach the floor; constant does not
    assert cos(TOTAL) == pytest.approx(FLOOR, rel=1e-6) == wsd(TOTAL)
    # no warmup: the peak from the first step
    assert _schedule("constant", warmup=0)(0) == pytest.approx(PEAK, rel=1e-6)


def test_wsd_whole_run_decay_still_reaches_the_floor():
    """decay_fraction 1 (allowed: (0, 1]) decays over every step after warmup."""
    lr = _schedule("wsd", decay_fraction=1.0)
    assert lr(WARM) == pytest.approx(PEAK, rel=1e-6)
    assert lr(TOTAL) == pytest.approx(FLOOR, rel=1e-6)

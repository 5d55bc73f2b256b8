"""The fused AdamW: same numbers as optax's chained AdamW, a real skip, half the
traffic; the weight-decay mask, a bfloat16 first moment, optax optimizers by name;
the learning-rate schedules by their formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmoe import checkpoint
from jaxmoe.config import ConfigError, OptimizerConfig, config_from_dict
from jaxmoe.optim import make_optimizer
from jaxmoe.optim.params import decay_mask
from jaxmoe.optim.schedules import learning_rate_schedule
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import apply_gradients, build_steps

from poison import poison_loss, poisoned

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


def test_the_update_runs_under_a_named_scope():
    """Profiles show the auto-sharded step's optimizer update as `optimizer/...`
    (the ddp step's: test_ddp_step_with_lion_and_bf16_mu_trains_skips_and_restores)."""
    tx, params = make_optimizer(CFG, STEPS), _params()
    update = jax.jit(lambda p, s, g: apply_gradients(tx, p, s, g, jnp.float32(0))[:2])
    assert "optimizer/" in update.lower(params, tx.init(params), params).as_text(debug_info=True)


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


# --- the weight-decay mask, a bfloat16 first moment, optax optimizers by name


def _model_like():
    """Names as jaxmoe's model has them: an embedding, an LM head, a router and
    norms, one stacked over two layers (a norm of rank 2)."""
    ks = jax.random.split(jax.random.key(1), 5)
    return {"embed": jax.random.normal(ks[0], (16, 8)), "head": jax.random.normal(ks[1], (8, 16)),
            "final_norm": {"scale": 1 + 0.1 * jax.random.normal(ks[2], (8,))},
            "moe_layers": {"attn_norm": {"scale": 1 + 0.1 * jax.random.normal(ks[3], (2, 8))},
                           "moe": {"router": {"w": jax.random.normal(ks[4], (2, 8, 4))}}}}


# the default mask, written out: every matrix decays but the embedding; norms never
DEFAULT_MASK = {"embed": False, "head": True, "final_norm": {"scale": False},
                "moe_layers": {"attn_norm": {"scale": False}, "moe": {"router": {"w": True}}}}


def _cfg(**changes):
    return OptimizerConfig(**{**CFG.__dict__, **changes})


def _trajectory(tx, params, steps, grad_scale):
    state, update = tx.init(params), jax.jit(tx.update)
    for i in range(steps):
        g = jax.tree.map(lambda p: jnp.sin(p * (i + 1)) * grad_scale, params)
        # odd steps hand over the norm the train step has already computed
        norm = {"grad_norm": optax.tree.norm(g)} if i % 2 else {}
        u, state = update(g, state, params, **norm)
        params = optax.apply_updates(params, u)
    return params, state


def test_default_adamw_matches_optax_chain_with_the_default_mask():
    assert decay_mask(_model_like(), CFG.no_decay) == DEFAULT_MASK

    def reference(mask):
        return optax.chain(optax.clip_by_global_norm(CFG.grad_clip),
                           optax.scale_by_adam(b1=CFG.b1, b2=CFG.b2, eps=CFG.eps),
                           optax.add_decayed_weights(CFG.weight_decay, mask),
                           optax.scale_by_learning_rate(learning_rate_schedule(CFG, STEPS)))

    ours, _ = _trajectory(make_optimizer(CFG, STEPS), _model_like(), 5, 30.0)
    want, _ = _trajectory(reference(DEFAULT_MASK), _model_like(), 5, 30.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), ours, want)
    # the rank rule (every tensor of rank 2 and up decays) differs on the embedding
    # and on the stacked norm
    by_rank = reference(lambda ps: jax.tree.map(lambda p: p.ndim >= 2, ps))
    other, _ = _trajectory(by_rank, _model_like(), 5, 30.0)
    for key in (("embed",), ("moe_layers", "attn_norm", "scale")):
        a, b = functools.reduce(dict.get, key, ours), functools.reduce(dict.get, key, other)
        assert float(jnp.max(jnp.abs(a - b))) > 1e-4, key


@pytest.mark.parametrize("no_decay, decayed", [
    (("embed",), {"head", "w"}),
    ((), {"embed", "head", "w"}),  # every matrix; the norms still never decay
    (("embed", "*router*"), {"head"}),
])
def test_the_mask_decides_what_weight_decay_shrinks(no_decay, decayed):
    """Zero gradients leave Adam's step at zero: only the decay moves a parameter,
    by (1 - lr * wd) per step."""
    lr, wd, steps = 0.1, 0.5, 2
    cfg = _cfg(no_decay=no_decay, learning_rate=lr, weight_decay=wd, warmup_steps=0,
               schedule="constant")
    tx, params = make_optimizer(cfg, STEPS), _model_like()
    state, p = tx.init(params), params
    for _ in range(steps):
        u, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, p)
        p = optax.apply_updates(p, u)
    for path, new in jax.tree_util.tree_leaves_with_path(p):
        old = functools.reduce(lambda t, k: t[k.key], path, params)
        if path[-1].key in decayed:
            np.testing.assert_allclose(new, old * (1 - lr * wd) ** steps, rtol=1e-6)
        else:
            np.testing.assert_array_equal(new, old)


def test_bfloat16_first_moment_stays_within_its_rounding_of_float32():
    """The stored first moment is rounded to bfloat16, 8 significant bits (relative
    error at most r = 2^-8 / (1 - 2^-8) of the stored value); the update itself runs
    in float32.
    With e_t the first-moment error before step t's update,
    e_t <= b1 (e_{t-1} + r |mu_{t-1}|), and the parameters part by at most
    sum_t lr_t e_t / (c1_t (sqrt(nu_t / c2_t) + eps)), nu being the same in both runs."""
    b1, b2, eps, steps = CFG.b1, CFG.b2, CFG.eps, 6
    schedule = learning_rate_schedule(CFG, STEPS)
    r = 2.0 ** -8 / (1 - 2.0 ** -8)
    txs = [make_optimizer(_cfg(mu_dtype=d), STEPS) for d in ("float32", "bfloat16")]
    p32 = p16 = _params()
    s32, s16 = (tx.init(_params()) for tx in txs)
    assert {m.dtype for m in jax.tree.leaves(s16.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for v in jax.tree.leaves(s16.nu)} == {jnp.dtype(jnp.float32)}
    err = gap = jax.tree.map(jnp.zeros_like, _params())
    for t in range(1, steps + 1):
        g = _grads(t, 0.01)
        err = jax.tree.map(lambda e, m: b1 * (e + r * jnp.abs(m.astype(jnp.float32))), err, s16.mu)
        u, s32 = txs[0].update(g, s32, p32)
        p32 = optax.apply_updates(p32, u)
        u, s16 = txs[1].update(g, s16, p16)
        p16 = optax.apply_updates(p16, u)
        jax.tree.map(np.testing.assert_array_equal, s16.nu, s32.nu)
        lr, c1, c2 = float(schedule(t - 1)), 1 - b1 ** t, 1 - b2 ** t
        gap = jax.tree.map(lambda G, e, v: G + lr * e / (c1 * (jnp.sqrt(v / c2) + eps)),
                           gap, err, s16.nu)
    for a, b, bound in zip(jax.tree.leaves(p16), jax.tree.leaves(p32), jax.tree.leaves(gap)):
        # plus a few float32 ulp per step for the two runs' own rounding
        assert bool(jnp.all(jnp.abs(a - b) <= bound + steps * 4 * 2.0 ** -24 * jnp.abs(b)))
    assert max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(p32))) > 0


def test_an_optax_optimizer_by_name_equals_optax_and_skips():
    cfg = _cfg(name="lion", optax_kwargs={"b2": 0.99}, learning_rate=1e-3)
    ours = make_optimizer(cfg, STEPS)

    def lion(**mask):
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.lion(
            learning_rate_schedule(cfg, STEPS), b2=0.99, weight_decay=cfg.weight_decay, **mask))

    got, state = _trajectory(ours, _model_like(), 4, 30.0)
    want, _ = _trajectory(lion(mask=DEFAULT_MASK), _model_like(), 4, 30.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)
    assert int(state.count) == 4
    unmasked, _ = _trajectory(lion(), _model_like(), 4, 30.0)  # the mask reached optax
    assert float(jnp.max(jnp.abs(unmasked["embed"] - got["embed"]))) > 1e-5
    # a skipped step: zero updates, every leaf of the state as it was
    bad = jax.tree.map(lambda p: p.at[0].set(jnp.nan), got)
    skip = jax.jit(lambda g, s, p: ours.update(g, s, p, skip=jnp.bool_(True)))
    u, skipped = skip(bad, state, got)
    assert all(not np.any(x) for x in jax.tree.leaves(u))
    jax.tree.map(np.testing.assert_array_equal, skipped, state)
    _, poisoned = ours.update(bad, state, got)  # unskipped, the same gradients poison it
    assert not all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(poisoned))
    bf16 = make_optimizer(_cfg(name="lion", mu_dtype="bfloat16"), STEPS).init(_model_like())
    assert {m.dtype for m in jax.tree.leaves(bf16.inner[0].mu)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("raw, key", [
    ({"optax_kwargs": {"b2": 0.99}}, "optimizer.optax_kwargs"),  # jaxmoe's adamw takes none
    ({"name": "lion", "optax_kwargs": [0.99]}, "optimizer.optax_kwargs"),
    ({"no_decay": ["embed", " "]}, "optimizer.no_decay"),
    ({"mu_dtype": "float16"}, "optimizer.mu_dtype"),
    ({"name": "lion", "b1": 0.8}, "optimizer.b1: used by adamw only"),  # would be ignored
])
def test_bad_optimizer_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        config_from_dict({"optimizer": raw})


@pytest.mark.parametrize("raw, key", [
    ({"name": "adamw_typo"}, "optimizer.name"),
    ({"name": "clip_by_global_norm"}, "optimizer.name"),  # a transformation, no optimizer
    ({"name": "lion", "optax_kwargs": {"beta2": 0.99}}, "optimizer.optax_kwargs.beta2"),
    ({"name": "lion", "optax_kwargs": {"b1": "high"}}, "optimizer.optax_kwargs"),
    ({"name": "lion", "optax_kwargs": {"learning_rate": 1.0}},
     "optimizer.optax_kwargs.learning_rate"),
    ({"name": "sgd"}, "optimizer.weight_decay"),  # no weight decay, and 0.1 asked for
    ({"name": "novograd"}, "optimizer.weight_decay"),  # decay without a mask
    ({"name": "sgd", "weight_decay": 0, "mu_dtype": "bfloat16"}, "optimizer.mu_dtype"),
    ({"name": "lbfgs", "weight_decay": 0}, "optimizer.name"),  # its update needs the loss
])
def test_optax_optimizers_that_cannot_run_are_refused_where_built(raw, key):
    """The config loads (it needs no jax); building the optimizer, which build_steps
    does before compiling, names the key."""
    cfg = config_from_dict({"optimizer": raw}).optimizer
    with pytest.raises(ConfigError, match=f"^{key}"):
        make_optimizer(cfg, 10)


def test_optax_kwargs_load_hash_and_round_trip():
    """A dict in a frozen config: set by a dotted override, equal after a round trip
    through to_dict (checkpoints, config.yaml), and hashable (configs are static jit
    arguments)."""
    cfg = config_from_dict({"optimizer": {"name": "sgd", "weight_decay": 0}},
                           ["optimizer.optax_kwargs.momentum=0.9"])
    assert cfg.optimizer.optax_kwargs == {"momentum": 0.9}
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and hash(again) == hash(cfg)


TINY = {"model": {"d_model": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "dispatcher": "dense"},
        "train": {"steps": 4, "batch_size": 8, "seq_len": 16},
        "optimizer": {"warmup_steps": 0}, "mesh": {"data": 8}}


def _tiny(mesh=None, **optimizer):
    return config_from_dict({**TINY, "optimizer": {**TINY["optimizer"], **optimizer},
                             "mesh": mesh or TINY["mesh"]})


def test_settings_checked_against_the_model_and_mesh():
    with pytest.raises(ConfigError, match=r"^optimizer.no_decay: \['embedding'\] match no"):
        cfg = _tiny(no_decay=["embedding"])
        build_steps(cfg, make_mesh(cfg.mesh))
    # adafactor's factored moments and parameter scale are per tensor: the ddp step's
    # per-device shards would each see a part; fsdp updates whole tensors
    cfg = _tiny(name="adafactor")
    with pytest.raises(ConfigError, match="^optimizer.name: adafactor takes statistics"):
        build_steps(cfg, make_mesh(cfg.mesh))
    cfg = _tiny(mesh={"data": 8, "parallelism": "fsdp"}, name="adafactor")
    build_steps(cfg, make_mesh(cfg.mesh))


def test_ddp_step_with_lion_and_bf16_mu_trains_skips_and_restores(tmp_path, monkeypatch):
    """8 devices, ZeRO-1, an optax optimizer with a bfloat16 first moment: its state
    is sharded like the parameters' ZeRO-1 shards, a NaN step changes nothing, the
    checkpoint restores (also into a float32 config, cast) and refuses to resume as
    adamw. The optimizer runs under its own named scope."""
    cfg = _tiny(name="lion", learning_rate=3e-4, mu_dtype="bfloat16")
    poison_loss(monkeypatch)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    rows = np.random.default_rng(0).integers(0, 200, (8, 17)).astype(np.int32)
    tokens = jax.device_put(rows, steps.batch_sharding)
    assert "optimizer/" in steps.train_step.lower(state, tokens).as_text(debug_info=True)
    states, skipped = [jax.device_get(state)], []
    for batch in (rows, poisoned(rows)):  # the second step's loss is NaN
        state, metrics = steps.train_step(state, jax.device_put(batch, steps.batch_sharding))
        states.append(jax.device_get(state))
        skipped.append(int(metrics["skipped"]))
    assert skipped == [0, 1] and int(state.opt_state.count) == 1
    assert not np.array_equal(states[1].params["head"][...], states[0].params["head"][...])
    jax.tree.map(np.testing.assert_array_equal, (states[2].params, states[2].opt_state),
                 (states[1].params, states[1].opt_state))
    mu = state.opt_state.inner[0].mu["moe_layers"]["attn"]["w_q"][...]
    assert mu.dtype == jnp.bfloat16 and "data" in str(mu.sharding.spec)  # a ZeRO-1 shard

    manager = checkpoint.checkpoint_manager(tmp_path, cfg)
    checkpoint.save(manager, state, {"step": 2}, steps)
    manager.wait_until_finished()
    restored, _ = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.opt_state),
                 states[2].opt_state)
    f32 = _tiny(name="lion", learning_rate=3e-4)
    as_f32, _ = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path),
                                   build_steps(f32, make_mesh(f32.mesh)))
    embed_mu = as_f32.opt_state.inner[0].mu["embed"][...]
    assert embed_mu.dtype == jnp.float32
    np.testing.assert_array_equal(embed_mu, states[2].opt_state.inner[0].mu["embed"][...]
                                  .astype(np.float32))
    adamw = _tiny()
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.name: checkpoint 'lion'"):
        checkpoint.restore(checkpoint.checkpoint_dir(tmp_path),
                           build_steps(adamw, make_mesh(adamw.mesh)))

"""Balance losses and load metrics: exact on crafted routings, also under EP."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import checkpoint
from jaxmoe.config import MoEConfig, MeshConfig, config_from_dict
from jaxmoe.load_metrics import gerrymandering, load_metrics
from jaxmoe.model.moe import MoE
from jaxmoe.parallel.layout import GlobalLayout
from jaxmoe.model.router import balance_loss, route
from jaxmoe.sharding import make_mesh
from jaxmoe.step import build_steps, update_expert_bias

E, K = 8, 2


def _np_switch(expert_TxK, probs_TxE, groups):
    T = probs_TxE.shape[0]
    out = []
    for g in range(groups):
        sl = slice(g * T // groups, (g + 1) * T // groups)
        f = np.bincount(expert_TxK[sl].ravel(), minlength=E) / expert_TxK[sl].size
        P = probs_TxE[sl].mean(0)
        out.append(E * np.sum(f * P))
    return np.mean(out)


@pytest.mark.parametrize("groups", [1, 4, 16])  # global, per device (4), per sequence (16)
def test_balance_loss_scopes_match_numpy(groups):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, E)).astype(np.float32) * 2
    logits[:32, 3] += 4  # the first half of the batch prefers expert 3
    r = route(jnp.asarray(logits), MoEConfig(num_experts=E, top_k=K))
    got = float(balance_loss(r, groups))
    want = _np_switch(np.asarray(r.expert_TxK), np.asarray(r.probs_TxE), groups)
    assert got == pytest.approx(want, rel=1e-5)
    if groups > 1:  # the scopes really differ on this routing
        assert abs(got - float(balance_loss(r, 1))) > 1e-3


def _crafted(assign_T, T=64):
    """A routing whose top-1 choices are assign_T with uniform-ish scores."""
    probs = np.full((T, E), 1.0 / E, np.float32)
    expert = np.asarray(assign_T, np.int32)[:, None]
    return expert, probs


@pytest.mark.parametrize("name, assign, max_mean, dead, deficit", [
    ("one expert", np.zeros(64, int), E, E - 1, np.log(E)),
    ("uniform", np.arange(64) % E, 1.0, 0, 0.0),
    ("two dead", np.arange(64) % 6, None, 2, None),  # max/mean checked from the counts below
])
def test_metrics_exact_on_crafted_routings(name, assign, max_mean, dead, deficit):
    expert, probs = _crafted(assign)
    counts = np.bincount(expert.ravel(), minlength=E)
    aux = {"counts_E": counts[None], "prob_sum_E": probs.sum(0)[None],
           "margin_sum": np.zeros(1, np.float32), "dropped": np.zeros(1, np.int32),
           "balance_loss": np.ones(1, np.float32)}
    m = jax.device_get(load_metrics(aux, 64, 1, 2, 0.01))
    assert m["load_max_over_mean"][0] == pytest.approx(counts.max() / counts.mean())
    assert m["dead_experts"][0] == dead
    f = counts / counts.sum()
    ent = -np.sum(f[f > 0] * np.log(f[f > 0]))
    assert m["entropy_deficit"][0] == pytest.approx(np.log(E) - ent, abs=1e-6)
    if deficit is not None:
        assert m["entropy_deficit"][0] == pytest.approx(deficit, abs=1e-6)
        assert m["load_max_over_mean"][0] == pytest.approx(max_mean)
    ranks = counts.reshape(2, E // 2).sum(1)
    assert m["rank_load_max_over_mean"][0] == pytest.approx(ranks.max() / ranks.mean())
    # uniform scores: no covariance and dead experts hold exactly their 1/E share each
    assert m["balance_cov"][0] == pytest.approx(0.0, abs=1e-6)
    assert m["dead_score_mass"][0] == pytest.approx(dead / E)


def _forced_moe(moe_cfg, dead=0):
    """An MoE whose router sends token t to expert t % (E - dead) (input one-hot)."""
    moe = MoE(E, moe_cfg, 0.02, 0.02, nnx.Rngs(0))
    moe.router.w[...] = jnp.eye(E) * 10.0
    T = 64
    x = jax.nn.one_hot(jnp.arange(T) % (E - dead), E).reshape(8, T // 8, E)
    return moe, x


@pytest.mark.parametrize("dead", [0, 3])
def test_metrics_exact_under_expert_parallelism(dead):
    cfg = MoEConfig(num_experts=E, top_k=1, dispatcher="alltoall", capacity_factor=float(E))
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    moe, x = _forced_moe(cfg, dead)
    graphdef, state = nnx.split(moe)

    @jax.jit
    def run(state, x):
        y, aux = nnx.merge(graphdef, state)(x, GlobalLayout(mesh))
        aux = jax.tree.map(lambda a: a[None], aux)
        return load_metrics(aux, 64, 1, mesh.shape["expert"], 0.01)

    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert"))))
    m = jax.device_get(run(state, x))
    counts = np.bincount(np.arange(64) % (E - dead), minlength=E)
    assert m["dead_experts"][0] == dead
    assert m["load_max_over_mean"][0] == pytest.approx(counts.max() / counts.mean())
    ranks = counts.reshape(4, 2).sum(1)
    assert m["rank_load_max_over_mean"][0] == pytest.approx(ranks.max() / ranks.mean())
    assert m["drop_fraction"][0] == 0.0


def test_everything_to_one_expert_under_alltoall_tight_capacity():
    cfg = MoEConfig(num_experts=E, top_k=1, dispatcher="alltoall", capacity_factor=1.0,
                    score_func="softmax", renormalize=False)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    moe = MoE(E, cfg, 0.02, 0.02, nnx.Rngs(0))
    moe.router.w[...] = jnp.zeros((E, E)).at[:, 5].set(10.0)  # every token -> expert 5
    x = jax.random.normal(jax.random.key(0), (8, 8, E)) ** 2 + 0.1  # positive: picks 5
    graphdef, state = nnx.split(moe)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert")))
    y, aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, GlobalLayout(mesh)))(
        state, jax.device_put(x, spec))
    T_local, C = 8, 1  # 64 tokens over 8 devices; capacity ceil(1.0 * 8 * 1 / 8) = 1
    assert int(aux["dropped"]) == 8 * (T_local - C)
    m = load_metrics(jax.tree.map(lambda a: a[None], aux), 64, 1, 4, 0.01)
    assert float(m["drop_fraction"][0]) == pytest.approx(56 / 64)
    y = np.asarray(y).reshape(64, E)
    assert np.isfinite(y).all()
    dense_cfg = dataclasses.replace(cfg, dispatcher="dense")
    dense_graphdef, _ = nnx.split(MoE(E, dense_cfg, 0.02, 0.02, nnx.Rngs(0)))
    ref = np.asarray(nnx.merge(dense_graphdef, state)(x, None)[0]).reshape(64, E)
    kept = np.arange(64) % T_local == 0  # each device's first token is the one kept
    np.testing.assert_allclose(y[kept], ref[kept], rtol=1e-5, atol=1e-6)
    assert np.allclose(y[~kept], 0.0) and not np.allclose(ref[~kept], 0.0)


def test_bias_update_balances_skewed_router():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(512, E)) + np.linspace(0, 2, E), jnp.float32)
    cfg = MoEConfig(num_experts=E, top_k=K, expert_bias=True)
    buffers = {"moe_layers": {"moe": {"router": {"bias": jnp.zeros((1, E))}}}}
    imbalance = []
    for _ in range(60):  # a few dozen steps
        r = route(logits, cfg, buffers["moe_layers"]["moe"]["router"]["bias"][0])
        counts = jnp.zeros((E,), jnp.int32).at[r.expert_TxK.ravel()].add(1)
        imbalance.append(float(counts.max() / counts.mean()))
        buffers = update_expert_bias(buffers, counts[None], 0.005)
    assert imbalance[0] > 1.8 and max(imbalance[-10:]) < 1.25


def _bias_config():
    """One MoE layer with aux-loss-free bias on 8 data-parallel devices."""
    return config_from_dict({
        "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "moe": {"num_experts": 4, "top_k": 1, "expert_hidden": 16, "expert_bias": True,
                "bias_update_rate": 0.01},
        "mesh": {"data": 8}, "train": {"steps": 5, "batch_size": 8, "seq_len": 8},
        "optimizer": {"warmup_steps": 1}})


def test_bias_lives_outside_optimizer_and_survives_checkpoint(tmp_path):
    cfg = _bias_config()
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    assert "bias" not in str(jax.tree_util.tree_structure(state.params))
    batch = jax.device_put(np.arange(8 * 9).reshape(8, 9) % 256, steps.batch_sharding)
    state, _ = steps.train_step(state, batch)
    bias = np.asarray(state.buffers["moe_layers"]["moe"]["router"]["bias"][...])
    assert np.abs(bias).max() == pytest.approx(0.01)
    manager = checkpoint.checkpoint_manager(tmp_path, cfg)
    checkpoint.save(manager, state, {"step": 1}, cfg)
    manager.wait_until_finished()
    restored, data = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)
    np.testing.assert_array_equal(restored.buffers["moe_layers"]["moe"]["router"]["bias"][...], bias)
    assert data == {"step": 1}


def test_gerrymandering_detector():
    honest = [(1.2 - 0.01 * i, 2.0 - 0.05 * i) for i in range(10)]
    gerry = [(1.2 - 0.01 * i, 2.0 + 0.05 * i) for i in range(10)]
    assert gerrymandering(honest) is None
    assert "balance loss fell" in gerrymandering(gerry)


def test_plots_write_pngs(tmp_path):
    import json
    from jaxmoe import plots
    rows = [{"step": s, "balance_loss": 1.1 - 0.01 * s, "load_max_over_mean": [1.0 + 0.1 * s, 1.2],
             "dead_experts": [0, s % 2], "expert_load": [1.0] * 4 + [0.5 * s] * 4}
            for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    for path in (plots.load_heatmaps(tmp_path), plots.balance_vs_imbalance(tmp_path)):
        assert path.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval_ce": 2.0}) + "\n")
    with pytest.raises(ValueError, match="no expert-load records"):
        plots.load_heatmaps(tmp_path)


def test_skipped_step_leaves_bias_untouched():
    cfg = _bias_config()
    batch = np.arange(8 * 9).reshape(8, 9) % 256
    for poison, moved in [(jnp.nan, 0.0), (1.0, 0.01)]:  # a non-finite loss vs a normal one
        steps = build_steps(cfg, make_mesh(cfg.mesh), loss_hook=lambda loss, step: loss * poison)
        state, metrics = steps.train_step(steps.init(jax.random.PRNGKey(0)),
                                          jax.device_put(batch, steps.batch_sharding))
        assert int(metrics["skipped"]) == (poison != 1.0)
        bias = np.asarray(state.buffers["moe_layers"]["moe"]["router"]["bias"][...])
        assert np.abs(bias).max() == pytest.approx(moved)


@pytest.mark.parametrize("weight, flagged", [(0.1, True), (0.0, False)])
def test_monitor_flags_only_a_trained_balance_loss(tmp_path, weight, flagged):
    from jaxmoe.monitor import Monitor
    monitor = Monitor(tmp_path, 100, 0, progress=False)
    for i in range(10):  # balance loss falls while the worst load rises
        loss, load = 1.2 - 0.02 * i, 2.0 + 0.5 * i
        monitor.progress(1, {"step": i, "loss": 3.0, "tokens_per_s": 1.0, "balance_loss": loss,
                             "balance_loss_scaled": [weight * loss], "load_max_over_mean": [load],
                             "dead_experts": [0], "drop_fraction": [0.0]})
    monitor.close()
    assert monitor.flagged is flagged

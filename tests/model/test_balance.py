"""Balance losses and load metrics: exact on crafted routings, also under EP; the
gerrymandering detectors on recorded histories and a real run."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import checkpoint
from jaxmoe.config import MoEConfig, MeshConfig, config_from_dict
from jaxmoe.model.load_metrics import load_metrics
from jaxmoe.model.moe import MoE
from jaxmoe.model.router import balance_loss, route
from jaxmoe.model.router import update_expert_bias
from jaxmoe.observe import gerrymandering as lm
from jaxmoe.observe.gerrymandering import gerrymandering, steady_gerrymandering
from jaxmoe.parallel.layout import GlobalLayout
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps

from poison import poison_loss, poisoned

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
    aux = {"counts": counts[None], "prob_sums": probs.sum(0)[None],
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
    ref = np.asarray(nnx.merge(dense_graphdef, state)(x)[0]).reshape(64, E)
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
    checkpoint.save(manager, state, {"step": 1}, steps)
    manager.wait_until_finished()
    restored, data = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)
    np.testing.assert_array_equal(restored.buffers["moe_layers"]["moe"]["router"]["bias"][...], bias)
    assert data == {"step": 1}


def test_plots_write_pngs(tmp_path):
    from jaxmoe.observe import plots
    rows = [{"step": s, "balance_loss": 1.1 - 0.01 * s, "load_max_over_mean": [1.0 + 0.1 * s, 1.2],
             "dead_experts": [0, s % 2], "expert_load": [1.0] * 4 + [0.5 * s] * 4}
            for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    for path in (plots.load_heatmaps(tmp_path), plots.balance_vs_imbalance(tmp_path)):
        assert path.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval_ce": 2.0}) + "\n")
    with pytest.raises(ValueError, match="no expert-load records"):
        plots.load_heatmaps(tmp_path)


def test_skipped_step_leaves_bias_untouched(monkeypatch):
    cfg = _bias_config()
    poison_loss(monkeypatch)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = np.arange(8 * 9).reshape(8, 9) % 200
    for rows, moved in [(poisoned(batch), 0.0), (batch, 0.01)]:  # a non-finite loss, a normal one
        state, metrics = steps.train_step(steps.init(jax.random.PRNGKey(0)),
                                          jax.device_put(rows, steps.batch_sharding))
        assert int(metrics["skipped"]) == (moved == 0.0)
        bias = np.asarray(state.buffers["moe_layers"]["moe"]["router"]["bias"][...])
        assert np.abs(bias).max() == pytest.approx(moved)


def _record(step, loss_L, load_L, dead_L, deficit_L, E=16, weight=0.1):
    """A logged training record (jaxmoe.train) with the fields the detectors read."""
    L = len(loss_L)
    return {"step": step, "loss": 3.0, "tokens_per_s": 1.0, "balance_loss": sum(loss_L) / L,
            "balance_loss_layer": list(loss_L), "balance_loss_scaled": [weight * x for x in loss_L],
            "load_max_over_mean": list(load_L), "dead_experts": list(dead_L),
            "entropy_deficit": list(deficit_L), "drop_fraction": [0.0] * L,
            "expert_load": [1.0] * (L * E)}


# configs/gerrymander.yaml with train.seed=3 as recorded (its first 200 of 300 steps): per
# MoE layer (2 of them, 16 experts) the balance loss, max/mean load, dead experts and
# entropy deficit.
SEED3 = [
    (10, (1.168, 1.201), (9.42, 9.34), (14, 13), (2.10, 1.83)),
    (20, (1.112, 1.102), (8.86, 9.37), (12, 12), (2.04, 2.04)),
    (30, (1.130, 1.098), (11.40, 9.23), (11, 10), (2.05, 1.62)),
    (40, (1.090, 1.081), (5.82, 6.31), (10, 9), (1.32, 1.53)),
    (50, (1.077, 1.084), (7.86, 5.66), (10, 11), (1.42, 1.50)),
    (60, (1.066, 1.052), (7.77, 5.73), (12, 12), (1.57, 1.42)),
    (70, (1.077, 1.033), (5.05, 6.69), (12, 11), (1.41, 1.32)),
    (80, (1.047, 1.011), (6.27, 6.32), (9, 11), (1.22, 1.41)),
    (90, (1.050, 1.004), (6.20, 11.49), (9, 12), (1.26, 1.97)),
    (100, (1.042, 0.984), (6.15, 9.88), (9, 12), (1.19, 1.70)),
    (110, (1.030, 1.022), (7.86, 7.58), (8, 13), (1.33, 1.72)),
    (120, (1.015, 1.018), (8.20, 8.37), (10, 11), (1.51, 1.67)),
    (130, (1.009, 1.017), (7.36, 7.77), (11, 11), (1.37, 1.85)),
    (140, (1.005, 1.018), (7.90, 8.33), (12, 10), (1.92, 1.68)),
    (150, (1.003, 1.013), (7.97, 6.55), (12, 10), (1.86, 1.31)),
    (160, (1.002, 1.007), (7.38, 13.67), (13, 10), (1.71, 2.19)),
    (170, (1.001, 1.004), (6.93, 16.00), (13, 15), (1.71, 2.77)),
    (180, (1.001, 1.003), (7.19, 16.00), (13, 15), (1.71, 2.77)),
    (190, (1.000, 1.002), (9.27, 16.00), (13, 15), (1.81, 2.77)),
    (200, (1.000, 1.001), (8.70, 16.00), (13, 15), (1.96, 2.77)),
]


def test_falling_loss_detector():
    def history(slope):  # layer 1 is the worst; the mean balance loss falls 0.01 a step
        return [_record(i, [1.2 - 0.01 * i] * 2, [1.5, 2.0 + slope * i], [0, 0], [0.1, 0.1])
                for i in range(10)]
    assert gerrymandering(history(-0.05)) is None
    layer, message = gerrymandering(history(0.05))
    assert layer == 1
    assert message == ("gerrymandering: balance loss fell 1.180 -> 1.130 while max/mean expert "
                       "load rose 2.10 -> 2.35; at step 9 MoE layer 1 has balance loss 1.110, "
                       "max/mean load 2.45, 0 of 16 experts dead, entropy deficit 0.10 nats")
    assert gerrymandering(history(0.05)[1:]) is None  # two windows of 5 needed


BALANCED = dict(loss_L=[1.01], load_L=[2.5], dead_L=[0], deficit_L=[0.08])
FAR = dict(loss_L=[1.02], load_L=[9.0], dead_L=[11], deficit_L=[1.6])


@pytest.mark.parametrize("name, figures, fires", [
    ("far from balanced", FAR, True),
    ("balanced, loss near 1", BALANCED, False),
    ("far, but the loss says so", FAR | {"loss_L": [1.0 + 2 * lm.LOSS_BAND]}, False),
    ("far, loss below 1", FAR | {"loss_L": [0.95]}, True),
    # each sign of imbalance alone, just past its threshold
    ("max/mean", BALANCED | {"load_L": [lm.MAX_OVER_MEAN]}, True),
    ("dead experts", BALANCED | {"dead_L": [4]}, True),  # a quarter of 16
    ("entropy deficit", BALANCED | {"deficit_L": [lm.ENTROPY_DEFICIT]}, True),
    ("all just short", {"loss_L": [1.0 + lm.LOSS_BAND], "load_L": [lm.MAX_OVER_MEAN - 0.01],
                        "dead_L": [3], "deficit_L": [lm.ENTROPY_DEFICIT - 0.01]}, False),
])
def test_steady_state_detector(name, figures, fires):
    records = [_record(s, **figures) for s in range(60, 110, 10)]
    assert (steady_gerrymandering(records, settle=50) is not None) is fires


def test_steady_state_detector_needs_a_settled_persistent_pattern():
    far = [_record(s, **FAR) for s in range(60, 110, 10)]
    assert steady_gerrymandering(far, settle=50) is not None
    assert steady_gerrymandering(far, settle=60) is None  # step 60 is still settling
    assert steady_gerrymandering(far[1:], settle=50) is None  # four logged steps, not five
    one_good = far[:2] + [_record(80, **BALANCED)] + far[3:]
    assert steady_gerrymandering(one_good, settle=50) is None
    # logged every step: five logged steps are not enough, 40 steps are
    every_step = [_record(s, **FAR) for s in range(51, 92)]
    assert steady_gerrymandering(every_step[:-1], settle=50) is None
    assert "over steps 51-91" in steady_gerrymandering(every_step, settle=50)[1]
    # the same layer throughout: layer 0 bad, then layer 1 bad, is no steady state
    swapped = [_record(s, [1.0, 1.0], [9.0, 2.0] if s < 80 else [2.0, 9.0], [0, 0], [0.1, 0.1])
               for s in range(60, 110, 10)]
    assert steady_gerrymandering(swapped, settle=50) is None
    assert lm.settle_step(300) == lm.SETTLE_STEPS and lm.settle_step(10_000) == 1000


def test_recent_history_keeps_what_the_checks_read():
    every_step = [_record(s, **FAR) for s in range(1, 101)]
    assert [r["step"] for r in lm.recent_history(every_step)] == list(range(60, 101))
    sparse = [_record(s, **FAR) for s in range(100, 2100, 100)]
    assert [r["step"] for r in lm.recent_history(sparse)] == list(range(1100, 2100, 100))
    every_third = [_record(s, **FAR) for s in range(3, 151, 3)]  # 3 does not divide 40
    assert [r["step"] for r in lm.recent_history(every_third)][0] == 108  # 150 - 40 = 110


@pytest.mark.parametrize("log_every", range(1, 21))
def test_steady_check_fires_whatever_the_logging_interval(log_every):
    """Far from balanced from the first step: fires at the first logged step at least
    WINDOW records and STEADY_STEPS steps past the settling, as a Monitor keeps them."""
    settle, history, fired = 50, [], None
    for step in range(log_every, 401, log_every):
        history = lm.recent_history(history + [_record(step, **FAR)])
        if steady_gerrymandering(history, settle):
            fired = step
            break
    counted = [s for s in range(log_every, 401, log_every) if s > settle]
    want = next(s for i, s in enumerate(counted)
                if i + 1 >= lm.WINDOW and s - counted[0] >= lm.STEADY_STEPS)
    assert fired == want


def test_steady_state_message_names_layer_and_figures():
    records = [_record(*row) for row in SEED3[:11]]  # steps 10-110
    layer, message = steady_gerrymandering(records[:10], settle=50)  # steps 60-100 count
    assert layer == 0
    assert message == ("gerrymandering: MoE layer 0's balance loss sits near its balanced 1.0 "
                       "(1.042-1.077) over steps 60-100 while its load is far from balanced: "
                       "max/mean 5.05-7.77, 9-12 of 16 experts dead, entropy deficit "
                       "1.19-1.57 nats")
    assert steady_gerrymandering(records[:9], settle=50) is None  # steps 60-90: too few


class _Sink:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)

    def close(self):
        pass


def test_monitor_reports_each_kind_once(tmp_path, capsys):
    """The recorded seed-3 history: the steady state shows at step 100, a falling loss
    at 120; each is reported once, in the log, metrics.jsonl and the sinks."""
    from jaxmoe.observe.monitor import Monitor
    from jaxmoe.observe.sinks import scalars
    sink = _Sink()
    monitor = Monitor(tmp_path, 300, 0, progress=False, sinks=[sink])
    for row in SEED3:
        monitor.progress(10, _record(*row))
    monitor.close()
    assert monitor.flagged == {"steady", "falling"}
    log = [line for line in capsys.readouterr().out.splitlines() if "gerrymandering" in line]
    assert len(log) == 2
    assert log[0].startswith("warning at step 100: gerrymandering: MoE layer 0's balance loss")
    assert log[1].startswith("warning at step 120: gerrymandering: balance loss fell 1.079 -> "
                             "1.022 while max/mean expert load rose 8.01 -> 8.78; at step 120 "
                             "MoE layer 1 has balance loss 1.018")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == sink.records
    assert [(r["step"], r["warning"]) for r in records] == [(100, log[0][21:]), (120, log[1][21:])]
    assert records[0]["gerrymander_steady"] == [1.0, 0.0]
    assert records[1]["gerrymander_falling"] == [0.0, 1.0]
    assert scalars(records[0]) == {"gerrymander_steady/layer0": 1.0,
                                   "gerrymander_steady/layer1": 0.0}  # no text for the sinks


@pytest.mark.parametrize("weight, flagged", [(0.1, {"falling", "steady"}), (0.0, set())])
def test_monitor_flags_only_a_trained_balance_loss(tmp_path, weight, flagged):
    from jaxmoe.observe.monitor import Monitor
    monitor = Monitor(tmp_path, 100, 0, progress=False)
    for i in range(6, 16):  # balance loss falls to near 1 while the worst load rises
        monitor.progress(10, _record(10 * i, [1.2 - 0.02 * i], [2.0 + 0.5 * i], [0], [0.6],
                                     weight=weight))
    monitor.close()
    assert monitor.flagged == flagged


@pytest.mark.slow
def test_gerrymander_config_flags_the_steady_state(tmp_path):
    """configs/gerrymander.yaml on seed 3, cut down (one MoE layer, 100 steps of 8 x 32
    tokens, logged every step): the Switch loss sits near 1 while experts lie dead."""
    from jaxmoe.config import load_config
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.train import train
    cfg = load_config(Path(__file__).parents[2] / "configs" / "gerrymander.yaml", [
        "train.seed=3", "train.steps=100", "train.batch_size=8", "train.seq_len=32",
        "model.num_layers=2", "logging.log_every=1", f"train.run_dir={tmp_path}"])
    train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (warning,) = [r for r in records if "gerrymander_steady" in r]  # once
    assert warning["step"] > lm.settle_step(100) + lm.STEADY_STEPS
    assert warning["gerrymander_steady"] == [1.0] and "MoE layer 0" in warning["warning"]
    logged = {r["step"]: r for r in records if "balance_loss_layer" in r}
    for step in range(warning["step"] - lm.STEADY_STEPS, warning["step"] + 1):
        r = logged[step]
        assert r["balance_loss_layer"][0] <= 1.0 + lm.LOSS_BAND
        assert (r["load_max_over_mean"][0] >= lm.MAX_OVER_MEAN or r["dead_experts"][0] >= 4
                or r["entropy_deficit"][0] >= lm.ENTROPY_DEFICIT)


def test_plots_cli_names_a_missing_run(tmp_path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "jaxmoe.observe.plots", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"{tmp_path / 'metrics.jsonl'} does not exist" in result.stderr

"""The model: MoE dispatch paths agree, drops are counted, attention is causal,
router jitter is the configured noise and only in training."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import MoEConfig, config_from_dict
from jaxmoe.model.dispatch import capacity, dense_dispatch, grouped_dispatch
from jaxmoe.model.experts import ExpertWeights
from jaxmoe.model.router import route
from jaxmoe.model.transformer import Transformer

T, D, F, E, K = 48, 16, 24, 8, 2


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, D))
    logits = jax.random.normal(ks[1], (T, E)) * 2
    w = ExpertWeights(jax.random.normal(ks[2], (E, D, 2 * F)) * 0.2,
                      jax.random.normal(ks[3], (E, F, D)) * 0.2)
    return x, logits, w


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_grouped_equals_dense_outputs_and_grads(score_func):
    cfg = MoEConfig(num_experts=E, top_k=K, score_func=score_func, capacity_factor=E / K)
    x, logits, w = _inputs()

    def loss(dispatch, x, logits, w):
        out = dispatch(x, route(logits, cfg), w, cfg)
        return jnp.sum(jnp.sin(out.y_TxD)), out.dropped

    results = {}
    for name, fn in [("dense", dense_dispatch), ("grouped", grouped_dispatch)]:
        (val, dropped), grads = jax.value_and_grad(
            lambda *a: loss(fn, *a), argnums=(0, 1, 2), has_aux=True)(x, logits, w)
        assert int(dropped) == 0
        results[name] = (val, grads)
    chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    jax.tree.map(chex_close, results["dense"], results["grouped"])
    # and the comparison can fail: a different routing gives a different result
    other = loss(grouped_dispatch, x, logits.at[:, 0].add(5.0), w)[0]
    assert abs(float(other) - float(results["dense"][0])) > 1e-3


def test_grouped_counts_drops_exactly():
    cfg = MoEConfig(num_experts=E, top_k=K, capacity_factor=1.0)
    x, _, w = _inputs()
    # every token's first choice is expert 0 and second choice expert 1
    logits = jnp.zeros((T, E)).at[:, 0].set(10.0).at[:, 1].set(5.0)
    C = capacity(T, K, E, cfg.capacity_factor)
    out = grouped_dispatch(x, route(logits, cfg), w, cfg)
    assert int(out.dropped) == 2 * (T - C)
    # kept copies are the first C tokens of each expert: their outputs match dense
    ref = dense_dispatch(x, route(logits, cfg), w, cfg).y_TxD
    np.testing.assert_allclose(out.y_TxD[:C], ref[:C], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.y_TxD[C:], 0.0)  # both copies dropped
    assert not np.allclose(ref[C:], 0.0)


def test_route_bias_selects_but_does_not_weight():
    cfg = MoEConfig(num_experts=E, top_k=1, renormalize=False)
    logits = jnp.zeros((4, E)).at[:, 3].set(1.0)
    bias = jnp.zeros((E,)).at[5].set(1.0)
    r = route(logits, cfg, bias)
    assert (r.expert_TxK[:, 0] == 5).all()
    np.testing.assert_allclose(r.gate_TxK[:, 0], jax.nn.softmax(logits, -1)[:, 5])


@pytest.mark.parametrize("k", [1, 2, E])
def test_route_margin_is_kth_minus_next_score(k):
    cfg = MoEConfig(num_experts=E, top_k=k, score_func="sigmoid")
    _, logits, _ = _inputs(3)
    logits = logits.at[0, :3].set(5.0)  # a three-way tie at the top of token 0
    r = route(logits, cfg)
    ranked = -np.sort(-np.asarray(jax.nn.sigmoid(logits)), axis=-1)
    expected = ranked[:, k - 1] - ranked[:, k] if k < E else np.zeros(T)
    np.testing.assert_allclose(r.margin_T, expected, atol=1e-6)
    if k < 3:  # tied with the runner-up: no margin
        assert float(r.margin_T[0]) == 0.0
    assert float(jnp.min(r.margin_T[1:])) >= 0 and (k == E or float(jnp.max(r.margin_T)) > 0)


def _groups_reference(scores, bias, groups, kept, k):
    """Group-limited top-k for one token, written out: DeepSeek-V3's rule."""
    choice = scores + bias
    per = len(choice) // groups
    group_score = [sum(sorted(choice[g * per:(g + 1) * per])[-2:]) for g in range(groups)]
    best = sorted(range(groups), key=lambda g: -group_score[g])[:kept]
    allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
    return set(sorted(allowed, key=lambda e: -choice[e])[:k])


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_group_limited_routing_is_deepseek_v3_s(score_func):
    """Experts in 4 groups of 2, each token's 2 best groups, top-2 inside: the same
    experts and gates as a written-out reference, as transformers' GLM-4.5 and
    DeepSeek-V3 routers (fed the same logits), and not those of ungrouped top-k."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = MoEConfig(num_experts=E, top_k=K, score_func=score_func, routing_groups=4,
                    groups_per_token=2, gate_scale=1.5, expert_bias=True)
    _, logits, _ = _inputs(7)
    bias = 0.3 * jax.random.normal(jax.random.key(8), (E,))
    r = route(logits, cfg, bias)
    scores = np.asarray(jax.nn.sigmoid(logits) if score_func == "sigmoid"
                        else jax.nn.softmax(logits, -1), np.float64)
    chosen = [set(np.asarray(row).tolist()) for row in r.expert_TxK]
    assert chosen == [_groups_reference(s, np.asarray(bias), 4, 2, K) for s in scores]
    picked = np.take_along_axis(scores, np.asarray(r.expert_TxK), -1)
    np.testing.assert_allclose(r.gate_TxK, 1.5 * picked / picked.sum(-1, keepdims=True),
                               rtol=1e-6)
    assert np.all(np.isfinite(r.margin_T)) and float(np.min(r.margin_T)) >= 0
    # one kept group of 2 holds exactly the K chosen: no runner-up, no margin (not inf)
    one = route(logits, MoEConfig(num_experts=E, top_k=K, score_func=score_func,
                                  routing_groups=4, groups_per_token=1), bias)
    np.testing.assert_array_equal(one.margin_T, 0.0)
    ungrouped = route(logits, MoEConfig(num_experts=E, top_k=K, score_func=score_func,
                                        expert_bias=True), bias)
    differs = [set(np.asarray(a).tolist()) != set(np.asarray(b).tolist())
               for a, b in zip(r.expert_TxK, ungrouped.expert_TxK)]
    assert 0 < sum(differs) < T  # the groups change some tokens' experts, not all
    if score_func == "softmax":
        return  # transformers' group-limited routers score with a sigmoid
    import importlib
    for module, family in (("glm4_moe", "Glm4Moe"), ("deepseek_v3", "DeepseekV3")):
        config = getattr(transformers, f"{family}Config")(
            hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
            routed_scaling_factor=1.5, norm_topk_prob=True)
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        router = getattr(modeling, f"{family}TopkRouter")(config)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))  # its logits are the input
            router.e_score_correction_bias.copy_(torch.tensor(np.array(bias)))
            out = router(torch.as_tensor(np.asarray(logits)))
        weights, indices = out[-2].numpy(), out[-1].numpy()
        order = np.argsort(indices, -1)
        ours = np.argsort(np.asarray(r.expert_TxK), -1)
        np.testing.assert_array_equal(np.take_along_axis(indices, order, -1),
                                      np.take_along_axis(np.asarray(r.expert_TxK), ours, -1))
        np.testing.assert_allclose(np.take_along_axis(weights, order, -1),
                                   np.take_along_axis(np.asarray(r.gate_TxK), ours, -1),
                                   rtol=1e-6)


def test_group_limited_routing_through_dense_and_grouped():
    """The groups choose the experts before dispatch: dense and grouped agree on them
    (the expert-parallel dispatchers: tests/parallel/test_ep_dispatch.py)."""
    cfg = MoEConfig(num_experts=E, top_k=K, capacity_factor=E / K, routing_groups=4,
                    groups_per_token=1)
    x, logits, w = _inputs(9)
    r = route(logits, cfg)
    assert all(len({int(e) // 2 for e in row}) == 1 for row in np.asarray(r.expert_TxK))
    np.testing.assert_allclose(grouped_dispatch(x, r, w, cfg).y_TxD,
                               dense_dispatch(x, r, w, cfg).y_TxD, rtol=1e-5, atol=1e-5)


def test_routing_compiles_without_a_full_sort():
    """Routing runs XLA's top-k, never a sort of whole rows (about 20x slower at 128
    experts on XLA:CPU; reading the (K+1)-th top-k score once made jax 0.10 sort)."""
    cfg = MoEConfig(num_experts=128, top_k=4, expert_bias=True)
    logits = jax.random.normal(jax.random.key(0), (64, 128))
    hlo = jax.jit(lambda l, b: route(l, cfg, b)).lower(logits, jnp.zeros(128)).compile().as_text()
    assert " sort(" not in hlo
    # companion: a sort of the rows is seen
    slow = jax.jit(lambda l: jnp.sort(l)[:, -5]).lower(logits).compile().as_text()
    assert " sort(" in slow


@pytest.fixture(scope="module")
def small_model():
    cfg = config_from_dict({
        "model": {"d_model": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                  "num_dense_layers": 1, "mlp_hidden": 64},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "capacity_factor": 2.0,
                "shared_expert_hidden": 32}})
    return cfg, Transformer.of(cfg, nnx.Rngs(0))


def test_causal(small_model):
    cfg, model = small_model
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
    changed = tokens.at[:, 15].set((tokens[:, 15] + 7) % 256)
    fwd = jax.jit(lambda t: model(t)[0])
    a, b = fwd(tokens), fwd(changed)
    np.testing.assert_allclose(a[:, :15], b[:, :15], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 15:], b[:, 15:], atol=1e-3)


def test_remat_modes_agree(small_model):
    cfg, model = small_model
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, remat):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens, remat=remat)
        return jnp.mean(logits ** 2) + jnp.mean(aux["balance_loss"])

    ref = jax.grad(loss)(params, "none")
    for mode in ["full", "matmuls"]:
        got = jax.grad(loss)(params, mode)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), ref, got)


def test_aux_reports_every_moe_layer(small_model):
    cfg, model = small_model
    tokens = jnp.zeros((2, 8), jnp.int32)
    _, aux = model(tokens)
    assert aux["counts"].shape == (cfg.num_moe_layers, cfg.moe.num_experts)
    assert (aux["counts"].sum(-1) == 2 * 8 * cfg.moe.top_k).all()


def test_blockwise_attention_equals_fused_in_less_memory():
    from jaxmoe.model.blockwise_attention import blockwise_attention
    ks = jax.random.split(jax.random.key(3), 3)
    B, L, H, G, K = 2, 64, 4, 2, 16  # grouped-query: 2 heads per KV head
    q = jax.random.normal(ks[0], (B, L, H, K))
    k, v = (jax.random.normal(kk, (B, L, G, K)) for kk in ks[1:])
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    blocks = lambda q, k, v: blockwise_attention(q, k, v, 16)  # noqa: E731
    np.testing.assert_allclose(blocks(q, k, v), dense(q, k, v), atol=2e-6)
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1, 2))(q, k, v)  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), grad(blocks), grad(dense))
    # teeth: the causal mask matters on these inputs
    assert not np.allclose(jax.nn.dot_product_attention(q, k, v), dense(q, k, v), atol=1e-2)
    # the point: scores of one block at a time, not L x L (forward and backward)
    L2 = 1024
    shapes = [jax.ShapeDtypeStruct((1, L2, H, K), jnp.float32)] + \
        [jax.ShapeDtypeStruct((1, L2, G, K), jnp.float32)] * 2
    temp = {name: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), (0, 1, 2))).lower(*shapes)
            .compile().memory_analysis().temp_size_in_bytes
            for name, fn in [("dense", dense), ("blocks", lambda *a: blockwise_attention(*a, 128))]}
    assert temp["blocks"] * 4 < temp["dense"], temp


def test_chunked_loss_equals_whole_in_less_memory():
    cfg = config_from_dict({"model": {"num_layers": 2, "d_model": 32, "num_heads": 2,
                                      "num_kv_heads": 1, "vocab_size": 4096},
                            "moe": {"num_experts": 4, "expert_hidden": 32, "dispatcher": "dense"},
                            "train": {"seq_len": 64}})
    model = Transformer.of(cfg, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(4), (2, 65), 0, 4096)

    def loss(params, chunk):
        m = nnx.merge(graphdef, params, rest)
        x, _ = m.hidden(tokens[:, :-1])
        return m.cross_entropy(x, tokens[:, 1:], chunk=chunk)

    value_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (whole, g_whole), (chunked, g_chunked) = value_grad(params, 0), value_grad(params, 16)
    assert float(chunked) == pytest.approx(float(whole), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 g_chunked, g_whole)
    temp = {c: value_grad.lower(params, c).compile().memory_analysis().temp_size_in_bytes
            for c in (0, 8)}
    assert temp[8] * 2 < temp[0], temp  # [2, 64, 4096] logits (and their gradient) never whole


# --- router jitter: multiplicative uniform noise on the router's input, training only

JITTER = 0.1


def _identity_router(jitter):
    """A router whose weight is the identity, so its logits are its (jittered) input."""
    from jaxmoe.model.router import Router
    cfg = MoEConfig(num_experts=E, top_k=K, router_jitter=jitter)
    router = Router(E, cfg, 0.02, nnx.Rngs(0))
    router.w[...] = jnp.eye(E)
    return router


def test_router_jitter_is_uniform_in_the_configured_band():
    """jitter eps multiplies each input element by its own U[1 - eps, 1 + eps]."""
    x_TxD = jax.random.normal(jax.random.key(5), (512, E)) + 3.0  # away from 0: a clean ratio
    router = _identity_router(JITTER)
    clean = router(x_TxD).logits_TxE
    np.testing.assert_array_equal(clean, x_TxD)  # the identity weight: logits are the input
    ratio = np.asarray(router(x_TxD, jax.random.key(6)).logits_TxE / x_TxD)
    # f32 division of a product of f32s: a few ulps of 1 either side
    tol = 4 * np.finfo(np.float32).eps
    assert ratio.min() >= 1 - JITTER - tol and ratio.max() <= 1 + JITTER + tol
    # 4096 draws fill the band: P(no draw in an edge strip of width eps/50) = 0.99**4096 ~ 1e-18
    assert ratio.min() < 1 - JITTER * 0.98 and ratio.max() > 1 + JITTER * 0.98
    # uniform, not two-valued or clustered: each quarter of the band holds ~1/4 of the draws
    quarters = np.histogram(ratio, bins=4, range=(1 - JITTER - tol, 1 + JITTER + tol))[0]
    np.testing.assert_allclose(quarters / ratio.size, 0.25, atol=0.04)  # 6 sigma at n = 4096
    # one factor per element, not one per token
    assert np.all(ratio.std(axis=1) > 0)


def test_router_jitter_only_with_a_key_and_a_positive_setting():
    x_TxD = jax.random.normal(jax.random.key(7), (T, E))
    key = jax.random.key(8)
    jittered, off = _identity_router(JITTER), _identity_router(0.0)
    clean = off(x_TxD)
    # no key (evaluation), or jitter 0 with a key: routing identical, bit for bit
    for routing in (jittered(x_TxD), off(x_TxD, key)):
        jax.tree.map(np.testing.assert_array_equal, routing, clean)
    # with a key: the same key gives the same noise, another key another
    a, b = jittered(x_TxD, key), jittered(x_TxD, key)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    other = jittered(x_TxD, jax.random.key(9))
    assert not np.array_equal(a.logits_TxE, other.logits_TxE)
    assert not np.array_equal(a.logits_TxE, clean.logits_TxE)


def _first_step_losses(jitter):
    """Loss of one train step from the same state at steps 0, 0 and 1, and eval's ce."""
    from jaxmoe.eval import heldout
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps
    cfg = config_from_dict({
        "model": {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "moe": {"num_experts": 4, "top_k": 1, "expert_hidden": 16, "dispatcher": "dense",
                "router_jitter": jitter},
        "train": {"steps": 4, "batch_size": 8, "seq_len": 16},
        "optimizer": {"warmup_steps": 1}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    batch = jax.device_put(jax.random.randint(jax.random.key(1), (8, 17), 0, 256),
                           steps.batch_sharding)
    # the step donates its state: each call gets a fresh copy
    at = lambda s: jax.tree.map(jnp.copy, state)._replace(step=jnp.int32(s))  # noqa: E731
    losses = [float(steps.train_step(at(s), batch)[1]["ce"]) for s in (0, 0, 1)]
    return losses, heldout.nats(steps, state, [np.asarray(batch)]) / (8 * 16)


@pytest.mark.slow  # two train steps to compile
def test_train_step_jitter_is_keyed_by_the_step():
    """The train step's jitter key is fold_in(key, step): deterministic per step, new
    noise each step; without jitter the step number does not touch the loss."""
    (a, again, next_step), eval_jittered = _first_step_losses(0.5)
    assert a == again and a != next_step
    (a0, again0, next0), eval_plain = _first_step_losses(0.0)
    assert a0 == again0 == next0
    assert a != a0  # the jitter did reach the loss
    # evaluation never jitters: same parameters (jitter does not touch init), same ce
    assert eval_jittered == pytest.approx(eval_plain, rel=1e-6)

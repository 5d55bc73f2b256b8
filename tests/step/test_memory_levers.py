"""The memory levers the large configs pull (`train.grad_reduce_dtype`,
`train.grad_accum_dtype`, `train.dense_mlp_chunk`), each against the unchanged computation within a
tolerance derived from its arithmetic, and each tolerance shown tight enough to
catch a dropped or doubled term. 8 fake CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmoe.checkpoint import abstract_target
from jaxmoe.config import ConfigError, MeshConfig, config_from_dict
from jaxmoe.model.transformer import Transformer
from jaxmoe.parallel import ddp
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps

U_BF16 = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, round to nearest


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k roundings."""
    return k * u / (1 - k * u)


def test_bf16_reduce_scatter_within_its_rounding_bound():
    """A reduce-scatter of 8 devices' bf16 gradients in bf16: each element's sum is
    at most 7 bf16 additions, so it lies within gamma_7 x sum_i |g_i| of the exact
    sum (Higham, recursive summation, any order). The same reduction in fp32 is
    within gamma_7 at fp32's 2^-24, which the bf16 result exceeds somewhere: the
    dtype is really bf16. Dropping or doubling one device's term breaks the bound."""
    n = 8
    mesh = make_mesh(MeshConfig(data=n))
    r = ddp.reduction(P(), P("data"), mesh)  # replicated, its optimizer state split over data
    rng = np.random.default_rng(0)
    g_NxRxC = jnp.asarray(rng.standard_normal((n, 16, 8)), jnp.bfloat16)

    def reduced(dtype):
        def local(g):
            return ddp.reduce_gradient(ddp.to_per_device(g[0].astype(dtype), r), r)
        f = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        return np.asarray(jax.jit(f)(g_NxRxC).astype(jnp.float32), np.float64)

    terms = np.asarray(g_NxRxC.astype(jnp.float32), np.float64)
    exact, magnitude = terms.sum(0), np.abs(terms).sum(0)
    bound = _gamma(n - 1, U_BF16) * magnitude
    bf16 = reduced(jnp.bfloat16)
    assert np.all(np.abs(bf16 - exact) <= bound)
    fp32 = reduced(jnp.float32)
    fp32_bound = _gamma(n - 1, 2.0 ** -24) * magnitude
    assert np.all(np.abs(fp32 - exact) <= fp32_bound)
    assert np.any(np.abs(bf16 - exact) > fp32_bound)
    for wrong in (exact - terms[3], exact + terms[3]):
        assert np.any(np.abs(bf16 - wrong) > bound)


BASE = {
    "model": {"d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64, "compute_dtype": "bfloat16"},
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 4.0,
            "dispatcher": "alltoall", "balance_scope": "global"},
    "train": {"steps": 10, "batch_size": 16, "seq_len": 16},
    "mesh": {"data": 4, "expert": 2},
    # no clip: the first step's first moment is exactly (1 - b1) x the gradient
    "optimizer": {"warmup_steps": 0, "grad_clip": 0.0},
}
TOKENS = np.random.default_rng(1).integers(0, 256, (16, 17)).astype(np.int32)


def _first_gradients(reduce_dtype: str):
    """(the ddp step's first gradient, how many of its reduce-scatters are bf16 as
    lowered: XLA:CPU may widen them again, a GPU sends them as bf16)."""
    cfg = config_from_dict({**BASE, "train": {**BASE["train"], "grad_reduce_dtype": reduce_dtype}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = jax.device_put(TOKENS, steps.batch_sharding)
    lowered = steps.train_step.lower(abstract_target(steps), batch).as_text()
    # each op's operand type follows its reduction region
    types = re.findall(r"stablehlo\.reduce_scatter.*?\}\) : \(tensor<[0-9x]*(\w+)>", lowered, re.S)
    bf16_scatters = types.count("bf16")
    state, _ = steps.train_step(steps.init(jax.random.PRNGKey(0)), batch)
    b1 = 0.9
    grads = jax.tree.map(lambda m: np.asarray(m) / (1 - b1), jax.device_get(state.opt_state.mu))
    return grads, bf16_scatters


def test_bf16_gradient_reduction_step():
    """The ddp step with `grad_reduce_dtype: bfloat16` against the same step reducing
    in fp32: each matrix's gradient sums n = 8 (dense) or 4 (experts) device terms
    in bf16, within gamma_7 of sum_i |g_i|, which a tensor's largest term bounds
    where the devices' gradients agree in sign (a typical bound: first-step
    gradients of i.i.d. shards do). A device's term missing or counted twice is
    1/8 of the gradient, far outside it. Its reduce-scatters are bf16, and the
    results differ."""
    got, bf16_scatters = _first_gradients("bfloat16")
    want, fp32_bf16_scatters = _first_gradients("float32")
    _assert_within_and_caught(got, want, _gamma(7, U_BF16), terms=8)
    assert bf16_scatters > 0 and fp32_bf16_scatters == 0


def _assert_within_and_caught(got, want, tol: float, terms: int):
    """Every gradient within `tol` relative, and `tol` of its tensor's largest entry;
    one of the `terms` summed terms missing or counted twice fails that; and the two
    differ somewhere (they are different computations)."""
    def close(g, w, scale=1.0):
        np.testing.assert_allclose(scale * g, w, rtol=tol, atol=tol * float(np.abs(w).max()))

    jax.tree.map(close, got, want)
    for wrong in ((terms - 1) / terms, (terms + 1) / terms):
        with pytest.raises(AssertionError):
            jax.tree.map(lambda g, w: close(g, w, wrong), got, want)
    assert any(jax.tree.leaves(jax.tree.map(lambda g, w: bool(np.any(g != w)), got, want)))


def _accumulated_gradients(accum_dtype: str):
    """The ddp step's first gradient summed over 4 slices in `accum_dtype`."""
    cfg = config_from_dict({**BASE, "train": {**BASE["train"], "batch_size": 32,
                                              "accumulation_steps": 4,
                                              "grad_accum_dtype": accum_dtype}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    tokens = np.random.default_rng(2).integers(0, 256, (32, 17)).astype(np.int32)
    state, _ = steps.train_step(steps.init(jax.random.PRNGKey(0)),
                                jax.device_put(tokens, steps.batch_sharding))
    b1 = 0.9  # the first step's first moment is (1 - b1) x the gradient (no clip)
    return jax.tree.map(lambda m: np.asarray(m) / (1 - b1), jax.device_get(state.opt_state.mu))


def test_bf16_gradient_accumulation_within_its_rounding_bound():
    """`grad_accum_dtype: bfloat16` against fp32 sums of the same 4 slices' gradients
    (bf16 already: the compute dtype's): each device's sum is 3 bf16 additions, within
    gamma_3 of sum_i |g_i| (Higham), which a tensor's largest term bounds where the
    slices' gradients agree in sign (first-step gradients of i.i.d. slices do); the
    device sums are then reduced alike in both. A slice missing or counted twice is
    about a quarter of the gradient, far outside; and the two differ."""
    got, want = _accumulated_gradients("bfloat16"), _accumulated_gradients("float32")
    _assert_within_and_caught(got, want, _gamma(3, U_BF16), terms=4)


def test_grad_reduce_dtype_needs_the_ddp_step():
    with pytest.raises(ConfigError, match="train.grad_reduce_dtype"):
        config_from_dict({**BASE, "mesh": {**BASE["mesh"], "parallelism": "fsdp"},
                          "train": {**BASE["train"], "grad_reduce_dtype": "bfloat16"}})


def _dense_grads(chunk: int, params=None):
    cfg = config_from_dict({**BASE, "model": {**BASE["model"], "compute_dtype": "float32"},
                            "mesh": {"data": 1}, "moe": {**BASE["moe"], "dispatcher": "grouped"},
                            "train": {**BASE["train"], "dense_mlp_chunk": chunk}})
    graphdef, init_params, rest = nnx.split(Transformer.of(cfg, nnx.Rngs(0)), nnx.Param, ...)
    params = init_params if params is None else params

    def loss(p):
        logits, _ = nnx.merge(graphdef, p, rest)(jnp.asarray(TOKENS[:, :-1]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    # the loops over the 16 / chunk chunks in the gradient's program
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    chunk_scans = jaxpr.count(f"length={16 // chunk}") if chunk else 0
    return params, jax.device_get(jax.jit(jax.grad(loss))(params)), chunk_scans


def test_dense_mlp_in_chunks_equals_at_once():
    """The dense MLP 4 positions at a time (each chunk recomputed) gives the same
    gradients: the per-position math is unchanged and the weight gradients' fp32
    sums over 256 tokens are only regrouped (gamma_256 at 2^-24, 2^-16 relative,
    bounds them); a chunk's tokens dropped or counted twice move the dense MLP's
    weight gradients by ~1/4."""
    params, want, _ = _dense_grads(0)
    _, got, chunk_scans = _dense_grads(4, params)
    assert chunk_scans >= 2  # the chunks' forward and backward loops: chunking is on
    tol = 2.0 ** -16

    def close(g, w, scale=1.0):
        np.testing.assert_allclose(scale * g, w, rtol=tol, atol=tol * float(np.abs(w).max()))

    jax.tree.map(close, got, want)
    mlp_got, mlp_want = got["dense_layers"]["mlp"], want["dense_layers"]["mlp"]
    for wrong in (3 / 4, 5 / 4):
        with pytest.raises(AssertionError):
            jax.tree.map(lambda g, w: close(g, w, wrong), mlp_got, mlp_want)


def test_dense_mlp_chunk_must_divide_the_sequence():
    with pytest.raises(ConfigError, match="train.dense_mlp_chunk: 5 does not divide"):
        config_from_dict({**BASE, "train": {**BASE["train"], "dense_mlp_chunk": 5}})

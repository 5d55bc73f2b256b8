"""Multi-head latent attention (`model.attention: mla`): under ddp, expert parallelism
and a sequence split it trains as one device does; decoding from its latent cache
equals the uncached forward; each with a companion that breaks it."""

import jax
import numpy as np
import pytest

import jaxmoe
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.generate import generate
from jaxmoe.model import kv_cache


from one_device import first_step, matches

MLA = {"attention": "mla", "qk_norm": "none", "num_heads": 4, "num_kv_heads": 4,
       "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 6, "rope_interleave": True, "yarn_factor": 4.0,
       "yarn_original_max_positions": 8, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.8}
BASE = {
    "model": {"d_model": 32, "num_layers": 3, "num_dense_layers": 1, "mlp_hidden": 64, **MLA},
    # DeepSeek-V3's router; capacity for every copy, as the one-device reference
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "shared_expert_hidden": 32, "score_func": "sigmoid", "expert_bias": True,
            "routing_groups": 4, "groups_per_token": 2, "gate_scale": 2.5,
            "balance_scope": "sequence"},
    "train": {"steps": 10, "batch_size": 8, "seq_len": 32, "accumulation_steps": 1},
    "optimizer": {"warmup_steps": 0, "learning_rate": 1e-2, "grad_clip": 0.0},
}


def _cfg(mesh, dispatcher="dense", **model):
    return config_from_dict({**BASE, "model": {**BASE["model"], **model}, "mesh": mesh,
                             "moe": {**BASE["moe"], "dispatcher": dispatcher}})


@pytest.fixture(scope="module")
def one_device():
    return first_step(_cfg({"data": 1}))


@pytest.mark.parametrize("mesh, dispatcher", [
    ({"data": 2, "expert": 4}, "alltoall"),
    ({"data": 1, "expert": 8}, "ragged"),
    ({"data": 2, "context": 2, "expert": 2}, "allgather"),
])
def test_latent_attention_trains_as_one_device(one_device, mesh, dispatcher):
    matches(first_step(_cfg(mesh, dispatcher)), one_device)


def test_latent_attention_against_its_pieces(one_device):
    """Companion: the same model without the query LoRA, or with rotate-half RoPE pairs,
    is another model (its step differs), so the checks above see what MLA computes."""
    for other in ({"q_lora_rank": 0}, {"rope_interleave": False}, {"yarn_factor": 0.0}):
        with pytest.raises(AssertionError):
            matches(first_step(_cfg({"data": 1}, **other)), one_device)


def test_decoding_from_the_latent_cache_equals_the_forward():
    cfg = jaxmoe.api.local_config(_cfg({"data": 1}))
    params = jaxmoe.init(cfg, jax.random.PRNGKey(1))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 10))
    want, _ = jaxmoe.apply(params, tokens, cfg)
    # per token and layer the cache holds the latent and the RoPE key: 8 + 4 numbers,
    # where grouped-query attention of these 4 heads would hold 2 x 4 x 12
    assert kv_cache.cache_numbers_per_token(cfg.model) == 8 + 4
    cache = kv_cache.init_cache(cfg.model, 2, 16)
    assert {a.shape[3:] for pair in cache.values() for a in pair} == {(8,), (4,)}
    model = jaxmoe.api.to_module(params, cfg)
    logits, cache, _ = kv_cache.forward(model, tokens[:, :6], cache, 0)
    steps = [logits]
    for t in range(6, 10):  # one token at a time
        logits, cache, _ = kv_cache.forward(model, tokens[:, t:t + 1], cache, t)
        steps.append(logits)
    got = np.concatenate([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)
    # companion: decoding from a cache whose RoPE keys were written one position off
    shifted, _, _ = kv_cache.forward(model, tokens[:, :6], kv_cache.init_cache(cfg.model, 2, 16), 1)
    assert np.abs(np.asarray(shifted) - np.asarray(want)[:, :6]).max() > 1e-3
    out = generate(params, tokens[:, :4], cfg, key=jax.random.key(0), max_new_tokens=3,
                   temperature=0.0)
    assert np.asarray(out).shape == (2, 3)


def test_latent_attention_settings_are_checked():
    with pytest.raises(ConfigError, match=r"model.num_kv_heads: mla gives each of the 4 heads"):
        _cfg({"data": 1}, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"model.qk_rope_head_dim: mla needs an even RoPE"):
        _cfg({"data": 1}, qk_rope_head_dim=3)
    with pytest.raises(ConfigError, match=r"model.qk_norm: mla normalises its latents"):
        _cfg({"data": 1}, qk_norm="head")
    with pytest.raises(ConfigError, match=r"model.yarn_factor: YaRN stretches RoPE"):
        _cfg({"data": 1}, yarn_factor=0.5)


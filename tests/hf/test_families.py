"""Hugging Face interop: tiny models of each family made with `transformers` import
with the same logits and export back to the same tensors; a jaxmoe model exports to a
directory `transformers` loads with the same logits and greedy continuation."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxmoe
from jaxmoe import hf
from jaxmoe.hf import HFError, SafetensorsReader, load_hf, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 300
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, eos_token_id=1, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_window_layers=3)),
    # GLM-4.5's own: half of each head rotated, group-limited routing, no shared expert
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        use_qk_norm=True, num_nextn_predict_layers=0)),
    # and one with shared experts, whole heads rotated and no QK-norm
    "glm4_moe-shared": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=False, use_qk_norm=False, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})),
    # DeepSeek-V3's multi-head latent attention: no query LoRA, two dense layers, two
    # shared experts, groups, YaRN with both of its scales, interleaved RoPE pairs
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        rope_interleave=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 0.8})),
    # and with a query LoRA, one dense layer and shared expert, plain rotate-half RoPE
    "deepseek_v3-qlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, num_nextn_predict_layers=0,
        rope_interleave=False)),
}


def _hf_model(family, directory):
    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **kw})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms and biases away from their initial 1s and 0s
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # routers that tell the groups apart
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(directory)
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imports_with_the_same_logits_and_exports_the_same_tensors(family, tmp_path):
    model = _hf_model(family, tmp_path / "hf")
    params, cfg = load_hf(tmp_path / "hf")
    family = family.split("-")[0]
    assert hf.family_for(cfg) == family
    tokens = np.random.default_rng(0).integers(0, V, (2, 12))
    want = _logits(model, tokens)
    got, _ = jaxmoe.apply(params, tokens, cfg)
    # fp32 sums over 64-wide rows in another order: ~1e-6 of the logits' scale
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(got) - _logits(model, tokens[:, ::-1].copy())).max() > 1e-2

    save_hf(params, cfg, tmp_path / "back", shard_bytes=200_000)  # several shards
    original, back = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "back")
    assert set(back.where) == set(original.where)
    assert len({path for path, _, _ in back.where.values()}) > 2
    for name in original.where:
        np.testing.assert_array_equal(back(name), original(name), err_msg=name)
    reloaded = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "back")
    np.testing.assert_array_equal(_logits(reloaded.eval(), tokens), want)
    if family in hf.SIGMOID:  # bfloat16 keeps the router in fp32, as transformers loads it
        save_hf(params, cfg, tmp_path / "bf16", dtype="bfloat16")
        dtypes = {n: dtype for n, (_, dtype, _) in SafetensorsReader(tmp_path / "bf16")
                  .where.items()}
        moe = f"model.layers.{cfg.model.num_dense_layers}.mlp."  # the first MoE layer
        assert dtypes[moe + "gate.weight"] == "F32"
        assert dtypes[moe + "gate.e_score_correction_bias"] == "F32"
        assert dtypes[moe + "experts.0.up_proj.weight"] == "BF16"
    if family == "qwen3_moe":  # bfloat16: the same tensors, rounded
        import ml_dtypes
        save_hf(params, cfg, tmp_path / "bf16", dtype="bfloat16")
        bf16 = SafetensorsReader(tmp_path / "bf16")
        for name in original.where:
            rounded = original(name).astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(bf16(name), rounded, err_msg=name)
        assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def _rewrite(directory, tensors: dict, **config):
    """A checkpoint directory's tensors and config.json replaced (one file, no index)."""
    from safetensors.numpy import save_file
    for f in [*directory.glob("model*.safetensors"), directory / hf.INDEX]:
        f.unlink(missing_ok=True)
    save_file(tensors, directory / "model.safetensors", {"format": "pt"})
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))


def _tensors(directory):
    read = SafetensorsReader(directory)
    return {name: read(name) for name in read.where}


def test_multi_token_prediction_layers_import_and_export(tmp_path):
    """DeepSeek-V3's MTP layer as its checkpoints store it (layer num_hidden_layers, its
    own norms and projection, copies of the embedding and head), which transformers
    neither builds nor saves."""
    model = _hf_model("deepseek_v3-qlora", tmp_path / "hf")
    tensors = _tensors(tmp_path / "hf")
    n, D = 3, 64
    rng = np.random.default_rng(0)
    mtp = {k.replace("layers.2.", "layers.3."): v + 0.01 * rng.standard_normal(v.shape,
                                                                                np.float32)
           for k, v in tensors.items() if k.startswith("model.layers.2.")}
    pre = f"model.layers.{n}."
    mtp |= {pre + "enorm.weight": 1 + 0.1 * rng.standard_normal(D, np.float32),
            pre + "hnorm.weight": 1 + 0.1 * rng.standard_normal(D, np.float32),
            pre + "eh_proj.weight": 0.02 * rng.standard_normal((D, 2 * D), np.float32),
            pre + "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(D, np.float32),
            pre + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
            pre + "shared_head.head.weight": tensors["lm_head.weight"]}
    _rewrite(tmp_path / "hf", {**tensors, **mtp}, num_nextn_predict_layers=1)
    params, cfg = load_hf(tmp_path / "hf")
    assert cfg.model.mtp_layers == 1
    np.testing.assert_array_equal(params["mtp_layers"]["proj"][0], mtp[pre + "eh_proj.weight"].T)
    np.testing.assert_array_equal(params["mtp_layers"]["block"]["attn"]["kv_a_norm"][0],
                                  mtp[pre + "self_attn.kv_a_layernorm.weight"])
    tokens = np.random.default_rng(1).integers(0, V, (2, 12))  # the main model is untouched
    np.testing.assert_allclose(np.asarray(jaxmoe.apply(params, tokens, cfg)[0]),
                               _logits(model, tokens), rtol=1e-4, atol=1e-4)
    save_hf(params, cfg, tmp_path / "back")
    back = _tensors(tmp_path / "back")
    assert set(back) == set(tensors) | set(mtp)
    for name, t in {**tensors, **mtp}.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    assert json.loads((tmp_path / "back" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    # a copy of the head that is not the model's cannot be shared
    _rewrite(tmp_path / "hf", {**tensors, **mtp, pre + "shared_head.head.weight":
                               2 * tensors["lm_head.weight"]})
    with pytest.raises(HFError, match=r"model.layers.3.shared_head.head.weight differs from "
                                      r"the model's"):
        load_hf(tmp_path / "hf")
    # a config naming a layer the tensors lack (as transformers saves them): the model alone
    _rewrite(tmp_path / "hf", tensors)
    with pytest.warns(UserWarning, match="names 1 multi-token prediction layer"):
        params, cfg = load_hf(tmp_path / "hf")
    assert cfg.model.mtp_layers == 0 and "mtp_layers" not in params


def _fp8_blocks(w, block):
    """DeepSeek's block quantization of a [rows, cols] weight: e4m3 values and one
    float32 scale per block (its largest magnitude over e4m3's 448)."""
    import ml_dtypes
    rows, cols = w.shape
    b0, b1 = block
    pad = np.pad(np.abs(w), ((0, -rows % b0), (0, -cols % b1)))
    amax = pad.reshape(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-12) / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, b0, 0), b1, 1)[:rows, :cols]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def test_fp8_block_quantized_weights_are_dequantized(tmp_path):
    """The released DeepSeek-V3's (and Kimi-K2's) weights: e4m3 in 128 x 128 blocks
    (here 16 x 16, so that tiny matrices hold several), each with a float32 scale."""
    _hf_model("deepseek_v3-qlora", tmp_path / "hf")
    tensors = _tensors(tmp_path / "hf")
    block = (16, 16)
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith("proj.weight"):  # attention and MLP projections, as released
            q, scale = _fp8_blocks(w, block)
            quantized |= {name: q, name + "_scale_inv": scale}
            full = np.repeat(np.repeat(scale, 16, 0), 16, 1)[:w.shape[0], :w.shape[1]]
            dequantized[name] = q.astype(np.float32) * full
        else:
            quantized[name] = dequantized[name] = w
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic", "weight_block_size": [16, 16]}}
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    _rewrite(tmp_path / "q", quantized, **config)
    _rewrite(tmp_path / "hf", dequantized)
    got, cfg = load_hf(tmp_path / "q")
    want, _ = load_hf(tmp_path / "hf")
    jax.tree.map(np.testing.assert_array_equal, got, want)
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert quantized[name + "_scale_inv"].shape == (4, 2)  # 64 x 32 in 16 x 16 blocks
    # companions: the stored e4m3 values alone are not the weights; a scale of another
    # block size, or fp8 weights without a quantization_config, are refused by name
    assert np.abs(quantized[name].astype(np.float32) - dequantized[name]).max() > 1.0
    _rewrite(tmp_path / "q", {**quantized, name + "_scale_inv": np.ones((2, 2), np.float32)})
    with pytest.raises(HFError, match=r"_scale_inv has shape \(2, 2\), not one scale per 16 x 16"):
        load_hf(tmp_path / "q")
    _rewrite(tmp_path / "q", quantized, quantization_config=None)
    with pytest.raises(HFError, match="has dtype F8_E4M3"):
        load_hf(tmp_path / "q")


# Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture, its own model_type and values
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_group": 1,
    "topk_method": "noaux_tc", "tie_word_embeddings": False, "v_head_dim": 128,
    "vocab_size": 163840}


def test_kimi_k2_config_imports():
    from flax import nnx

    from jaxmoe.plan.counts import param_counts
    from jaxmoe.model.transformer import Transformer
    cfg = hf.config_from_hf(KIMI_K2)
    assert hf.family_for(cfg) == "deepseek_v3"
    m, moe = cfg.model, cfg.moe
    assert (m.attention, m.num_layers, m.num_dense_layers, m.num_heads, m.yarn_factor,
            m.rope_interleave, moe.num_experts, moe.top_k, moe.routing_groups,
            moe.gate_scale) == ("mla", 61, 1, 64, 32.0, True, 384, 8, 1, 2.827)
    # the model it builds (abstract: nothing allocated) holds what the count says, and
    # that is Moonshot's 1.04T total and 32.6B activated, to their rounding and the
    # router's columns (2% allowed)
    model = nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0)))
    counts = param_counts(cfg)
    assert counts.total == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counts.total == pytest.approx(1.04e12, rel=0.02)
    assert counts.active == pytest.approx(32.6e9, rel=0.02)
    for change, message in [({"scoring_func": "softmax"}, r"scoring_func \(jaxmoe's"),
                            ({"topk_method": "greedy"}, r"topk_method \(jaxmoe routes"),
                            ({"quantization_config": {"quant_method": "fp8"}},
                             r"quantization_config")]:
        with pytest.raises(HFError, match=message):
            hf.config_from_hf({**KIMI_K2, **change})


def test_refusals_are_named(tmp_path):
    tiny = jaxmoe.config_from_dict({"moe": {"expert_bias": True}})  # the default job's router
    with pytest.raises(HFError, match=r"moe.expert_bias \(a selection bias beside a softmax "
                                      r"router is in no family \(moe.score_func: sigmoid"):
        hf.family_for(tiny)
    with pytest.raises(HFError, match=r"model.qk_norm \(dots1 and glm4_moe normalise q and k"):
        hf.family_for(jaxmoe.config_from_dict({"model": {"qk_norm": "full"},
                                               "moe": {"score_func": "sigmoid"}}))
    for key, value, message in [("moe.routing_groups", 2, "group-limited routing comes with a "
                                 "sigmoid"), ("model.rope_fraction", 0.5, "only glm4_moe")]:
        with pytest.raises(HFError, match=f"{key} \\({message}"):
            hf.family_for(jaxmoe.config_from_dict({}, [f"{key}={value}"]))
    assert hf.family_for(jaxmoe.config_from_dict({"moe": {"score_func": "sigmoid"}})) == \
        "glm4_moe"  # no shared expert: not dots1
    # a released GLM-4.5's shape: biased attention projections, a prediction layer
    released = {"model_type": "glm4_moe", "vocab_size": 300, "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_experts_per_tok": 2,
                "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4,
                "attention_bias": True,
                "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1}
    with pytest.raises(HFError, match=r"attention_bias \(jaxmoe's projections have no bias"):
        hf.config_from_hf(released)
    # keys it leaves out mean what they mean to transformers: one shared expert, one
    # dense layer, 8 KV heads, renormalised gates
    cfg = hf.config_from_hf({**released, "attention_bias": False})
    assert (cfg.moe.shared_expert_hidden, cfg.model.num_dense_layers, cfg.model.num_kv_heads,
            cfg.model.rope_fraction, cfg.moe.renormalize) == (32, 1, 8, 0.5, True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HFError, match="model_type 'llama' is not one jaxmoe reads"):
        load_hf(tmp_path)
    model = _hf_model("mixtral", tmp_path / "m")
    del model
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    for change, message in [
            ({"sliding_window": 64}, r"sliding_window \(jaxmoe attends to the whole sequence"),
            ({"tie_word_embeddings": True}, r"tie_word_embeddings \(jaxmoe's LM head"),
            ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling"),
            ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
            ({"num_experts_per_tok": None}, r"no value for num_experts_per_tok"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                  "partial_rotary_factor": 0.5}},
             r"partial_rotary_factor \(mixtral rotates whole heads")]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HFError, match=message):
            load_hf(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / hf.INDEX).write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(HFError, match="shard model-00002-of-00002.safetensors named by "
                                      "model.safetensors.index.json is missing"):
        load_hf(tmp_path / "m")


# jaxmoe settings of each family: (model section, moe section)
TRAINED = {
    "qwen3_moe": ({"qk_norm": "head"}, {}),
    "olmoe": ({"qk_norm": "full"}, {"renormalize": False}),
    "mixtral": ({"qk_norm": "none"}, {}),
    "dots1": ({"qk_norm": "head"}, {"score_func": "sigmoid", "expert_bias": True,
                                    "shared_expert_hidden": 32, "gate_scale": 2.5,
                                    "routing_groups": 2, "groups_per_token": 1}),
    "glm4_moe": ({"qk_norm": "head", "rope_fraction": 0.5},
                 {"score_func": "sigmoid", "expert_bias": True, "routing_groups": 2,
                  "groups_per_token": 1}),
    "deepseek_v3": ({"attention": "mla", "qk_norm": "none", "num_kv_heads": 2,
                     "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                     "qk_rope_head_dim": 8, "v_head_dim": 12, "rope_interleave": True,
                     "mtp_layers": 1},
                    {"score_func": "sigmoid", "expert_bias": True, "shared_expert_hidden": 32,
                     "gate_scale": 2.5, "routing_groups": 2, "groups_per_token": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TRAINED))
def test_a_trained_model_exports_to_transformers_with_the_same_text(family, tmp_path):
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.export import main as export_main
    from jaxmoe.generate import generate
    from jaxmoe.train import train

    model, moe = TRAINED[family]
    dense = 1 if family in ("qwen3_moe", "dots1", "glm4_moe", "deepseek_v3") else 0
    cfg = jaxmoe.config_from_dict({
        "model": {"d_model": 32, "num_layers": 2 + dense, "num_heads": 2, "num_kv_heads": 1,
                  "num_dense_layers": dense, "mlp_hidden": 64, **model},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, **moe},
        "train": {"steps": 3, "batch_size": 8, "seq_len": 16, "eval_every": 0, "eval_batches": 1,
                  "run_dir": str(tmp_path / "run")},
        "optimizer": {"warmup_steps": 1, "learning_rate": 1e-2},
        "logging": {"progress": False}})
    train(cfg, load_corpus("stdlib", None, 256, 16))
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--format", "hf",
                        "--out", str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == hf.FAMILIES[family]
    params, saved = jaxmoe.load_params(tmp_path / "run")
    # raw text through the export's own tokenizer: the bytes the model trained on
    text = "\x00def f(x):\n    return"
    tokens = np.asarray(transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)
                        ["input_ids"], np.int64)[None]
    np.testing.assert_array_equal(tokens[0], list(text.encode()))
    vocab = saved.model.vocab_size
    want = _logits(model, tokens)
    got, _ = jaxmoe.apply(params, tokens, saved)  # load_params' config is dropless
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    ours = np.asarray(generate(params, tokens, saved, key=jax.random.key(0), max_new_tokens=12,
                               temperature=0.0))
    prompt = torch.as_tensor(tokens)  # starts with byte 0, the EOS: no padding to infer
    with torch.no_grad():
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                do_sample=False, eos_token_id=None, pad_token_id=vocab - 1)
    np.testing.assert_array_equal(ours, theirs.numpy()[:, tokens.shape[1]:])
    if saved.model.mtp_layers:  # trained prediction modules travel too, where transformers
        imported, _ = load_hf(tmp_path / "hf")  # keeps them but never runs them
        jax.tree.map(np.testing.assert_array_equal, imported["mtp_layers"],
                     jax.tree.map(np.asarray, params["mtp_layers"]))


def test_init_from_hf_starts_a_run_from_the_checkpoint(tmp_path):
    from jaxmoe.data.batches import heldout_batches
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.train import train

    model = _hf_model("qwen3_moe", tmp_path / "hf")
    weights, hf_cfg = load_hf(tmp_path / "hf")
    user = jaxmoe.config_from_dict({
        "moe": {"dispatcher": "dense"},
        "train": {"steps": 1, "batch_size": 8, "seq_len": 16, "eval_batches": 1, "eval_every": 0,
                  "run_dir": str(tmp_path / "run")},
        "optimizer": {"warmup_steps": 0}, "logging": {"progress": False}})
    cfg = hf.with_architecture(user, hf_cfg)
    assert cfg.model.d_model == 64 and cfg.moe.dispatcher == "dense"  # shapes theirs, the rest ours
    corpus = load_corpus("stdlib", None, V, 16)
    summary = train(cfg, corpus, init_weights=weights)
    (batch,) = heldout_batches(corpus.heldout, 8, 16, 1)
    logits = torch.as_tensor(_logits(model, batch[:, :-1]))
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V),
                                             torch.as_tensor(batch[:, 1:]).reshape(-1).long())
    np.testing.assert_allclose(summary["heldout_loss_initial"], float(want), rtol=1e-5)


CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
# toy widths; the architecture (router, gates, bias, groups, QK-norm, RoPE, dense and
# shared layers, expert count) stays the shipped config's
TOY = ["model.vocab_size=256", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
       "model.head_dim=16", "model.mlp_hidden=64", "model.compute_dtype=float32",
       "model.attention_block=0", "moe.expert_hidden=16", "moe.expert_precision=compute",
       "model.projection_precision=compute",
       "mesh.data=1", "mesh.expert=1", "mesh.stage=1", "mesh.context=1",
       "pipeline.virtual_stages=1",
       "pipeline.stage_microbatches=1", "train.batch_size=8", "train.seq_len=16",
       "train.accumulation_steps=1", "train.loss_chunk=0", "train.dense_mlp_chunk=0",
       "train.grad_reduce_dtype=float32"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_has_a_family(path, tmp_path):
    """Each shipped config's architecture at toy widths: a family takes it, and its
    export loads in transformers with jaxmoe's logits (dropless)."""
    from jaxmoe.config import load_config

    shipped = load_config(path)
    ratio = shipped.moe.shared_expert_hidden // shipped.moe.expert_hidden
    mla = [] if shipped.model.attention != "mla" else [
        "model.num_kv_heads=2", "model.kv_lora_rank=8", "model.qk_nope_head_dim=8",
        "model.qk_rope_head_dim=8", "model.v_head_dim=8",
        f"model.q_lora_rank={8 if shipped.model.q_lora_rank else 0}"]
    cfg = jaxmoe.api.local_config(load_config(path, TOY + mla + [
        f"model.num_layers={shipped.model.num_dense_layers + 2}",
        f"moe.shared_expert_hidden={16 * ratio}"]))
    family = hf.family_for(cfg)
    params = jax.tree.map(np.asarray, jaxmoe.init(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    stack = params["moe_layers"]["moe"]["router"]
    # routing with margins: wide enough to beat rounding, narrow enough that no sigmoid
    # score saturates to a tie at 1.0 among 256 experts
    stack["w"] = 0.2 * rng.normal(size=stack["w"].shape).astype(np.float32)
    if "bias" in stack:
        stack["bias"] = 0.1 * rng.normal(size=stack["bias"].shape).astype(np.float32)
    save_hf(params, cfg, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == hf.FAMILIES[family]
    tokens = rng.integers(0, 256, (2, 12))
    got, _ = jaxmoe.apply(params, tokens, cfg)
    np.testing.assert_allclose(np.asarray(got), _logits(model, tokens), rtol=1e-4, atol=1e-4)

"""config.json <-> jaxmoe's config: the keys every family shares, each family's own
from its adapter (`jaxmoe.hf.family`)."""

from __future__ import annotations

from jaxmoe.config import SHAPE_KEYS, Config, ConfigError, config_from_dict
from jaxmoe.hf.families import ADAPTERS, adapter
from jaxmoe.hf.family import HFError, raise_for

# The keys of an architecture: what a checkpoint's weights fix. The rest of a run's
# config (dispatcher, capacity, losses, precision, parallelism) stays the user's.
# The keys that shape the weights, and those that change what the weights compute.
ARCHITECTURE = {"model": SHAPE_KEYS["model"] + (
    "rope_theta", "rope_fraction", "norm_eps", "rope_interleave", "yarn_factor",
    "yarn_original_max_positions", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
    "yarn_mscale_all_dim"),
                "moe": SHAPE_KEYS["moe"] + ("top_k", "score_func", "renormalize", "gate_scale",
                                            "routing_groups", "groups_per_token")}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_experts_per_tok", "intermediate_size")


def hf_config(cfg: Config, family: str, eos_id: int | None = None, bos_id: int | None = None,
              dtype: str = "float32") -> dict:
    """config.json for `family` (see `family_for`)."""
    m, moe = cfg.model, cfg.moe
    out = {"architectures": [ADAPTERS[family].architecture], "model_type": family,
           "vocab_size": m.vocab_size, "hidden_size": m.d_model,
           "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
           "num_key_value_heads": m.num_kv_heads, "hidden_act": "silu",
           "max_position_embeddings": max(cfg.train.seq_len, 4096), "rms_norm_eps": m.norm_eps,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
           "tie_word_embeddings": False, "attention_bias": False,
           "num_experts_per_tok": moe.top_k, "output_router_logits": False,
           "router_aux_loss_coef": moe.balance_loss_weight, "bos_token_id": bos_id,
           "eos_token_id": eos_id, "dtype": dtype}
    if ADAPTERS[family].writes_head_dim:
        out["head_dim"] = m.head_size
    return ADAPTERS[family].config_json(cfg, out)


def config_from_hf(hf: dict) -> Config:
    """The jaxmoe config of a Hugging Face config.json; HFError names what it cannot hold.
    MoE layers dispatch dropless (`grouped` with room for every copy), so jaxmoe's
    logits are the checkpoint's."""
    family = adapter(hf.get("model_type"))
    name = family.model_type
    missing = [k for k in _REQUIRED if not hf.get(k)]
    if missing:
        raise HFError(f"config.json ({name}): no value for {', '.join(missing)}")
    get = {**family.omitted, **hf}.get
    rope = dict(get("rope_parameters") or {})
    if family.yarn and get("rope_scaling"):  # the released checkpoints' key
        rope = {**rope, **get("rope_scaling")}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = family.yarn and rope_type == "yarn"
    theta = rope.get("rope_theta") or get("rope_theta") or family.rope_theta
    eps = get("rms_norm_eps") or family.norm_eps
    fraction = float(rope.get("partial_rotary_factor", get("partial_rotary_factor",
                                                           family.rope_fraction)))
    quantized = get("quantization_config")
    whole_sequence = "jaxmoe attends to the whole sequence"
    plain_rope = "jaxmoe has plain RoPE only (and deepseek_v3's YaRN)"
    raise_for([
        ("quantization_config", quantized is not None and not _fp8_blocks(quantized),
         "jaxmoe reads unquantised weights and DeepSeek's FP8 blocks (quant_method fp8, "
         f"fmt e4m3, a weight_block_size), not {quantized}"),
        ("moe_layer_freq", get("moe_layer_freq", 1) != 1,
         "jaxmoe's MoE layers are every layer after the dense ones"),
        ("tie_word_embeddings", bool(get("tie_word_embeddings")),
         "jaxmoe's LM head is its own matrix (untie the checkpoint first)"),
        ("rope_scaling", not family.yarn and bool(get("rope_scaling")), plain_rope),
        ("attention_bias", bool(get("attention_bias")), "jaxmoe's projections have no bias"),
        ("hidden_act", get("hidden_act", "silu") != "silu", "jaxmoe's MLPs are SwiGLU"),
        ("rope_parameters.rope_type", rope_type != "default" and not yarn, plain_rope),
        ("layer_types", any(t != "full_attention" for t in get("layer_types") or []),
         whole_sequence),
        ("partial_rotary_factor", not family.rotates_part and fraction != 1.0,
         f"{name} rotates whole heads"),
        *family.refusals(get),
    ], f"config.json ({name}): cannot be represented in jaxmoe: ")
    heads, d = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or d // heads
    experts, top_k = family.num_experts(get), get("num_experts_per_tok")
    model = {"vocab_size": get("vocab_size"), "d_model": d, "num_layers": get("num_hidden_layers"),
             "num_heads": heads, "num_kv_heads": get("num_key_value_heads") or heads,
             "head_dim": head_dim if head_dim * heads != d else 0,
             "mlp_hidden": get("intermediate_size"), "num_dense_layers": family.dense_layers(get),
             "rope_theta": float(theta), "rope_fraction": fraction, "norm_eps": float(eps),
             "mtp_layers": (get("num_nextn_predict_layers") or 0) if family.mtp else 0,
             **family.model_keys(get)}
    if yarn:
        model |= family.yarn_keys(get, rope)
    moe = {"num_experts": experts, "top_k": top_k, "expert_hidden": family.expert_hidden(get),
           "router_jitter": float(get("router_jitter_noise") or 0.0),
           "dispatcher": "grouped", "capacity_factor": experts / top_k, **family.moe_keys(get)}
    try:
        return config_from_dict({"model": model, "moe": moe})
    except ConfigError as e:  # a combination jaxmoe's config refuses (groups of one, ...)
        raise HFError(f"config.json ({name}): cannot be represented in jaxmoe: {e}") from None


def _fp8_blocks(quantization: dict) -> bool:
    """Whether a quantization_config is DeepSeek-V3's: e4m3 weights, one float32 scale
    per block (`weight_scale_inv`), which import multiplies out."""
    block = quantization.get("weight_block_size") or []
    return (quantization.get("quant_method") == "fp8" and quantization.get("fmt", "e4m3") == "e4m3"
            and len(block) == 2)


def with_architecture(cfg: Config, source: Config) -> Config:
    """`cfg` with the architecture keys of `source` (e.g. `config_from_hf`'s)."""
    raw = cfg.to_dict()
    for section, keys in ARCHITECTURE.items():
        for key in keys:
            raw[section][key] = getattr(getattr(source, section), key)
    return config_from_dict(raw)

"""Hugging Face interop: jaxmoe models <-> Qwen3-MoE, OLMoE, Mixtral, dots1, GLM-4.5
(glm4_moe) and DeepSeek-V3 (deepseek_v3) checkpoints.

Which family takes a jaxmoe config (`family_for`):

| jaxmoe                                        | family    |
|-----------------------------------------------|-----------|
| softmax router, per-head QK-norm              | qwen3_moe |
| softmax router, QK-norm over the projection   | olmoe     |
| softmax router, no QK-norm, renormalised gates | mixtral   |
| sigmoid router (+ selection bias, groups), shared expert, per-head QK-norm | dots1 |
| sigmoid router (+ selection bias, groups), any other: no shared expert, no QK-norm, partial RoPE | glm4_moe |
| multi-head latent attention, sigmoid router (+ selection bias, groups, shared experts) | deepseek_v3 |

Anything else (a softmax router with a selection bias or a shared expert, QK-norm
over the projection beside a sigmoid router, ...) has no family in `transformers`
and is refused by name. dots1 and glm4_moe compute alike where both apply (their
routers are DeepSeek-V3's); a model both take is written as dots1.

Kimi-K2's config (`kimi_k2`) reads as deepseek_v3. deepseek_v3 and glm4_moe
checkpoints keep multi-token prediction layers after the last layer, which are
read and written where they keep them (`mtp_tensors`); DeepSeek's FP8
block-quantised weights are dequantised as they are read (`SafetensorsReader`).

Tensors are written as `save_pretrained` writes them: one per expert, in
`[out, in]` layout, through the safetensors library's numpy interface (bfloat16
without torch): a shard's converted tensors are held together while it is
written. Reading takes one tensor at a time, so one layer at a time is converted.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxmoe.api import check_params
from jaxmoe.config import SHAPE_KEYS, Config, ConfigError, config_from_dict

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "mixtral": "MixtralForCausalLM", "dots1": "Dots1ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# DeepSeek-V3's router: sigmoid, correction bias, groups
SIGMOID = ("dots1", "glm4_moe", "deepseek_v3")
# What transformers (5.24) takes for a key a config.json leaves out, where it is not
# jaxmoe's own fallback
OMITTED = {"glm4_moe": {"n_shared_experts": 1, "first_k_dense_replace": 1,
                        "num_key_value_heads": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-5},
           "dots1": {"first_k_dense_replace": 0, "num_key_value_heads": 32,
                     "norm_topk_prob": False},
           "deepseek_v3": {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8,
                           "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                           "rms_norm_eps": 1e-6, "rope_interleave": True, "q_lora_rank": 1536,
                           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                           "v_head_dim": 128}}
# model types that are another family's architecture under their own name
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2: DeepSeek-V3's, its own config values
# families whose checkpoints hold multi-token prediction layers (after the last layer)
WITH_MTP = ("deepseek_v3", "glm4_moe")
INDEX = "model.safetensors.index.json"
_DTYPES = ("F32", "BF16", "F16")  # what jaxmoe reads (as float32)
_FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn}  # block-quantized weights, with their scales


class HFError(ValueError):
    """A model or checkpoint that cannot cross between jaxmoe and Hugging Face."""


# ---------------------------------------------------------------- configs


def family_for(cfg: Config) -> str:
    """The family whose architecture is this config's, or HFError naming the option."""
    m, moe = cfg.model, cfg.moe
    if not cfg.num_moe_layers:
        raise HFError("model.num_dense_layers == model.num_layers: a dense model is not an MoE "
                      "family's")
    shared = moe.shared_expert_hidden
    if m.attention == "mla":
        _refuse("multi-head latent attention", [
            ("moe.score_func", moe.score_func != "sigmoid", "deepseek_v3's router is sigmoid"),
            ("moe.shared_expert_hidden", shared % moe.expert_hidden != 0,
             "a shared expert is a whole number of expert widths")], "deepseek_v3")
        return "deepseek_v3"
    if moe.score_func == "sigmoid":
        _refuse("a sigmoid router", [
            ("model.qk_norm", m.qk_norm == "full", "dots1 and glm4_moe normalise q and k per "
             "head or not at all"),
            ("moe.shared_expert_hidden", shared % moe.expert_hidden != 0,
             "a shared expert is a whole number of expert widths")], "dots1, glm4_moe")
        if m.qk_norm == "head" and shared and m.rope_fraction == 1.0:
            return "dots1"
        return "glm4_moe"
    problems = [("moe.expert_bias", moe.expert_bias, "a selection bias beside a softmax router "
                 "is in no family (moe.score_func: sigmoid exports as dots1 or glm4_moe)"),
                ("moe.shared_expert_hidden", bool(shared),
                 "a shared expert beside a softmax router is in no family (moe.score_func: "
                 "sigmoid exports as dots1 or glm4_moe)"),
                ("moe.gate_scale", moe.gate_scale != 1.0, "only dots1 and glm4_moe scale the "
                 "gates"),
                ("moe.routing_groups", moe.routing_groups > 1, "group-limited routing comes "
                 "with a sigmoid router (dots1, glm4_moe)"),
                ("model.rope_fraction", m.rope_fraction != 1.0, "only glm4_moe rotates part of "
                 "each head")]
    _refuse("a softmax router", problems, "qwen3_moe, olmoe or mixtral")
    if m.qk_norm == "head":
        return "qwen3_moe"
    if m.qk_norm == "full":
        _refuse("QK-norm over the projection", [
            ("model.num_dense_layers", m.num_dense_layers > 0, "olmoe has no dense layers"),
            ("model.head_dim", m.head_size * m.num_heads != m.d_model,
             "olmoe's head size is d_model / num_heads")], "olmoe")
        return "olmoe"
    _refuse("no QK-norm", [
        ("model.num_dense_layers", m.num_dense_layers > 0, "mixtral has no dense layers"),
        ("moe.renormalize", not moe.renormalize, "mixtral always renormalises the top-k gates")],
        "mixtral")
    return "mixtral"


def _refuse(what: str, problems: list, families: str) -> None:
    _raise_for(problems, f"no Hugging Face family takes this model: with {what} ({families}), ")


def _raise_for(problems: list, preface: str) -> None:
    """HFError listing each (key, wrong, why) that is wrong, after `preface`."""
    bad = [f"{key} ({why})" for key, wrong, why in problems if wrong]
    if bad:
        raise HFError(preface + "; ".join(bad))


def hf_config(cfg: Config, family: str, eos_id: int | None = None, bos_id: int | None = None,
              dtype: str = "float32") -> dict:
    """config.json for `family` (see `family_for`)."""
    m, moe = cfg.model, cfg.moe
    n = m.num_layers
    out = {"architectures": [FAMILIES[family]], "model_type": family, "vocab_size": m.vocab_size,
           "hidden_size": m.d_model, "num_hidden_layers": n, "num_attention_heads": m.num_heads,
           "num_key_value_heads": m.num_kv_heads, "hidden_act": "silu",
           "max_position_embeddings": max(cfg.train.seq_len, 4096), "rms_norm_eps": m.norm_eps,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
           "tie_word_embeddings": False, "attention_bias": False,
           "num_experts_per_tok": moe.top_k, "output_router_logits": False,
           "router_aux_loss_coef": moe.balance_loss_weight, "bos_token_id": bos_id,
           "eos_token_id": eos_id, "dtype": dtype}
    if family not in ("olmoe", "deepseek_v3"):  # deepseek_v3's is its RoPE part
        out["head_dim"] = m.head_size
    if family == "glm4_moe":  # its default rotates half of each head
        out["rope_parameters"]["partial_rotary_factor"] = m.rope_fraction
    if family == "qwen3_moe":
        out |= {"intermediate_size": m.mlp_hidden, "moe_intermediate_size": moe.expert_hidden,
                "num_experts": moe.num_experts, "norm_topk_prob": moe.renormalize,
                "decoder_sparse_step": 1, "mlp_only_layers": list(range(m.num_dense_layers)),
                "use_sliding_window": False, "sliding_window": None}
    elif family == "olmoe":
        out |= {"intermediate_size": moe.expert_hidden, "num_experts": moe.num_experts,
                "norm_topk_prob": moe.renormalize, "clip_qkv": None}
    elif family == "mixtral":
        out |= {"intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
                "sliding_window": None, "router_jitter_noise": moe.router_jitter}
    else:  # dots1, glm4_moe
        out |= {"intermediate_size": m.mlp_hidden, "moe_intermediate_size": moe.expert_hidden,
                "n_routed_experts": moe.num_experts,
                "n_shared_experts": moe.shared_expert_hidden // moe.expert_hidden,
                "n_group": moe.routing_groups, "topk_group": moe.groups_per_token,
                "first_k_dense_replace": m.num_dense_layers,
                "norm_topk_prob": moe.renormalize, "routed_scaling_factor": moe.gate_scale}
        if family == "dots1":
            out |= {"sliding_window": None, "max_window_layers": n,
                    "layer_types": ["full_attention"] * n}
        elif family == "deepseek_v3":
            out |= {"q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
                    "qk_nope_head_dim": m.qk_nope_head_dim,
                    "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
                    "rope_interleave": m.rope_interleave,
                    "num_nextn_predict_layers": m.mtp_layers}
            if m.yarn_factor:
                out["rope_parameters"] |= {
                    "rope_type": "yarn", "factor": m.yarn_factor,
                    "original_max_position_embeddings": m.yarn_original_max_positions,
                    "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
                    "mscale": m.yarn_mscale, "mscale_all_dim": m.yarn_mscale_all_dim}
        else:
            out |= {"use_qk_norm": m.qk_norm == "head", "num_nextn_predict_layers": m.mtp_layers}
    return out


def config_from_hf(hf: dict) -> Config:
    """The jaxmoe config of a Hugging Face config.json; HFError names what it cannot hold.
    MoE layers dispatch dropless (`grouped` with room for every copy), so jaxmoe's
    logits are the checkpoint's."""
    family = ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    if family not in FAMILIES:
        raise HFError(f"config.json: model_type {family!r} is not one jaxmoe reads (families: "
                      f"{', '.join([*FAMILIES, *ALIASES])})")
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_experts_per_tok", "intermediate_size"]
    missing = [k for k in required if not hf.get(k)]
    if missing:
        raise HFError(f"config.json ({family}): no value for {', '.join(missing)}")
    get = {**OMITTED.get(family, {}), **hf}.get
    rope = dict(get("rope_parameters") or {})
    if family == "deepseek_v3" and get("rope_scaling"):  # the released checkpoints' key
        rope = {**rope, **get("rope_scaling")}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = family == "deepseek_v3" and rope_type == "yarn"
    # transformers' defaults where a config leaves them out
    theta = rope.get("rope_theta") or get("rope_theta") or (1e6 if family == "mixtral" else 1e4)
    eps = get("rms_norm_eps") or (1e-5 if family in ("olmoe", "mixtral") else 1e-6)
    fraction = float(rope.get("partial_rotary_factor", get("partial_rotary_factor",
                                                           0.5 if family == "glm4_moe" else 1.0)))
    layer_types = get("layer_types") or []
    quantized = get("quantization_config")
    problems = [
        ("quantization_config", quantized is not None and not _fp8_blocks(quantized),
         "jaxmoe reads unquantised weights and DeepSeek's FP8 blocks (quant_method fp8, "
         f"fmt e4m3, a weight_block_size), not {quantized}"),
        ("scoring_func", family == "deepseek_v3" and get("scoring_func", "sigmoid") != "sigmoid",
         "jaxmoe's deepseek_v3 router is DeepSeek-V3's sigmoid"),
        ("topk_method", family == "deepseek_v3" and get("topk_method", "noaux_tc") != "noaux_tc",
         "jaxmoe routes as DeepSeek-V3's noaux_tc (group-limited, with the correction bias)"),
        ("moe_layer_freq", get("moe_layer_freq", 1) != 1,
         "jaxmoe's MoE layers are every layer after the dense ones"),
        ("tie_word_embeddings", bool(get("tie_word_embeddings")),
         "jaxmoe's LM head is its own matrix (untie the checkpoint first)"),
        ("rope_scaling", family != "deepseek_v3" and bool(get("rope_scaling")),
         "jaxmoe has plain RoPE only (and deepseek_v3's YaRN)"),
        ("attention_bias", bool(get("attention_bias")), "jaxmoe's projections have no bias"),
        ("hidden_act", get("hidden_act", "silu") != "silu", "jaxmoe's MLPs are SwiGLU"),
        ("rope_parameters.rope_type", rope_type != "default" and not yarn,
         "jaxmoe has plain RoPE only (and deepseek_v3's YaRN)"),
        ("use_sliding_window", family == "qwen3_moe" and bool(get("use_sliding_window")),
         "jaxmoe attends to the whole sequence"),
        ("sliding_window", family == "mixtral" and get("sliding_window") is not None,
         "jaxmoe attends to the whole sequence"),
        ("layer_types", any(t != "full_attention" for t in layer_types),
         "jaxmoe attends to the whole sequence"),
        ("clip_qkv", family == "olmoe" and get("clip_qkv") is not None, "jaxmoe does not clip"),
        ("decoder_sparse_step", family == "qwen3_moe" and get("decoder_sparse_step", 1) != 1,
         "jaxmoe's MoE layers are every layer after the dense ones"),
        ("mlp_only_layers", family == "qwen3_moe" and list(get("mlp_only_layers") or [])
         != list(range(len(get("mlp_only_layers") or []))),
         "jaxmoe's dense layers are the first ones"),
        ("partial_rotary_factor", family != "glm4_moe" and fraction != 1.0,
         f"{family} rotates whole heads"),
        ("n_shared_experts", family == "dots1" and get("n_shared_experts") is None,
         "dots1's config names its shared experts"),
    ]
    _raise_for(problems, f"config.json ({family}): cannot be represented in jaxmoe: ")
    heads, d = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or d // heads
    sigmoid = family in SIGMOID
    dense = len(get("mlp_only_layers") or []) if family == "qwen3_moe" else \
        (get("first_k_dense_replace") or 0) if sigmoid else 0
    expert_hidden = get("moe_intermediate_size") if family == "qwen3_moe" or sigmoid \
        else get("intermediate_size")
    # transformers writes Qwen3-MoE's num_experts as num_local_experts
    experts = get("n_routed_experts") if sigmoid else (
        get("num_experts") or get("num_local_experts"))
    top_k = get("num_experts_per_tok")
    model = {"vocab_size": get("vocab_size"), "d_model": d, "num_layers": get("num_hidden_layers"),
             "num_heads": heads, "num_kv_heads": get("num_key_value_heads") or heads,
             "head_dim": head_dim if head_dim * heads != d else 0,
             "mlp_hidden": get("intermediate_size"), "num_dense_layers": dense,
             "qk_norm": {"olmoe": "full", "mixtral": "none"}.get(family, "head"),
             "rope_theta": float(theta), "rope_fraction": fraction, "norm_eps": float(eps),
             "mtp_layers": (get("num_nextn_predict_layers") or 0) if family in WITH_MTP else 0}
    if family == "glm4_moe" and not get("use_qk_norm"):
        model["qk_norm"] = "none"
    if family == "deepseek_v3":
        model |= {"attention": "mla", "qk_norm": "none", "num_kv_heads": heads, "head_dim": 0,
                  "q_lora_rank": get("q_lora_rank") or 0, "kv_lora_rank": get("kv_lora_rank"),
                  "qk_nope_head_dim": get("qk_nope_head_dim"),
                  "qk_rope_head_dim": get("qk_rope_head_dim"), "v_head_dim": get("v_head_dim"),
                  "rope_interleave": bool(get("rope_interleave"))}
        if yarn:
            factor = rope.get("factor") or (get("max_position_embeddings")
                                            / rope["original_max_position_embeddings"])
            model |= {"yarn_factor": float(factor),
                      "yarn_original_max_positions": rope["original_max_position_embeddings"],
                      "yarn_beta_fast": float(rope.get("beta_fast") or 32),
                      "yarn_beta_slow": float(rope.get("beta_slow") or 1),
                      "yarn_mscale": float(rope.get("mscale") or 0.0),
                      "yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}
    moe = {"num_experts": experts, "top_k": top_k, "expert_hidden": expert_hidden,
           "score_func": "sigmoid" if sigmoid else "softmax",
           "renormalize": True if family == "mixtral" else bool(get("norm_topk_prob")),
           "router_jitter": float(get("router_jitter_noise") or 0.0),
           "dispatcher": "grouped", "capacity_factor": experts / top_k}
    if sigmoid:
        moe |= {"expert_bias": True,
                "shared_expert_hidden": expert_hidden * (get("n_shared_experts") or 0),
                "gate_scale": float(get("routed_scaling_factor") or 1.0),
                "routing_groups": get("n_group") or 1, "groups_per_token": get("topk_group") or 1}
    try:
        return config_from_dict({"model": model, "moe": moe})
    except ConfigError as e:  # a combination jaxmoe's config refuses (groups of one, ...)
        raise HFError(f"config.json ({family}): cannot be represented in jaxmoe: {e}") from None


# The keys of an architecture: what a checkpoint's weights fix. The rest of a run's
# config (dispatcher, capacity, losses, precision, parallelism) stays the user's.
# The keys that shape the weights, and those that change what the weights compute.
ARCHITECTURE = {"model": SHAPE_KEYS["model"] + (
    "rope_theta", "rope_fraction", "norm_eps", "rope_interleave", "yarn_factor",
    "yarn_original_max_positions", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
    "yarn_mscale_all_dim"),
                "moe": SHAPE_KEYS["moe"] + ("top_k", "score_func", "renormalize", "gate_scale",
                                            "routing_groups", "groups_per_token")}


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


# ---------------------------------------------------------------- tensors


def _mlp_names(family: str, moe: bool) -> tuple[str, str, str, str]:
    """(block prefix, gate, up, down) of an expert or dense MLP."""
    if family == "mixtral" and moe:
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def layer_tensors(layer: dict, cfg: Config, family: str, i: int) -> dict[str, np.ndarray]:
    """One layer's tensors under its Hugging Face names (`layer`: that layer's slice of a
    params stack)."""
    m = cfg.model
    H, G, Hd, D = m.num_heads, m.num_kv_heads, m.head_size, m.d_model
    a, pre = layer["attn"], f"model.layers.{i}."
    out = {pre + "input_layernorm.weight": layer["attn_norm"]["scale"],
           pre + "post_attention_layernorm.weight": layer["mlp_norm"]["scale"]}
    if m.attention == "mla":
        out |= {pre + "self_attn." + name + ".weight": w.reshape(w.shape[0], -1).T
                for name, w in _latent_projections(a, m)}
        out |= {pre + "self_attn.kv_a_layernorm.weight": a["kv_a_norm"],
                pre + "self_attn.o_proj.weight": a["w_o"].reshape(-1, D).T}
        if m.q_lora_rank:
            out[pre + "self_attn.q_a_layernorm.weight"] = a["q_a_norm"]
    else:
        out |= {pre + "self_attn.q_proj.weight": a["w_q"].reshape(D, H * Hd).T,
                pre + "self_attn.k_proj.weight": a["w_k"].reshape(D, G * Hd).T,
                pre + "self_attn.v_proj.weight": a["w_v"].reshape(D, G * Hd).T,
                pre + "self_attn.o_proj.weight": a["w_o"].reshape(H * Hd, D).T}
    if m.qk_norm != "none":
        out[pre + "self_attn.q_norm.weight"] = a["q_norm"].reshape(-1)
        out[pre + "self_attn.k_norm.weight"] = a["k_norm"].reshape(-1)
    if "moe" not in layer:
        out |= _mlp(pre + "mlp.", layer["mlp"], *_mlp_names(family, False)[1:])
        return out
    moe = layer["moe"]
    block, gate, up, down = _mlp_names(family, True)
    out[pre + f"{block}.gate.weight"] = moe["router"]["w"].T
    if family in SIGMOID:
        bias = moe["router"].get("bias")
        out[pre + "mlp.gate.e_score_correction_bias"] = (
            np.zeros(cfg.moe.num_experts, np.float32) if bias is None else bias)
        # glm4_moe holds a shared expert of zero width where the model has none
        D = cfg.model.d_model
        shared = moe.get("shared") or {"w_gate_up": np.zeros((D, 0), np.float32),
                                       "w_down": np.zeros((0, D), np.float32)}
        out |= _mlp(pre + "mlp.shared_experts.", shared, "gate_proj", "up_proj", "down_proj")
    experts = moe["experts"]
    for e in range(cfg.moe.num_experts):
        out |= _mlp(pre + f"{block}.experts.{e}.", {k: v[e] for k, v in experts.items()},
                    gate, up, down)
    return out


# MLA's projections: deepseek_v3's name, jaxmoe's, and jaxmoe's shape ([in, out...])
def _latent_names(m) -> list[tuple[str, str]]:
    q = [("q_a_proj", "w_q_a"), ("q_b_proj", "w_q_b")] if m.q_lora_rank else [("q_proj", "w_q")]
    return q + [("kv_a_proj_with_mqa", "w_kv_a"), ("kv_b_proj", "w_kv_b")]


def _latent_projections(attn: dict, m) -> list[tuple[str, np.ndarray]]:
    return [(hf, attn[ours]) for hf, ours in _latent_names(m)]


def _mlp(prefix: str, mlp: dict, gate: str, up: str, down: str) -> dict[str, np.ndarray]:
    F = mlp["w_down"].shape[0]
    return {prefix + f"{gate}.weight": mlp["w_gate_up"][:, :F].T,
            prefix + f"{up}.weight": mlp["w_gate_up"][:, F:].T,
            prefix + f"{down}.weight": mlp["w_down"].T}


def _unmlp(read, prefix: str, gate: str, up: str, down: str) -> dict[str, np.ndarray]:
    return {"w_gate_up": np.concatenate([read(prefix + f"{gate}.weight").T,
                                         read(prefix + f"{up}.weight").T], axis=1),
            "w_down": read(prefix + f"{down}.weight").T}


def read_layer(read, cfg: Config, family: str, i: int, moe: bool) -> dict:
    """The inverse of `layer_tensors`: layer i's params from `read(name) -> array`."""
    m = cfg.model
    H, G, Hd, D = m.num_heads, m.num_kv_heads, m.head_size, m.d_model
    pre = f"model.layers.{i}."
    if m.attention == "mla":
        Hn, Hr, Hv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        shapes = {"w_q": (D, H, Hn + Hr), "w_q_a": (D, m.q_lora_rank),
                  "w_q_b": (m.q_lora_rank, H, Hn + Hr), "w_kv_a": (D, m.kv_lora_rank + Hr),
                  "w_kv_b": (m.kv_lora_rank, H, Hn + Hv)}
        attn = {ours: read(pre + f"self_attn.{hf}.weight").T.reshape(shapes[ours])
                for hf, ours in _latent_names(m)}
        attn |= {"kv_a_norm": read(pre + "self_attn.kv_a_layernorm.weight"),
                 "w_o": read(pre + "self_attn.o_proj.weight").T.reshape(H, Hv, D)}
        if m.q_lora_rank:
            attn["q_a_norm"] = read(pre + "self_attn.q_a_layernorm.weight")
    else:
        attn = {"w_q": read(pre + "self_attn.q_proj.weight").T.reshape(D, H, Hd),
                "w_k": read(pre + "self_attn.k_proj.weight").T.reshape(D, G, Hd),
                "w_v": read(pre + "self_attn.v_proj.weight").T.reshape(D, G, Hd),
                "w_o": read(pre + "self_attn.o_proj.weight").T.reshape(H, Hd, D)}
    if m.qk_norm == "head":
        attn |= {"q_norm": read(pre + "self_attn.q_norm.weight"),
                 "k_norm": read(pre + "self_attn.k_norm.weight")}
    elif m.qk_norm == "full":
        attn |= {"q_norm": read(pre + "self_attn.q_norm.weight").reshape(H, Hd),
                 "k_norm": read(pre + "self_attn.k_norm.weight").reshape(G, Hd)}
    layer = {"attn": attn, "attn_norm": {"scale": read(pre + "input_layernorm.weight")},
             "mlp_norm": {"scale": read(pre + "post_attention_layernorm.weight")}}
    if not moe:
        layer["mlp"] = _unmlp(read, pre + "mlp.", *_mlp_names(family, False)[1:])
        return layer
    block, gate, up, down = _mlp_names(family, True)
    experts = [_unmlp(read, pre + f"{block}.experts.{e}.", gate, up, down)
               for e in range(cfg.moe.num_experts)]
    router = {"w": read(pre + f"{block}.gate.weight").T}
    if cfg.moe.expert_bias:
        router["bias"] = read(pre + "mlp.gate.e_score_correction_bias")
    layer["moe"] = {"router": router,
                    "experts": {k: np.stack([x[k] for x in experts]) for k in experts[0]}}
    if cfg.moe.shared_expert_hidden:
        layer["moe"]["shared"] = _unmlp(read, pre + "mlp.shared_experts.", "gate_proj",
                                        "up_proj", "down_proj")
    return layer


def mtp_tensors(module: dict, params: dict, cfg: Config, family: str, i: int) -> dict:
    """Multi-token prediction module i's tensors as DeepSeek-V3 lays them out: layer
    num_layers + i, its transformer layer's tensors and its own, with copies of the
    shared embedding and head (`module`: that module's slice of the `mtp_layers` stack)."""
    n = cfg.model.num_layers + i
    pre = f"model.layers.{n}."
    return {**layer_tensors(module["block"], cfg, family, n),
            pre + "enorm.weight": module["embed_norm"]["scale"],
            pre + "hnorm.weight": module["hidden_norm"]["scale"],
            pre + "eh_proj.weight": module["proj"].T,
            pre + "shared_head.norm.weight": module["out_norm"]["scale"],
            pre + "embed_tokens.weight": np.asarray(params["embed"]),
            pre + "shared_head.head.weight": np.asarray(params["head"]).T}


def read_mtp(read, cfg: Config, family: str, i: int) -> dict:
    """The inverse of `mtp_tensors`: module i's params; copies of the embedding or the
    head that differ from the model's are refused (jaxmoe shares them)."""
    n = cfg.model.num_layers + i
    pre = f"model.layers.{n}."
    return {"block": read_layer(read, cfg, family, n, cfg.num_moe_layers > 0),
            "embed_norm": {"scale": read(pre + "enorm.weight")},
            "hidden_norm": {"scale": read(pre + "hnorm.weight")},
            "proj": np.ascontiguousarray(read(pre + "eh_proj.weight").T),
            "out_norm": {"scale": read(pre + "shared_head.norm.weight")}}


def _layer(params: dict, cfg: Config, i: int) -> dict:
    dense = cfg.model.num_dense_layers
    stack, j = ("dense_layers", i) if i < dense else ("moe_layers", i - dense)
    return _index(params[stack], j)


def _index(tree, j):
    return jax.tree.map(lambda a: np.asarray(a[j]), tree)


def _stack(layers: list[dict]):
    return jax.tree.map(lambda *xs: np.stack(xs), *layers)


# ---------------------------------------------------------------- safetensors files


class SafetensorsReader:
    """Tensors of one or many safetensors files (a sharded checkpoint's index names
    each tensor's file), read one at a time through the safetensors library, as
    float32. block: the (rows, columns) of DeepSeek's FP8 blocks, where the
    checkpoint's weights are float8 e4m3 with a float32 `weight_scale_inv` per block
    (None: such a tensor is refused)."""

    def __init__(self, directory: Path, block: tuple[int, int] | None = None):
        self.directory, self.block = directory, block
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        elif (directory / "model.safetensors").is_file():
            weight_map = None
        else:
            raise HFError(f"{directory} holds neither {INDEX} nor model.safetensors")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise HFError(f"{directory}: shard {missing[0]} named by {INDEX} is missing")
        self.where: dict[str, tuple[Path, str, tuple[int, ...]]] = {}  # file, dtype, shape
        for f in files:
            with safe_open(directory / f, framework="numpy") as fh:
                for name in fh.keys():
                    info = fh.get_slice(name)
                    self.where[name] = (directory / f, info.get_dtype(), tuple(info.get_shape()))

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise HFError(f"{self.directory}: tensor {name} is missing")
        path, dtype, _ = self.where[name]
        if dtype in _FP8 and self.block:
            return self._dequantized(name)
        if dtype not in _DTYPES:
            raise HFError(f"{path}: tensor {name} has dtype {dtype}; jaxmoe reads "
                          f"{', '.join(_DTYPES)} (and {', '.join(_FP8)} with block scales, "
                          "as a quantization_config of quant_method fp8 names them)")
        with safe_open(path, framework="numpy") as fh:
            return np.asarray(fh.get_tensor(name), np.float32)

    def _dequantized(self, name: str) -> np.ndarray:
        """An FP8 weight times its blocks' scales: float32, as DeepSeek's own dequant."""
        path, dtype, (rows, cols) = self.where[name]
        scale_name = name + "_scale_inv"
        if scale_name not in self.where:
            raise HFError(f"{path}: tensor {name} is {dtype} without its block scales "
                          f"{scale_name}")
        scale = self(scale_name)
        b0, b1 = self.block
        if scale.shape != (-(-rows // b0), -(-cols // b1)):
            raise HFError(f"{path}: {scale_name} has shape {scale.shape}, not one scale per "
                          f"{b0} x {b1} block of {name}'s {rows} x {cols}")
        scale = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[:rows, :cols]
        return self._raw(name).astype(np.float32) * scale

    def _raw(self, name: str) -> np.ndarray:
        """A tensor's stored values (safetensors' numpy interface has no float8): its
        bytes, at the offsets the file's header gives."""
        path, dtype, shape = self.where[name]
        with open(path, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            start, end = header[name]["data_offsets"]
            fh.seek(fh.tell() + start)
            return np.frombuffer(fh.read(end - start), _FP8[dtype]).reshape(shape)


# ---------------------------------------------------------------- whole models


def params_to_hf(params: dict, cfg: Config, family: str):
    """(name, tensor) of a model-order params tree, one layer at a time."""
    yield "model.embed_tokens.weight", np.asarray(params["embed"])
    for i in range(cfg.model.num_layers):
        yield from layer_tensors(_layer(params, cfg, i), cfg, family, i).items()
    yield "model.norm.weight", np.asarray(params["final_norm"]["scale"])
    yield "lm_head.weight", np.asarray(params["head"]).T
    if family in WITH_MTP:  # the others have no place for them: generation never runs them
        for i in range(cfg.model.mtp_layers):
            yield from mtp_tensors(_index(params["mtp_layers"], i), params, cfg, family,
                                   i).items()


def _shapes_only(tree):
    """The tree with each array replaced by a zero-strided one of its shape and dtype:
    free to transpose, slice and reshape."""
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), np.asarray(a).dtype),
                                                  np.shape(a)), tree)


def check_out_dir(out: str | Path) -> Path:
    """`out` as a Path, or HFError where it is a file (an export is a directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HFError(f"--out {out} is a file; give a directory")
    return out


def save_hf(params: dict, cfg: Config, out: str | Path, *, dtype: str = "float32",
            tokenizer=None, shard_bytes: int = 2 << 30) -> dict:
    """Writes a Hugging Face checkpoint directory; returns its config.json. The host
    holds `params` and one converted tensor at a time."""
    family = family_for(cfg)
    wanted = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype("<f4")

    def dtype_of(name):  # dots1 and glm4_moe keep the router in fp32 (transformers loads it so)
        fp32 = family in SIGMOID and name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        return np.dtype("<f4") if fp32 else wanted

    out = check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # a leftover would be read
        stale.unlink(missing_ok=True)
    shards, size = [[]], 0  # the names in each shard, planned from shapes alone
    for name, tensor in params_to_hf(_shapes_only(params), cfg, family):
        nbytes = tensor.size * dtype_of(name).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    shard_of = {name: n for n, names in enumerate(shards) for name in names}
    shapes = dict(params_to_hf(_shapes_only(params), cfg, family))
    for n, file in enumerate(files):
        save_file({name: np.ascontiguousarray(t, dtype_of(name))
                   for name, t in params_to_hf(params, cfg, family) if shard_of[name] == n},
                  out / file, {"format": "pt"})
    total = sum(int(np.prod(t.shape)) * dtype_of(name).itemsize for name, t in shapes.items())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": int(total)},
                                         "weight_map": {k: files[v] for k, v in shard_of.items()}},
                                        indent=1))
    eos = None if tokenizer is None else tokenizer.eos_id
    bos = None if tokenizer is None else tokenizer.bos_id
    config = hf_config(cfg, family, eos, bos, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"_from_model_config": True, "eos_token_id": eos, "bos_token_id": bos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    if tokenizer is not None:
        tokenizer.save_hf(out)
    return config


def _check_shared_copies(read, params: dict, m) -> None:
    """The embedding and head copies a checkpoint keeps with each multi-token prediction
    layer must be the model's: jaxmoe shares them."""
    for i in range(m.mtp_layers):
        pre = f"model.layers.{m.num_layers + i}."
        for name, shared in (("embed_tokens.weight", params["embed"]),
                             ("shared_head.head.weight", params["head"].T)):
            if pre + name in read.where and not np.array_equal(read(pre + name), shared):
                raise HFError(f"{read.directory}: {pre + name} differs from the model's "
                              "(jaxmoe's multi-token prediction shares the embedding and head)")


def read_config(directory: str | Path) -> tuple[dict, Config]:
    """(config.json, its jaxmoe Config) of a Hugging Face checkpoint directory."""
    directory = Path(directory).expanduser().absolute()
    if not (directory / "config.json").is_file():
        raise HFError(f"{directory} holds no config.json")
    try:
        hf = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise HFError(f"{directory / 'config.json'} is not valid JSON ({e})") from None
    return hf, config_from_hf(hf)


def load_hf(directory: str | Path) -> tuple[dict, Config]:
    """(params in model order, Config) of a local Hugging Face checkpoint of a supported
    family. Anything the config holds that jaxmoe cannot is refused before any weight
    is read."""
    directory = Path(directory).expanduser().absolute()
    hf, cfg = read_config(directory)
    quantized = hf.get("quantization_config")
    read = SafetensorsReader(directory, quantized and tuple(quantized["weight_block_size"]))
    family, m = ALIASES.get(hf["model_type"], hf["model_type"]), cfg.model
    if m.mtp_layers and f"model.layers.{m.num_layers}.eh_proj.weight" not in read.where:
        warnings.warn(f"{directory}: config.json names {m.mtp_layers} multi-token prediction "
                      "layer(s) and the checkpoint holds none (transformers saves none); "
                      "imported without them", stacklevel=2)
        raw = cfg.to_dict()
        cfg = config_from_dict({**raw, "model": {**raw["model"], "mtp_layers": 0}})
        m = cfg.model
    try:
        params = {"embed": read("model.embed_tokens.weight"),
                  "head": np.ascontiguousarray(read("lm_head.weight").T),
                  "final_norm": {"scale": read("model.norm.weight")}}
        layers = [read_layer(read, cfg, family, i, i >= m.num_dense_layers)
                  for i in range(m.num_layers)]
        if m.num_dense_layers:
            params["dense_layers"] = _stack(layers[:m.num_dense_layers])
        params["moe_layers"] = _stack(layers[m.num_dense_layers:])
        if m.mtp_layers:
            params["mtp_layers"] = _stack([read_mtp(read, cfg, family, i)
                                           for i in range(m.mtp_layers)])
            _check_shared_copies(read, params, m)
        check_params(params, cfg)
    except ValueError as e:  # a reshape that does not fit, or check_params's verdict
        if isinstance(e, HFError):
            raise
        raise HFError(f"{directory}: the tensors do not match config.json: {e}") from None
    return params, cfg

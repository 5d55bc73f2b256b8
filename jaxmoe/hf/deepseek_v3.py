"""DeepSeek-V3 (and Kimi-K2's config, which reads as it): multi-head latent attention,
DeepSeek's router, YaRN, multi-token prediction layers after the last layer, FP8
block-quantised checkpoints (dequantised as read: `jaxmoe.hf.files`)."""

from __future__ import annotations

from jaxmoe.config import Config, ModelConfig
from jaxmoe.hf.family import DeepSeekRouter


def _latent_names(m: ModelConfig) -> list[tuple[str, str]]:
    """MLA's projections: DeepSeek-V3's name and jaxmoe's ([in, out...])."""
    q = [("q_a_proj", "w_q_a"), ("q_b_proj", "w_q_b")] if m.q_lora_rank else [("q_proj", "w_q")]
    return q + [("kv_a_proj_with_mqa", "w_kv_a"), ("kv_b_proj", "w_kv_b")]


class DeepseekV3(DeepSeekRouter):
    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"
    omitted = {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8,
               "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
               "rms_norm_eps": 1e-6, "rope_interleave": True, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128}
    yarn = True
    mtp = True
    writes_head_dim = False  # its head_dim is the RoPE part

    def config_json(self, cfg: Config, out: dict) -> dict:
        m = cfg.model
        out = super().config_json(cfg, out) | {
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
            "num_nextn_predict_layers": m.mtp_layers}
        if m.yarn_factor:
            out["rope_parameters"] |= {
                "rope_type": "yarn", "factor": m.yarn_factor,
                "original_max_position_embeddings": m.yarn_original_max_positions,
                "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
                "mscale": m.yarn_mscale, "mscale_all_dim": m.yarn_mscale_all_dim}
        return out

    def refusals(self, get) -> list:
        return [("scoring_func", get("scoring_func", "sigmoid") != "sigmoid",
                 "jaxmoe's deepseek_v3 router is DeepSeek-V3's sigmoid"),
                ("topk_method", get("topk_method", "noaux_tc") != "noaux_tc",
                 "jaxmoe routes as DeepSeek-V3's noaux_tc (group-limited, with the correction "
                 "bias)")]

    def model_keys(self, get) -> dict:
        heads = get("num_attention_heads")
        return {"attention": "mla", "qk_norm": "none", "num_kv_heads": heads, "head_dim": 0,
                "q_lora_rank": get("q_lora_rank") or 0, "kv_lora_rank": get("kv_lora_rank"),
                "qk_nope_head_dim": get("qk_nope_head_dim"),
                "qk_rope_head_dim": get("qk_rope_head_dim"), "v_head_dim": get("v_head_dim"),
                "rope_interleave": bool(get("rope_interleave"))}

    def yarn_keys(self, get, rope: dict) -> dict:
        """jaxmoe's YaRN keys of a config.json's `rope_parameters` of type yarn."""
        factor = rope.get("factor") or (get("max_position_embeddings")
                                        / rope["original_max_position_embeddings"])
        return {"yarn_factor": float(factor),
                "yarn_original_max_positions": rope["original_max_position_embeddings"],
                "yarn_beta_fast": float(rope.get("beta_fast") or 32),
                "yarn_beta_slow": float(rope.get("beta_slow") or 1),
                "yarn_mscale": float(rope.get("mscale") or 0.0),
                "yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}

    def attention_tensors(self, attn: dict, m: ModelConfig, pre: str) -> dict:
        out = {pre + f"self_attn.{hf}.weight": attn[ours].reshape(attn[ours].shape[0], -1).T
               for hf, ours in _latent_names(m)}
        out |= {pre + "self_attn.kv_a_layernorm.weight": attn["kv_a_norm"],
                pre + "self_attn.o_proj.weight": attn["w_o"].reshape(-1, m.d_model).T}
        if m.q_lora_rank:
            out[pre + "self_attn.q_a_layernorm.weight"] = attn["q_a_norm"]
        return out

    def read_attention(self, read, m: ModelConfig, pre: str) -> dict:
        H, D = m.num_heads, m.d_model
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
        return attn

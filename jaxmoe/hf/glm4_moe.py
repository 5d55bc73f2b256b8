"""GLM-4.5 (glm4_moe): DeepSeek-V3's router, part of each head rotated, QK-norm per
head or none, multi-token prediction layers after the last layer."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.family import DeepSeekRouter


class Glm4Moe(DeepSeekRouter):
    model_type, architecture = "glm4_moe", "Glm4MoeForCausalLM"
    omitted = {"n_shared_experts": 1, "first_k_dense_replace": 1, "num_key_value_heads": 8,
               "norm_topk_prob": True, "rms_norm_eps": 1e-5}
    rope_fraction = 0.5  # its default rotates half of each head
    rotates_part = True
    mtp = True

    def config_json(self, cfg: Config, out: dict) -> dict:
        m = cfg.model
        out["rope_parameters"]["partial_rotary_factor"] = m.rope_fraction
        return super().config_json(cfg, out) | {"use_qk_norm": m.qk_norm == "head",
                                                "num_nextn_predict_layers": m.mtp_layers}

    def model_keys(self, get) -> dict:
        return {"qk_norm": "head" if get("use_qk_norm") else "none"}

"""OLMoE: softmax router, QK-norm over the whole projection, no dense layers."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.family import Family


class Olmoe(Family):
    model_type, architecture = "olmoe", "OlmoeForCausalLM"
    norm_eps = 1e-5
    writes_head_dim = False  # its head size is d_model / num_heads

    def config_json(self, cfg: Config, out: dict) -> dict:
        moe = cfg.moe
        return out | {"intermediate_size": moe.expert_hidden, "num_experts": moe.num_experts,
                      "norm_topk_prob": moe.renormalize, "clip_qkv": None}

    def refusals(self, get) -> list:
        return [("clip_qkv", get("clip_qkv") is not None, "jaxmoe does not clip")]

    def model_keys(self, get) -> dict:
        return {"qk_norm": "full"}

"""dots1 (rednote): DeepSeek-V3's router with shared experts, per-head QK-norm."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.family import DeepSeekRouter


class Dots1(DeepSeekRouter):
    model_type, architecture = "dots1", "Dots1ForCausalLM"
    omitted = {"first_k_dense_replace": 0, "num_key_value_heads": 32, "norm_topk_prob": False}

    def config_json(self, cfg: Config, out: dict) -> dict:
        n = cfg.model.num_layers
        return super().config_json(cfg, out) | {
            "sliding_window": None, "max_window_layers": n, "layer_types": ["full_attention"] * n}

    def refusals(self, get) -> list:
        return [("n_shared_experts", get("n_shared_experts") is None,
                 "dots1's config names its shared experts")]

"""Qwen3-MoE: softmax router, per-head QK-norm, dense layers named by `mlp_only_layers`."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.family import Family


class Qwen3Moe(Family):
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"

    def config_json(self, cfg: Config, out: dict) -> dict:
        m, moe = cfg.model, cfg.moe
        return out | {"intermediate_size": m.mlp_hidden, "moe_intermediate_size": moe.expert_hidden,
                      "num_experts": moe.num_experts, "norm_topk_prob": moe.renormalize,
                      "decoder_sparse_step": 1, "mlp_only_layers": list(range(m.num_dense_layers)),
                      "use_sliding_window": False, "sliding_window": None}

    def refusals(self, get) -> list:
        dense = list(get("mlp_only_layers") or [])
        return [("use_sliding_window", bool(get("use_sliding_window")),
                 "jaxmoe attends to the whole sequence"),
                ("decoder_sparse_step", get("decoder_sparse_step", 1) != 1,
                 "jaxmoe's MoE layers are every layer after the dense ones"),
                ("mlp_only_layers", dense != list(range(len(dense))),
                 "jaxmoe's dense layers are the first ones")]

    def dense_layers(self, get) -> int:
        return len(get("mlp_only_layers") or [])

    def expert_hidden(self, get) -> int:
        return get("moe_intermediate_size")

"""Mixtral: softmax router, renormalised top-k gates, no QK-norm, experts as
`block_sparse_moe.experts.{e}.w1/w3/w2`."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.family import Family


class Mixtral(Family):
    model_type, architecture = "mixtral", "MixtralForCausalLM"
    rope_theta, norm_eps = 1e6, 1e-5
    experts = ("block_sparse_moe", "w1", "w3", "w2")

    def config_json(self, cfg: Config, out: dict) -> dict:
        moe = cfg.moe
        return out | {"intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
                      "sliding_window": None, "router_jitter_noise": moe.router_jitter}

    def refusals(self, get) -> list:
        return [("sliding_window", get("sliding_window") is not None,
                 "jaxmoe attends to the whole sequence")]

    def model_keys(self, get) -> dict:
        return {"qk_norm": "none"}

    def moe_keys(self, get) -> dict:
        return {"score_func": "softmax", "renormalize": True}

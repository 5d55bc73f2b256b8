"""A Hugging Face family's adapter: how its config.json and its tensors' names differ
from the layout the families share.

The shared layout is Llama's, which every family here starts from: `self_attn`'s
q/k/v/o projections in `[out, in]`, RMSNorms before attention and the MLP, SwiGLU MLPs
as `mlp.{gate,up,down}_proj`, one tensor set per expert, the router as
`mlp.gate.weight`. `Family` holds that layout and the hooks a family overrides;
`DeepSeekRouter` is the sigmoid router with its correction bias, groups and shared
experts that dots1, GLM-4.5 and DeepSeek-V3 share. The common mapping of config keys
is `jaxmoe.hf.config`, of tensors `jaxmoe.hf.tensors`.
"""

from __future__ import annotations

import numpy as np

from jaxmoe.config import Config, ModelConfig
from jaxmoe.hf.tensors import mlp_tensors


class HFError(ValueError):
    """A model or checkpoint that cannot cross between jaxmoe and Hugging Face."""


def raise_for(problems: list, preface: str) -> None:
    """HFError listing each (key, wrong, why) that is wrong, after `preface`."""
    bad = [f"{key} ({why})" for key, wrong, why in problems if wrong]
    if bad:
        raise HFError(preface + "; ".join(bad))


class Family:
    model_type: str
    architecture: str  # the `transformers` class
    # what transformers takes for a key a config.json leaves out, where it is not
    # jaxmoe's own fallback (transformers 5.24)
    omitted: dict = {}
    # transformers' defaults where a config.json gives none
    rope_theta, norm_eps, rope_fraction = 1e4, 1e-6, 1.0
    rotates_part = False  # config.json may rotate part of each head
    yarn = False  # config.json may scale RoPE by YaRN
    mtp = False  # checkpoints keep multi-token prediction layers after the last layer
    router_fp32 = False  # bfloat16 checkpoints keep the router in float32
    writes_head_dim = True  # config.json names head_dim
    # (block, gate, up, down): the names of an MoE layer's experts and router
    experts = ("mlp", "gate_proj", "up_proj", "down_proj")

    # -- config.json

    def config_json(self, cfg: Config, out: dict) -> dict:
        """config.json: the keys every family writes (`out`) with this family's own."""
        return out

    def refusals(self, get) -> list:
        """(key, wrong, why) of this family's config.json keys jaxmoe cannot hold."""
        return []

    def dense_layers(self, get) -> int:
        return 0

    def expert_hidden(self, get) -> int:
        return get("intermediate_size")

    def num_experts(self, get) -> int:
        # transformers writes Qwen3-MoE's num_experts as num_local_experts
        return get("num_experts") or get("num_local_experts")

    def model_keys(self, get) -> dict:
        """This family's say in jaxmoe's model section."""
        return {"qk_norm": "head"}

    def moe_keys(self, get) -> dict:
        """This family's say in jaxmoe's moe section."""
        return {"score_func": "softmax", "renormalize": bool(get("norm_topk_prob"))}

    # -- tensors

    def attention_tensors(self, attn: dict, m: ModelConfig, pre: str) -> dict:
        """A layer's attention projections under their names (`pre`: the layer's)."""
        H, G, Hd, D = m.num_heads, m.num_kv_heads, m.head_size, m.d_model
        return {pre + "self_attn.q_proj.weight": attn["w_q"].reshape(D, H * Hd).T,
                pre + "self_attn.k_proj.weight": attn["w_k"].reshape(D, G * Hd).T,
                pre + "self_attn.v_proj.weight": attn["w_v"].reshape(D, G * Hd).T,
                pre + "self_attn.o_proj.weight": attn["w_o"].reshape(H * Hd, D).T}

    def read_attention(self, read, m: ModelConfig, pre: str) -> dict:
        """`attention_tensors`' inverse."""
        H, G, Hd, D = m.num_heads, m.num_kv_heads, m.head_size, m.d_model
        return {"w_q": read(pre + "self_attn.q_proj.weight").T.reshape(D, H, Hd),
                "w_k": read(pre + "self_attn.k_proj.weight").T.reshape(D, G, Hd),
                "w_v": read(pre + "self_attn.v_proj.weight").T.reshape(D, G, Hd),
                "w_o": read(pre + "self_attn.o_proj.weight").T.reshape(H, Hd, D)}

    def router_tensors(self, moe: dict, cfg: Config, pre: str) -> dict:
        """An MoE layer's tensors beside the router's matrix and the experts."""
        return {}


class DeepSeekRouter(Family):
    """DeepSeek-V3's router: sigmoid scores, a correction bias that only selects,
    group-limited routing, scaled gates, shared experts beside the routed ones, dense
    layers first."""

    router_fp32 = True  # transformers loads it so

    def config_json(self, cfg: Config, out: dict) -> dict:
        m, moe = cfg.model, cfg.moe
        return out | {
            "intermediate_size": m.mlp_hidden, "moe_intermediate_size": moe.expert_hidden,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.shared_expert_hidden // moe.expert_hidden,
            "n_group": moe.routing_groups, "topk_group": moe.groups_per_token,
            "first_k_dense_replace": m.num_dense_layers, "norm_topk_prob": moe.renormalize,
            "routed_scaling_factor": moe.gate_scale}

    def dense_layers(self, get) -> int:
        return get("first_k_dense_replace") or 0

    def expert_hidden(self, get) -> int:
        return get("moe_intermediate_size")

    def num_experts(self, get) -> int:
        return get("n_routed_experts")

    def moe_keys(self, get) -> dict:
        hidden = self.expert_hidden(get)
        return {"score_func": "sigmoid", "renormalize": bool(get("norm_topk_prob")),
                "expert_bias": True, "shared_expert_hidden": hidden * (get("n_shared_experts") or 0),
                "gate_scale": float(get("routed_scaling_factor") or 1.0),
                "routing_groups": get("n_group") or 1, "groups_per_token": get("topk_group") or 1}

    def router_tensors(self, moe: dict, cfg: Config, pre: str) -> dict:
        """The correction bias, and the shared experts (of zero width where the model
        has none: these families' modules hold them whatever their width)."""
        bias = moe["router"].get("bias")
        D = cfg.model.d_model
        shared = moe.get("shared") or {"w_gate_up": np.zeros((D, 0), np.float32),
                                       "w_down": np.zeros((0, D), np.float32)}
        return {pre + "mlp.gate.e_score_correction_bias":
                np.zeros(cfg.moe.num_experts, np.float32) if bias is None else bias,
                **mlp_tensors(pre + "mlp.shared_experts.", shared, "gate_proj", "up_proj",
                              "down_proj")}

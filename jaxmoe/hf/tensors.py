"""jaxmoe's parameters <-> a checkpoint's tensors, one layer at a time: the layout the
families share, with each family's names from its adapter (`jaxmoe.hf.family`).

Tensors are named and laid out as `save_pretrained` writes them: `[out, in]`, one set
per expert. Multi-token prediction modules sit after the last layer as DeepSeek-V3
lays them out (GLM-4.5 too), with copies of the shared embedding and head.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmoe.config import Config

_DENSE_MLP = ("mlp", "gate_proj", "up_proj", "down_proj")


def mlp_tensors(prefix: str, mlp: dict, gate: str, up: str, down: str) -> dict[str, np.ndarray]:
    """A SwiGLU MLP's three matrices under their names."""
    F = mlp["w_down"].shape[0]
    return {prefix + f"{gate}.weight": mlp["w_gate_up"][:, :F].T,
            prefix + f"{up}.weight": mlp["w_gate_up"][:, F:].T,
            prefix + f"{down}.weight": mlp["w_down"].T}


def read_mlp(read, prefix: str, gate: str, up: str, down: str) -> dict[str, np.ndarray]:
    """`mlp_tensors`' inverse."""
    return {"w_gate_up": np.concatenate([read(prefix + f"{gate}.weight").T,
                                         read(prefix + f"{up}.weight").T], axis=1),
            "w_down": read(prefix + f"{down}.weight").T}


def layer_tensors(layer: dict, cfg: Config, family, i: int) -> dict[str, np.ndarray]:
    """One layer's tensors under their Hugging Face names (`layer`: that layer's slice of a
    params stack; `family`: the adapter)."""
    m = cfg.model
    a, pre = layer["attn"], f"model.layers.{i}."
    out = {pre + "input_layernorm.weight": layer["attn_norm"]["scale"],
           pre + "post_attention_layernorm.weight": layer["mlp_norm"]["scale"],
           **family.attention_tensors(a, m, pre)}
    if m.qk_norm != "none":
        out[pre + "self_attn.q_norm.weight"] = a["q_norm"].reshape(-1)
        out[pre + "self_attn.k_norm.weight"] = a["k_norm"].reshape(-1)
    if "moe" not in layer:
        out |= mlp_tensors(pre + "mlp.", layer["mlp"], *_DENSE_MLP[1:])
        return out
    moe = layer["moe"]
    block, gate, up, down = family.experts
    out[pre + f"{block}.gate.weight"] = moe["router"]["w"].T
    out |= family.router_tensors(moe, cfg, pre)
    experts = moe["experts"]
    for e in range(cfg.moe.num_experts):
        out |= mlp_tensors(pre + f"{block}.experts.{e}.", {k: v[e] for k, v in experts.items()},
                           gate, up, down)
    return out


def read_layer(read, cfg: Config, family, i: int, moe: bool) -> dict:
    """The inverse of `layer_tensors`: layer i's params from `read(name) -> array`."""
    m = cfg.model
    H, G, Hd = m.num_heads, m.num_kv_heads, m.head_size
    pre = f"model.layers.{i}."
    attn = family.read_attention(read, m, pre)
    if m.qk_norm == "head":
        attn |= {"q_norm": read(pre + "self_attn.q_norm.weight"),
                 "k_norm": read(pre + "self_attn.k_norm.weight")}
    elif m.qk_norm == "full":
        attn |= {"q_norm": read(pre + "self_attn.q_norm.weight").reshape(H, Hd),
                 "k_norm": read(pre + "self_attn.k_norm.weight").reshape(G, Hd)}
    layer = {"attn": attn, "attn_norm": {"scale": read(pre + "input_layernorm.weight")},
             "mlp_norm": {"scale": read(pre + "post_attention_layernorm.weight")}}
    if not moe:
        layer["mlp"] = read_mlp(read, pre + "mlp.", *_DENSE_MLP[1:])
        return layer
    block, gate, up, down = family.experts
    experts = [read_mlp(read, pre + f"{block}.experts.{e}.", gate, up, down)
               for e in range(cfg.moe.num_experts)]
    router = {"w": read(pre + f"{block}.gate.weight").T}
    if cfg.moe.expert_bias:
        router["bias"] = read(pre + "mlp.gate.e_score_correction_bias")
    layer["moe"] = {"router": router,
                    "experts": {k: np.stack([x[k] for x in experts]) for k in experts[0]}}
    if cfg.moe.shared_expert_hidden:
        layer["moe"]["shared"] = read_mlp(read, pre + "mlp.shared_experts.", *_DENSE_MLP[1:])
    return layer


def mtp_tensors(module: dict, params: dict, cfg: Config, family, i: int) -> dict:
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


def read_mtp(read, cfg: Config, family, i: int) -> dict:
    """The inverse of `mtp_tensors`: module i's params (the embedding and head copies
    are the checkpoint reader's to check: jaxmoe shares them)."""
    n = cfg.model.num_layers + i
    pre = f"model.layers.{n}."
    return {"block": read_layer(read, cfg, family, n, cfg.num_moe_layers > 0),
            "embed_norm": {"scale": read(pre + "enorm.weight")},
            "hidden_norm": {"scale": read(pre + "hnorm.weight")},
            "proj": np.ascontiguousarray(read(pre + "eh_proj.weight").T),
            "out_norm": {"scale": read(pre + "shared_head.norm.weight")}}


def params_to_hf(params: dict, cfg: Config, family):
    """(name, tensor) of a model-order params tree, one layer at a time."""
    yield "model.embed_tokens.weight", np.asarray(params["embed"])
    for i in range(cfg.model.num_layers):
        yield from layer_tensors(_layer(params, cfg, i), cfg, family, i).items()
    yield "model.norm.weight", np.asarray(params["final_norm"]["scale"])
    yield "lm_head.weight", np.asarray(params["head"]).T
    if family.mtp:  # the others have no place for them: generation never runs them
        for i in range(cfg.model.mtp_layers):
            yield from mtp_tensors(_index(params["mtp_layers"], i), params, cfg, family,
                                   i).items()


def params_of(read, cfg: Config, family) -> dict:
    """A model-order params tree from `read(name) -> array`, one layer at a time."""
    m = cfg.model
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
    return params


def _layer(params: dict, cfg: Config, i: int) -> dict:
    dense = cfg.model.num_dense_layers
    stack, j = ("dense_layers", i) if i < dense else ("moe_layers", i - dense)
    return _index(params[stack], j)


def _index(tree, j):
    return jax.tree.map(lambda a: np.asarray(a[j]), tree)


def _stack(layers: list[dict]):
    return jax.tree.map(lambda *xs: np.stack(xs), *layers)

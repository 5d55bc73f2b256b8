"""Which family a jaxmoe config or a config.json is: one adapter per family."""

from __future__ import annotations

from jaxmoe.config import Config
from jaxmoe.hf.deepseek_v3 import DeepseekV3
from jaxmoe.hf.dots1 import Dots1
from jaxmoe.hf.family import DeepSeekRouter, Family, HFError, raise_for
from jaxmoe.hf.glm4_moe import Glm4Moe
from jaxmoe.hf.mixtral import Mixtral
from jaxmoe.hf.olmoe import Olmoe
from jaxmoe.hf.qwen3_moe import Qwen3Moe

ADAPTERS: dict[str, Family] = {f.model_type: f for f in (
    Qwen3Moe(), Olmoe(), Mixtral(), Dots1(), Glm4Moe(), DeepseekV3())}
FAMILIES = {name: f.architecture for name, f in ADAPTERS.items()}  # model_type: class
# DeepSeek-V3's router: sigmoid, correction bias, groups
SIGMOID = tuple(name for name, f in ADAPTERS.items() if isinstance(f, DeepSeekRouter))
# model types that are another family's architecture under their own name
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2: DeepSeek-V3's, its own config values


def adapter(model_type: str | None) -> Family:
    """The adapter of a config.json's model_type, or HFError naming those jaxmoe reads."""
    family = ALIASES.get(model_type, model_type)
    if family not in ADAPTERS:
        raise HFError(f"config.json: model_type {family!r} is not one jaxmoe reads (families: "
                      f"{', '.join([*ADAPTERS, *ALIASES])})")
    return ADAPTERS[family]


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
    raise_for(problems, f"no Hugging Face family takes this model: with {what} ({families}), ")

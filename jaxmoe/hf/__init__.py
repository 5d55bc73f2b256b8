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
read and written where they keep them (`tensors.mtp_tensors`); DeepSeek's FP8
block-quantised weights are dequantised as they are read (`files.SafetensorsReader`).

One adapter per family, a module of its name (`qwen3_moe`, `olmoe`, `mixtral`, `dots1`,
`glm4_moe`, `deepseek_v3`), says where its config.json and its tensors' names differ
from the layout they share (`family`); `families` chooses one, `config` maps
config.json, `tensors` the parameters layer by layer, `files` reads safetensors,
`checkpoint` writes and reads a whole checkpoint directory.
"""

from jaxmoe.hf.checkpoint import check_out_dir, load_hf, read_config, save_hf
from jaxmoe.hf.config import ARCHITECTURE, config_from_hf, hf_config, with_architecture
from jaxmoe.hf.families import ADAPTERS, ALIASES, FAMILIES, SIGMOID, adapter, family_for
from jaxmoe.hf.family import HFError
from jaxmoe.hf.files import INDEX, SafetensorsReader

__all__ = ["ADAPTERS", "ALIASES", "ARCHITECTURE", "FAMILIES", "HFError", "INDEX", "SIGMOID",
           "SafetensorsReader", "adapter", "check_out_dir", "config_from_hf", "family_for",
           "hf_config", "load_hf", "read_config", "save_hf", "with_architecture"]

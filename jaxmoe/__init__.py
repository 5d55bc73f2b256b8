"""jaxmoe: Mixture-of-Experts language-model training in JAX."""

from jaxmoe.api import apply, init, init_moe_layer, load_params, moe_layer, moe_layer_params
from jaxmoe.config import Config, config_from_dict, load_config

__all__ = ["Config", "apply", "config_from_dict", "init", "init_moe_layer", "load_config",
           "load_params", "moe_layer", "moe_layer_params"]

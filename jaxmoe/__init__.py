"""jaxmoe: Mixture-of-Experts language-model training in JAX.

The pure-function API is imported on first use, so `import jaxmoe.config` (and the
planner, which must set the fake device count first) does not start JAX.
"""

from jaxmoe.config import Config, config_from_dict, load_config

import importlib
import importlib.util

_API = ("apply", "init", "init_moe_layer", "load_params", "moe_layer", "moe_layer_params")

__all__ = ["Config", "config_from_dict", "load_config", "load_hf", *_API]


def __getattr__(name: str):
    if name in _API:
        from jaxmoe import api
        return getattr(api, name)
    if name == "load_hf":
        from jaxmoe.hf import load_hf
        return load_hf
    # submodules on first use too: jaxmoe.hf, jaxmoe.plan, ...
    if importlib.util.find_spec(f"jaxmoe.{name}") is not None:
        return importlib.import_module(f"jaxmoe.{name}")
    raise AttributeError(f"module 'jaxmoe' has no attribute {name!r}")

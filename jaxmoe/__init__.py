"""jaxmoe: Mixture-of-Experts language-model training in JAX.

The pure-function API is imported on first use, so `import jaxmoe.config` (and the
planner, which must set the fake device count first) does not start JAX.
"""

import importlib
import importlib.util
import logging
import os

from jaxmoe.config import Config, config_from_dict, load_config


def _no_gpu() -> bool:
    """Whether this machine has no NVIDIA GPU (no driver, no device node)."""
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0",
                                                 "/proc/driver/nvidia/version"))


def _quiet_gpu_plugin_on_cpu() -> None:
    """On a machine without a GPU but with the CUDA plugin installed (XLA:GPU's
    compiler, which the test extra brings), JAX logs the plugin's failed start, a
    20-line traceback, every time it starts, then runs on the CPU as it would have:
    that one record is dropped. A machine with a GPU logs it as ever."""
    if _no_gpu():
        logging.getLogger("jax._src.xla_bridge").addFilter(
            lambda record: not record.getMessage().startswith("Jax plugin configuration error"))


_quiet_gpu_plugin_on_cpu()

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

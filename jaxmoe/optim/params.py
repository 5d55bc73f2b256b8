"""Parameters by path: their names, and the weight-decay mask (norms and biases never
decay; `optimizer.no_decay` names the rest that do not)."""

from __future__ import annotations

import fnmatch

import jax


def param_name(path) -> str:
    """A parameter's path joined with "/", e.g. "moe_layers/moe/router/w" (an nnx
    Variable's trailing `.value` left out)."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts)


def _is_norm_or_bias(name: str, p) -> bool:
    """Vectors, and what the name says is a norm or a bias: stacked layers give a
    norm's scale a leading layer axis, so the rank alone would call it a matrix."""
    parts = name.lower().split("/")
    return (p.ndim < 2 or any("norm" in part for part in parts)
            or parts[-1].endswith(("bias", "scale")))


def decays(name: str, p, no_decay: tuple[str, ...]) -> bool:
    """Whether weight decay applies to the parameter `p` at path `name`."""
    return not (_is_norm_or_bias(name, p) or any(fnmatch.fnmatchcase(name, pattern)
                                                 for pattern in no_decay))


def decay_mask(params, no_decay: tuple[str, ...]):
    """A tree like `params` holding, for each parameter, whether it decays. Static:
    it depends on paths and ranks only."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: decays(param_name(path), p, no_decay), params)


def param_names(params) -> list[str]:
    return [param_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def unmatched_patterns(params, no_decay: tuple[str, ...]) -> list[str]:
    """The `no_decay` patterns that match no parameter of `params` (typos)."""
    names = param_names(params)
    return [pattern for pattern in no_decay
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]

"""A NumPy reading of the MoE stack's stored layout, kept apart from
`jaxmoe.checkpoint.to_model_order` so that tests can check it."""

import jax
import numpy as np

from jaxmoe.model.transformer import stored_layer_order


def in_model_order(tree, cfg):
    """A stored-layout tree (a pipeline's: by stage, maybe padded) with every MoE
    leaf's layer axis in model order, padding dropped."""
    keep = np.argsort(stored_layer_order(cfg))[: cfg.num_moe_layers]
    return jax.tree_util.tree_map_with_path(
        lambda p, a: a[keep] if "'moe_layers'" in jax.tree_util.keystr(p) else a, tree)

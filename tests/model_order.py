"""A NumPy reading of how pipeline stages hold the MoE stack ([V, S, per, ...],
flattening to model order then padding), kept apart from `jaxmoe.parallel.pipeline`
so that tests can check it."""

import jax
import numpy as np


def in_model_order(tree, cfg):
    """A state tree as a layout of `cfg` stores it with every MoE leaf [Lm, ...] in
    model order (a pipeline's stage-held stack flattened, its padding dropped)."""
    if max(cfg.mesh.stage, 1) == 1:
        return tree
    Lm = cfg.num_moe_layers

    def flat(path, a):
        if "'moe_layers'" not in jax.tree_util.keystr(path):
            return a
        a = np.asarray(a)
        return a.reshape((-1,) + a.shape[3:])[:Lm]

    return jax.tree_util.tree_map_with_path(flat, tree)


def same_init(got, want):
    """Two inits of the same model: equal but for the last bits of the truncated
    normal's erf_inv, which XLA evaluates in whatever fusion the program puts it (a
    few ulps, 2^-20 relative at most here); a layer drawn for another slot differs
    by the init's whole scale."""
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2.0 ** -20, atol=0),
                 got, want)

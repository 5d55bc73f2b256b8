"""Decoder-only MoE transformer with layers stacked and scanned.

Layers of one kind share a stack whose parameters carry a leading `layers`
axis; `lax.scan` runs the stack, so compile time does not grow with depth.
The first `num_dense_layers` layers form a dense-MLP stack, the rest a MoE stack.

Nothing here knows the mesh: calls take a layout that pins activations, dispatches
tokens and runs the MoE stack (`jaxmoe.model.layout`'s for one device, the default;
a mesh's from `jaxmoe.parallel.layout`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import Config, ModelConfig, MoEConfig
from jaxmoe.model.attention import MAX_LOGIT, Attention, unmeasured
from jaxmoe.model.layers import MLP, RMSNorm, param
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.mla import LatentAttention
from jaxmoe.model.moe import MoE
from jaxmoe.model.mtp import MTPModule, valid_targets
from jaxmoe.model.remat import LAYER_INPUT, REMAT_POLICIES


def init_stds(m: ModelConfig) -> tuple[float, float]:
    """Init std of a block's input projections, and of its output projections (scaled
    down with depth, so the residual stream's variance stays put)."""
    return m.init_std, m.init_std / math.sqrt(2 * m.num_layers)


class Block(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, use_moe: bool, rngs: nnx.Rngs, *,
                 mlp_chunk: int = 0, max_logits: bool = False):
        """mlp_chunk: a dense MLP's positions at a time (0: all); max_logits: report the
        heads' largest attention logits (QK-clip rescales heads by them)."""
        std, out_std = init_stds(m)
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        self.attn = attention_class(m)(m, out_std, rngs)
        self.mlp_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        if use_moe:
            self.moe = MoE(m.d_model, moe, std, out_std, rngs)
        else:
            self.mlp = MLP(m.d_model, m.mlp_hidden, std, out_std, rngs)
        self.use_moe = use_moe
        self.mlp_chunk = mlp_chunk
        self.with_max_logits = max_logits

    def __call__(self, x_BxLxD, positions_BxL, layout: LocalLayout = LOCAL_LAYOUT,
                 jitter_key=None):
        """x after the layer, and its aux: the MoE's ({} for a dense layer), and with
        QK-clip its heads' largest attention logits (`attention.MAX_LOGIT`)."""
        x_BxLxD = layout.constrain_batch(x_BxLxD)
        y_BxLxD = self.attn(self.attn_norm(x_BxLxD), positions_BxL, layout,
                            self.with_max_logits)
        logits = {}
        if self.with_max_logits:
            y_BxLxD, logits = y_BxLxD[0], {MAX_LOGIT: y_BxLxD[1]}
        x_BxLxD, aux = self.feed_forward(x_BxLxD + y_BxLxD, layout, jitter_key)
        return layout.constrain_batch(x_BxLxD), {**aux, **logits}

    def feed_forward(self, x_BxLxD, layout: LocalLayout = LOCAL_LAYOUT, jitter_key=None):
        """The block's second half, shared with KV-cache decoding: x + MLP or MoE of
        norm(x), and the MoE's aux ({} for a dense layer)."""
        h = self.mlp_norm(x_BxLxD)
        if self.use_moe:
            y, aux = self.moe(h, layout, jitter_key)
        else:
            with jax.named_scope("dense_mlp"):
                y, aux = _in_chunks(self.mlp, h, self.mlp_chunk), {}
        return x_BxLxD + y, aux


def attention_class(cfg) -> type[Attention] | type[LatentAttention]:
    """The attention module of `cfg` (a ModelConfig): `model.attention` names it."""
    return LatentAttention if cfg.attention == "mla" else Attention


def _in_chunks(per_position, x_BxLxD, chunk: int):
    """per_position(x) for a function of each position alone, `chunk` positions at a
    time, each chunk recomputed in the backward pass (at once when chunk is 0 or
    does not cut L, as in decoding)."""
    L = x_BxLxD.shape[1]
    if not chunk or chunk >= L or L % chunk:
        return per_position(x_BxLxD)
    return _joined(jax.lax.map(jax.checkpoint(per_position, prevent_cse=False),
                               _chunks(x_BxLxD, chunk)))


def _chunks(a_BxLx, chunk: int) -> jax.Array:
    """[B, L, ...] as [L / chunk, B, chunk, ...]: chunks of positions to map over."""
    B, L = a_BxLx.shape[:2]
    return a_BxLx.reshape(B, L // chunk, chunk, *a_BxLx.shape[2:]).swapaxes(0, 1)


def _joined(a_NxBxLcx) -> jax.Array:
    """`_chunks` undone: [N, B, chunk, ...] as [B, N * chunk, ...]."""
    N, B, Lc = a_NxBxLcx.shape[:3]
    return a_NxBxLcx.swapaxes(0, 1).reshape(B, N * Lc, *a_NxBxLcx.shape[3:])


def in_moe_stack(path) -> bool:
    """Whether a tree path runs through the MoE stack (a `moe_layers` key)."""
    return any(getattr(k, "key", None) == "moe_layers" for k in path)


def map_moe_stack(fn, tree):
    """`tree` (params, buffers, optimizer state or a whole TrainState: anything whose
    MoE stack sits under a `moe_layers` key) with `fn` applied to each MoE leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, a: fn(a) if in_moe_stack(path) else a,
                                            tree)


def _stack(m: ModelConfig, moe: MoEConfig, use_moe: bool, n: int, rngs: nnx.Rngs, held=None,
           mtp: bool = False, **block_options) -> Block | MTPModule:
    """n blocks stacked on a leading `layers` axis, layer i drawn from the i-th of the
    rng stream's splits (a prefix of any longer split's). mtp: multi-token prediction
    modules around the blocks, on an axis of their own (`mtp_layers`).

    held: a `StageStack` (a pipeline's): the stack made as its stages hold it,
    [W, S, per, ...], the same layers as ever at their model-order positions and
    zeros in the padding. Each stage's chunks are drawn stage-major ([S, W, per]
    flattened), so a program sharded over `stage` draws each chunk on its stage.
    """
    # MoE layers are what pipeline stages split ("layers" -> stage); the few dense
    # layers in front run replicated, like the embedding.
    axis = "mtp_layers" if mtp else "layers" if use_moe else "dense_layers"

    def make(key, count):
        r = nnx.Rngs(params=key)
        r.params.count[...] = count
        block = Block(m, moe, use_moe, r, **block_options)
        if mtp:
            return MTPModule(m.d_model, m.norm_eps, init_stds(m)[0], block, r)
        return block

    make = nnx.vmap(make, in_axes=(0, 0), out_axes=0,
                    transform_metadata={nnx.PARTITION_NAME: axis})
    slots = n if held is None else held.slots
    forked = nnx.split_rngs(rngs, splits=slots, graph_updates=False).params
    keys, counts = forked.key[...], forked.count[...]
    if held is None:
        return make(keys, counts)
    W, S, per = held
    order = held.stage_major()
    blocks = make(keys[order], counts[order])
    real = held.real(n)

    def to_held(a):  # [S W per, ...] -> [W, S, per, ...], padding zeroed
        a = jnp.swapaxes(a.reshape(S, W, per, *a.shape[1:]), 0, 1)
        return jnp.where(real.reshape(real.shape + (1,) * (a.ndim - 3)), a, jnp.zeros((), a.dtype))

    nnx.update(blocks, jax.tree.map(to_held, nnx.state(blocks)))
    return blocks


def run_stack(stack: Block, x_BxLxD, positions_BxL, layout, key, remat: str):
    """Scans the stacked blocks over x; returns x and the per-layer aux, stacked."""
    graphdef, state = nnx.split(stack)
    return scan_layers(graphdef, state, x_BxLxD, positions_BxL, layout, key, remat)


def scan_layers(graphdef, state, x_BxLxD, positions_BxL, layout, key, remat: str, active_N=None,
                unroll: bool = False, fetch=None):
    """lax.scan of one block over stacked layer states (leading axis = layers).

    active_N: per-layer flags; an inactive layer passes x through and reports nothing
    (`attention.unmeasured`).
    unroll: the layers one after another rather than in a loop: their weights are
    then static slices of the stack and their gradients land in the stack's
    gradient where they belong, where a loop stacks them into a zeroed buffer of
    its own first (a pipeline stage's few layers, run once per iteration).
    fetch: what makes a layer's stored state into the state it computes with (a
    layout's: gathering it over the mesh). The scan then fetches one layer ahead:
    layer i computes with what the iteration before fetched while layer i + 1's is
    fetched beside it, so the fetch (and, in the backward pass, its transpose) has a
    layer's compute to hide behind. What the layers compute is unchanged.
    """
    n = jax.tree.leaves(state)[0].shape[0]
    keys = None if key is None else jax.random.split(key, n)

    def body(x, layer):
        layer_state, k, active = layer
        y, aux = nnx.merge(graphdef, layer_state)(x, positions_BxL, layout, k)
        if active is not None:
            y = jnp.where(active, y, x)
            aux = {k: jnp.where(active, a, unmeasured(k, a)) for k, a in aux.items()}
        # unrolled, no fusion spans two layers: each computes (and rounds) as in a loop
        return jax.lax.optimization_barrier(y) if unroll else y, aux

    if remat != "none":
        layer = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
        body = lambda x, xs: layer(checkpoint_name(x, LAYER_INPUT), xs)  # noqa: E731
    with jax.named_scope("layers"):
        if fetch is None:
            return jax.lax.scan(body, x_BxLxD, (state, keys, active_N), unroll=unroll)
        if unroll:
            raise ValueError("scan_layers: fetch runs a loop; it cannot be unrolled")
        return _scan_fetching_ahead(body, fetch, x_BxLxD, (state, keys, active_N))


def _scan_fetching_ahead(body, fetch, x, xs):
    """`lax.scan(body, x, xs)` where body takes `fetch` of each layer's state: layers
    0 .. n - 2 in a loop that fetches the next layer's as it computes one, the last
    after it with what the loop's last iteration fetched (one layer: a loop of none)."""
    state, *per_layer = xs
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731

    def step(carry, xs):
        x, ready = carry
        following, *rest = xs
        fetched = fetch(following)  # layer i + 1's, beside layer i's compute
        y, aux = body(x, (ready, *rest))
        return (y, fetched), aux

    following = jax.tree.map(lambda a: a[1:], state)
    head = [None if a is None else a[:-1] for a in per_layer]
    (x, last), aux = jax.lax.scan(step, (x, fetch(at(state, 0))), (following, *head))
    y, aux_last = body(x, (last, *[None if a is None else a[-1] for a in per_layer]))
    return y, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), aux, aux_last)


class Transformer(nnx.Module):
    def __init__(self, model: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs, held=None, *,
                 mlp_chunk: int = 0, max_logits: bool = False):
        """held: a pipeline's `StageStack`, to make the MoE stack as its stages hold it
        (the same values, [W, S, per, ...]); None: [Lm, ...] in model order. mlp_chunk
        and max_logits: each block's (see `Block`)."""
        m = model
        options = {"mlp_chunk": mlp_chunk, "max_logits": max_logits}
        self.embed = param(rngs, (m.vocab_size, m.d_model), ("vocab", "embed"), m.init_std)
        if m.num_dense_layers:
            self.dense_layers = _stack(m, moe, False, m.num_dense_layers, rngs, **options)
        if m.num_moe_layers:
            self.moe_layers = _stack(m, moe, True, m.num_moe_layers, rngs, held, **options)
        if m.mtp_layers:
            self.mtp_layers = _stack(m, moe, m.num_moe_layers > 0, m.mtp_layers, rngs, mtp=True,
                                     **options)
        self.final_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        self.head = param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), m.init_std)
        self.model_cfg = m

    @classmethod
    def of(cls, cfg: Config, rngs: nnx.Rngs, held=None) -> Transformer:
        """The model a run's config describes: its `model` and `moe` sections, the dense
        MLP's chunks (`train.dense_mlp_chunk`), and the largest attention logits QK-clip
        reads (`optimizer.qk_clip`). The one place the model is made from a whole config."""
        return cls(cfg.model, cfg.moe, rngs, held, mlp_chunk=cfg.train.dense_mlp_chunk,
                   max_logits=cfg.optimizer.qk_clip > 0)

    def __call__(self, tokens_BxL: jax.Array, *, layout: LocalLayout = LOCAL_LAYOUT,
                 key: jax.Array | None = None, remat: str = "none") -> tuple[jax.Array, dict]:
        """Returns fp32 logits [B, L, V] and aux: per MoE layer router stats, stacked.

        `key` enables training-time randomness (router jitter); `layout` says where the
        model runs (one device by default; a mesh's for expert parallelism and pipelines).
        """
        x_BxLxD, aux = self.hidden(tokens_BxL, layout=layout, key=key, remat=remat)
        return self.logits(x_BxLxD, layout), aux

    def hidden(self, tokens_BxL: jax.Array, *, layout: LocalLayout = LOCAL_LAYOUT,
               key: jax.Array | None = None, remat: str = "none") -> tuple[jax.Array, dict]:
        """The last block's output [B, L, D] (before the final norm) and aux: the MoE
        layers' router stats, and with QK-clip every layer's heads' largest logits
        [num_layers, H] in model order (`attention.MAX_LOGIT`)."""
        B, L = tokens_BxL.shape
        positions_BxL = layout.positions(B, L)
        x, dense_aux = self.front(tokens_BxL, layout=layout, remat=remat)
        aux = {}
        if self.model_cfg.num_moe_layers:
            x, aux = layout.run_moe_stack(self, x, positions_BxL, key, remat)
        if MAX_LOGIT in dense_aux:  # the dense layers' before the MoE layers'
            moe = [aux[MAX_LOGIT]] if MAX_LOGIT in aux else []
            aux = {**aux, MAX_LOGIT: jnp.concatenate([dense_aux[MAX_LOGIT], *moe])}
        return x, aux

    def front(self, tokens_BxL: jax.Array, *, layout: LocalLayout = LOCAL_LAYOUT,
              remat: str = "none") -> tuple[jax.Array, dict]:
        """What runs before the MoE layers: the embedding and the dense layers. Returns
        x [B, L, D] and the dense layers' aux ({} without them)."""
        m = self.model_cfg
        B, L = tokens_BxL.shape
        with jax.named_scope("embed"):
            x = self.embed[...][tokens_BxL].astype(jnp.dtype(m.compute_dtype))
        x = layout.constrain_batch(x)
        if not m.num_dense_layers:
            return x, {}
        return run_stack(self.dense_layers, x, layout.positions(B, L), layout, None, remat)

    def mtp_losses(self, h_BxLxD: jax.Array, tokens_BxLn: jax.Array, *,
                   layout: LocalLayout = LOCAL_LAYOUT, key: jax.Array | None = None,
                   remat: str = "none", chunk: int = 0) -> tuple[jax.Array, dict]:
        """The multi-token prediction modules' cross-entropies [N] (each the mean over
        the positions whose target lies in their row) and their layers' aux stacked
        [N, ...] ({} without MoE layers), from `hidden`'s output h over L inputs.
        tokens_BxLn: the L inputs and the 1 + N tokens after them (zeros past a row's
        end; `jaxmoe.model.mtp`)."""
        N = self.model_cfg.mtp_layers
        B, L, _ = h_BxLxD.shape
        positions_BxL = layout.positions(B, L)
        length = layout.sequence_length(L)
        graphdef, state = nnx.split(self.mtp_layers)
        keys = None if key is None else jax.random.split(jax.random.fold_in(key, 1), N)

        def depth(module_state, h, embedded, k):
            return nnx.merge(graphdef, module_state)(h, embedded, positions_BxL, layout, k)

        if remat != "none":
            layer = jax.checkpoint(depth, policy=REMAT_POLICIES[remat], prevent_cse=False)
            depth = lambda st, h, *xs: layer(st, checkpoint_name(h, LAYER_INPUT), *xs)  # noqa: E731
        ces, auxes = [], []
        for d in range(1, N + 1):
            module_state = jax.tree.map(lambda a: a[d - 1], state)  # noqa: B023
            with jax.named_scope(f"mtp_{d}"):
                embedded = self.embed[...][tokens_BxLn[:, d:d + L]].astype(
                    jnp.dtype(self.model_cfg.compute_dtype))
                h_BxLxD, aux = depth(module_state, h_BxLxD, embedded,
                                     None if keys is None else keys[d - 1])
                ce = self.cross_entropy(h_BxLxD, tokens_BxLn[:, d + 1:d + 1 + L], layout, chunk,
                                        nnx.merge(graphdef, module_state).out_norm,
                                        valid_targets(positions_BxL, length, d))
            ces.append(ce * length / (length - d))  # the mean over counted positions
            auxes.append(aux)
        return jnp.stack(ces), jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    def moe_stack(self) -> tuple[nnx.GraphDef, nnx.State]:
        """The MoE layers' graphdef and stacked state: [Lm, ...] in model order, or
        [W, S, per, ...] for a model made `held` by pipeline stages."""
        return nnx.split(self.moe_layers)

    def scan_moe_layers(self, x_BxLxD, positions_BxL, layout: LocalLayout, key, remat: str):
        """The MoE layers, one scan in model order (a layout without pipeline stages)."""
        graphdef, state = self.moe_stack()
        return scan_layers(graphdef, state, x_BxLxD, positions_BxL, layout, key, remat)

    def logits(self, x_BxLxD: jax.Array, layout: LocalLayout = LOCAL_LAYOUT,
               norm: RMSNorm | None = None) -> jax.Array:
        """Final norm (or `norm`: a multi-token prediction module's) and LM head: fp32
        logits [B, L, V]."""
        with jax.named_scope("lm_head"):
            x_BxLxD = (norm or self.final_norm)(x_BxLxD)
            logits = jnp.einsum("bld,dv->blv", x_BxLxD, self.head[...].astype(x_BxLxD.dtype))
            return layout.constrain_batch(logits).astype(jnp.float32)

    def target_logprobs(self, x_BxLxD: jax.Array, targets_BxL: jax.Array,
                        layout: LocalLayout = LOCAL_LAYOUT,
                        chunk: int = 0) -> tuple[jax.Array, jax.Array]:
        """From `hidden`'s output: log p(target) [B, L], and whether each target is the
        model's argmax [B, L] (the first of tied maxima, as torch's argmax). chunk > 0:
        the head runs `chunk` positions at a time, never holding B x L x V logits."""

        def score(x_BxLbxD, targets_BxLb):
            logits = self.logits(x_BxLbxD, layout)
            logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BxLb[..., None],
                                          axis=-1)[..., 0]
            return logprob, jnp.argmax(logits, axis=-1) == targets_BxLb

        L = x_BxLxD.shape[1]
        if not chunk or chunk >= L or L % chunk:
            return score(x_BxLxD, targets_BxL)
        scores = jax.lax.map(lambda xs: score(*xs),
                             (_chunks(x_BxLxD, chunk), _chunks(targets_BxL, chunk)))
        return tuple(_joined(a_NxBxLb) for a_NxBxLb in scores)

    def cross_entropy(self, x_BxLxD: jax.Array, targets_BxL: jax.Array,
                      layout: LocalLayout = LOCAL_LAYOUT,
                      chunk: int = 0, norm: RMSNorm | None = None,
                      counted_BxL: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy from `hidden`'s output (`norm`: see `logits`),
        over all B x L positions, those not `counted` adding zero. chunk > 0: the head
        runs `chunk` positions at a time, recomputed in the backward pass, so only
        [B, chunk, V] logits exist at once."""
        B, L, _ = x_BxLxD.shape

        def ce_sum(x_BxLbxD, targets_BxLb, counted_BxLb=None):
            logits = self.logits(x_BxLbxD, layout, norm)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxLb)
            return jnp.sum(ce if counted_BxLb is None else jnp.where(counted_BxLb, ce, 0.0))

        if not chunk or chunk >= L:
            return ce_sum(x_BxLxD, targets_BxL, counted_BxL) / (B * L)

        @jax.checkpoint
        def chunk_ce(total, xs):
            return total + ce_sum(*xs), None

        xs = (_chunks(x_BxLxD, chunk), _chunks(targets_BxL, chunk))
        if counted_BxL is not None:
            xs += (_chunks(counted_BxL, chunk),)
        # a zero that varies over the same mesh axes as x (inside the ddp step)
        zero = jnp.zeros_like(x_BxLxD[0, 0, 0], dtype=jnp.float32)
        total, _ = jax.lax.scan(chunk_ce, zero, xs)
        return total / (B * L)

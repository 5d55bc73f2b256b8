"""What a config's values must satisfy: each section's own checks, then those that tie
sections together, run whenever a `Config` is made, before anything compiles. Each
failure is a `ConfigError` naming the key at fault. The checks that need the devices
(the mesh a config resolves to, the model's parameters on it) are
`jaxmoe.step.checks`, which `build_steps` runs; `check_expert_split` and
`check_context_split` serve both."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sections run these checks when made: they import this module
    from jaxmoe.config.sections import (Config, DataConfig, LoggingConfig, MeshConfig,
                                        ModelConfig, MoEConfig, OptimizerConfig, TrainConfig)

# the device mesh's axes, outermost first (`jaxmoe.parallel.sharding` says what each holds)
MESH_AXES = ("data", "stage", "context", "expert")


class ConfigError(ValueError):
    """A config problem; the message names the offending key."""


def require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_expert_split(num_experts: int, expert: int) -> None:
    """Each expert rank holds num_experts / expert of them; run wherever `expert` is
    known (the config, a resolved mesh, a caller's mesh)."""
    require(num_experts % expert == 0, "moe.num_experts",
             f"{num_experts} experts cannot be split over mesh.expert={expert}")


def check_context_split(c: Config, context: int) -> None:
    """Each device holds seq_len / context positions of its rows and, inside attention,
    num_heads / context of the heads over the whole sequence; run wherever `context`
    is known (the config, a resolved mesh)."""
    m, t = c.model, c.train
    require(c.mesh.parallelism == "ddp", "mesh.context",
             f"splitting sequences over {context} devices needs mesh.parallelism: ddp")
    require(t.seq_len % context == 0, "mesh.context",
             f"train.seq_len={t.seq_len} cannot be split into {context} equal chunks")
    require(m.num_heads % context == 0, "mesh.context",
             f"attention spreads model.num_heads={m.num_heads} over {context} devices")
    require(m.num_kv_heads % context == 0 or context % m.num_kv_heads == 0, "mesh.context",
             f"model.num_kv_heads={m.num_kv_heads} neither divides over {context} devices "
             "nor repeats evenly to them")
    for key in ("loss_chunk", "dense_mlp_chunk"):
        chunk, per_device = getattr(t, key), t.seq_len // context
        require(not chunk or chunk >= per_device or per_device % chunk == 0, f"train.{key}",
                 f"{chunk} does not divide the {per_device} positions each of mesh.context="
                 f"{context} devices holds")


# numbers that must be above zero; the others of these sections must not be below it
_POSITIVE = {f"model.{k}" for k in ("vocab_size", "d_model", "num_layers", "num_heads",
                                    "num_kv_heads")} | {"train.steps", "train.batch_size",
                                                        "train.seq_len", "train.max_bad_steps"}


def check_signs(c: Config) -> None:
    """No number below zero, and those of `_POSITIVE` above it."""
    for sec_name in ("model", "moe", "train", "train.evals", "optimizer", "checkpoint", "logging",
                     "pipeline"):
        sec = c
        for part in sec_name.split("."):
            sec = getattr(sec, part)
        for f in dataclasses.fields(sec):
            v, key = getattr(sec, f.name), f"{sec_name}.{f.name}"
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                require(v > 0 if key in _POSITIVE else v >= 0, key,
                        f"must be {'positive' if key in _POSITIVE else '>= 0'}, got {v}")


def check_model(m: ModelConfig) -> None:
    require(m.num_heads % m.num_kv_heads == 0, "model.num_heads",
            f"{m.num_heads} heads are not divisible by num_kv_heads={m.num_kv_heads}")
    if not m.head_dim:
        require(m.d_model % m.num_heads == 0, "model.d_model",
                f"{m.d_model} is not divisible by num_heads={m.num_heads} (or set model.head_dim)")
    require(m.attention == "mla" or m.head_size % 2 == 0, "model.head_dim",
            f"RoPE needs an even head size, got {m.head_size}")
    if m.attention == "mla":
        require(m.kv_lora_rank > 0, "model.kv_lora_rank", "mla needs a latent of at least 1")
        require(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
                "model.qk_rope_head_dim", f"mla needs an even RoPE part, got {m.qk_rope_head_dim}")
        require(m.v_head_dim > 0, "model.v_head_dim", "mla needs values of at least 1")
        require(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
                f"mla gives each of the {m.num_heads} heads its own key and value; set "
                f"num_kv_heads: {m.num_heads}")
        require(m.qk_norm == "none", "model.qk_norm", "mla normalises its latents, not q and k")
        require(m.rope_fraction == 1.0, "model.rope_fraction",
                "mla rotates qk_rope_head_dim of each head")
    if m.yarn_factor:
        require(m.yarn_factor > 1 and m.yarn_original_max_positions > 0, "model.yarn_factor",
                f"YaRN stretches RoPE by a factor above 1 of yarn_original_max_positions "
                f"(> 0); got {m.yarn_factor} of {m.yarn_original_max_positions}")
    require(0 < m.rope_fraction <= 1 and m.rotary_dims % 2 == 0 and m.rotary_dims > 0,
            "model.rope_fraction", f"{m.rope_fraction} of head size {m.head_size} rotates "
            f"{m.rotary_dims} dimensions; need an even number, at least 2, in (0, 1]")
    require(m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
            f"{m.num_dense_layers} exceeds num_layers={m.num_layers}")
    if m.num_dense_layers:
        require(m.mlp_hidden > 0, "model.mlp_hidden", "dense layers need a positive hidden size")


def check_moe(moe: MoEConfig) -> None:
    """A model with MoE layers' router and experts."""
    require(moe.num_experts > 0, "moe.num_experts", "must be positive")
    require(0 < moe.top_k <= moe.num_experts, "moe.top_k",
            f"{moe.top_k} must be in [1, num_experts={moe.num_experts}]")
    require(moe.expert_hidden > 0, "moe.expert_hidden", "must be positive")
    require(moe.capacity_factor > 0, "moe.capacity_factor", "must be positive")
    require(moe.exchange_chunks >= 1, "moe.exchange_chunks", "must be at least 1")
    G = moe.routing_groups
    require(G > 0 and moe.num_experts % G == 0, "moe.routing_groups",
            f"{G} groups cannot split {moe.num_experts} experts evenly")
    if G > 1:
        require(moe.num_experts // G >= 2, "moe.routing_groups",
                f"{moe.num_experts} experts in {G} groups leave one a group; a group's "
                "score sums its two best experts")
    require(1 <= moe.groups_per_token <= G, "moe.groups_per_token",
            f"{moe.groups_per_token} must be in [1, routing_groups={G}]")
    require(moe.top_k <= moe.groups_per_token * (moe.num_experts // G), "moe.top_k",
            f"{moe.top_k} experts cannot be picked from {moe.groups_per_token} group(s) of "
            f"{moe.num_experts // G}")


def check_mesh(mesh: MeshConfig) -> None:
    for axis in MESH_AXES:
        v = getattr(mesh, axis)
        require(v == -1 or v > 0, f"mesh.{axis}", f"must be positive or -1, got {v}")
    require([getattr(mesh, a) for a in MESH_AXES].count(-1) <= 1, "mesh",
            "at most one axis may be -1")


def check_train(t: TrainConfig) -> None:
    require(t.mtp_loss_weight >= 0, "train.mtp_loss_weight", "must be non-negative")
    for key in ("loss_chunk", "dense_mlp_chunk"):
        chunk = getattr(t, key)
        require(not chunk or t.seq_len % chunk == 0, f"train.{key}",
                f"{chunk} does not divide train.seq_len={t.seq_len}")
    require(t.accumulation_steps > 0 and t.batch_size % t.accumulation_steps == 0,
            "train.accumulation_steps", f"batch_size={t.batch_size} is not divisible by "
            f"accumulation_steps={t.accumulation_steps}")
    require(all(name.strip() for name in t.evals.tasks), "train.evals.tasks", "empty task name")
    require(all(p.strip() for p in t.evals.include_path), "train.evals.include_path", "empty path")


def check_optimizer(o: OptimizerConfig) -> None:
    require(o.learning_rate > 0, "optimizer.learning_rate", "must be positive")
    require(0.0 <= o.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    require(0.0 < o.decay_fraction <= 1.0, "optimizer.decay_fraction", "must be in (0, 1]")
    require(0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0, "optimizer.b1", "betas must be in [0, 1)")
    require(all(p.strip() for p in o.no_decay), "optimizer.no_decay", "empty pattern")
    if o.name == "muon":
        require(0.0 <= o.muon_momentum < 1.0, "optimizer.muon_momentum", "must be in [0, 1)")
        require(o.muon_ns_steps > 0, "optimizer.muon_ns_steps", "must be positive")
        require(o.muon_rms > 0, "optimizer.muon_rms", "must be positive")
    else:
        for key in ("muon_momentum", "muon_ns_steps", "muon_rms", "muon_ns_dtype",
                    "adamw_params"):
            require(getattr(o, key) == getattr(type(o), key), f"optimizer.{key}",
                    f"used by muon only, not {o.name}")
    if o.name in ("adamw", "muon"):
        require(not o.optax_kwargs, "optimizer.optax_kwargs",
                f"jaxmoe's {o.name} takes none (its knobs are optimizer.b1, b2, eps); name an "
                "optax optimizer to use them, e.g. optimizer.name: optax.adamw")
    else:
        # the optax optimizer itself (its name, arguments and one test update) is
        # checked where it is built, by jaxmoe.optim.make_optimizer
        for key in ("b1", "b2", "eps"):
            require(getattr(o, key) == getattr(type(o), key), f"optimizer.{key}",
                    f"used by adamw only; give {o.name} its {key} in optimizer.optax_kwargs")


def check_data(d: DataConfig) -> None:
    require(0.0 < d.heldout_fraction <= 0.5, "data.heldout_fraction", "must be in (0, 0.5]")
    if d.source != "stdlib":
        require(bool(d.path), "data.path", f"source '{d.source}' needs a path")
    if d.source != "tokens":
        require(d.tokenizer == "bytes", "data.tokenizer",
                f"source '{d.source}' reads bytes; to train on text with {d.tokenizer!r}, "
                f"tokenize it with python -m jaxmoe.data.prepare and use source: tokens")
        require(isinstance(d.path, str | None), "data.path",
                f"source '{d.source}' takes one path, got {list(d.path or ())}")
    if d.weights is not None:
        entries = 1 if isinstance(d.path, str) else len(d.path or ())
        require(d.source == "tokens" and len(d.weights) == entries, "data.weights",
                f"{len(d.weights)} weights for {entries} data.path entries (source "
                f"{d.source}); give one weight per entry of a tokens source")
        require(all(w > 0 for w in d.weights), "data.weights", "must all be positive")
    require(d.prefetch >= 0, "data.prefetch", "must be >= 0")


def check_logging(lg: LoggingConfig) -> None:
    require(lg.log_every > 0, "logging.log_every", "must be positive")
    require(bool(lg.wandb_project.strip()), "logging.wandb_project", "must not be empty")


def projection_shapes(c: Config) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each dense projection the model has, as one matrix each
    (`jaxmoe.model.mx_weights.PROJECTIONS`)."""
    m, moe = c.model, c.moe
    D, H, Hd, Hv = m.d_model, m.num_heads, m.head_size, m.value_size
    shapes = {"w_o": (H * Hv, D)}
    if m.attention == "mla":
        Rq, Rkv = m.q_lora_rank, m.kv_lora_rank
        shapes |= {"w_kv_a": (D, Rkv + m.qk_rope_head_dim),
                   "w_kv_b": (Rkv, H * (m.qk_nope_head_dim + Hv))}
        shapes |= ({"w_q_a": (D, Rq), "w_q_b": (Rq, H * Hd)} if Rq else {"w_q": (D, H * Hd)})
    else:
        shapes |= {"w_q": (D, H * Hd), "w_k": (D, m.num_kv_heads * Hd),
                   "w_v": (D, m.num_kv_heads * Hd)}
    for name, hidden, present in (("mlp", m.mlp_hidden, m.num_dense_layers),
                                  ("shared", moe.shared_expert_hidden, c.num_moe_layers)):
        if present and hidden:
            shapes |= {f"{name}.w_gate_up": (D, 2 * hidden), f"{name}.w_down": (hidden, D)}
    return shapes


def check_across(c: Config) -> None:
    """What ties sections together: lengths against train.seq_len, the mesh and the
    pipeline against the layers and the batch, options against the model."""
    m, moe, t, o = c.model, c.moe, c.train, c.optimizer
    if m.attention_block:
        require(t.seq_len % m.attention_block == 0, "model.attention_block",
                f"{m.attention_block} does not divide train.seq_len={t.seq_len}")
    require(t.grad_reduce_dtype == "float32" or c.mesh.parallelism == "ddp",
            "train.grad_reduce_dtype", f"{t.grad_reduce_dtype} applies to the ddp step, whose "
            f"reductions it places; mesh.parallelism is {c.mesh.parallelism}")
    require(0 <= m.mtp_layers < t.seq_len, "model.mtp_layers",
            f"{m.mtp_layers} must be in [0, train.seq_len={t.seq_len})")
    if c.num_moe_layers and moe.expert_precision == "mxfp8":
        require(m.d_model % 32 == 0 and moe.expert_hidden % 32 == 0, "moe.expert_precision",
                "mxfp8 blocks of 32 need d_model and expert_hidden divisible by 32")
    if m.projection_precision == "mxfp8":
        uneven = {name: shape for name, shape in projection_shapes(c).items()
                  if any(n % 32 for n in shape)}
        require(not uneven, "model.projection_precision", "mxfp8 blocks of 32 need every "
                f"projection's inputs and outputs divisible by 32; not {uneven}")
        if moe.mxfp8_weight_grad:  # their weight gradients block a call's rows by 32
            rows = t.seq_len // max(c.mesh.context, 1)
            require(rows % 32 == 0 and t.dense_mlp_chunk % 32 == 0, "moe.mxfp8_weight_grad",
                    "MXFP8 projections' weight gradients block rows by 32: train.seq_len / "
                    f"mesh.context ({rows}) and train.dense_mlp_chunk "
                    f"({t.dense_mlp_chunk}) must be multiples of 32")
    if c.mesh.context != 1:
        check_context_split(c, c.mesh.context)
    if c.num_moe_layers and c.mesh.expert > 0:
        check_expert_split(moe.num_experts, c.mesh.expert)
    M, W = c.pipeline.stage_microbatches, c.pipeline.virtual_stages
    require(W >= 1, "pipeline.virtual_stages", "must be at least 1")
    if W > 1:  # circular
        require(c.mesh.stage > 1, "mesh.stage", "virtual stages need an explicit stage count "
                "above 1")
        require(M >= c.mesh.stage, "pipeline.stage_microbatches",
                f"a circular schedule needs at least as many micro-batches as stages "
                f"({c.mesh.stage})")
    if c.mesh.stage > 1:
        require(c.num_moe_layers >= c.mesh.stage * W, "mesh.stage",
                f"{c.num_moe_layers} MoE layers cannot fill {c.mesh.stage} stages "
                f"x {W} virtual stages")
    A = max(t.accumulation_steps, 1)
    require(c.pipeline.schedule in ("circular", "1f1b"), "pipeline.schedule",
            f"{c.pipeline.schedule!r} is not one of 'circular', '1f1b'")
    if c.pipeline.schedule == "1f1b" and c.mesh.stage != 1:  # without stages it is inert
        require(c.mesh.stage > 1, "pipeline.schedule", "1f1b needs an explicit stage count "
                f"(mesh.stage above 1, not {c.mesh.stage})")
        require(c.mesh.parallelism == "ddp", "pipeline.schedule", "1f1b runs in the ddp step "
                "(mesh.parallelism: ddp)")
        require(t.remat == "full", "pipeline.schedule", "1f1b recomputes every chunk from its "
                f"input in its backward: train.remat must be 'full', not {t.remat!r}")
        require(W == 1 or A * M % c.mesh.stage == 0, "pipeline.schedule",
                f"interleaved 1f1b runs a step's micro-batches (accumulation_steps x "
                f"stage_microbatches = {A * M}) in groups of mesh.stage = {c.mesh.stage}")
    require(M > 0 and (t.batch_size // A) % M == 0, "pipeline.stage_microbatches",
            f"{M} does not divide the batch of one accumulation step, {t.batch_size // A}")
    require(o.warmup_steps < t.steps, "optimizer.warmup_steps",
            f"{o.warmup_steps} must be below train.steps={t.steps}")
    require(not o.qk_clip or m.qk_norm == "none", "optimizer.qk_clip",
            f"model.qk_norm: {m.qk_norm} normalises q and k after their projections and "
            "would undo QK-clip's rescaling of them; use model.qk_norm: none")
    if c.data.source != "tokens":
        require(m.vocab_size >= 256, "model.vocab_size", "byte-level corpora need at least 256")
    span = c.logging.profile_steps
    if span is not None:
        require(len(span) == 2 and 1 <= span[0] <= span[1] <= t.steps, "logging.profile_steps",
                f"expected [start, stop] with 1 <= start <= stop <= train.steps={t.steps}, "
                f"got {list(span)}")


def validate(c: Config) -> None:
    """Every check of a config: each section's own, then those across sections."""
    check_signs(c)
    check_model(c.model)
    if c.num_moe_layers:
        check_moe(c.moe)
    check_mesh(c.mesh)
    check_train(c.train)
    check_optimizer(c.optimizer)
    check_data(c.data)
    check_logging(c.logging)
    require(c.checkpoint.keep > 0, "checkpoint.keep", "must keep at least one checkpoint")
    check_across(c)

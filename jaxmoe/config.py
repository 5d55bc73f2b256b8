"""Frozen run configuration: YAML in, validated dataclasses out, derived sizes.

Every section is a frozen dataclass. `load_config(path, overrides)` reads YAML,
applies dotted `key=value` overrides, rejects unknown keys, wrong types and
inconsistent values with a `ConfigError` naming the key, before anything compiles.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem; the message names the offending key."""


@dataclass(frozen=True)
class ModelConfig:
    """The transformer: sizes, attention (grouped-query or MLA), RoPE and YaRN,
    multi-token prediction."""
    vocab_size: int = 256  # token ids the embedding and LM head hold (>= the tokenizer's)
    d_model: int = 128  # the residual stream's width
    num_layers: int = 4  # transformer layers, dense and MoE
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key and value heads (grouped-query attention; num_heads divides by it)
    head_dim: int = 0  # 0: d_model // num_heads
    mlp_hidden: int = 512  # hidden width of the dense (non-MoE) MLP layers
    num_dense_layers: int = 0  # the first N layers use a dense MLP instead of MoE
    # RMSNorm of queries and keys before RoPE: per head over head_dim (Qwen3, dots1),
    # over the whole projection, all heads at once (OLMoE), or none (Mixtral)
    qk_norm: Literal["none", "head", "full"] = "head"
    rope_theta: float = 10_000.0  # RoPE's base wavelength
    # share of each head's dimensions RoPE rotates (the first ones; GLM-4.5 rotates half)
    rope_fraction: float = 1.0
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    # standard deviation of the initial weights, a normal truncated at 3 sigma (output
    # projections: divided by sqrt(2 num_layers))
    init_std: float = 0.02
    # dtype of activations and the GEMMs' operands; parameters and the optimizer stay fp32
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # 0: jax.nn.dot_product_attention (cuDNN's fused kernel on GPU, the whole L x L
    # score matrix elsewhere); N: blocks of N queries x N keys with an online
    # softmax, so memory grows with L * N (long sequences without a fused kernel)
    attention_block: int = 0
    # "gqa": grouped-query attention (num_heads queries over num_kv_heads keys and
    # values of head_dim). "mla": DeepSeek-V2/V3's multi-head latent attention
    # (jaxmoe/model/mla.py): queries through a q_lora_rank bottleneck (0: one full
    # projection), keys and values expanded from one kv_lora_rank latent per token;
    # each head's query and key hold qk_nope_head_dim dimensions without RoPE and
    # qk_rope_head_dim with it (the key's rotated part shared by all heads), its
    # value v_head_dim; num_kv_heads equals num_heads, head_dim and qk_norm unused
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0  # mla: the query's bottleneck; 0: one full query projection
    kv_lora_rank: int = 0  # mla: the latent each token's keys and values expand from
    qk_nope_head_dim: int = 0  # mla: a head's query and key dimensions without RoPE
    qk_rope_head_dim: int = 0  # mla: and with RoPE (the key's rotated part shared by all heads)
    v_head_dim: int = 0  # mla: a head's value size
    # RoPE rotates a head's dimension pairs (i, i + R/2) (Llama's rotate-half) or, as
    # DeepSeek's checkpoints lay them out, (2i, 2i + 1) (transformers' rope_interleave)
    rope_interleave: bool = False
    # YaRN context extension of RoPE (transformers' rope_parameters of type yarn);
    # yarn_factor 0: plain RoPE
    yarn_factor: float = 0.0
    yarn_original_max_positions: int = 0  # the context length RoPE was trained at
    # YaRN: dimensions turning more often than this over the original length keep their
    # frequency
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0  # YaRN: dimensions turning fewer times than this, fully interpolated
    yarn_mscale: float = 1.0  # YaRN's cos/sin scale term
    # DeepSeek's softmax-scale term (and the cos/sin scale's divisor)
    yarn_mscale_all_dim: float = 0.0
    # DeepSeek-V3's multi-token prediction (jaxmoe/model/mtp.py): N modules after the
    # last layer, the k-th predicting the token k + 1 ahead; trained with
    # train.mtp_loss_weight, never run by generation or scoring
    mtp_layers: int = 0

    @property
    def head_size(self) -> int:
        """A query's and key's size per head (MLA: the part without RoPE and the part
        with it)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.num_heads

    @property
    def value_size(self) -> int:
        """A value's size per head."""
        return self.v_head_dim if self.attention == "mla" else self.head_size

    @property
    def rotary_dims(self) -> int:
        """How many of a head's dimensions RoPE rotates (the first ones; MLA: its
        qk_rope_head_dim, the last ones)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_size * self.rope_fraction)


@dataclass(frozen=True)
class MoEConfig:
    """The MoE layers: router, experts, dispatch, capacity, balancing, expert precision."""
    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is sent to
    expert_hidden: int = 256  # each expert's SwiGLU hidden width
    shared_expert_hidden: int = 0  # 0: no shared expert
    score_func: Literal["softmax", "sigmoid"] = "softmax"  # the router's expert scores, in fp32
    renormalize: bool = True  # rescale the top-k gates to sum to one
    gate_scale: float = 1.0  # then multiply them by this (dots1's routed_scaling_factor)
    # group-limited routing (DeepSeek-V3, GLM-4.5): the experts in routing_groups
    # contiguous groups; each token keeps the groups_per_token groups whose two best
    # selection scores sum highest, and picks its top_k among their experts
    routing_groups: int = 1
    groups_per_token: int = 1  # the groups each token picks its experts from
    expert_bias: bool = False  # selection-only per-expert bias (aux-loss-free balancing)
    bias_update_rate: float = 1e-3  # bias += rate * sign(mean load - load) after each step
    router_jitter: float = 0.0  # multiplicative input noise in training, e.g. 0.01
    # how routed tokens reach their experts (jaxmoe.model.dispatch, jaxmoe.parallel.ep_dispatch):
    # dense (every expert on every token: the reference), grouped (one device), or over
    # mesh.expert: alltoall, allgather, ragged (lax.ragged_all_to_all; for GPUs)
    dispatcher: Literal["dense", "grouped", "alltoall", "allgather", "ragged"] = "grouped"
    # rows of each expert's buffer = factor x its uniform share T * K / E, over a
    # device's T tokens (grouped, alltoall) or its expert group's (ragged, allgather);
    # copies past it are dropped and counted. E / K never drops (room for every token)
    capacity_factor: float = 1.25
    # a step whose copies overflow the buffers: drop them (counted in drop_fraction);
    # rerun it, its update not applied, at doubled capacity up to E / K (jaxmoe.step.overflow);
    # or raise, stopping with the demand seen
    on_overflow: Literal["drop", "rerun", "raise"] = "drop"
    # expert GEMMs: in model.compute_dtype, or MXFP8 (e4m3 blocks of 32 with e8m0 scales)
    expert_precision: Literal["compute", "mxfp8"] = "compute"
    mxfp8_weight_grad: bool = False  # mxfp8: weight gradients in MXFP8 too (else bf16)
    # mxfp8 block scale: "ceil" 2^ceil(log2(amax / 448)), never saturating (cuBLAS's and
    # Transformer Engine's RCEIL), or "floor" 2^(floor(log2 amax) - 8), the OCP MX spec's
    mxfp8_scale: Literal["ceil", "floor"] = "ceil"
    balance_loss_weight: float = 0.01  # the Switch load-balancing loss's weight; 0: off
    # tokens over which the Switch loss's f and P are taken: each device's
    # micro-batch, each sequence, or the whole (micro)batch across data-parallel ranks
    balance_scope: Literal["microbatch", "sequence", "global"] = "microbatch"
    z_loss_weight: float = 0.001  # the router z-loss's weight (mean squared logsumexp)


# the device mesh's axes, outermost first (`jaxmoe.parallel.sharding` says what each holds)
MESH_AXES = ("data", "stage", "context", "expert")


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh and how the state is placed on it (`jaxmoe.parallel.sharding`)."""
    data: int = -1  # -1: all devices left over
    expert: int = 1  # devices the experts are split over (expert parallelism)
    stage: int = 1  # pipeline stages the MoE layers are split over
    # devices each sequence is split over (long context): every device holds a
    # contiguous chunk of seq_len / context positions of its rows; attention gathers
    # heads across the chunks (`jaxmoe.parallel.context`); ddp only
    context: int = 1
    # ddp: dense weights replicated, experts resident, tokens routed; fsdp: weights also
    # split over data and gathered where used
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    zero1: bool = True  # shard optimizer state over each tensor's replica axes

    @property
    def devices(self) -> int:
        """The mesh's devices (every axis given: none -1)."""
        return math.prod(getattr(self, a) for a in MESH_AXES)

    @property
    def token_shards(self) -> int:
        """Devices holding different tokens of a batch: data x context x expert."""
        return self.data * self.context * self.expert


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline stages' schedule (`mesh.stage` sets how many stages)."""
    stage_microbatches: int = 1  # micro-batches flowing through the stages, per accumulation step
    # chunks of layers per device: 1 is GPipe; 2 or more a circular schedule that
    # visits them round-robin
    virtual_stages: int = 1


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its schedule, weight decay, clipping and QK-clip."""
    # "adamw": jaxmoe's fused AdamW (b1, b2, eps below). "muon": Muon for the weight
    # matrices (attention, MLPs, shared and routed experts, each expert's matrices on
    # their own) and that AdamW for the rest (jaxmoe/optim/muon.py). Any other name is an optax
    # optimizer function ("lion", "adafactor", "sgd", ...; "optax.adamw" for optax's
    # own), called with the schedule as its learning_rate, and weight_decay, no_decay
    # (as its mask) and mu_dtype where it takes them; a step that is skipped for a
    # non-finite loss or gradient leaves its state as it was. Optimizers that take
    # statistics over whole tensors (adafactor, lamb, lars, ...) need mesh.parallelism:
    # fsdp where the mesh splits tensors: the ddp step updates each device's part alone.
    name: str = "adamw"
    # further arguments of an optax optimizer, e.g. {b2: 0.99} for lion (optax's
    # defaults otherwise: b1, b2 and eps above are the fused AdamW's)
    optax_kwargs: dict[str, Any] = field(default_factory=dict)
    learning_rate: float = 3e-3  # the peak, after warmup
    # after warmup: cosine decay, wsd (warmup, stable, decay), or constant
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20  # linear warmup from 0
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    min_lr_ratio: float = 0.1  # the learning rate the decay ends at, over the peak
    b1: float = 0.9  # adamw: first-moment decay
    b2: float = 0.95  # adamw: second-moment decay
    eps: float = 1e-8  # adamw: added to the second moment's root
    weight_decay: float = 0.1  # decoupled: each step subtracts lr * weight_decay * parameter
    # parameters left out of weight decay: glob patterns matched against a parameter's
    # path, e.g. "embed" (the token embedding, as OLMo), "*router*", "head"; [] decays
    # every matrix. Norms and biases never decay (1-D tensors, and paths with a part
    # containing "norm" or ending in "bias" or "scale").
    no_decay: tuple[str, ...] = ("embed",)
    # dtype of the stored first moment; bfloat16 halves its memory (the update is
    # still computed in float32; the second moment stays float32)
    mu_dtype: Literal["float32", "bfloat16"] = "float32"
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    muon_momentum: float = 0.95  # muon: Nesterov momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations orthogonalizing the momentum
    # muon: the RMS each matrix's update is scaled to, per sqrt(max(fan_in, fan_out))
    # (Moonlight's 0.2, which lets AdamW's learning rate and weight decay carry over)
    muon_rms: float = 0.2
    # the dtype of the Newton-Schulz products: float32 (optax's numbers) or bfloat16
    # (the tensor cores' rate; the momentum and the update stay float32)
    muon_ns_dtype: Literal["float32", "bfloat16"] = "float32"
    # muon: glob patterns of parameter paths AdamW updates even where they are matrices
    # (e.g. "dense_layers/*")
    adamw_params: tuple[str, ...] = ()
    # QK-clip (MuonClip's, with any optimizer): after each update, the query and key
    # projections of every head whose largest attention logit in the step exceeded
    # this are scaled so that its logits shrink to it (jaxmoe/optim/qk_clip.py; Kimi K2 used
    # 100). 0: off. Needs model.qk_norm: none.
    qk_clip: float = 0.0

    def __hash__(self) -> int:
        """Configs are static jit arguments; optax_kwargs' values may be unhashable
        (lists), so only its keys are hashed (equal configs still hash equally)."""
        return hash(tuple(tuple(sorted(v)) if isinstance(v, dict) else v
                          for v in (getattr(self, f.name) for f in dataclasses.fields(self))))


@dataclass(frozen=True)
class DataConfig:
    """What the run trains on (`jaxmoe.data`)."""
    # stdlib: byte tokens of Python's standard library (no download); text: UTF-8 files
    # as bytes; tokens: token shards (python -m jaxmoe.data.prepare)
    source: Literal["stdlib", "text", "tokens"] = "stdlib"
    # tokens: a prepared directory, a shard, a glob, or a list of them (a mixture)
    path: str | tuple[str, ...] | None = None
    weights: tuple[float, ...] | None = None  # one per path entry; None: equal
    # "bytes", or a Hugging Face tokenizer.json (or a directory holding one)
    tokenizer: str = "bytes"
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # of index-less raw shards
    heldout_fraction: float = 0.05  # share held out for evaluation (raw shards: each one's tail)
    # text: a binary file (a NUL byte) or one not UTF-8 stops the run (refuse), has its
    # bad bytes replaced by U+FFFD (replace; binary files still stop it), or is left out
    bad_text: Literal["refuse", "replace", "skip"] = "refuse"
    prefetch: int = 2  # batches read ahead in a background thread; 0: none


@dataclass(frozen=True)
class EvalsConfig:
    """Downstream evaluations inside training (lm-eval task definitions, jaxmoe.eval.downstream)."""
    # task names: jaxmoe's own (stdlib_word_order, stdlib_next_line), lm-eval's, or YAMLs
    # under include_path; scored by log-likelihood (generation runs on checkpoints,
    # with python -m jaxmoe.eval)
    tasks: tuple[str, ...] = ()
    every: int = 0  # steps between evaluations; 0: with the held-out loss (train.eval_every)
    limit: int = 0  # examples per task; 0: all of them
    num_fewshot: int | None = None  # None: each task's own setting (0 if it has none)
    include_path: tuple[str, ...] = ()  # directories of task YAMLs


@dataclass(frozen=True)
class TrainConfig:
    """The step: batch, length, recomputation, gradient dtypes, evaluation, the run
    directory."""
    steps: int = 200  # optimizer steps
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 256  # tokens per sequence
    # the batch is split into this many slices, run one after another with their
    # gradients summed (gradient accumulation)
    accumulation_steps: int = 1
    # what each layer keeps for the backward pass (the rest is recomputed there):
    # none: everything; full: only its input; matmuls: the outputs of dots without
    # batch dims (projections, router, dense MLP) and of the expert GEMMs;
    # save_expert_gemms / save_attention / save_exchange: only those named tensors
    # (both expert GEMMs' outputs / attention's q, k, v and core output / the
    # buffers an expert-parallel exchange receives, both ways); offload: the expert
    # GEMM outputs and attention's tensors, in pinned host memory (on CPU, where
    # host memory is device memory, the same as keeping them). See jaxmoe/model/remat.py.
    remat: Literal["none", "full", "matmuls", "save_expert_gemms", "save_attention",
                   "save_exchange", "offload"] = "none"
    # 0: logits for the whole sequence at once; N: the LM head and cross-entropy run
    # N positions at a time (recomputed in the backward), never holding B x L x V logits
    loss_chunk: int = 0
    # the multi-token prediction modules' loss, the mean over their depths, is added
    # to the main loss times this (DeepSeek-V3: 0.3, then 0.1 late in training)
    mtp_loss_weight: float = 0.3
    # 0: the dense layers' MLP over every position at once; N: N positions at a time,
    # each slice recomputed in the backward (a [B, N, 2 mlp_hidden] hidden at once)
    dense_mlp_chunk: int = 0
    # dtype the ddp step reduces the matrices' gradients in, widened into the fp32
    # ZeRO-1 shard: bfloat16 sends half the bytes and never holds a whole fp32
    # gradient, each addition of the sum rounded to bf16 (norms and the router
    # reduce in fp32 either way)
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # dtype the matrices' gradients are summed in over `accumulation_steps` slices:
    # bfloat16 holds the sum in half the memory (a parameter-size buffer of the
    # many-expert configs), each of its additions rounded to bf16; the slices'
    # gradients are bf16 already wherever the compute dtype is (norms and the
    # router sum in fp32 either way)
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0  # of the initial weights, the data order and the steps' random keys
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8  # held-out batches (of each source, with a mixture)
    evals: EvalsConfig = field(default_factory=EvalsConfig)  # downstream tasks in training
    max_bad_steps: int = 5  # stop after this many consecutive non-finite steps (each is skipped)
    run_dir: str = "runs/default"  # where checkpoints, metrics.jsonl and config.yaml go


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are saved and kept."""
    every: int = 0  # save every N steps; 0: only at the end
    keep: int = 2  # keep the last K checkpoints
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of N; 0: none
    # a newer checkpoint that does not read back whole: resume from the newest one that
    # does, the damaged one set aside (renamed, kept); false: refuse to resume
    skip_damaged: bool = True


@dataclass(frozen=True)
class LoggingConfig:
    """metrics.jsonl, the progress bar, metric sinks, the profiler."""
    log_every: int = 10  # steps between lines of metrics.jsonl
    progress: bool = True  # a tqdm progress bar with the loss and load summary
    tensorboard: bool = False  # also write TensorBoard event files to RUN_DIR/tensorboard
    wandb: bool = False  # also log to a W&B run (files in RUN_DIR/wandb)
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: `wandb sync` uploads later
    wandb_project: str = "jaxmoe"  # the W&B project
    wandb_entity: str | None = None  # the W&B team or user; None: the account's default
    wandb_name: str | None = None  # the run's display name; None: the run directory's name
    # [start, stop]: a jax.profiler trace of train steps start..stop (inclusive) in
    # RUN_DIR/profile, for TensorBoard's profile plugin or Perfetto; None: no trace
    profile_steps: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        validate(self)

    @property
    def num_moe_layers(self) -> int:
        return self.model.num_layers - self.model.num_dense_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- validation


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_expert_split(num_experts: int, expert: int) -> None:
    """Each expert rank holds num_experts / expert of them; run wherever `expert` is
    known (the config, a resolved mesh, a caller's mesh)."""
    _require(num_experts % expert == 0, "moe.num_experts",
             f"{num_experts} experts cannot be split over mesh.expert={expert}")


def check_context_split(c: Config, context: int) -> None:
    """Each device holds seq_len / context positions of its rows and, inside attention,
    num_heads / context of the heads over the whole sequence; run wherever `context`
    is known (the config, a resolved mesh)."""
    m, t = c.model, c.train
    _require(c.mesh.parallelism == "ddp", "mesh.context",
             f"splitting sequences over {context} devices needs mesh.parallelism: ddp")
    _require(t.seq_len % context == 0, "mesh.context",
             f"train.seq_len={t.seq_len} cannot be split into {context} equal chunks")
    _require(m.num_heads % context == 0, "mesh.context",
             f"attention spreads model.num_heads={m.num_heads} over {context} devices")
    _require(m.num_kv_heads % context == 0 or context % m.num_kv_heads == 0, "mesh.context",
             f"model.num_kv_heads={m.num_kv_heads} neither divides over {context} devices "
             "nor repeats evenly to them")
    for key in ("loss_chunk", "dense_mlp_chunk"):
        chunk, per_device = getattr(t, key), t.seq_len // context
        _require(not chunk or chunk >= per_device or per_device % chunk == 0, f"train.{key}",
                 f"{chunk} does not divide the {per_device} positions each of mesh.context="
                 f"{context} devices holds")


# numbers that must be above zero; the others of these sections must not be below it
_POSITIVE = {f"model.{k}" for k in ("vocab_size", "d_model", "num_layers", "num_heads",
                                    "num_kv_heads")} | {"train.steps", "train.batch_size",
                                                        "train.seq_len", "train.max_bad_steps"}


def validate(c: Config) -> None:
    """Cross-field checks; each names the key at fault."""
    m, moe, t, o = c.model, c.moe, c.train, c.optimizer
    for sec_name in ("model", "moe", "train", "train.evals", "optimizer", "checkpoint", "logging",
                     "pipeline"):
        sec = c
        for part in sec_name.split("."):
            sec = getattr(sec, part)
        for f in dataclasses.fields(sec):
            v, key = getattr(sec, f.name), f"{sec_name}.{f.name}"
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _require(v > 0 if key in _POSITIVE else v >= 0, key,
                         f"must be {'positive' if key in _POSITIVE else '>= 0'}, got {v}")
    _require(m.num_heads % m.num_kv_heads == 0, "model.num_heads",
             f"{m.num_heads} heads are not divisible by num_kv_heads={m.num_kv_heads}")
    if not m.head_dim:
        _require(m.d_model % m.num_heads == 0, "model.d_model",
                 f"{m.d_model} is not divisible by num_heads={m.num_heads} (or set model.head_dim)")
    _require(m.attention == "mla" or m.head_size % 2 == 0, "model.head_dim",
             f"RoPE needs an even head size, got {m.head_size}")
    if m.attention == "mla":
        _require(m.kv_lora_rank > 0, "model.kv_lora_rank", "mla needs a latent of at least 1")
        _require(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
                 "model.qk_rope_head_dim", f"mla needs an even RoPE part, got {m.qk_rope_head_dim}")
        _require(m.v_head_dim > 0, "model.v_head_dim", "mla needs values of at least 1")
        _require(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
                 f"mla gives each of the {m.num_heads} heads its own key and value; set "
                 f"num_kv_heads: {m.num_heads}")
        _require(m.qk_norm == "none", "model.qk_norm", "mla normalises its latents, not q and k")
        _require(m.rope_fraction == 1.0, "model.rope_fraction",
                 "mla rotates qk_rope_head_dim of each head")
    if m.yarn_factor:
        _require(m.yarn_factor > 1 and m.yarn_original_max_positions > 0, "model.yarn_factor",
                 f"YaRN stretches RoPE by a factor above 1 of yarn_original_max_positions "
                 f"(> 0); got {m.yarn_factor} of {m.yarn_original_max_positions}")
    _require(0 < m.rope_fraction <= 1 and m.rotary_dims % 2 == 0 and m.rotary_dims > 0,
             "model.rope_fraction", f"{m.rope_fraction} of head size {m.head_size} rotates "
             f"{m.rotary_dims} dimensions; need an even number, at least 2, in (0, 1]")
    if m.attention_block:
        _require(t.seq_len % m.attention_block == 0, "model.attention_block",
                 f"{m.attention_block} does not divide train.seq_len={t.seq_len}")
    for key in ("loss_chunk", "dense_mlp_chunk"):
        chunk = getattr(t, key)
        _require(not chunk or t.seq_len % chunk == 0, f"train.{key}",
                 f"{chunk} does not divide train.seq_len={t.seq_len}")
    _require(t.grad_reduce_dtype == "float32" or c.mesh.parallelism == "ddp",
             "train.grad_reduce_dtype", f"{t.grad_reduce_dtype} applies to the ddp step, whose "
             f"reductions it places; mesh.parallelism is {c.mesh.parallelism}")
    _require(0 <= m.mtp_layers < t.seq_len, "model.mtp_layers",
             f"{m.mtp_layers} must be in [0, train.seq_len={t.seq_len})")
    _require(t.mtp_loss_weight >= 0, "train.mtp_loss_weight", "must be non-negative")
    _require(m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
             f"{m.num_dense_layers} exceeds num_layers={m.num_layers}")
    if m.num_dense_layers:
        _require(m.mlp_hidden > 0, "model.mlp_hidden", "dense layers need a positive hidden size")
    if c.num_moe_layers:
        _require(moe.num_experts > 0, "moe.num_experts", "must be positive")
        _require(0 < moe.top_k <= moe.num_experts, "moe.top_k",
                 f"{moe.top_k} must be in [1, num_experts={moe.num_experts}]")
        _require(moe.expert_hidden > 0, "moe.expert_hidden", "must be positive")
        _require(moe.capacity_factor > 0, "moe.capacity_factor", "must be positive")
        G = moe.routing_groups
        _require(G > 0 and moe.num_experts % G == 0, "moe.routing_groups",
                 f"{G} groups cannot split {moe.num_experts} experts evenly")
        if G > 1:
            _require(moe.num_experts // G >= 2, "moe.routing_groups",
                     f"{moe.num_experts} experts in {G} groups leave one a group; a group's "
                     "score sums its two best experts")
        _require(1 <= moe.groups_per_token <= G, "moe.groups_per_token",
                 f"{moe.groups_per_token} must be in [1, routing_groups={G}]")
        _require(moe.top_k <= moe.groups_per_token * (moe.num_experts // G), "moe.top_k",
                 f"{moe.top_k} experts cannot be picked from {moe.groups_per_token} group(s) of "
                 f"{moe.num_experts // G}")
        if moe.expert_precision == "mxfp8":
            _require(m.d_model % 32 == 0 and moe.expert_hidden % 32 == 0, "moe.expert_precision",
                     "mxfp8 blocks of 32 need d_model and expert_hidden divisible by 32")
    for axis in MESH_AXES:
        v = getattr(c.mesh, axis)
        _require(v == -1 or v > 0, f"mesh.{axis}", f"must be positive or -1, got {v}")
    _require([getattr(c.mesh, a) for a in MESH_AXES].count(-1) <= 1, "mesh",
             "at most one axis may be -1")
    if c.mesh.context != 1:
        check_context_split(c, c.mesh.context)
    if c.num_moe_layers and c.mesh.expert > 0:
        check_expert_split(moe.num_experts, c.mesh.expert)
    M, W = c.pipeline.stage_microbatches, c.pipeline.virtual_stages
    _require(W >= 1, "pipeline.virtual_stages", "must be at least 1")
    if W > 1:  # circular
        _require(c.mesh.stage > 1, "mesh.stage", "virtual stages need an explicit stage count "
                 "above 1")
        _require(M >= c.mesh.stage, "pipeline.stage_microbatches",
                 f"a circular schedule needs at least as many micro-batches as stages "
                 f"({c.mesh.stage})")
    if c.mesh.stage > 1:
        _require(c.num_moe_layers >= c.mesh.stage * W, "mesh.stage",
                 f"{c.num_moe_layers} MoE layers cannot fill {c.mesh.stage} stages "
                 f"x {W} virtual stages")
    A = max(t.accumulation_steps, 1)
    _require(M > 0 and (t.batch_size // A) % M == 0, "pipeline.stage_microbatches",
             f"{M} does not divide the batch of one accumulation step, {t.batch_size // A}")
    _require(t.accumulation_steps > 0 and t.batch_size % t.accumulation_steps == 0,
             "train.accumulation_steps", f"batch_size={t.batch_size} is not divisible by "
             f"accumulation_steps={t.accumulation_steps}")
    _require(o.learning_rate > 0, "optimizer.learning_rate", "must be positive")
    _require(0.0 <= o.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    _require(0.0 < o.decay_fraction <= 1.0, "optimizer.decay_fraction", "must be in (0, 1]")
    _require(0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0, "optimizer.b1", "betas must be in [0, 1)")
    _require(o.warmup_steps < t.steps, "optimizer.warmup_steps",
             f"{o.warmup_steps} must be below train.steps={t.steps}")
    _require(all(p.strip() for p in o.no_decay), "optimizer.no_decay", "empty pattern")
    if o.name == "muon":
        _require(0.0 <= o.muon_momentum < 1.0, "optimizer.muon_momentum", "must be in [0, 1)")
        _require(o.muon_ns_steps > 0, "optimizer.muon_ns_steps", "must be positive")
        _require(o.muon_rms > 0, "optimizer.muon_rms", "must be positive")
    else:
        for key in ("muon_momentum", "muon_ns_steps", "muon_rms", "muon_ns_dtype",
                    "adamw_params"):
            _require(getattr(o, key) == getattr(OptimizerConfig, key), f"optimizer.{key}",
                     f"used by muon only, not {o.name}")
    _require(not o.qk_clip or m.qk_norm == "none", "optimizer.qk_clip",
             f"model.qk_norm: {m.qk_norm} normalises q and k after their projections and "
             "would undo QK-clip's rescaling of them; use model.qk_norm: none")
    if o.name in ("adamw", "muon"):
        _require(not o.optax_kwargs, "optimizer.optax_kwargs",
                 f"jaxmoe's {o.name} takes none (its knobs are optimizer.b1, b2, eps); name an "
                 "optax optimizer to use them, e.g. optimizer.name: optax.adamw")
    else:
        # the optax optimizer itself (its name, arguments and one test update) is
        # checked where it is built, by jaxmoe.optim.make_optimizer
        for key in ("b1", "b2", "eps"):
            _require(getattr(o, key) == getattr(OptimizerConfig, key), f"optimizer.{key}",
                     f"used by adamw only; give {o.name} its {key} in optimizer.optax_kwargs")
    _require(0.0 < c.data.heldout_fraction <= 0.5, "data.heldout_fraction", "must be in (0, 0.5]")
    d = c.data
    if d.source != "stdlib":
        _require(bool(d.path), "data.path", f"source '{d.source}' needs a path")
    if d.source != "tokens":
        _require(m.vocab_size >= 256, "model.vocab_size", "byte-level corpora need at least 256")
        _require(d.tokenizer == "bytes", "data.tokenizer",
                 f"source '{d.source}' reads bytes; to train on text with {d.tokenizer!r}, "
                 f"tokenize it with python -m jaxmoe.data.prepare and use source: tokens")
        _require(isinstance(d.path, str | None), "data.path",
                 f"source '{d.source}' takes one path, got {list(d.path or ())}")
    if d.weights is not None:
        entries = 1 if isinstance(d.path, str) else len(d.path or ())
        _require(d.source == "tokens" and len(d.weights) == entries, "data.weights",
                 f"{len(d.weights)} weights for {entries} data.path entries (source "
                 f"{d.source}); give one weight per entry of a tokens source")
        _require(all(w > 0 for w in d.weights), "data.weights", "must all be positive")
    _require(d.prefetch >= 0, "data.prefetch", "must be >= 0")
    _require(c.logging.log_every > 0, "logging.log_every", "must be positive")
    _require(bool(c.logging.wandb_project.strip()), "logging.wandb_project", "must not be empty")
    span = c.logging.profile_steps
    if span is not None:
        _require(len(span) == 2 and 1 <= span[0] <= span[1] <= t.steps, "logging.profile_steps",
                 f"expected [start, stop] with 1 <= start <= stop <= train.steps={t.steps}, "
                 f"got {list(span)}")
    _require(all(name.strip() for name in t.evals.tasks), "train.evals.tasks", "empty task name")
    _require(all(p.strip() for p in t.evals.include_path), "train.evals.include_path", "empty path")
    _require(c.checkpoint.keep > 0, "checkpoint.keep", "must keep at least one checkpoint")


# ---------------------------------------------------------------- loading


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Returns `value` coerced to `tp` (int -> float only), or raises naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is dict:  # dict[str, X]: YAML gives a mapping, copied so the config owns it
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        value_tp = typing.get_args(tp)[1]
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be names, got {type(k).__name__} {k!r}")
        return {k: copy.deepcopy(v) if value_tp is Any else _check_type(v, value_tp, f"{key}.{k}")
                for k, v in value.items()}
    if origin is tuple:  # tuple[X, ...]: YAML gives a list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_check_type(v, typing.get_args(tp)[0], f"{key}[{i}]")
                     for i, v in enumerate(value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


# Keys that meant two things: both are refused, naming the new keys.
_BOTH_MICROBATCHES = ("gradient accumulation is now train.accumulation_steps and the "
                      "micro-batches flowing through pipeline stages pipeline.stage_microbatches")
RENAMED = {"train.microbatches": _BOTH_MICROBATCHES, "pipeline.microbatches": _BOTH_MICROBATCHES}
# Values that older configs and checkpoints spell another way.
LEGACY_VALUES = {"model.qk_norm": {True: "head", False: "none"}}


def _retired_schedule(pipeline: dict) -> None:
    """pipeline.schedule, which only restated virtual_stages: checked and dropped."""
    value = pipeline.pop("schedule")
    W = pipeline.get("virtual_stages", PipelineConfig.virtual_stages)
    implied = "circular" if isinstance(W, int) and W > 1 else "gpipe"
    if value != implied:
        raise ConfigError(f"pipeline.schedule: {value!r} disagrees with virtual_stages={W}, "
                          f"which means {implied!r}; the key is no longer read (virtual_stages "
                          "alone picks the schedule): drop it")


# Keys older configs and checkpoints hold that no longer choose anything.
RETIRED = {"pipeline.schedule": _retired_schedule}


def current_value(key: str, value: Any) -> Any:
    """`value` of the dotted `key` as this jaxmoe spells it."""
    if type(value) is bool and key in LEGACY_VALUES:
        return LEGACY_VALUES[key][value]
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in list(raw):
        key = f"{prefix}.{name}" if prefix else name
        if key in RENAMED:
            raise ConfigError(f"{key}: renamed, {RENAMED[key]}")
        if key in RETIRED:
            RETIRED[key](raw)
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{key}: unknown key (valid: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        value = current_value(key, value)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key)
        else:
            kwargs[name] = _check_type(value, tp, key)
    return cls(**kwargs)  # Config.__post_init__ runs validate()


def _apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected section.key=value")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{dotted}: cannot parse value {text!r}: {e}") from None


def config_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds a validated Config from nested dicts plus dotted overrides."""
    raw = copy.deepcopy(raw or {})
    for o in overrides:
        _apply_override(raw, o)
    return _build(Config, raw, "")


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that a mapping repeats (the plain loader keeps
    the last, silently)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise _DuplicateKey(f"key {key!r} appears twice in one section (lines "
                                    f"{lines[key]} and {key_node.start_mark.line + 1})")
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """A validated Config from a YAML file, with dotted overrides ("moe.top_k=4") applied
    after it; ConfigError names the first bad key (unknown, mistyped, repeated or
    inconsistent)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506: a safe loader
    except _DuplicateKey as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    return config_from_dict(raw, overrides)


def override_config(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`cfg` with dotted overrides ("train.steps=100") applied, validated again."""
    return config_from_dict(cfg.to_dict(), overrides)


def dropless(cfg: Config) -> Config:
    """`cfg` with MoE buffers that hold every routed copy: capacity factor E / K, so a
    token's output never depends on the other tokens of its batch."""
    if not cfg.num_moe_layers:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, capacity_factor=cfg.moe.num_experts / cfg.moe.top_k))


# ---------------------------------------------------------------- derived sizes

# Keys whose change alters parameter or optimizer-state shapes.
SHAPE_KEYS = {
    "model": ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "mlp_hidden", "num_dense_layers", "qk_norm", "attention", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers"),
    "moe": ("num_experts", "expert_hidden", "shared_expert_hidden", "expert_bias"),
}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # parameters touched by one token: top-k of the routed experts
    embedding: int  # input embedding table (a lookup, no matmul FLOPs)
    norm: int  # norm scales (elementwise, no matmul FLOPs)


def param_counts(c: Config) -> ParamCounts:
    """The model's total parameters and those one token uses (active: top-k of the
    routed experts, everything else whole), embedding and head included."""
    m, moe = c.model, c.moe
    d, hd = m.d_model, m.head_size
    layer_norms = 2 * d + {"none": 0, "head": 2 * hd, "full": (m.num_heads + m.num_kv_heads) * hd}[m.qk_norm]
    if m.attention == "mla":
        H, Rq, Rkv, Hv = m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim
        layer_norms += Rq + Rkv  # the latents' norms
        q = (d * Rq + Rq * H * hd) if Rq else d * H * hd
        attn = (q + d * (Rkv + m.qk_rope_head_dim) + Rkv * H * (m.qk_nope_head_dim + Hv)
                + H * Hv * d + layer_norms)
    else:
        attn = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + layer_norms  # q, k, v, o
    dense_mlp = 3 * d * m.mlp_hidden
    shared = 3 * d * moe.shared_expert_hidden
    expert = 3 * d * moe.expert_hidden
    router = d * moe.num_experts
    embed = m.vocab_size * d
    outer = 2 * embed + d  # embedding, LM head, final norm
    L_dense, L_moe = m.num_dense_layers, c.num_moe_layers
    total = outer + m.num_layers * attn + L_dense * dense_mlp
    total += L_moe * (router + shared + moe.num_experts * expert)
    active = total - L_moe * (moe.num_experts - moe.top_k) * expert
    # a multi-token prediction module: a layer like the last (MoE where the model has
    # MoE layers), its projection of [embedding; hidden] and three norms; embedding
    # and head are the model's
    ffn_total, ffn_active = ((router + shared + moe.num_experts * expert,
                              router + shared + moe.top_k * expert) if L_moe
                             else (dense_mlp, dense_mlp))
    total += m.mtp_layers * (attn + ffn_total + 2 * d * d + 3 * d)
    active += m.mtp_layers * (attn + ffn_active + 2 * d * d + 3 * d)
    return ParamCounts(total=total, active=active, embedding=embed,
                       norm=(m.num_layers + m.mtp_layers) * layer_norms + d + 3 * d * m.mtp_layers)


FLOP_COUNTS = ("palm", "megatron", "maxtext")


def flops_per_token(c: Config, count: str = "palm") -> float:
    """Training FLOPs per token: 6 x active matmul params + attention scores, counted
    one of three ways (the anchors' figures are each in their own):

    palm      PaLM's: attention adds 6 x layers x heads x (qk + v head dims) x seq_len
              (forward QK^T and AV, times three), without causal savings. Multi-token
              prediction modules count as layers, each also running the LM head.
    megatron  Megatron-LM's and Megatron-Bridge's (`num_floating_point_operations`):
              causal attention, half PaLM's; MTP modules as in palm; the router not
              counted.
    maxtext   MaxText's (`calculate_tflops_training_per_device`): causal attention; the
              router counted; no MTP module (its DeepSeek-V3 config runs none).
    """
    if count not in FLOP_COUNTS:
        raise ValueError(f"count: {count!r} is not one of {FLOP_COUNTS}")
    m = c.model
    if count == "maxtext" and m.mtp_layers:
        c = dataclasses.replace(c, model=dataclasses.replace(m, mtp_layers=0))
        m = c.model
    counts = param_counts(c)
    matmul_params = counts.active - counts.embedding - counts.norm
    matmul_params += m.mtp_layers * m.d_model * m.vocab_size  # the shared head, again
    if count == "megatron":  # no router; MLA's latent norms and MTP's three norms are in
        matmul_params -= (c.num_moe_layers + m.mtp_layers) * m.d_model * c.moe.num_experts \
            if c.num_moe_layers else 0
        if m.attention == "mla":
            matmul_params += (m.num_layers + m.mtp_layers) * (m.q_lora_rank + m.kv_lora_rank)
        matmul_params += m.mtp_layers * 3 * m.d_model
    layers = m.num_layers + m.mtp_layers
    attention = 6 * layers * m.num_heads * (m.head_size + m.value_size) * c.train.seq_len
    return 6.0 * matmul_params + (attention if count == "palm" else attention / 2)

"""The run's configuration: frozen dataclasses, a section each, every key with its type,
its default and what it means (the comment on or above it: docs/reference/config.md is
generated from them). What the values must satisfy is `jaxmoe.config.checks`, run
whenever a `Config` is made; reading YAML and overrides is `jaxmoe.config.load`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxmoe.config.checks import MESH_AXES, validate


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
    # the dense projections' GEMMs (attention's and MLA's, the dense MLPs, the shared
    # experts; not the embedding, LM head, router or MTP's joining projection): in
    # compute_dtype, or MXFP8 as the experts' (moe.mxfp8_scale, moe.mxfp8_weight_grad;
    # jaxmoe/model/mx_weights.py), the weights quantised once per step
    projection_precision: Literal["compute", "mxfp8"] = "compute"

    @property
    def num_moe_layers(self) -> int:
        """The layers after the dense ones: MoE layers."""
        return self.num_layers - self.num_dense_layers

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
    # device's T tokens (grouped, alltoall; a chunk's with exchange_chunks) or its
    # expert group's (ragged, allgather);
    # copies past it are dropped and counted. E / K never drops (room for every token)
    capacity_factor: float = 1.25
    # a step whose copies overflow the buffers: drop them (counted in drop_fraction);
    # rerun it, its update not applied, at doubled capacity up to E / K (jaxmoe.step.overflow);
    # or raise, stopping with the demand seen
    on_overflow: Literal["drop", "rerun", "raise"] = "drop"
    # a layer's routed tokens dispatched in this many equal chunks, one after another:
    # independent exchanges and expert GEMMs, so that one chunk's all-to-all runs
    # beside another's GEMMs (the routing and its statistics stay the whole layer's;
    # capacity is each chunk's share)
    exchange_chunks: int = 1
    # expert GEMMs: in model.compute_dtype, or MXFP8 (e4m3 blocks of 32 with e8m0 scales)
    expert_precision: Literal["compute", "mxfp8"] = "compute"
    # mxfp8 (experts, and projections with model.projection_precision): weight gradients
    # in MXFP8 too (else bf16)
    mxfp8_weight_grad: bool = False
    # mxfp8 block scale: "ceil" 2^ceil(log2(amax / 448)), never saturating (cuBLAS's and
    # Transformer Engine's RCEIL), or "floor" 2^(floor(log2 amax) - 8), the OCP MX spec's
    mxfp8_scale: Literal["ceil", "floor"] = "ceil"
    balance_loss_weight: float = 0.01  # the Switch load-balancing loss's weight; 0: off
    # tokens over which the Switch loss's f and P are taken: each device's
    # micro-batch, each sequence, or the whole (micro)batch across data-parallel ranks
    balance_scope: Literal["microbatch", "sequence", "global"] = "microbatch"
    z_loss_weight: float = 0.001  # the router z-loss's weight (mean squared logsumexp)


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
    # "circular": the stages run the step's slices one after another, and autodiff of
    # the loop gives each slice's backward (GPipe with virtual_stages 1): a stage holds
    # a slice's M x virtual_stages chunk inputs. "1f1b": every slice's micro-batches in
    # one pass that runs each chunk's backward as soon as it can (interleaved 1F1B with
    # virtual_stages above 1): a stage holds a fixed count of chunk inputs, and the
    # pipeline fills and drains once a step (the ddp step, train.remat: full; without
    # stages there is no pipeline to schedule, and the key changes nothing)
    schedule: str = "circular"


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
        return self.model.num_moe_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys whose change alters parameter or optimizer-state shapes.
SHAPE_KEYS = {
    "model": ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "mlp_hidden", "num_dense_layers", "qk_norm", "attention", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers"),
    "moe": ("num_experts", "expert_hidden", "shared_expert_hidden", "expert_bias"),
}

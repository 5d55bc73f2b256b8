"""The measured rows jaxmoe sets its expected figures beside, and the configs that are them.

Each anchor is a training run another stack published: its model, batch, micro-batch,
precision, GPUs and the rate it measured, in the FLOP count it used (`config.FLOP_COUNTS`).
Each has a shipped config with the same model, sequence length, global batch,
micro-batch per GPU, expert precision and GPU count; the layout (mesh, pipeline,
recomputation, dispatcher) is jaxmoe's. `benchmarks/gpu_programs.py anchors` compiles
each for its GPU and prints jaxmoe's expected figure beside the measured one, in the
anchor's count; `tests/plan/test_gpu_compile.py` checks each config against its row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    who: str
    config: str  # configs/NAME.yaml
    target: str  # the GPU it ran on (jaxmoe.plan.targets)
    gpus: int
    sequences: int  # global batch, in sequences
    seq_len: int
    micro_batch: int  # sequences per GPU per forward-backward pass
    expert_precision: str  # jaxmoe's name: "compute" (bf16) or "mxfp8"
    measured: float
    unit: str  # "tokens/s" or "TFLOP/s", per GPU
    count: str  # how it counts model FLOPs: palm, megatron, maxtext
    source: str


ANCHORS = (
    Anchor("OLMo-core 3, 47B", "olmocore_47b_8xb300", "b300", 8, 512, 8192, 2, "compute",
           52_000, "tokens/s", "palm",
           "OLMo-core 3 report: the 47B (128 experts, top-4) on 8 B300s, 4 Mi tokens a step"),
    Anchor("OLMo-core 3, Large-128E", "olmocore_large_296b_512xb300", "b300", 512, 4096,
           8192, 1, "compute", 768, "TFLOP/s", "palm",
           "OLMo-core 3 report, Table 30; allenai/OLMo-core src/examples/olmo_ddp "
           "(OLMoE3-dev-l001: EP8 PP4, 2 virtual stages, bf16, no recomputation)"),
    Anchor("OLMo-core 3, Ultra-128E", "olmocore_ultra_1200b_512xb300", "b300", 512, 8192,
           8192, 1, "mxfp8", 858, "TFLOP/s", "palm",
           "OLMo-core 3 report, Table 30; allenai/OLMo-core src/examples/olmo_ddp "
           "(OLMoE3-dev-u001: EP8 PP8, 2 virtual stages, MXFP8, layers recomputed)"),
    Anchor("Megatron-Bridge, Qwen3-30B-A3B", "qwen3_30b_a3b_8xb300", "b300", 8, 512, 4096, 8,
           "mxfp8", 30_553, "tokens/s", "megatron",
           "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, NeMo 26.04 "
           "(703 TFLOP/s; EP8, nothing recomputed)"),
    Anchor("Megatron-Bridge, DeepSeek-V3 on B300", "deepseek_v3_256xb300", "b300", 256, 4096,
           4096, 1, "mxfp8", 814, "TFLOP/s", "megatron",
           "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, NeMo 26.04 "
           "(3,131 tokens/s; PP16 EP8, MLA up-projections recomputed)"),
    Anchor("Megatron-Bridge, DeepSeek-V3 on GB300", "deepseek_v3_256xgb300", "gb300", 256,
           4096, 4096, 1, "mxfp8", 1_648, "TFLOP/s", "megatron",
           "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, NeMo 26.06 "
           "(6,338 tokens/s; PP2 VP8 EP32, nothing recomputed, whole-step CUDA graph)"),
    Anchor("MaxText + TE, DeepSeek-V3", "maxtext_deepseek_v3_128xgb300", "gb300", 128, 768,
           4096, 6, "mxfp8", 1_068, "TFLOP/s", "maxtext",
           "NVIDIA blog 'Accelerating Dropless MoE Training in JAX with NVIDIA Transformer "
           "Engine'; NVIDIA/JAX-Toolbox docs/frameworks/maxtext/deepseek-v3-moe "
           "(FSDP 16 x EP 8, 6 sequences per GPU, FP8 projections, MXFP8 experts)"),
)


def anchor_for(config_name: str) -> Anchor | None:
    """The anchor whose config is configs/`config_name`.yaml, if any."""
    return next((a for a in ANCHORS if a.config == config_name), None)


def micro_batch(cfg) -> float:
    """Sequences each GPU runs through one forward and backward pass: the global
    batch over accumulation slices, pipeline micro-batches and the data x expert
    devices that split it (a context split shares each sequence among its GPUs)."""
    t, m = cfg.train, cfg.mesh
    if -1 in (m.data, m.expert):
        raise ValueError("micro_batch needs the mesh's sizes: mesh.data or mesh.expert is -1")
    per_pass = t.batch_size / max(t.accumulation_steps, 1) / cfg.pipeline.stage_microbatches
    return per_pass / (m.data * m.expert)


def differences(cfg, anchor: Anchor) -> list[str]:
    """What in `cfg` is not `anchor`'s run: empty for its config."""
    t = cfg.train
    pairs = [("GPUs", cfg.mesh.devices, anchor.gpus),
             ("sequences a step", t.batch_size, anchor.sequences),
             ("sequence length", t.seq_len, anchor.seq_len),
             ("sequences per GPU per pass", micro_batch(cfg), anchor.micro_batch),
             ("expert precision", cfg.moe.expert_precision, anchor.expert_precision)]
    return [f"{name}: {have} where {anchor.who} ran {want}" for name, have, want in pairs
            if have != want]

"""The FLOPs a compiled program does, per named scope and pass, counted from its HLO.

`cost_analysis()` returns nothing for a program compiled for a GPU without one,
so the planner counts the matrix products itself, as the program has them:
every `dot` (top-level, or inside a fusion such as XLA:GPU's Triton GEMMs), the
GEMM custom calls (cuBLAS, cuBLASLt, cuDNN's block-scaled MXFP8 GEMM) and cuDNN's
fused attention, each times its runs per step (`Program.runs`: loop trip counts).
Elementwise work and reductions are not counted: at these shapes they are a
fraction of a percent of the products.

    dot / GEMM        2 x (output elements) x (contracted elements)
    fused attention   forward 4 B H Lq Lk Dh (QK^T and PV), halved when causal
                      (the kernel skips the masked half); backward 2.5 x that
                      (QK^T again, dV, dP, dQ, dK)

Each product is attributed to the first of `SCOPES` (in that order) on its op's
name stack (the model's `jax.named_scope`s; "other" when none) and to a pass:
"backward" under a `transpose(...)`, "recompute" where the backward re-runs a
checkpointed forward (`rematted_computation`), else "forward". Custom calls of
unknown kernels are listed, not guessed at. The figures are the kernels' operand
shapes: padding a kernel adds (cuDNN's block-scaled GEMM pads rows to 128) counts.

A grouped GEMM (tokamax's ragged dot, `jaxmoe.ops.grouped_gemm`; forward, input
and weight gradient) computes only the rows its groups hold, which are data, not
shapes. At balanced routing, the planner's premise, each of its E groups (experts)
holds `Program.routed_share` x C / E of its C rows (the routed copies over the rows
of the buffers they are packed into), and the kernel runs whole tiles of rows from
each group's start, so with I inputs, O outputs and row tiles of T it counts

    grouped GEMM      2 x min(C, E x ceil(share x C / E / T) x T) x I x O

The program names its grouped GEMMs two ways. tokamax's Triton kernel is a jax-triton
call (`triton_kernel_call_ffi`) whose backend config carries the compiled kernel (a
zlib-compressed proto with its Triton IR): the IR names the kernel (tokamax's
`_ragged_dot_kernel` for forward and input gradient, one program per group and tile
of rows that starts inside it; `_ragged_contracting_dim_dot_kernel` for the weight
gradient, which steps through a group's rows) and its tiles as the ranges of its
offsets (`offs_m`, the rows of the first; `offs_k`, the rows the second contracts).
Its other kernels (Mosaic GPU) carry tokamax's own JSON tag with their tiles, where
JAX keeps it on the op (outside a `shard_map`). cuDNN's grouped MXFP8 GEMMs
(`jaxmoe.ops.mx_grouped`) are CuTe DSL kernels in CUTLASS's call
(`CuteDSLRT_NvJaxCutlassCall`) with e4m3 (or, the bf16 weight gradient's, bf16)
operands and int32 group ends: their groups
are padded to whole 256-row tiles, so T = 256, and their buffers hold 256 rows a group
past the capacity's C (`jaxmoe.ops.mx_grouped.aligned_rows`), which the count takes
off (and off tokamax's weight gradient on the same groups, named `aligned_groups`);
the MXFP8 ones are priced at the block-scaled rate; their bytes, like any call's,
are their operands' and results' shapes (the whole buffer, read or not).
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

from jaxmoe.ops.mx_grouped import ALIGN, ALIGNED_SCOPE
from jaxmoe.plan.hlo import Instruction, Program, arrays

# in priority order: a GEMM under dispatch/expert_gemms counts as expert_gemms
SCOPES = ("expert_gemms", "router", "shared_expert", "dense_mlp", "attention", "lm_head",
          "dispatch", "optimizer", "embed",
          # the step's own work around the model: the working copy (casts, ZeRO-1 gathers,
          # MXFP8 weight copies), gradient sums over micro-batches and their reduction,
          # the layer and pipeline loops' slicing and stacking of weights, and the
          # pipeline stages' share of the rows outside it handed in and out
          "working_copy", "accumulate", "reduce", "layers", "pipeline", "stage_rows")
PASSES = ("forward", "backward", "recompute")
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_BLOCK_SCALED = ("__cudnn$blockScaledDot", "__op$block_scaled_dot")
# cuDNN's grouped block-scaled GEMMs (`jaxmoe.ops.cudnn_grouped`): a CuTe DSL kernel in
# CUTLASS's call, told apart from any other by its e4m3 operands and int32 group ends
_CUTE_CALL = "CuteDSLRT_NvJaxCutlassCall"
# rows: the groups are aligned to the kernels' 256-row tiles; a grouped GEMM of tokamax's
# on those aligned groups (the bf16 weight gradient) is named ALIGNED_SCOPE: its buffer
# holds the same room for padding
_CUTE_GROUPED_TILE = ALIGN
_ATTENTION = re.compile(r"^__cudnn\$fmha\w*$")
# tokamax names its op, tiles included, in the call's metadata (escaped JSON)
_GROUPED = re.compile(r'tokamax:\{\\"op\\":\{\\"__type\\":\\"[\w.]*RaggedDot')
_BLOCK_M = re.compile(r'\\"block_m\\":(\d+)')
# jax-triton's call, and tokamax's ragged-dot kernels in it: the offsets that range over rows
_TRITON_CALL = "triton_kernel_call_ffi"
_OPAQUE = re.compile(r'opaque = "((?:[^"\\]|\\.)*)"')
_RAGGED_KERNELS = {"_ragged_dot_kernel": "offs_m", "_ragged_contracting_dim_dot_kernel": "offs_k"}
_KERNEL = re.compile(r"tt\.func public @(\w+)")
_C_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "'": 39}


@dataclass
class ProgramFlops:
    """FLOPs per step of one device's program."""

    by_scope: dict[str, dict[str, float]] = field(default_factory=dict)  # scope -> pass -> FLOPs
    # scope -> what computed its products ("dot", or a custom call's target) -> runs
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)
    unknown_kernels: dict[str, int] = field(default_factory=dict)  # other custom calls -> runs
    block_scaled: float = 0.0  # of them, the block-scaled (MXFP8) products', any scope

    def total(self, scope: str | None = None, passes: tuple[str, ...] = PASSES) -> float:
        scopes = [scope] if scope else list(self.by_scope)
        return sum(self.by_scope.get(s, {}).get(p, 0.0) for s in scopes for p in passes)


def scope_of(op_name: str) -> str:
    # a transform around a scope wraps its name: "transpose(jvp(lm_head))"
    parts = [re.sub(r"^(?:[\w.]+\()+", "", p).rstrip(")") for p in op_name.split("/")]
    for scope in SCOPES:
        if scope in parts:
            return scope
    return "other"


def pass_of(op_name: str) -> str:
    if "rematted_computation" in op_name:
        return "recompute"
    return "backward" if "transpose(" in op_name else "forward"


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(inst: Instruction, program: Program) -> float:
    out, lhs = arrays(inst.type_text), arrays(program.type_of(inst.operands[0]))
    if not out or not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _dims(inst.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(out[0][1]) * contracted


def _backend_config(attrs: str) -> dict:
    m = re.search(r"backend_config=(\{.*\})\s*$", attrs)
    if not m:
        return {}
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return {}


def _gemm_call_flops(inst: Instruction, program: Program) -> float:
    """cuBLAS(Lt) GEMMs: the dimension numbers are in the backend config."""
    config = _backend_config(inst.attrs).get("gemm_backend_config", {})
    numbers = config.get("dot_dimension_numbers", {})
    lhs = arrays(program.type_of(inst.operands[0]))
    out = arrays(inst.type_text)
    if not lhs or not out:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(out[0][1]) * contracted


def _block_scaled_flops(inst: Instruction, program: Program) -> float:
    """[B, M, K] x [B, N, K] -> [B, M, N]."""
    lhs, out = arrays(program.type_of(inst.operands[0])), arrays(inst.type_text)
    return 2.0 * math.prod(out[0][1]) * lhs[0][1][-1] if lhs and out else 0.0


def _unescape(text: str) -> bytes:
    """The bytes of an HLO string literal (C escapes, other bytes as two hex digits)."""
    def byte(m: re.Match) -> str:
        e = m.group(1)
        return chr(int(e, 16) if len(e) == 2 else _C_ESCAPES.get(e, ord(e)))
    return re.sub(r"\\([0-9A-Fa-f]{2}|.)", byte, text).encode("latin-1")


@functools.lru_cache(maxsize=4096)
def _triton_ir(attrs: str) -> str:
    """The Triton IR of a jax-triton call's kernel ("" if it carries none)."""
    m = _OPAQUE.search(attrs)
    try:
        return zlib.decompress(_unescape(m.group(1))).decode("latin-1") if m else ""
    except zlib.error:
        return ""


def _row_tile(inst: Instruction, program: Program | None = None) -> int | None:
    """The rows a grouped GEMM's kernel computes together from each group's start; None
    if `inst` is not a grouped GEMM (tokamax's ragged dot, or cuDNN's MXFP8 one, which
    `program` tells apart by its operands)."""
    if inst.op != "custom-call":
        return None
    if inst.target.startswith(_CUTE_CALL):
        return _CUTE_GROUPED_TILE if program is not None and _cute_grouped(inst, program) \
            else None
    if inst.target == _TRITON_CALL:
        ir = _triton_ir(inst.attrs)
        kernel = _KERNEL.search(ir)
        rows = _RAGGED_KERNELS.get(kernel.group(1)) if kernel else None
        tile = rows and re.search(rf"%{rows}(?:_\d+)? = tt\.make_range \{{end = (\d+)", ir)
        return int(tile.group(1)) if tile else None
    if _GROUPED.search(inst.attrs):
        m = _BLOCK_M.search(inst.attrs)
        return int(m.group(1)) if m else 1
    return None


def _cute_grouped(inst: Instruction, program: Program) -> bool:
    """Whether a CuTe DSL call is one of cuDNN's grouped GEMMs: e4m3 (MXFP8) or bf16
    operands (the bf16 weight gradient) and the int32 group ends."""
    types = [dt for o in inst.operands for dt, _ in arrays(program.type_of(o))]
    return bool({"f8e4m3fn", "bf16"} & set(types)) and "s32" in types


def grouped_gemm(inst: Instruction, program: Program | None = None) -> bool:
    """Whether `inst` is a grouped GEMM (tokamax's ragged dot or cuDNN's grouped MXFP8
    GEMM, any pass)."""
    return _row_tile(inst, program) is not None


def block_scaled(inst: Instruction, program: Program | None = None) -> bool:
    """Whether `inst` is one of cuDNN's block-scaled (MXFP8) GEMMs, grouped or not."""
    if inst.op != "custom-call":
        return False
    if inst.target in _BLOCK_SCALED:
        return True
    return (program is not None and inst.target.startswith(_CUTE_CALL)
            and grouped_gemm(inst, program) and any(
                dt == "f8e4m3fn" for o in inst.operands for dt, _ in arrays(program.type_of(o))))


def attention_backward(inst: Instruction) -> bool:
    return "Backward" in inst.target


def _grouped_dims(inst: Instruction, program: Program) -> tuple[int, int, int] | None:
    """(C, E, FLOPs per row and expert) of a grouped GEMM. Forward and input gradient:
    [C, i] x [E, i, o] -> [C, o] (the weight in either layout: i is what remains of
    it); weight gradient: [C, a] and [C, b] (or transposed) -> [E, a, b], C contracted.
    None where the shapes are not one of these."""
    out = arrays(inst.type_text)
    # the values' operands: not block scales (e8m0), not group ends (int)
    operands = [dims for o in inst.operands for dt, dims in arrays(program.type_of(o))
                if dt.startswith(("f", "bf")) and dt != "f8e8m0fnu"]
    if not out or not operands:
        return None
    out = out[0][1]
    if len(out) == 2:
        weight = next((d for d in operands if len(d) == 3), None)
        if weight is None:
            return None
        C, E, per_row = out[0], weight[0], 2 * math.prod(weight[1:])  # 2 i o
    else:
        E, a, b = out
        C, per_row = math.prod(operands[0]) // a, 2 * a * b
    if _row_tile(inst, program) == _CUTE_GROUPED_TILE or ALIGNED_SCOPE in inst.op_name:
        C -= E * _CUTE_GROUPED_TILE  # the room for the groups' padding (`aligned_rows`)
    return C, E, per_row


def rows_per_group(inst: Instruction, program: Program) -> float:
    """A grouped GEMM's rows per group at balanced routing: `routed_share` x C / E."""
    C, E, _ = _grouped_dims(inst, program) or (0, 1, 0)
    return program.routed_share * C / E


def _grouped_flops(inst: Instruction, program: Program) -> float:
    """Its rows in whole tiles of the kernel, per expert at balanced routing, at most
    C, times each row's FLOPs."""
    dims = _grouped_dims(inst, program)
    if dims is None:
        return 0.0
    C, E, per_row = dims
    tile = _row_tile(inst, program)
    return min(C, E * math.ceil(program.routed_share * C / E / tile) * tile) * per_row


def _attention_flops(inst: Instruction) -> float:
    config = _backend_config(inst.attrs).get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    out = arrays(inst.type_text)
    if len(scores) != 4 or not out:
        return 0.0
    head = out[0][1][-1]  # [B, H, Lq, Dh] (the query's gradient, backward)
    flops = 4.0 * math.prod(scores) * head
    if "CAUSAL" in str(config.get("mask_type", "")):
        flops /= 2
    return flops * (2.5 if "Backward" in inst.target else 1.0)


def product_flops(inst: Instruction, program: Program) -> float | None:
    """The FLOPs of one matrix product (a `dot`, a GEMM custom call, cuDNN's block-scaled
    GEMM or fused attention); None for any other instruction."""
    if inst.op == "dot":
        return _dot_flops(inst, program)
    if inst.op != "custom-call":
        return None
    if inst.target in _GEMM_CALLS:
        return _gemm_call_flops(inst, program)
    if inst.target in _BLOCK_SCALED:
        return _block_scaled_flops(inst, program)
    if grouped_gemm(inst, program):
        return _grouped_flops(inst, program)
    if _ATTENTION.match(inst.target):
        return _attention_flops(inst)
    return None


def program_flops(program: Program | str) -> ProgramFlops:
    """Matrix-product FLOPs per step of `program` (one device's), by scope and pass."""
    program = program if isinstance(program, Program) else Program(program)
    by_scope: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    unknown: dict[str, int] = defaultdict(int)
    scaled = 0.0
    for inst, runs, _ in program.instructions():
        flops = product_flops(inst, program)
        if flops is None:
            if inst.op == "custom-call":
                unknown[inst.target] += runs
            continue
        scope = scope_of(inst.op_name)
        by_scope[scope][pass_of(inst.op_name)] += flops * runs
        kernels[scope]["grouped" if grouped_gemm(inst, program) else inst.target or "dot"] += runs
        scaled += flops * runs if block_scaled(inst, program) else 0.0
    return ProgramFlops({s: dict(p) for s, p in by_scope.items()},
                        {s: dict(k) for s, k in kernels.items()}, dict(unknown), scaled)

"""The GPU program, compiled by XLA:GPU for 8 virtual H100s and B300s (and two hosts),
with no GPU: what it computes, sends and calls. Each property has a companion that
breaks it and shows the check catching the break."""

import dataclasses
import functools
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.config import config_from_dict, load_config
from jaxmoe.plan.hlo import Program, arrays
from jaxmoe.model.dispatch import capacity
from jaxmoe.model.experts import ExpertWeights, expert_ffn
from jaxmoe.parallel import ep_dispatch
from jaxmoe.plan.anchors import ANCHORS, differences
from jaxmoe.plan.collectives import collectives
from jaxmoe.plan.planner import (compile_train_step, expert_gemm_ratios, routed_expert_flops,
                                 routed_share)
from jaxmoe.plan.program_flops import block_scaled, grouped_gemm, program_flops
from jaxmoe.plan.roofline import quantisations
from jaxmoe.plan.targets import (EXTRA, Target, compile_deviceless, get_target,
                                 gpu_compiler_available, virtual_devices)

if not gpu_compiler_available():  # part of the test extra: missing is a failure, not a skip
    pytest.fail(f"the GPU compiler is not installed: {EXTRA}", pytrace=False)

E, K, R = 16, 2, 8
BASE = {
    # two MoE layers and nothing else: each compile takes 5-6 s here, a dense layer
    # and a shared expert would add 2-3 (the shipped configs below have both)
    "model": {"vocab_size": 512, "d_model": 128, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 32, "compute_dtype": "bfloat16"},
    "moe": {"num_experts": E, "top_k": K, "expert_hidden": 128, "dispatcher": "ragged",
            "capacity_factor": 1.25},
    "mesh": {"data": 1, "expert": R},
    "train": {"batch_size": 64, "seq_len": 64, "accumulation_steps": 2, "remat": "full"},
}


def _config(**sections):
    return config_from_dict({k: {**BASE.get(k, {}), **sections.get(k, {})}
                             for k in BASE.keys() | sections.keys()})


def _compiled(target: str, hosts: int | None = None, **changes) -> tuple[Program, object]:
    """(program, config) of the train step for `target`; `changes`: config keys as
    section__key."""
    sections = {}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        sections.setdefault(section, {})[key] = value
    cfg = _config(**sections)
    return _compile(target, hosts, cfg), cfg


@functools.lru_cache(maxsize=None)
def _compile(target: str, hosts: int | None, cfg) -> Program:
    """Each (target, hosts, config) compiled once per module."""
    compiled, steps, _ = compile_train_step(cfg, target, hosts)
    program = Program(compiled.as_text())
    program.mesh = steps.mesh
    program.routed_share = routed_share(cfg)  # as the planner counts grouped GEMMs
    return program


def _expert_ratio(program: Program, cfg) -> float:
    flops = program_flops(program).by_scope["expert_gemms"]
    return expert_gemm_ratios(flops, routed_expert_flops(cfg))["max"]


# ------------------------------------------------------------------ expert GEMM work


# a device's routed copies per accumulation slice, and the local experts
N = BASE["train"]["batch_size"] * BASE["train"]["seq_len"] // R // 2 * K
El = E // R


def _buffer_rows(dispatcher: str, factor: float) -> int:
    """Rows of a device's expert buffers: per (source, expert) for `alltoall`, pooled
    over the group for `ragged` and `allgather`."""
    Tl = N // K
    if dispatcher == "alltoall":
        return El * R * capacity(Tl, K, E, factor)
    return El * capacity(R * Tl, K, E, factor)


def _rows_x_experts_x_D_buffers(program: Program, n: int = N) -> list[str]:
    """Arrays of at least (ranks x rows) x local experts x D elements: what a GEMM that
    runs every received row of the group through every local expert holds (n: a
    device's routed copies per micro-batch)."""
    return [inst.name for inst, _, _ in program.instructions()
            if any(math.prod(dims) >= R * n * El * 128 for _, dims in arrays(inst.type_text))]


# 16x BASE's batch: 4096 routed rows per local expert per micro-batch, whole tiles of
# the kernel's 128 rows
ROUTED = 16


@pytest.mark.parametrize("target", ["h100", "b200", "b300"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "ragged"])
def test_expert_gemms_do_the_routed_work(dispatcher, target):
    """bf16 experts on a GPU run a grouped GEMM over the packed routed rows (tokamax's
    Triton kernel), in every pass: forward, recompute, input and weight gradient, of
    2 GEMMs x 2 layers x 2 micro-batches; Hopper (sm90) and both Blackwells (sm100,
    sm103)."""
    batch = ROUTED * BASE["train"]["batch_size"]
    program, cfg = _compiled(target, moe__dispatcher=dispatcher, train__batch_size=batch)
    assert program_flops(program).kernels["expert_gemms"] == {"grouped": 4 * 2 * 2 * 2}
    # 4,096 routed rows per local expert: 32 whole tiles of the kernel's 128, no padding
    assert _expert_ratio(program, cfg) == pytest.approx(1.0, rel=1e-6)
    assert _rows_x_experts_x_D_buffers(program, ROUTED * N) == []


def test_the_ratio_sees_the_buffers():
    """Companion: counted over all their rows the same grouped GEMMs do the buffers'
    capacity_factor x the routed work; MXFP8 experts on Hopper (MXFP8 emulated in bf16
    GEMMs over per-expert buffers) do it, and doubling the buffers doubles it."""
    program, cfg = _compiled("h100", train__batch_size=ROUTED * BASE["train"]["batch_size"])
    program.routed_share = 1.0
    try:
        assert _expert_ratio(program, cfg) == pytest.approx(1.25, rel=1e-6)
    finally:
        program.routed_share = routed_share(cfg)
    assert _buffer_rows("ragged", 1.25) / N == 1.25
    for factor in (1.25, 2.5):  # rows of 5,120 and 10,240 per expert
        program, cfg = _compiled("h100", moe__expert_precision="mxfp8",
                                 moe__capacity_factor=factor,
                                 train__batch_size=ROUTED * BASE["train"]["batch_size"])
        assert "grouped" not in program_flops(program).kernels["expert_gemms"]
        assert _expert_ratio(program, cfg) == pytest.approx(factor, rel=1e-6)
    assert _buffer_rows("ragged", 2.5) == 2 * _buffer_rows("ragged", 1.25)


def test_ragged_dot_as_xla_lowers_it_fails_both_checks():
    """Companion: `lax.ragged_dot` over the group's received rows (R N, the old receive
    buffer) and the El local experts, at the train step's shapes, compiles for the GPU
    to a masked copy of every row per expert and a dense dot over all of them: El x the
    FLOPs and an (R N) x El x D buffer, which both checks above catch."""
    M, D, F = R * N, 128, 256

    def gemm(x, w, sizes):
        with jax.named_scope("expert_gemms"):
            return jax.lax.ragged_dot(x, w, sizes)

    program = _gpu_program("h100", gemm, ((M, D), jnp.bfloat16), ((El, D, F), jnp.bfloat16),
                           ((El,), jnp.int32))
    flops = program_flops(program).total("expert_gemms")
    assert flops == pytest.approx(El * 2 * M * D * F, rel=1e-6)  # El x the rows' work
    assert _rows_x_experts_x_D_buffers(program)


# ------------------------------------------------------------------ exchange and reductions


def _float_all_to_alls(program: Program) -> list[str]:
    """All-to-alls moving floating-point rows: the CPU stand-in's padded exchange."""
    return [inst.name for inst, _, _ in program.instructions()
            if inst.op.removesuffix("-start") == "all-to-all"
            and any(dt.startswith(("f", "bf")) for o in inst.operands
                    for dt, _ in arrays(program.type_of(o)))]


def test_ragged_program_exchanges_with_the_real_op():
    program, _ = _compiled("h100")
    ops = {inst.op for inst, _, _ in program.instructions()}
    assert {"ragged-all-to-all", "ragged-all-to-all-start"} & ops
    assert _float_all_to_alls(program) == []
    # companion: the alltoall dispatcher's exchange is such an all-to-all, and is caught
    assert _float_all_to_alls(_compiled("h100", moe__dispatcher="alltoall")[0])


def _copied_exchange_buffers(program: Program) -> list[str]:
    """Copies of a constant buffer (made from nothing) that a ragged exchange then
    writes into in place."""
    users = program.users
    return [inst.name for inst, _, _ in program.instructions()
            if inst.op == "copy" and not program.by_name[inst.operands[0]].operands
            and any(u.op.startswith("ragged-all-to-all") and u.operands[1] == inst.name
                    for u in users[inst.name])]


def test_ragged_exchanges_write_into_buffers_of_their_own(monkeypatch):
    """The ragged exchanges' output buffers are made where they are written, not copied
    from a buffer XLA merged with the backward pass's zeros (`EXCHANGE_BUFFER_FILL`).
    Companion: with +0.0 buffers the backward pass copies them."""
    assert _copied_exchange_buffers(_compiled("b300")[0]) == []
    monkeypatch.setattr(ep_dispatch, "EXCHANGE_BUFFER_FILL", 0.0)
    assert _copied_exchange_buffers(_compile.__wrapped__("b300", None, _config()))


def _reductions(program: Program) -> list[tuple[str, int, int, bool]]:
    """(kind, operand bytes, runs, in a loop) of every gradient-sized reduction."""
    return sorted((c.kind, c.operand_bytes, c.runs, c.in_loop) for c in collectives(program)
                  if c.kind in ("all-reduce", "reduce-scatter") and c.sent_bytes > 0
                  and c.operand_bytes > 4096)


def test_ddp_reduces_each_gradient_once_outside_every_loop():
    by_steps = {2: _reductions(_compiled("h100")[0]),
                8: _reductions(_compiled("h100", train__accumulation_steps=8)[0])}
    assert by_steps[2] and not any(in_loop for *_, in_loop in by_steps[2])
    assert all(runs == 1 for _, _, runs, _ in by_steps[2])
    assert by_steps[2] == by_steps[8]  # the same reductions, whatever the accumulation
    # companion: the auto-sharded fsdp step reduces inside its accumulation loop
    fsdp = _reductions(_compiled("h100", mesh__parallelism="fsdp")[0])
    assert any(in_loop for *_, in_loop in fsdp)


def test_one_slice_reduces_each_layers_gradient_beside_the_backward_loop():
    """A step of one slice reducing in bf16: the layer scan gathers each layer's ZeRO-1
    shards an iteration ahead, so each MoE layer's gradient is reduce-scattered in the
    backward loop (XLA pipelines one iteration's out of it), asynchronous, with kernels
    in its window (the roofline's walk), and the weights' gathers run in the forward
    loop likewise; the reduce-scatters still move each gradient once (the bytes a step
    of the program with two slices moves). Companion: with two slices the gradients
    are reduced after every loop, as before."""
    from jaxmoe.plan.roofline import Link, roofline
    from jaxmoe.plan.targets import get_target

    def scatters(program):
        return [c for c in collectives(program) if c.kind == "reduce-scatter" and c.sent_bytes > 0]

    program, _ = _compiled("b300", train__accumulation_steps=1, model__num_layers=3,
                           train__grad_reduce_dtype="bfloat16")
    walk = roofline(program, Link.of(get_target("b300")))
    looped = [c for c in collectives(program) if c.kind in ("reduce-scatter", "all-gather")
              and c.in_loop and c.sent_bytes > 0 and "working_copy" in c.op_name]
    assert {c.kind for c in looped} == {"reduce-scatter", "all-gather"}
    for c in looped:
        assert program.by_name[c.name].op.endswith("-start"), c
        assert walk.window_kinds.get(c.name), c.name  # kernels run while it does
    two_slices, _ = _compiled("b300", train__accumulation_steps=2, model__num_layers=3,
                              train__grad_reduce_dtype="bfloat16")
    assert not [c for c in scatters(two_slices) if c.in_loop]
    sent = lambda p: sum(c.sent_bytes * c.runs for c in scatters(p))  # noqa: E731
    assert sent(program) == sent(two_slices)


@dataclasses.dataclass(frozen=True)
class _SmallB300(Target):
    """A B300 with `memory_bytes` of device memory: what XLA plans its program's
    memory against."""

    memory_bytes: int = 0

    @functools.cached_property
    def spec(self) -> str:
        return re.sub(r"device_memory_size: \d+", f"device_memory_size: {self.memory_bytes}",
                      get_target("b300").spec)


def test_xla_recomputation_is_counted_where_the_memory_forces_it():
    """Nothing recomputed by the policy (`remat: none`): on a B300 of 14 MB the small
    program's 11 MB of temporaries and its weights do not fit, and XLA's own
    rematerialisation clones kernels to bring its peak down; the walk counts them
    (`xla_recomputation`) and their seconds are part of the expected step. Companion:
    on the B300 (288 GB) XLA clones none."""
    from jaxmoe.plan.roofline import Link, roofline, xla_recomputation

    def recomputed(target):
        program, _ = _compiled(target, train__remat="none")
        walk = roofline(program, Link.of(get_target(target) if isinstance(target, str) else
                                         target, expected=True))
        return xla_recomputation(walk), walk

    small = _SmallB300("b300", 900e9, 100e9, memory_bytes=14_000_000)
    assert small.memory == 14_000_000
    x, walk = recomputed(small)
    assert x["kernels"] > 0 and x["runs"] >= x["kernels"]
    assert 0 < x["seconds"] < walk.seconds() and x["bytes"] > 0
    assert recomputed("b300")[0]["kernels"] == 0


def test_offloaded_activations_are_host_transfers_not_kernels():
    """`remat: offload` compiled for B300: every instruction that reads or writes pinned
    host memory (S(5)), other than views, the dones and the host buffers' allocations,
    is priced as a host transfer over the host link and none as a kernel; the forward
    writes and the backward reads move the same bytes. Companion: `full` has none."""
    from jaxmoe.plan.roofline import Link, roofline
    from jaxmoe.plan.targets import get_target

    program, _ = _compiled("b300", train__remat="offload")
    walk = roofline(program, Link.of(get_target("b300")))
    fused = {inst.callee for inst, _, _ in program.instructions()
             if inst.op in ("fusion", "fusion-start")}  # a kernel's body, not kernels
    touching = {inst.name for inst, _, _ in program.instructions()
                if "S(5)" in " ".join([inst.type_text, *map(program.type_of, inst.operands)])
                and inst.computation not in fused and not inst.op.endswith("-done")
                and inst.op not in ("parameter", "get-tuple-element", "tuple", "bitcast",
                                    "while", "call", "conditional")
                and inst.target != "AllocateBuffer"}  # the host buffer's allocation
    moved = {t.name: t.bytes * t.runs for t in walk.host_transfers}
    assert touching and set(moved) == touching
    assert not touching & {k.name for k in walk.kernels}
    written = sum(b for n, b in moved.items() if "update" in n)
    assert written > 0 and written == sum(moved.values()) - written
    assert not roofline(_compiled("b300")[0], Link.of(get_target("b300"))).host_transfers


def _host_traffic(program: Program) -> list[str]:
    """Ops that wait on or talk to the host: callbacks, send/recv, in/outfeed."""
    return [inst.name for inst, _, _ in program.instructions()
            if inst.op in ("send", "recv", "send-done", "recv-done", "infeed", "outfeed")
            or "callback" in inst.target]


def test_no_host_traffic_inside_the_step():
    assert _host_traffic(_compiled("h100")[0]) == []
    assert _host_traffic(_compiled("b300", moe__expert_precision="mxfp8")[0]) == []
    # companion: a debug print is a host callback, and is caught (compiled for this
    # host: a callback needs a live device to be lowered)
    def f(x):
        jax.debug.print("{}", x.sum())
        return x * 2

    assert _host_traffic(Program(jax.jit(f).lower(jnp.ones(8)).compile().as_text()))


# ------------------------------------------------------------------ kernels for the target


def _block_scaled_calls(program: Program) -> list:
    """cuDNN's MXFP8 GEMMs among the experts': grouped (CuTe DSL) or over buffers."""
    return [inst for inst, _, _ in program.instructions()
            if block_scaled(inst, program) and "expert_gemms" in inst.op_name]


def _gpu_program(target: str, f, *shapes) -> Program:
    """`f` compiled for one virtual `target` GPU, on abstract arguments (shape, dtype)."""
    rep = NamedSharding(Mesh(virtual_devices(target, 1), ("x",)), P())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rep) for shape, dtype in shapes]
    return Program(compile_deviceless(jax.jit(f).trace(*args).lower()).as_text())


def test_the_specs_name_the_cudnn_that_xla_reads():
    """XLA 0.12 reads the cuDNN version from the spec's `gpu_device_info` (`dnn_version`):
    with it the B300's block-scaled MXFP8 GEMM is cuDNN's kernel. Companion: the same
    spec without it, XLA assumes a cuDNN too old and decomposes the GEMM into a
    dequantising multiply and a dot."""
    from jaxmoe.plan.targets import Target, get_target

    def block_scaled(target) -> int:
        rep = NamedSharding(Mesh(virtual_devices(target, 1), ("x",)), P())
        f8, e8 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rep) for shape, dtype in
                (((1, 128, 256), f8), ((1, 128, 256), f8), ((1, 128, 8), e8), ((1, 128, 8), e8))]
        mm = functools.partial(jax.nn.scaled_matmul, preferred_element_type=jnp.bfloat16)
        text = compile_deviceless(jax.jit(mm).trace(*args).lower()).as_text()
        return text.count('custom_call_target="__cudnn$blockScaledDot"')

    b300 = get_target("b300")
    assert 'dnn_version: "9.' in b300.spec and block_scaled(b300) == 1
    bare = Target("b300", b300.scale_up, b300.scale_out)
    bare.__dict__["spec"] = "\n".join(line for line in b300.spec.splitlines()
                                      if "dnn_version" not in line)
    assert block_scaled(bare) == 0


_CACHE_PROBE = """
import json, os, sys, warnings
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxmoe.plan.targets import compile_deviceless, virtual_devices
cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
jax.jit(lambda a: a * 3.0 + 1.0)(jnp.ones(3))  # the process has used its cache
rep = NamedSharding(Mesh(virtual_devices("h100", 1), ("x",)), P())
x = jax.ShapeDtypeStruct((96, 160), jnp.bfloat16, sharding=rep)
lowered = jax.jit(lambda a: (a @ a.T).sum()).trace(x).lower()
counts = [len(os.listdir(cache))]
compile_deviceless(lowered)
counts.append(len(os.listdir(cache)))
lowered.compile()
counts.append(len(os.listdir(cache)))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jax.jit(lambda a: (a @ a.T).sum()).trace(x).lower().compile()
print(json.dumps([counts, [str(w.message)[:60] for w in seen]]))
"""


def test_a_deviceless_program_stays_out_of_the_compilation_cache(tmp_path):
    """A deviceless executable cannot be loaded back from JAX's persistent cache, and JAX
    decides once per process whether to use the cache: `compile_deviceless` writes
    nothing to it even in a process that uses it. Companion: the same program compiled
    as JAX would is written, and reading it back fails. (In a fresh process: which
    compile comes first decides the cache for the rest of a process.)"""
    import json
    import subprocess
    import sys

    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (cpu, deviceless, as_jax), warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpu >= 1 and deviceless == cpu
    assert as_jax == cpu + 1
    assert any(w.startswith("Error reading persistent compilation cache") for w in warned)


def test_b300_expert_gemms_are_native_mxfp8():
    """MXFP8 experts on a B300 run cuDNN's grouped block-scaled GEMMs on the packed rows:
    e4m3 rows and weights, their e8m0 scales packed in 128 x 4 atoms, int32 group ends;
    forward and input gradient (the weight gradient, bf16 by default, tokamax's grouped
    GEMM), and no `__cudnn$blockScaledDot` over per-expert buffers."""
    program, _ = _compiled("b300", moe__expert_precision="mxfp8")
    calls = _block_scaled_calls(program)
    assert calls and all(grouped_gemm(inst, program) for inst in calls)
    for inst in calls:
        a, b, sa, sb, ends, alpha = (arrays(program.type_of(o))[0] for o in inst.operands)
        assert a[0] == b[0] == "f8e4m3fn" and len(b[1]) == 3  # [M, K] and [E, N, K]
        assert sa[0] == sb[0] == "f8e8m0fnu" and sa[1][-3:] == sb[1][-3:] == (32, 4, 4)
        assert sa[1][1] * 128 == a[1][0] and ends == ("s32", (b[1][0],))
    flops = program_flops(program)
    assert set(flops.kernels["expert_gemms"]) == {"grouped"}
    assert flops.unknown_kernels == {}
    assert _weight_grad_dtypes(program) == {"bf16"}
    # companion: on an H100 (no block-scaled GEMM) the expert GEMM emulates MXFP8, and
    # the check finds no native call
    cfg = _config(moe={"expert_precision": "mxfp8"}).moe
    from jaxmoe.ops.kernels import Kernels
    h100 = Kernels.of(virtual_devices("h100", 1))
    assert not h100.native_mxfp8 and Kernels.of(virtual_devices("b300", 1)).native_mxfp8

    def experts(x, w1, w2):
        return expert_ffn(ExpertWeights(w1, w2), x, cfg, h100)

    emulated = _gpu_program("h100", experts, ((2, 64, 128), jnp.bfloat16),
                            ((2, 128, 256), jnp.float32), ((2, 128, 128), jnp.float32))
    assert program_flops(emulated).total("expert_gemms") > 0 and _block_scaled_calls(emulated) == []


def _weight_grad_dtypes(program: Program) -> set[str]:
    """The dtypes the MXFP8 experts' weight-gradient GEMMs ([E, I, O]) store."""
    out = [arrays(inst.type_text)[0] for inst, _, _ in program.instructions()
           if inst.op == "custom-call" and "aligned_groups" in inst.op_name]
    assert out and all(len(dims) == 3 for _, dims in out)
    return {dt for dt, _ in out}


def test_mxfp8_weight_gradients_are_stored_in_the_weights_dtype():
    """The weight gradient leaves its kernel in the weight's dtype, not in fp32 for the
    next kernel to round (tests/ops/test_grouped_gemm.py: the same values): in a step
    of one slice whose circular pipeline gathers each round's weights in its loop
    (three rounds, so ZeRO-1 splits within a layer): they vary over fewer mesh axes
    than the rows, `context`, of one device, which sums nothing. Companion: fp32
    weights get an fp32 gradient."""
    pipelined = dict(mesh__data=2, mesh__stage=2, mesh__expert=2, mesh__zero1=True,
                     model__num_layers=6,
                     pipeline__virtual_stages=3, pipeline__stage_microbatches=2,
                     train__accumulation_steps=1,
                     train__grad_reduce_dtype="bfloat16", moe__expert_precision="mxfp8",
                     moe__dispatcher="alltoall")
    assert _weight_grad_dtypes(_compiled("b300", **pipelined)[0]) == {"bf16"}
    fp32, _ = _compiled("b300", **pipelined, model__compute_dtype="float32")
    assert _weight_grad_dtypes(fp32) == {"f32"}


def test_b300_projections_are_native_mxfp8_where_asked():
    """`model.projection_precision: mxfp8` on a B300: every attention projection's forward,
    recomputed forward and input gradient is cuDNN's block-scaled GEMM (4 projections x 3
    x 2 layers x 2 micro-batches), its weights quantised once per step outside every loop;
    the weight gradients stay bf16 dots. Companion: without the key, none is block-scaled
    and those GEMMs are bf16 dots."""
    program, _ = _compiled("b300", model__projection_precision="mxfp8")
    kernels = program_flops(program).kernels["attention"]
    assert kernels["__cudnn$blockScaledDot"] == 4 * 3 * 2 * 2
    weights = [q for q in quantisations(program) if "working_copy" in q[2]]
    assert weights and all(runs == 1 and not in_loop for runs, in_loop, _, _ in weights)
    # the roofline's account of them: every kernel on the quantisation's name stack
    from jaxmoe.plan.roofline import Link, quantisation_cost, roofline
    from jaxmoe.plan.targets import TARGETS
    link = Link.of(TARGETS["b300"], expected=True)
    cost = quantisation_cost(program, roofline(program, link))
    assert cost["weights"]["runs"] == cost["weights"]["kernels"] == len(weights)
    assert cost["activations"]["runs"] > cost["activations"]["kernels"] > 0
    assert all(v["bytes"] > 0 and v["seconds"] > 0 for v in cost.values())
    bf16, _ = _compiled("b300")
    plain = program_flops(bf16).kernels["attention"]
    assert "__cudnn$blockScaledDot" not in plain
    assert plain["dot"] > kernels["dot"] > 0
    assert all(v["runs"] == 0 for v in quantisation_cost(bf16, roofline(bf16, link)).values())


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "ragged"])
def test_mxfp8_expert_gemms_do_the_routed_work(dispatcher):
    """MXFP8 experts on a B300 do the routed rows' work in every pass (4,096 rows per
    local expert per micro-batch: whole groups of the kernels' 256 rows, no padding),
    every product cuDNN's grouped kernels with `moe.mxfp8_weight_grad` (forward,
    recompute, input and weight gradient of 2 GEMMs x 2 layers x 2 micro-batches).
    Companion: counted over all their rows (less each group's room for padding), the
    packed buffers hold capacity_factor x the routed rows."""
    batch = ROUTED * BASE["train"]["batch_size"]
    program, cfg = _compiled("b300", moe__dispatcher=dispatcher, train__batch_size=batch,
                             moe__expert_precision="mxfp8", moe__mxfp8_weight_grad=True)
    assert program_flops(program).kernels["expert_gemms"] == {"grouped": 4 * 2 * 2 * 2}
    assert all(block_scaled(inst, program) for inst, _, _ in program.instructions()
               if grouped_gemm(inst, program))
    assert _expert_ratio(program, cfg) == pytest.approx(1.0, rel=1e-6)
    program.routed_share = 1.0
    try:
        assert _expert_ratio(program, cfg) == pytest.approx(1.25, rel=1e-6)
    finally:
        program.routed_share = routed_share(cfg)


def test_mxfp8_experts_under_an_fsdp_pipeline_are_refused():
    """cuDNN's kernels have no batching rule, and the global-array pipeline vmaps its
    stages: MXFP8 experts on Blackwell with pipeline stages need ddp. Companion: the
    same layout on Hopper (MXFP8 emulated over buffers) builds."""
    from jaxmoe.config import ConfigError
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps

    cfg = _config(moe={"expert_precision": "mxfp8", "dispatcher": "alltoall"},
                  mesh={"data": 1, "expert": 4, "stage": 2, "parallelism": "fsdp"})
    with pytest.raises(ConfigError, match="pipeline stages need ddp"):
        build_steps(cfg, make_mesh(cfg.mesh, virtual_devices("b300", 8)))
    build_steps(cfg, make_mesh(cfg.mesh, virtual_devices("h100", 8)))


def _score_buffers(program: Program, L: int) -> list[str]:
    """Arrays of attention scores, [..., L, L], that the attention scope materialises."""
    return [inst.name for inst, _, _ in program.instructions()
            if "attention" in inst.op_name
            and any(dims[-2:] == (L, L) for _, dims in arrays(inst.type_text))]


def test_mxfp8_quantisation_holds_no_constant_broadcasts():
    """`quantize` selects nothing against a constant: XLA would make each such
    constant a full-size broadcast and hoist it out of the layer scan as a loop
    operand (6.44 GB apiece for a layer of the 1.2T config's experts). No
    operand-less fusion (a broadcast constant) of the quantisation is as large as
    one layer's local expert weights (zeros for accumulators are another matter);
    the program does quantise those weights."""
    program, cfg = _compiled("b300", moe__expert_precision="mxfp8")
    weight = E // R * cfg.model.d_model * 2 * cfg.moe.expert_hidden
    quantised = [i for i, _, _ in program.instructions()
                 if arrays(i.type_text) and arrays(i.type_text)[0][0] == "f8e4m3fn"
                 and math.prod(arrays(i.type_text)[0][1]) >= weight]
    assert quantised
    constants = [i.name for i, _, _ in program.instructions()
                 if i.op == "fusion" and not i.operands and "quantize" in i.attrs
                 and math.prod(arrays(i.type_text)[0][1]) >= weight]
    assert constants == []


def test_attention_is_cudnn_flash_attention():
    L = 80  # a length no other dimension has (BASE's 64 is also a slice of the weights)
    for program, _ in (_compiled("h100", train__seq_len=L),
                       _compiled("b300", moe__expert_precision="mxfp8", train__seq_len=L)):
        kernels = program_flops(program).kernels["attention"]
        assert kernels.get("__cudnn$fmhaSoftmax") and kernels.get("__cudnn$fmhaSoftmaxBackward")
        assert _score_buffers(program, L) == []
    # companion: XLA's attention (what fp32 compute gets: cuDNN's kernel takes 16-bit
    # inputs only) holds [B, H, L, L] scores, and the check finds them
    from jaxmoe.ops.kernels import Kernels
    h100 = Kernels.of(virtual_devices("h100", 1))
    assert h100.attention(_config(model={"compute_dtype": "float32"}).model) == "xla"
    # heads past 128: JAX checks cuDNN's limit against the tracing host's GPU, so a
    # deviceless compile (no GPU here) must not ask for it
    assert h100.attention(_config(model={"head_dim": 256}).model) == "xla"

    def attention(q, k, v):
        with jax.named_scope("attention"):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    q = ((2, L, 4, 32), jnp.float32)
    assert _score_buffers(_gpu_program("h100", attention, q, q, q), L)


MLA = dict(model__attention="mla", model__qk_norm="none", model__num_kv_heads=4,
           model__q_lora_rank=64, model__kv_lora_rank=32, model__qk_nope_head_dim=128,
           model__qk_rope_head_dim=64, model__v_head_dim=128, model__mtp_layers=1,
           train__seq_len=80)  # no other dimension of 80, for `_score_buffers`


@pytest.mark.parametrize("target", ["h100", "b300"])
def test_latent_attention_is_cudnn_flash_attention(target):
    """MLA's heads, DeepSeek-V3's 192 wide (128 without RoPE, 64 with), values 128:
    cuDNN's fused kernel forward and backward in every layer and the MTP module's,
    which takes heads up to 256 from Hopper on once the trace asks as the target's
    GPU (`targets.traced_on`, as the planner compiles), and no [L, L] scores."""
    from jaxmoe.ops.kernels import Kernels
    from jaxmoe.plan.targets import traced_on

    program, cfg = _compiled(target, **MLA)
    L = cfg.train.seq_len
    runs = {}  # (cuDNN kernel, in the MTP module) -> runs per step
    for inst, n, _ in program.instructions():
        if inst.op == "custom-call" and inst.target.startswith("__cudnn$fmha"):
            key = (inst.target.removeprefix("__cudnn$fmha"), "mtp_" in inst.op_name)
            runs[key] = runs.get(key, 0) + n
    A = BASE["train"]["accumulation_steps"]
    layers, mtp = cfg.model.num_layers, cfg.model.mtp_layers
    # the layers' forward twice per slice (recomputed under remat: full), backward once;
    # the MTP module runs last, right before its own backward, so XLA (0.12 on) merges
    # its recomputation with its forward (checkpointed with prevent_cse=False)
    assert runs == {("Softmax", False): 2 * A * layers, ("SoftmaxBackward", False): A * layers,
                    ("Softmax", True): A * mtp, ("SoftmaxBackward", True): A * mtp}
    assert _score_buffers(program, L) == []
    # companion: traced as this CPU host, JAX would refuse cuDNN 192-wide heads, and
    # the kernel choice falls back to XLA's attention (the [L, L] scores)
    device = virtual_devices(target, 1)[0]
    assert Kernels.of([device]).attention(cfg.model) == "xla"
    with traced_on(device):
        assert Kernels.of([device]).attention(cfg.model) == "cudnn"


# ------------------------------------------------------------------ two hosts


def _cross_host_exchanges(program: Program) -> int:
    """All-to-alls whose replica groups span hosts (their traffic leaves NVLink)."""
    hosts = [d.process_index for d in program.mesh.devices.flat]  # partition i: device i
    return sum(any(len({hosts[i] for i in group}) > 1 for group in c.groups)
               for c in collectives(program) if c.kind == "all-to-all" and c.sent_bytes > 0)


def test_two_hosts_keep_the_expert_exchange_on_each_host():
    """8 B300s on 2 hosts of 4: data 2 x expert 4 puts each expert group on one host."""
    program, cfg = _compiled("b300", hosts=2, mesh__data=2, mesh__expert=4)
    assert {d.process_index for d in program.mesh.devices.flat} == {0, 1}
    assert _cross_host_exchanges(program) == 0
    # 128 routed rows per local expert and micro-batch: one tile of the grouped kernel's
    assert _expert_ratio(program, cfg) == pytest.approx(1.0, rel=1e-6)
    # companion: an expert group of all 8 devices spans both hosts, and is caught
    program, _ = _compiled("b300", hosts=2, mesh__data=1, mesh__expert=8)
    assert _cross_host_exchanges(program) > 0


# ------------------------------------------------------------------ context parallelism


def _context_exchanges(program: Program) -> list:
    """Attention's all-to-alls over `context`: among the devices of one expert rank
    (mesh order data, stage, context, expert: device i is context i // R, rank i % R)."""
    ranks = program.mesh.shape["expert"]
    return [c for c in collectives(program) if c.kind == "all-to-all" and c.sent_bytes > 0
            and all(len({i % ranks for i in group}) == 1 for group in c.groups)]


@pytest.mark.parametrize("target", ["h100", "b300"])
def test_split_sequences_trade_heads_and_run_cudnn_attention(target):
    """context 2 x expert 4: the attention's four exchanges per layer and pass (q, k, v
    there, the output back) within each context pair, cuDNN's fused attention forward
    and backward, and every gradient still reduced once outside the loops."""
    program, cfg = _compiled(target, mesh__context=2, mesh__expert=4)
    exchanges = _context_exchanges(program)
    assert exchanges and all(c.group_size == 2 for c in exchanges)
    assert {c.groups for c in exchanges} == {((0, 4), (1, 5), (2, 6), (3, 7))}
    # forward, recompute (full remat) and backward: 3 x 4 per layer per micro-batch
    A, Lm = cfg.train.accumulation_steps, cfg.num_moe_layers
    assert sum(c.runs for c in exchanges) == 12 * A * Lm
    kernels = program_flops(program).kernels["attention"]
    assert kernels.get("__cudnn$fmhaSoftmax") and kernels.get("__cudnn$fmhaSoftmaxBackward")
    assert _score_buffers(program, cfg.train.seq_len) == []
    reductions = _reductions(program)
    assert reductions and not any(in_loop for *_, in_loop in reductions)
    # companion: without the split there are no such exchanges (the expert exchange
    # runs within an expert group, across ranks)
    assert _context_exchanges(_compiled(target, mesh__expert=8)[0]) == []


# ------------------------------------------------------------------ the shipped GPU configs

TOY_WIDTHS = ["model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2",
              "model.head_dim=32", "model.mlp_hidden=256", "moe.expert_hidden=128",
              "moe.shared_expert_hidden=128", "train.seq_len=64"]


@pytest.mark.parametrize("name", ["gpu1_small", "olmoe_8layer_e8"])
def test_shipped_gpu_configs_compile_for_an_h100(name):
    """As shipped (dispatcher, precision, remat, batch, layers), at toy widths: the
    one-GPU config, and the 8-layer family at 8 experts (one per device); e32 and e64
    are the family between it and e128, which test_plan compiles at full size (and
    the docs' commands test the 1.2T config at toy widths)."""
    path = Path(__file__).parents[2] / "configs" / f"{name}.yaml"
    cfg = load_config(path, TOY_WIDTHS + ["mesh.data=1"])
    program = _compile("h100", None, cfg)
    kernels = program_flops(program).kernels
    assert "__cudnn$fmhaSoftmax" in kernels["attention"]
    # bf16 experts: the grouped kernel over the routed rows, in whole tiles of 128 rows
    # here (e8's one expert per device gets 8 ranks x 64 tokens x 4 / 8 = 256 copies)
    assert set(kernels["expert_gemms"]) == {"grouped"}
    assert _expert_ratio(program, cfg) == pytest.approx(1.0, rel=1e-6)


def test_the_olmocore_47b_row_is_its_anchors_step():
    """configs/olmocore_47b_8xb300.yaml is OLMo-core's measured 47B row: 4 Mi tokens a
    step in micro-batches of 2 sequences per GPU on 8 GPUs, bf16. At toy widths (its
    batch, accumulation, layers and layout as shipped) it compiles for 8 virtual
    B300s: the grouped kernel over the routed rows, and nothing recomputed (its
    remat: none; companion: remat full recomputes the forward)."""
    path = Path(__file__).parents[2] / "configs" / "olmocore_47b_8xb300.yaml"
    cfg = load_config(path)
    t = cfg.train
    assert t.batch_size * t.seq_len == 4 * 2**20 and cfg.mesh.devices == 8
    assert t.batch_size // t.accumulation_steps // cfg.mesh.devices == 2
    assert cfg.model.compute_dtype == "bfloat16" and cfg.moe.expert_precision == "compute"
    toy = load_config(path, TOY_WIDTHS)
    flops = program_flops(_compile("b300", None, toy))
    assert set(flops.kernels["expert_gemms"]) == {"grouped"}
    assert flops.total(passes=("recompute",)) == 0 < flops.total(passes=("forward",))
    full = program_flops(_compile("b300", None, load_config(path, TOY_WIDTHS +
                                                            ["train.remat=full"])))
    assert full.total(passes=("recompute",)) > 0


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: a.config)
def test_each_anchor_config_is_its_anchors_run(anchor):
    """Each anchor's config holds the run it names: GPUs, global batch, sequence length,
    sequences per GPU per pass and expert precision (companion: half the accumulation
    slices doubles the pass, and the check says so)."""
    path = Path(__file__).parents[2] / "configs" / f"{anchor.config}.yaml"
    cfg = load_config(path)
    assert differences(cfg, anchor) == []
    assert cfg.model.compute_dtype == "bfloat16"
    A = cfg.train.accumulation_steps
    if A % 2 == 0:
        changed = load_config(path, [f"train.accumulation_steps={A // 2}"])
        assert [d.split(":")[0] for d in differences(changed, anchor)] == [
            "sequences per GPU per pass"]


@pytest.mark.parametrize("anchor", [a for a in ANCHORS if a.config != "olmocore_47b_8xb300"],
                         ids=lambda a: a.config)
def test_each_anchor_config_compiles_for_its_gpus(anchor):
    """The anchors' configs on their own GPUs and mesh (up to 512 virtual B300s), at toy
    widths and one MoE layer per pipeline chunk (the full programs are the planner's,
    benchmarks/RESULTS.md "The anchors' rows"): MXFP8 experts run cuDNN's native
    block-scaled GEMM, bf16 ones the grouped kernel, and stages hand activations on."""
    path = Path(__file__).parents[2] / "configs" / f"{anchor.config}.yaml"
    shipped = load_config(path)
    m, chunks = shipped.model, shipped.mesh.stage * shipped.pipeline.virtual_stages
    mla = [] if m.attention != "mla" else [
        "model.num_kv_heads=4", "model.q_lora_rank=32", "model.kv_lora_rank=32",
        "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=32"]
    toy = load_config(path, TOY_WIDTHS + mla + [
        f"model.num_layers={m.num_dense_layers + chunks}", "train.loss_chunk=0"])
    program = _compile(anchor.target, None, toy)
    assert len(program.mesh.devices.flat) == anchor.gpus
    if anchor.expert_precision == "mxfp8":
        assert _block_scaled_calls(program)
    else:
        assert set(program_flops(program).kernels["expert_gemms"]) == {"grouped"}
    permutes = [c for c in collectives(program) if c.kind == "collective-permute"]
    assert bool(permutes) == (shipped.mesh.stage > 1)


def test_in_loop_scoring_stays_within_the_train_steps_memory():
    """train.evals on the 47B config for 8 B300s: the dropless scoring program at the
    rows `Downstream` picks plans less memory per device than the train step; at the
    training batch's shape, every expert buffer holding every token, it plans more."""
    from jaxmoe.eval.downstream import Downstream
    from jaxmoe.plan.planner import peak_bytes
    from jaxmoe.data.tokenizer import BYTE_TOKENIZER

    cfg = load_config(Path(__file__).parents[2] / "configs" / "olmoe_8layer_e128.yaml",
                      ["mesh.data=1", "mesh.expert=8", "train.evals.tasks=[stdlib_word_order]",
                       "train.evals.limit=64"])
    compiled, steps, abstract = compile_train_step(cfg, "b300")

    def scoring_peak(B, L):
        rows = lambda dtype, n: jax.ShapeDtypeStruct((B, n), dtype,  # noqa: E731
                                                     sharding=steps.batch_sharding)
        lowered = steps.score_step.trace(abstract.params, abstract.buffers,
                                         rows(jnp.int32, L + 1), rows(jnp.bool_, L)).lower()
        return peak_bytes(compile_deviceless(lowered).memory_analysis())

    scorer = Downstream(cfg, steps, BYTE_TOKENIZER).scorer
    (L,) = scorer.lengths
    assert L < cfg.train.seq_len and scorer.batch % 8 == 0
    train = peak_bytes(compiled.memory_analysis())
    assert scoring_peak(scorer.batch, L) < train < scoring_peak(cfg.train.batch_size,
                                                                cfg.train.seq_len)


# ------------------------------------------------------------------ what the step's time goes to


def test_mxfp8_weights_are_quantised_once_per_step(monkeypatch):
    """The B300 program of an MXFP8 config quantises each expert weight once per step,
    outside every loop (the working copy's `mx_copies`); inside the loops the only
    quantisations are of the GEMMs' rows (every array has the packed buffer's rows).
    Companion: without the step's copies each expert GEMM quantises its weight in every
    layer iteration and pass, and the check finds weight-shaped quantisations in loops."""
    from jaxmoe.model.dispatch import packed_rows_count

    changes = {"moe__expert_precision": "mxfp8", "moe__expert_hidden": 192}
    program, cfg = _compiled("b300", **changes)
    C = _buffer_rows("ragged", cfg.moe.capacity_factor) // El
    rows = packed_rows_count(El, C, 256)  # 1,280: no weight has it
    found = quantisations(program)
    weights = [q for q in found if "working_copy" in q[2]]
    assert weights and all(runs == 1 and not in_loop for runs, in_loop, _, _ in weights)
    assert [q for q in found if q[1] and rows not in q[3]] == []

    import jaxmoe.step.loss
    monkeypatch.setattr(jaxmoe.step.loss, "mx_copies", lambda params, cfg: {})
    per_call = Program(compile_train_step(_config(moe={"expert_precision": "mxfp8",
                                                        "expert_hidden": 192}), "b300")[0].as_text())
    again = [q for q in quantisations(per_call) if q[1] and rows not in q[3]]
    assert again and min(runs for runs, *_ in again) >= 2


def _zero_buffers(program: Program, size: int) -> list:
    """Materialised fp32 zeros (operand-less fusions) of at least `size` elements, each
    with the instructions that read it (through its tuple outputs)."""
    found = []
    for inst, _, _ in program.instructions():
        if inst.op != "fusion" or inst.operands or inst.computation not in program.runs:
            continue
        if not any(dt == "f32" and math.prod(d) >= size for dt, d in arrays(inst.type_text)):
            continue
        readers, frontier = [], [inst.name]
        while frontier:
            for user in program.users.get(frontier.pop(), []):
                (frontier.append(user.name) if user.op == "get-tuple-element"
                 else readers.append(user))
        found.append((inst.name, readers))
    return found


def _loop_inits(program: Program, readers) -> bool:
    """Whether every reader is the tuple a `while` loop starts from."""
    return all(r.op == "tuple" and all(u.op == "while" for u in program.users.get(r.name, []))
               for r in readers)


def test_no_parameter_size_zero_buffer_lives_across_the_step(monkeypatch):
    """A small replica of the 47B config's step (ddp + EP, ZeRO-1, fp32 gradient sums
    over 2 slices): the only parameter-size fp32 zeros are the accumulators' start, read
    by the accumulation loop alone. Companion: an optimizer that selects its update
    against a zero constant on a skipped step makes XLA share that constant with the
    accumulators' zeros and keep it, materialised, for the update after the loop."""
    import optax

    import jaxmoe.step.build
    size = 2 * El * BASE["model"]["d_model"] * 2 * BASE["moe"]["expert_hidden"]  # w_gate_up
    program, _ = _compiled("b300")
    zeros = _zero_buffers(program, size)
    assert zeros and all(_loop_inits(program, readers) for _, readers in zeros)

    make = jaxmoe.step.build.make_optimizer

    def selecting(cfg, steps):
        tx = make(cfg, steps)

        def update(grads, state, params=None, *, skip=None, **kw):
            updates, state = tx.update(grads, state, params, skip=skip, **kw)
            return jax.tree.map(lambda u: jnp.where(skip, 0.0, u), updates), state

        return optax.GradientTransformationExtraArgs(tx.init, update)

    monkeypatch.setattr(jaxmoe.step.build, "make_optimizer", selecting)
    shared = Program(compile_train_step(_config(), "b300")[0].as_text())
    assert any(not _loop_inits(shared, readers) for _, readers in _zero_buffers(shared, size))


def test_expert_exchanges_run_beside_compute(monkeypatch):
    """With XLA:GPU's latency-hiding scheduler (`Kernels.compiler_options`), every
    exchange of token rows of a small config with a shared expert is asynchronous,
    with kernels in its window, for `alltoall` (the shipped GPU dispatcher) and
    `ragged`; with XLA's default scheduling some of `ragged`'s run synchronously.
    (Which kernels land in a window is the scheduler's choice: benchmarks/RESULTS.md
    counts the windows that hold a GEMM.)"""
    from jaxmoe.ops.kernels import Kernels
    from jaxmoe.plan.roofline import Link, roofline, row_exchanges
    from jaxmoe.plan.targets import TARGETS

    link = Link.of(TARGETS["b300"])

    def exchanges(dispatcher):
        cfg = _config(moe={"dispatcher": dispatcher, "shared_expert_hidden": 128})
        program = Program(compile_train_step(cfg, "b300")[0].as_text())
        return row_exchanges(program, roofline(program, link))

    for dispatcher in ("ragged", "alltoall"):
        found = exchanges(dispatcher)
        assert found and all(asynchronous and kinds for _, asynchronous, kinds in found)
    monkeypatch.setattr(Kernels, "compiler_options", property(lambda self: {}))
    assert not all(asynchronous for _, asynchronous, _ in exchanges("ragged"))

"""A step's time predicted from its compiled GPU program: every kernel at its roofline
(or its measured rate), every collective where the schedule puts it.

The GEMM-only bound (`plan.throughput_bound`) counts matrix products at peak and
collectives at link bandwidth. A compiled program spends more than that: the
memory-bound kernels between the products (casts, norms, softmaxes, quantisation,
the optimizer, copies) and the collectives the schedule leaves exposed. This
reads the scheduled program (`Program`, optimized HLO text, one device's) as
the GPU runs it, one kernel after another on one compute stream:

- each kernel (a fusion, a custom call, a copy, any other op that is not a
  view or control) takes max(FLOPs / peak, bytes / HBM bandwidth): its matrix
  products at the datasheet's dense bf16 peak (fp8 operands at the fp8 peak,
  fp32 ones at half the bf16 peak, as TF32), its bytes the operands it reads
  and the results it writes. A fusion's parameter that is only sliced inside
  it counts the slices; an in-place update (`dynamic-update-slice`, `scatter`
  into a parameter) counts what it writes, not the whole buffer;
- each collective takes its bytes sent per device (`parallel.collectives`) over
  the link it crosses: NVLink within a host, the network between hosts (an
  all-to-all's share for peers on other hosts, all of any other collective
  whose group spans hosts), plus a fixed latency;
- collectives run one at a time on one communication stream. An asynchronous
  one (`-start` ... `-done`) overlaps whatever kernels the schedule placed
  between its start and its done; the done waits for it. A synchronous one
  (no start/done pair, or `"is_sync":true`) blocks the compute stream;
- a copy to or from pinned host memory (memory space S(5): activations a remat
  policy offloads) takes the bytes it moves over the GPU's host link; an
  asynchronous one runs on a copy stream of its own, overlapping the kernels
  until its done as an asynchronous collective does;
- loops run their body once per trip (`known_trip_count`), conditionals their
  slowest branch; but a loop whose conditionals say which table drives them (the
  1F1B pass's, `one_f_one_b.branches`) runs trip by trip, each stage its own
  branches, every trip as long as its slowest stage's (the stages are in lockstep).

At the datasheet's peaks this is a bound. With `Link.rates` (`jaxmoe.plan.rates`)
the same walk prices each kernel and collective at the fraction of its peak that
GPUs of its generation measurably reach, by size where that matters (small GEMMs,
few rows per expert), with a launch cost per kernel: the expected step. Neither
knows caches (every byte is counted from HBM), collectives' contention with
kernels for HBM and SMs, or several streams of collectives at once. Both are
predictions to optimise against and to check on a GPU (`benchmarks/gpu.sh`), not
measurements.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from jaxmoe.plan.hlo import Instruction, Program, arrays, branch_table, nbytes
from jaxmoe.plan.collectives import KINDS, replica_groups, sent_bytes
from jaxmoe.plan.program_flops import (attention_backward, block_scaled, grouped_gemm,
                                       pass_of, product_flops, rows_per_group, scope_of)
from jaxmoe.plan.rates import Rates, rates_for

# ops that launch nothing: views, tuples, control (their callees are walked)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
         "conditional", "call", "after-all", "add-dependency", "opt-barrier", "partition-id",
         "replica-id", "domain"}
_COLLECTIVE = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast"}
_VIEWS = {"bitcast", "reshape"}  # same bytes, another shape
# a fusion, or one launched asynchronously (XLA 0.12 wraps the layer loops' slices and
# in-place updates so: `fusion-start` runs the fused computation, `fusion-done` waits)
_FUSIONS = {"fusion", "fusion-start"}
_SLICES = {"slice", "dynamic-slice", "gather"}
_HOST = "S(5)"  # a layout's memory space: pinned host memory
# each collective's fixed cost, whatever its size (NCCL's small-message latency)
LATENCY_S = {"scale_up": 10e-6, "scale_out": 25e-6}


@dataclass(frozen=True)
class Link:
    """What the walk assumes of one device: `jaxmoe.plan.targets.Target`'s datasheet
    figures, and with `rates` the fractions of them its generation measurably reaches
    (`jaxmoe.plan.rates`: the expected step; without, the bound)."""

    bf16_flops: float  # dense peak FLOP/s
    fp8_flops: float
    hbm: float  # bytes/s
    scale_up: float  # bytes/s per direction within a host
    scale_out: float  # between hosts
    rates: Rates | None = None
    host: float = math.inf  # bytes/s per direction between the GPU and its host's memory

    @classmethod
    def of(cls, target, expected: bool = False) -> Link:
        return cls(target.peak("bf16"), target.peak("fp8") or target.peak("bf16"),
                   target.hbm_bandwidth, target.scale_up, target.scale_out,
                   rates_for(target.compute_capability) if expected else None,
                   target.host_link)


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # "gemm" (matrix products, attention included) or "memory"
    scope: str  # `program_flops.SCOPES` ("other" when none)
    pass_: str  # forward, backward or recompute
    flops: float
    bytes: float
    seconds: float  # one run
    runs: int


@dataclass(frozen=True)
class CollectiveRun:
    name: str
    kind: str  # `parallel.collectives.KINDS`
    scope: str
    seconds: float  # one run, on its link
    asynchronous: bool
    runs: int


@dataclass(frozen=True)
class HostTransfer:
    name: str
    bytes: float  # crossing the host link, one run
    seconds: float
    asynchronous: bool
    runs: int


@dataclass
class Roofline:
    """One device's predicted step."""

    step_s: float = 0.0
    kernels: list[Kernel] = field(default_factory=list)
    collectives: list[CollectiveRun] = field(default_factory=list)
    host_transfers: list[HostTransfer] = field(default_factory=list)
    # per host transfer: seconds per step the compute stream waited for it
    host_exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # per collective op: seconds per step the compute stream waited for it
    exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # per collective op: kernel seconds per step that ran inside its window
    window: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # per asynchronous collective op: the kinds of kernel ("gemm", "memory") in its window
    window_kinds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def seconds(self, kind: str | None = None) -> float:
        """Kernel seconds per step (of one kind: gemm or memory)."""
        return sum(k.seconds * k.runs for k in self.kernels if kind in (None, k.kind))

    def bytes(self, kind: str | None = None) -> float:
        return sum(k.bytes * k.runs for k in self.kernels if kind in (None, k.kind))

    def collective_seconds(self) -> float:
        return sum(c.seconds * c.runs for c in self.collectives)

    def exposed_seconds(self) -> float:
        return sum(self.exposed.values())

    def host_seconds(self) -> float:
        return sum(t.seconds * t.runs for t in self.host_transfers)

    def by_scope(self, kind: str) -> dict[str, dict[str, float]]:
        """(scope, pass) -> seconds and bytes per step of one kind of kernel, slowest first."""
        out = defaultdict(lambda: {"seconds": 0.0, "bytes": 0.0, "kernels": 0})
        for k in self.kernels:
            if k.kind == kind:
                row = out[f"{k.scope}/{k.pass_}"]
                row["seconds"] += k.seconds * k.runs
                row["bytes"] += k.bytes * k.runs
                row["kernels"] += 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))

    def exposed_by_scope(self) -> dict[str, dict[str, float]]:
        """(kind, scope) -> exposed and total seconds per step of the collectives."""
        out = defaultdict(lambda: {"exposed_s": 0.0, "seconds": 0.0, "synchronous_ops": 0})
        for c in self.collectives:
            row = out[f"{c.kind}/{c.scope}"]
            row["exposed_s"] += self.exposed.get(c.name, 0.0)
            row["seconds"] += c.seconds * c.runs
            row["synchronous_ops"] += not c.asynchronous
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["exposed_s"]))


# ---------------------------------------------------------------- a kernel's cost


def _read_bytes(program: Program, param: Instruction, full: int) -> int:
    """Bytes a fusion reads of one parameter: the slices taken where every use slices
    it, nothing where it is only the buffer of an in-place update, else all of it."""
    total, frontier = 0, [param]
    while frontier:
        inst = frontier.pop()
        for user in program.users.get(inst.name, []):
            if user.op in _VIEWS:
                frontier.append(user)
            elif user.op in _SLICES and user.operands[0] == inst.name:
                total += nbytes(user.type_text)
            elif user.op in ("dynamic-update-slice", "scatter") and user.operands[0] == inst.name \
                    and inst.name not in user.operands[1:]:
                continue
            else:
                return full
    return min(total, full)


def _written_bytes(program: Program, root: Instruction) -> int:
    """Bytes a computation's result writes: an in-place update writes its update."""
    while root.op in _VIEWS:
        root = program.by_name[root.operands[0]]
    if root.op == "tuple":
        return sum(_written_bytes(program, program.by_name[o]) for o in root.operands)
    if root.op == "dynamic-update-slice":
        return nbytes(program.type_of(root.operands[1]))
    if root.op == "scatter":
        return sum(nbytes(program.type_of(o)) for o in root.operands[len(root.operands) // 2 + 1:])
    return nbytes(root.type_text)


def _fusion_bytes(program: Program, inst: Instruction) -> int:
    comp = inst.callee
    params = program.parameters(comp)
    read = sum(_read_bytes(program, params[i], nbytes(program.type_of(o)))
               if i in params else nbytes(program.type_of(o))
               for i, o in enumerate(inst.operands))
    return read + _written_bytes(program, program.root(comp))


def _call_bytes(program: Program, inst: Instruction) -> int:
    """A custom call's operands and results, not its scratch space (u8/s8 results)."""
    out = sum(nbytes(f"{dt}[{','.join(map(str, dims))}]") for dt, dims in arrays(inst.type_text)
              if dt not in ("u8", "s8"))
    return out + sum(nbytes(program.type_of(o)) for o in inst.operands)


def _products(program: Program, inst: Instruction, seen: frozenset = frozenset()):
    """(FLOPs, instruction) of every matrix product `inst` is or calls."""
    flops = product_flops(inst, program)
    if flops:
        yield flops, inst
    if inst.callee and inst.callee not in seen:
        for inner in program.computations[inst.callee]:
            yield from _products(program, inner, seen | {inst.callee})


def _peak(link: Link, dtype: str) -> float:
    if dtype.startswith("f8"):
        return link.fp8_flops
    return link.bf16_flops / 2 if dtype in ("f32", "f64") else link.bf16_flops


def product_seconds(program: Program, inst: Instruction, flops: float, link: Link) -> float:
    """One matrix product's time: at the datasheet's peak for its operands' type (the
    bound), or at the rate its class and size reach (`link.rates`, the expected)."""
    dtype = arrays(program.type_of(inst.operands[0])) if inst.operands else []
    scaled = block_scaled(inst, program)
    dtype = "f8e4m3fn" if scaled else (dtype[0][0] if dtype else "bf16")
    r = link.rates
    if r is None:
        return flops / _peak(link, dtype)
    if inst.op == "custom-call" and inst.target.startswith("__cudnn$fmha"):
        rate = r.attention_backward if attention_backward(inst) else r.attention_forward
        return flops / (link.bf16_flops * rate.value)
    fraction = r.gemm_fraction(flops)
    if grouped_gemm(inst, program):
        fraction *= r.grouped_factor(rows_per_group(inst, program))
    if scaled:
        return flops / (link.bf16_flops * fraction * r.block_scaled.value)
    if dtype.startswith("f8"):
        fraction *= r.fp8.value
    return flops / (_peak(link, dtype) * fraction)


def kernel_cost(program: Program, inst: Instruction, link: Link) -> tuple[float, float, float]:
    """(FLOPs, bytes, seconds) of one kernel's run."""
    if inst.op in _FUSIONS:
        moved = _fusion_bytes(program, inst)
    else:
        moved = _call_bytes(program, inst) if inst.op == "custom-call" else (
            nbytes(inst.type_text) + sum(nbytes(program.type_of(o)) for o in inst.operands))
    products = list(_products(program, inst))
    flops = sum(f for f, _ in products)
    compute = sum(product_seconds(program, p, f, link) for f, p in products)
    if link.rates is None:
        return flops, moved, max(compute, moved / link.hbm)
    r = link.rates
    return flops, moved, max(compute, moved / (link.hbm * r.hbm.value)) + r.launch_s.value


def _allocation(inst: Instruction) -> bool:
    """A buffer's allocation (a host buffer's for offloaded activations): no kernel."""
    return inst.op == "custom-call" and inst.target == "AllocateBuffer"


def host_transfer_bytes(program: Program, inst: Instruction) -> int | None:
    """Bytes `inst` moves between the device and pinned host memory (memory space
    S(5)); None if it moves none. Any kernel that reads or writes host memory moves
    its bytes over the host link. XLA:GPU lowers an offloaded activation to an
    asynchronous dynamic-update-slice into a host buffer (the forward) and a
    dynamic-slice out of it (the backward), or to a copy: each moves what it
    writes (the update, the slice), not the buffer."""
    op = inst.op.removesuffix("-start")
    if inst.op in _FREE or inst.op.endswith("-done") or op in _COLLECTIVE or _allocation(inst):
        return None
    types = [inst.type_text, *(program.type_of(o) for o in inst.operands)]
    if not any(_HOST in t for t in types):
        return None
    if inst.callee:  # a fusion: what it writes
        return _written_bytes(program, program.root(inst.callee))
    if op == "dynamic-update-slice":
        return nbytes(program.type_of(inst.operands[1]))
    if op == "copy" and inst.operands:
        return nbytes(program.type_of(inst.operands[0]))
    return nbytes(inst.type_text)


def host_transfer_seconds(moved: float, link: Link) -> float:
    """A host transfer's time: its bytes over the host link (at the fraction of it
    copies reach, for the expected step)."""
    fraction = link.rates.host_copy.value if link.rates else 1.0
    return moved / (link.host * fraction)


# ---------------------------------------------------------------- a collective's cost


def _collective_seconds(program: Program, inst: Instruction, kind: str, link: Link,
                        host: list[int] | None) -> float:
    base = kind.removeprefix("ragged-")
    operands = inst.operands[:1] if kind == "ragged-all-to-all" else inst.operands
    operand = sum(nbytes(program.type_of(o)) for o in operands)
    groups = replica_groups(inst.attrs, program.num_devices)
    sent = sent_bytes(base if base in KINDS else "all-reduce", operand, len(groups[0]), inst.attrs)
    if not sent:
        return 0.0
    r = link.rates
    up = link.scale_up * (1.0 if r is None else (
        r.all_to_all if base == "all-to-all" else r.scale_up).value)
    out = link.scale_out * (1.0 if r is None else r.scale_out.value)
    latency = LATENCY_S if r is None else {"scale_up": r.latency_s.value,
                                           "scale_out": r.latency_s.value}
    across = 0.0
    if host is not None and any(len({host[i] for i in g}) > 1 for g in groups):
        across = sent
        if base == "all-to-all":  # an equal part to each peer, those on its host on NVLink
            g = groups[0]
            across = sent * sum(host[i] != host[g[0]] for i in g) / (len(g) - 1)
    if across:
        return max((sent - across) / up, across / out) + latency["scale_out"]
    return sent / up + latency["scale_up"]


def _is_sync(inst: Instruction) -> bool:
    return '"is_sync":true' in inst.attrs


# ---------------------------------------------------------------- the schedule


class _Stream:
    """The compute stream's clock, the communication stream's and the host copies'."""

    def __init__(self):
        self.clock = 0.0  # when the compute stream is next free
        self.comm = 0.0  # when the communication stream is next free
        self.host = 0.0  # when the copy stream to and from host memory is next free
        self.pending: dict[str, tuple[str, float, float]] = {}  # start -> (op, finish, clock)


def hosts(mesh) -> list[int] | None:
    """The host of each device in the program's order, as `roofline` takes it (None: the
    mesh is on one host)."""
    host = [d.process_index for d in mesh.devices.flat]
    return host if len(set(host)) > 1 else None


def roofline(program: Program | str, link: Link, host: list[int] | None = None,
             branches: dict[str, np.ndarray] | None = None) -> Roofline:
    """The predicted step of `program` on a device with `link`'s figures; `host`: each
    device's host, in the program's device order (None: one host). branches: the
    branch each stage's conditionals of a lockstep loop take, by table name, [trip,
    stage] (`jaxmoe.parallel.one_f_one_b.branches`; by default the program's own)."""
    program = program if isinstance(program, Program) else Program(program, branches)
    branches = program.branches if branches is None else branches
    out = Roofline()
    costs: dict[str, tuple[str, float, bool]] = {}  # instruction -> (kind, seconds, async)

    def cost(inst: Instruction):
        if inst.name not in costs:
            op = inst.op.removesuffix("-start")
            moved = host_transfer_bytes(program, inst)
            if moved is not None:
                asynchronous = inst.op.endswith("-start")
                costs[inst.name] = ("host", host_transfer_seconds(moved, link), asynchronous)
                out.host_transfers.append(HostTransfer(
                    inst.name, moved, costs[inst.name][1], asynchronous,
                    program.runs.get(inst.computation, 0)))
            elif op in _COLLECTIVE:
                costs[inst.name] = ("collective", _collective_seconds(
                    program, inst, op, link, host), inst.op.endswith("-start") and not _is_sync(inst))
            else:
                flops, moved, seconds = kernel_cost(program, inst, link)
                costs[inst.name] = ("gemm" if flops else "memory", seconds, False)
                out.kernels.append(Kernel(inst.name, "gemm" if flops else "memory",
                                          scope_of(inst.op_name), pass_of(inst.op_name), flops,
                                          moved, seconds, program.runs.get(inst.computation, 0)))
        return costs[inst.name]

    for inst, runs, _ in program.instructions():  # the collectives' table
        op = inst.op.removesuffix("-start")
        if op in _COLLECTIVE and not inst.op.endswith("-done") and inst.computation in program.runs:
            kind, seconds, asynchronous = cost(inst)
            out.collectives.append(CollectiveRun(inst.name, _KIND.get(op, op),
                                                 scope_of(inst.op_name), seconds, asynchronous,
                                                 runs))

    def run(comp: str, s: _Stream, weight: float, pick: tuple[int, int] | None = None):
        """Advance the streams through one run of `comp`; `weight`: its runs per step
        per run simulated (exposure is booked per step). pick: (trip, stage) of a
        lockstep loop, whose tables choose its conditionals' branches."""
        for inst in program.computations[comp]:
            if inst.op == "while":
                body = _attr(inst, "body")
                if branches and body in lockstep_bodies:
                    lockstep_loop(body, _attr(inst, "condition"), inst.trip_count or 1, s,
                                  weight)
                else:
                    loop(body, _attr(inst, "condition"), inst.trip_count or 1, s, weight)
            elif inst.op == "conditional":
                table = branch_table(inst)
                if pick is not None and table in branches:
                    run(_branches(inst)[int(branches[table][pick])], s, weight, pick)
                    continue
                ends = []
                for b in _branches(inst):
                    t = _copy(s)
                    run(b, t, weight, pick)
                    ends.append(t)
                slowest = max(ends, key=lambda t: t.clock)
                s.clock, s.comm, s.host, s.pending = (slowest.clock, slowest.comm, slowest.host,
                                                      slowest.pending)
            elif inst.op == "call":
                run(inst.callee, s, weight, pick)
            elif inst.op.endswith("-done"):
                start = inst.operands[0] if inst.operands else ""
                if start in s.pending:
                    op, finish, opened = s.pending.pop(start)
                    exposed = out.host_exposed if op == "host" else out.exposed
                    if op != "host":
                        out.window[start] += (s.clock - opened) * weight
                    if finish > s.clock:
                        exposed[start] += (finish - s.clock) * weight
                        s.clock = finish
            elif inst.op in _FREE or _allocation(inst):
                continue
            else:
                kind, seconds, asynchronous = cost(inst)
                if kind == "host":
                    begin = max(s.clock, s.host)
                    s.host = begin + seconds
                    if asynchronous:
                        s.pending[inst.name] = ("host", s.host, s.clock)
                    else:
                        out.host_exposed[inst.name] += (s.host - s.clock) * weight
                        s.clock = s.host
                    continue
                if kind != "collective":
                    s.clock += seconds
                    for start, (op, _, _) in s.pending.items():
                        if op != "host":
                            out.window_kinds[start].add(kind)
                    continue
                begin = max(s.clock, s.comm)
                s.comm = begin + seconds
                if asynchronous:
                    s.pending[inst.name] = (inst.op, s.comm, s.clock)
                else:
                    out.exposed[inst.name] += (s.comm - s.clock) * weight
                    s.clock = s.comm
                    if inst.op.endswith("-start"):  # its done finds it finished
                        s.pending[inst.name] = (inst.op, s.comm, s.clock)

    def loop(body: str, condition: str, trips: int, s: _Stream, weight: float):
        # the second trip is the steady state: trips 3.. repeat its advance
        for i in range(min(trips, 2)):
            before = (s.clock, s.comm, s.host)
            run(condition, s, weight)
            run(body, s, weight * (1 if i == 0 or trips <= 2 else trips - 1))
        if trips > 2:  # every later trip shifts the streams by the second's period
            period = s.clock - before[0]
            s.clock += period * (trips - 2)
            if s.comm > before[1]:
                s.comm += period * (trips - 2)
            if s.host > before[2]:
                s.host += period * (trips - 2)
        run(condition, s, weight)

    def lockstep_loop(body: str, condition: str, trips: int, s: _Stream, weight: float):
        stages = next(iter(branches.values())).shape[1]
        if trips != next(iter(branches.values())).shape[0]:
            raise ValueError(f"a lockstep loop of {trips} trips, tables of "
                             f"{next(iter(branches.values())).shape[0]}")
        for t in range(trips):  # each trip ends when its slowest stage's does
            ends = []
            for stage in range(stages):  # each stage's exposure counts 1 / stages
                c = _copy(s)
                run(condition, c, weight / stages)
                run(body, c, weight / stages, (t, stage))
                ends.append(c)
            slowest = max(ends, key=lambda c: c.clock)
            s.clock, s.comm, s.host, s.pending = (slowest.clock, slowest.comm, slowest.host,
                                                  slowest.pending)
        run(condition, s, weight)

    # the loops whose conditionals follow the tables: the innermost that reach one
    lockstep_bodies = set()
    if branches:
        bodies = {_attr(i, "body") for insts in program.computations.values() for i in insts
                  if i.op == "while"}
        lockstep_bodies = {b for b in bodies if any(
            branch_table(i) in branches for c in program.reached(b)
            for i in program.computations[c] if i.op == "conditional")}
        lockstep_bodies = {b for b in lockstep_bodies
                           if not any(o != b and o in program.reached(b) for o in lockstep_bodies)}

    stream = _Stream()
    run(program.entry, stream, 1.0)
    out.step_s = max(stream.clock, stream.comm, stream.host)
    out.exposed = dict(out.exposed)
    out.host_exposed = dict(out.host_exposed)
    out.window = dict(out.window)
    out.window_kinds = dict(out.window_kinds)
    return out


_KIND = {"ragged-all-to-all": "all-to-all", "collective-broadcast": "all-gather"}


def _attr(inst: Instruction, key: str) -> str:
    return re.search(rf"{key}=%([\w.\-]+)", inst.attrs).group(1)


def _branches(inst: Instruction) -> list[str]:
    m = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
    if m:
        return re.findall(r"%([\w.\-]+)", m.group(1))
    # a predicate's conditional: index 0 is false, 1 true, as `branches` tables count
    return [_attr(inst, "false_computation"), _attr(inst, "true_computation")]


def _copy(s: _Stream) -> _Stream:
    t = _Stream()
    t.clock, t.comm, t.host, t.pending = s.clock, s.comm, s.host, dict(s.pending)
    return t


def summary(r: Roofline, model_flops: float, tokens_per_device: float, link: Link) -> dict:
    """The figures `jaxmoe.plan.planner` prints and writes."""
    step = r.step_s or math.inf
    return {"step_s": r.step_s,
            "tokens_per_s_per_device": tokens_per_device / step,
            "model_tflops_per_device": model_flops / step / 1e12,
            "mfu": model_flops / step / link.bf16_flops,
            "gemm_s": r.seconds("gemm"), "memory_bound_s": r.seconds("memory"),
            "memory_bound_bytes": r.bytes("memory"), "gemm_bytes": r.bytes("gemm"),
            "collective_s": r.collective_seconds(), "exposed_collective_s": r.exposed_seconds(),
            "synchronous_collectives": sum(not c.asynchronous for c in r.collectives
                                           if c.seconds > 0),
            "kernel_runs": sum(k.runs for k in r.kernels),
            "host_transfer_s": r.host_seconds(),
            "host_transfer_bytes": sum(t.bytes * t.runs for t in r.host_transfers),
            "exposed_host_s": sum(r.host_exposed.values()),
            "memory_bound_by_scope": r.by_scope("memory"),
            "gemm_by_scope": r.by_scope("gemm"),
            "exposed_by_scope": r.exposed_by_scope()}


# ---------------------------------------------------------------- lowering facts


def row_exchanges(program: Program, r: Roofline) -> list[tuple[str, bool, set[str]]]:
    """(name, asynchronous, kinds of kernel in its window) of every exchange of token
    rows (a floating-point all-to-all, ragged or not) that sends anything."""
    return [(c.name, c.asynchronous, r.window_kinds.get(c.name, set()))
            for c in r.collectives if c.kind == "all-to-all" and c.seconds > 0
            and any(dt.startswith(("f", "bf")) for dt, _ in arrays(program.by_name[c.name].type_text))]


def quantisations(program: Program) -> list[tuple[int, bool, str, tuple[int, ...]]]:
    """(runs per step, inside a loop, name stack, first result's dims) of every kernel
    of the MXFP8 quantisation (`jit(quantize)` on its name stack); the weights' are
    those under `working_copy`."""
    return [(runs, in_loop, inst.op_name, arrays(inst.type_text)[0][1])
            for inst, runs, in_loop in program.instructions()
            if inst.op in _FUSIONS and "quantize" in inst.op_name]


def quantisation_cost(program: Program, r: Roofline) -> dict[str, dict[str, float]]:
    """Per step, the MXFP8 quantisation's kernels (`quantisations`) in the walk `r`:
    kernels, runs, bytes and seconds, the weights' (under `working_copy`: once a step,
    or once a pipeline round) apart from the activations' and gradients' (in every
    layer, pass and micro-batch)."""
    parts = {"weights": [], "activations": []}
    for k in r.kernels:
        inst = program.by_name.get(k.name)
        if inst is None or inst.op not in _FUSIONS or "quantize" not in inst.op_name:
            continue
        parts["weights" if "working_copy" in inst.op_name else "activations"].append(k)
    return {part: _tally(kernels) for part, kernels in parts.items()}


def xla_recomputation(r: Roofline) -> dict[str, float]:
    """Per step, the kernels XLA's own rematerialisation added to the walk `r`: clones
    of a kernel whose result it chose not to keep (named `<kernel>.remat<n>`), made
    where the program would pass the memory XLA plans for (the device's, less the
    step's inputs and outputs, times `xla_gpu_memory_limit_slop_factor` percent).
    Work the model's `train.remat` policy did not ask for: kernels, runs, bytes and
    seconds."""
    return _tally([k for k in r.kernels if ".remat" in k.name])


def _tally(kernels: list[Kernel]) -> dict[str, float]:
    """Kernels, runs, bytes and seconds per step of some of a walk's kernels."""
    return {"kernels": len(kernels), "runs": sum(k.runs for k in kernels),
            "bytes": float(sum(k.bytes * k.runs for k in kernels)),
            "seconds": float(sum(k.seconds * k.runs for k in kernels))}

"""What the collectives of a compiled program send, per device and per step.

Reads the optimized HLO text. Each all-gather, reduce-scatter, all-reduce,
all-to-all (ragged too) and collective-permute is counted from its replica
groups, as the bytes one device sends over a ring of its group's n devices:

    all-reduce        2 (n - 1) / n x operand   (reduce-scatter, then all-gather)
    all-gather        (n - 1) x operand         (the shard goes to every peer)
    reduce-scatter    (n - 1) / n x operand
    all-to-all        (n - 1) / n x operand     (one block stays home)
    collective-permute  operand, unless every pair is a device to itself

A group of one device sends nothing (XLA keeps such ops, e.g. an all-reduce over
a mesh axis of size 1). An op inside a `while` body (scanned layers, micro-batch
accumulation, pipeline iterations) runs once per trip; `in_loop` marks it, since
a gradient reduction there is repeated work.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from jaxmoe.plan.hlo import Program, nbytes

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP_KIND = {"ragged-all-to-all": "all-to-all", **{k: k for k in KINDS}}


@dataclass(frozen=True)
class Collective:
    """One collective op of the program."""

    kind: str  # one of KINDS
    name: str  # the HLO instruction
    groups: tuple[tuple[int, ...], ...]  # its replica groups (program-order device indices)
    operand_bytes: int  # per device
    sent_bytes: float  # per device, per run
    runs: int  # runs per step: the product of the enclosing loops' trip counts
    in_loop: bool  # inside a while body
    op_name: str = ""  # its metadata's op_name: the named scopes it was traced in

    @property
    def group_size(self) -> int:
        """Devices in each of its replica groups."""
        return len(self.groups[0])


@dataclass(frozen=True)
class KindTotal:
    """One kind's traffic per step."""

    bytes: int  # sent per device
    runs: int  # op executions
    ops_in_loops: int  # distinct ops inside while bodies


def _iota(dims: str, reshape: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[dims]<=[reshape]T(perm)`."""
    ids = np.arange(math.prod(int(d) for d in reshape.split(","))).reshape(
        [int(d) for d in reshape.split(",")])
    if perm:
        ids = ids.transpose([int(d) for d in perm.split(",")])
    return ids.reshape([int(d) for d in dims.split(",")])


def _mesh_axes_groups(axes_text: str, devices_text: str | None,
                      grouped_text: str) -> tuple[tuple[int, ...], ...]:
    """The groups of XLA's mesh-axes form (0.12 on), `mesh['a'=2,'b'=4] {'b'}`: devices
    laid out on the named mesh (iota, unless `device_ids=(...)` lists them), one group per
    position of the other axes, running over the grouped ones in their listed order. A
    grouped sub-axis `'a':(pre)size` is the `size` positions of `a` with stride `pre`."""
    names, sizes = zip(*[(n, int(v)) for n, v in re.findall(r"'?([\w.\-]+)'?=(\d+)", axes_text)])
    if devices_text is None:
        devices = np.arange(math.prod(sizes))
    elif m := re.search(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", devices_text):
        devices = _iota(*m.groups())
    else:
        devices = np.array([int(d) for d in re.findall(r"\d+", devices_text.split("]")[-1])])
    refs = [(names.index(n), int(pre) if pre else None, int(size) if size else None)
            for n, pre, size in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", grouped_text)]
    # each mesh axis split into the pieces its grouped sub-axes need, major to minor
    dims, grouped = [], {}
    for axis, size in enumerate(sizes):
        mine = sorted((pre, sub, i) for i, (a, pre, sub) in enumerate(refs) if a == axis)
        if not mine:
            dims.append(size)
            continue
        if mine[0][0] is None:  # the whole axis
            grouped[mine[0][2]] = len(dims)
            dims.append(size)
            continue
        # sub-axes, major to minor: `pre` is the product of the pieces of the axis before
        # (major to) it, so the axis splits into [pre, size, rest] around each
        covered = 1
        for pre, sub, i in mine:
            if pre != covered:
                dims.append(pre // covered)
            grouped[i] = len(dims)
            dims.append(sub)
            covered = pre * sub
        if covered != size:
            dims.append(size // covered)
    order = [grouped[i] for i in range(len(refs))]
    rest = [d for d in range(len(dims)) if d not in order]
    ids = devices.reshape(dims).transpose(rest + order)
    n = math.prod(dims[d] for d in order)
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, n))


def replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective (program-order device indices), from
    `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[G,n]<=[dims]` with
    an optional transpose `T(perm)` (G groups of n), the mesh-axes form
    `replica_groups=mesh['a'=2,'b'=4] {'b'}` (`_mesh_axes_groups`), or `{}` / none (all
    devices). A collective-permute has pairs instead, and counts as one group of all
    devices."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? "
                     r"\{([^}]*)\}", attrs)
    if mesh:
        return _mesh_axes_groups(*mesh.groups())
    if maximal := re.search(r"replica_groups=maximal_mesh\[device_id=(\d+)\]", attrs):
        return ((int(maximal.group(1)),),)
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        ids = _iota(iota.group(1), iota.group(2), iota.group(3))
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, shape[-1]))
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    groups = tuple(tuple(int(d) for d in g.split(",") if d)
                   for g in re.findall(r"\{([\d,]*)\}", listed.group(1))) if listed else ()
    return tuple(g for g in groups if g) or (tuple(range(num_devices)),)


def sent_bytes(kind: str, operand_bytes: int, n: int, attrs: str = "") -> float:
    """Bytes one device sends for one run of a `kind` op over a group of `n`."""
    if kind == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[-1])
        return float(operand_bytes) if any(a != b for a, b in pairs) else 0.0
    if n <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1,
              "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n}[kind]
    return factor * operand_bytes


def collectives(hlo_text: str | Program) -> list[Collective]:
    """Every collective op reached from the entry computation, with its runs per step."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    found = []
    for inst, runs, in_loop in program.instructions():
        kind = _OP_KIND.get(inst.op.removesuffix("-start"))
        if not kind or inst.op.endswith("-done"):
            continue
        # a ragged exchange sends from its first operand; the rest are buffer and offsets
        operands = inst.operands[:1] if inst.op.startswith("ragged-all-to-all") else inst.operands
        operand = sum(nbytes(program.type_of(o)) for o in operands)
        groups = replica_groups(inst.attrs, program.num_devices)
        found.append(Collective(kind, inst.name, groups, operand,
                                sent_bytes(kind, operand, len(groups[0]), inst.attrs), runs,
                                in_loop, inst.op_name))
    return found


def totals(ops: list[Collective]) -> dict[str, KindTotal]:
    """Per kind: bytes sent per device per step, runs per step and ops inside loops
    of the ops that send anything."""
    out = {}
    for kind in KINDS:
        mine = [c for c in ops if c.kind == kind and c.sent_bytes > 0]
        out[kind] = KindTotal(int(round(sum(c.sent_bytes * c.runs for c in mine))),
                              sum(c.runs for c in mine), sum(c.in_loop for c in mine))
    return out


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes each kind sends per device in one run of the entry computation."""
    return {k: t.bytes for k, t in totals(collectives(hlo_text)).items()}


def compiled_collectives(compiled) -> list[Collective]:
    """`collectives` of a `jax.jit(...).lower(...).compile()` result."""
    return collectives(compiled.as_text())


def compiled_collective_bytes(compiled) -> dict[str, int]:
    """`collective_bytes` of a `jax.jit(...).lower(...).compile()` result."""
    return collective_bytes(compiled.as_text())

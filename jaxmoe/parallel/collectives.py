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

import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OP_KIND = {"ragged-all-to-all": "all-to-all", **{k: k for k in KINDS}}


@dataclass(frozen=True)
class Collective:
    """One collective op of the program."""

    kind: str  # one of KINDS
    name: str  # the HLO instruction
    group_size: int  # devices in each of its replica groups
    operand_bytes: int  # per device
    sent_bytes: float  # per device, per run
    runs: int  # runs per step: the product of the enclosing loops' trip counts
    in_loop: bool  # inside a while body


@dataclass(frozen=True)
class KindTotal:
    """One kind's traffic per step."""

    bytes: int  # sent per device
    runs: int  # op executions
    ops_in_loops: int  # distinct ops inside while bodies


def _bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype.startswith("f8"):
            size = 1
        elif dtype in _DTYPE_BYTES:
            size = _DTYPE_BYTES[dtype]
        else:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * size
    return total


def _operands(args_text: str) -> list[str]:
    """Names of the operands in `op(%a, %b), attr=...` (up to the closing paren)."""
    depth, end = 1, len(args_text)
    for i, ch in enumerate(args_text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", args_text[:end])


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group, from `replica_groups={{0,1},{2,3}}`, the iota
    form `replica_groups=[2,4]<=[8]`, or `{}` (all devices)."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}", attrs)
    if listed and listed.group(1):
        first = re.match(r"\{([\d,]*)\}", listed.group(1)).group(1)
        return len([d for d in first.split(",") if d])
    return num_devices


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


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op reached from the entry computation, with its runs per step."""
    shapes: dict[str, str] = {}
    own: dict[str, list[tuple[str, str, int, str]]] = defaultdict(list)
    calls: dict[str, list[tuple[int, bool, str]]] = defaultdict(list)  # (trips, is_loop, callee)
    header = re.search(r"num_partitions=(\d+)", hlo_text.split("\n", 1)[0])
    replicas = re.search(r"replica_count=(\d+)", hlo_text.split("\n", 1)[0])
    num_devices = (int(header.group(1)) if header else 1) * (int(replicas.group(1)) if replicas else 1)
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, type_text, op, rest = m.groups()
        shapes[name] = type_text
        kind = _OP_KIND.get(op.removesuffix("-start"))
        if kind and not op.endswith("-done"):
            operands = _operands(rest)
            if op.startswith("ragged-all-to-all"):
                operands = operands[:1]  # the rows sent; the rest are buffer and offsets
            own[current].append((kind, name, sum(_bytes(shapes.get(o, "")) for o in operands), rest))
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
            body = re.search(r"body=%([\w.\-]+)", rest)
            if body:
                calls[current].append((int(trips.group(1)) if trips else 1, True, body.group(1)))
        for callee in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.\-]+)",
                                 rest):
            calls[current].append((1, False, callee))
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches:
            for callee in re.findall(r"%([\w.\-]+)", branches.group(1)):
                calls[current].append((1, False, callee))

    reaches: dict[str, bool] = {}

    def has_collectives(comp: str) -> bool:
        if comp not in reaches:
            reaches[comp] = False  # cycles cannot occur in HLO; this guards the recursion
            reaches[comp] = bool(own[comp]) or any(has_collectives(c) for _, _, c in calls[comp])
        return reaches[comp]

    found: dict[str, Collective] = {}

    def walk(comp: str, runs: int, in_loop: bool) -> None:
        for kind, name, operand, attrs in own[comp]:
            n = group_size(attrs, num_devices)
            prev = found.get(name)  # a computation called from several places
            found[name] = Collective(kind, name, n, operand, sent_bytes(kind, operand, n, attrs),
                                     runs + (prev.runs if prev else 0),
                                     in_loop or (prev.in_loop if prev else False))
        for trips, is_loop, callee in calls[comp]:
            if has_collectives(callee):
                walk(callee, runs * trips, in_loop or is_loop)

    if entry:
        walk(entry, 1, False)
    return list(found.values())


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

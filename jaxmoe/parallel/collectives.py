"""Bytes each kind of collective moves per step, read from a compiled program.

Parses the optimized HLO text: every all-gather, reduce-scatter, all-reduce,
all-to-all and collective-permute counts the bytes of its operands (per device),
and ops inside a `while` loop (scanned layers, microbatches) count once per trip.
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")


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


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device operand bytes of each collective kind for one run of the entry."""
    shapes: dict[str, str] = {}
    own: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    calls: dict[str, list[tuple[int, str]]] = defaultdict(list)
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
        kind = op.removesuffix("-start")
        if kind in KINDS and not op.endswith("-done"):
            own[current][kind] += sum(_bytes(shapes.get(o, "")) for o in _operands(rest))
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
            body = re.search(r"body=%([\w.\-]+)", rest)
            if body:
                calls[current].append((int(trips.group(1)) if trips else 1, body.group(1)))
        for callee in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.\-]+)", rest):
            calls[current].append((1, callee))
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches:
            for callee in re.findall(r"%([\w.\-]+)", branches.group(1)):
                calls[current].append((1, callee))

    memo: dict[str, dict[str, int]] = {}

    def total(comp: str) -> dict[str, int]:
        if comp not in memo:
            memo[comp] = {}
            acc = defaultdict(int, own[comp])
            for times, callee in calls[comp]:
                for k, v in total(callee).items():
                    acc[k] += times * v
            memo[comp] = dict(acc)
        return memo[comp]

    result = total(entry) if entry else {}
    return {k: int(result.get(k, 0)) for k in KINDS}


def compiled_collective_bytes(compiled) -> dict[str, int]:
    """`collective_bytes` of a `jax.jit(...).lower(...).compile()` result."""
    return collective_bytes(compiled.as_text())

"""A compiled program's optimized HLO text, read as computations, instructions and runs.

`Program(compiled.as_text())` holds every instruction of every computation: its
result type, op, operands, attributes and `op_name` (JAX's name stack: the named
scopes it ran under, `jvp(...)` / `transpose(...)` for the forward and backward
passes, `rematted_computation` for recomputation). `runs` says how often each
computation runs per call of the program: the product of the trip counts of the
`while` loops around it (XLA records a loop's count when it knows it; a loop
without one counts once and is listed in `loops_without_trip_count`), summed over
its call sites. Both branches of a conditional are counted, so figures taken from
a program with conditionals are upper bounds.

The readers of these programs: `jaxmoe.plan.collectives` (bytes sent) and
`jaxmoe.plan.program_flops` (FLOPs per named scope and pass).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_CALLEES = re.compile(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")


@dataclass(frozen=True)
class Instruction:
    name: str
    computation: str
    type_text: str  # the result type: `bf16[8,128]{1,0}`, or a tuple of them
    op: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list
    op_name: str  # the JAX name stack of the op that produced it ("" if none)
    number: int = -1  # a parameter's position in its computation's arguments

    @property
    def trip_count(self) -> int | None:
        """A `while` loop's trip count, where XLA knows it."""
        m = re.search(r'known_trip_count":\{"n":"(\d+)"', self.attrs)
        return int(m.group(1)) if m else None

    @property
    def callee(self) -> str:
        """The computation a fusion or call runs ("" for other ops)."""
        m = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", self.attrs)
        return m.group(1) if m else ""

    @property
    def target(self) -> str:
        """A custom call's target ("" for other ops)."""
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return m.group(1) if m else ""


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a type, tuple elements in order."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(type_text)]


def nbytes(type_text: str) -> int:
    """Bytes of every array in a type (float8 types count one byte; tokens none)."""
    total = 0
    for dtype, dims in arrays(type_text):
        size = 1 if dtype.startswith("f8") else _DTYPE_BYTES.get(dtype)
        if size is None:
            continue
        n = 1
        for d in dims:
            n *= d
        total += n * size
    return total


def _split_operands(rest: str) -> tuple[tuple[str, ...], str]:
    """(operand names, attributes) from `a, %b), attr=...` (up to the closing paren)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return tuple(re.findall(r"%([\w.\-]+)", rest[:end])), rest[end + 1:]


def branch_table(inst: Instruction) -> str | None:
    """The table a conditional's branch follows (`one_f_one_b.branch_scope`), if any."""
    m = re.search(r"lockstep_branch=(\w+)/(?:cond|switch)$", inst.op_name)
    return m.group(1) if m else None


class Program:
    """The instructions and call graph of one HLO module's text."""

    def __init__(self, text: str, branches: dict | None = None):
        """branches: the branch each stage's conditionals of a lockstep loop take, by
        table name, [trip, stage] (-1 where one does not run;
        `jaxmoe.parallel.one_f_one_b.branches`). A conditional that names its table
        then runs each branch in the share of its runs the table gives it (the mean
        over stages), where without one each branch counts in every run."""
        self.branches = branches or {}
        header = text.split("\n", 1)[0]
        partitions = re.search(r"num_partitions=(\d+)", header)
        replicas = re.search(r"replica_count=(\d+)", header)
        self.num_devices = (int(partitions.group(1)) if partitions else 1) * (
            int(replicas.group(1)) if replicas else 1)
        self.computations: dict[str, list[Instruction]] = defaultdict(list)
        self.by_name: dict[str, Instruction] = {}
        # caller -> [(trips, is_loop, callee)]
        self.calls: dict[str, list[tuple[int, bool, str]]] = defaultdict(list)
        self._reached: dict[str, set[str]] = {}  # `reached`, computed once each
        self.entry = None
        self.loops_without_trip_count: list[str] = []  # counted as one trip each
        # the share of a grouped GEMM's rows that routing fills, which the program cannot
        # say (`program_flops`): 1 counts every row; the planner sets its routing's
        self.routed_share = 1.0
        current = None
        self._roots: dict[str, Instruction] = {}
        for line in text.splitlines():
            m = _COMPUTATION.match(line)
            if m and not line.startswith(" "):
                current = m.group(1)
                if line.startswith("ENTRY"):
                    self.entry = current
                continue
            m = _INSTRUCTION.match(line)
            if not m or current is None:
                continue
            name, type_text, op, rest = m.groups()
            operands, attrs = _split_operands(rest)
            op_name = re.search(r'op_name="([^"]*)"', attrs)
            number = re.match(r"\s*(\d+)", rest) if op == "parameter" else None
            inst = Instruction(name, current, type_text, op, operands, attrs,
                               op_name.group(1) if op_name else "",
                               int(number.group(1)) if number else -1)
            self.computations[current].append(inst)
            self.by_name[name] = inst
            if line.lstrip().startswith("ROOT"):
                self._roots[current] = inst
            if op == "while":
                trips = inst.trip_count
                body = re.search(r"body=%([\w.\-]+)", attrs)
                if body:
                    self.calls[current].append((trips or 1, True, body.group(1)))
                if not trips:
                    self.loops_without_trip_count.append(name)
            for callee in _CALLEES.findall(attrs):
                self.calls[current].append((1, False, callee))
            branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
            if branches:
                callees = re.findall(r"%([\w.\-]+)", branches.group(1))
                shares = self._shares(inst, len(callees))
                for callee, share in zip(callees, shares):
                    self.calls[current].append((share, False, callee))

    @cached_property
    def users(self) -> dict[str, list[Instruction]]:
        """Each instruction's users (within its computation), in program order."""
        out = defaultdict(list)
        for comp in self.computations.values():
            for inst in comp:
                for o in dict.fromkeys(inst.operands):
                    out[o].append(inst)
        return out

    def parameters(self, computation: str) -> dict[int, Instruction]:
        """A computation's parameters by position."""
        return {i.number: i for i in self.computations[computation] if i.op == "parameter"}

    def root(self, computation: str) -> Instruction:
        """A computation's result (its last instruction, as XLA prints it)."""
        return self._roots.get(computation) or self.computations[computation][-1]

    def type_of(self, name: str) -> str:
        inst = self.by_name.get(name)
        return inst.type_text if inst else ""

    @cached_property
    def _order(self) -> list[str]:
        """Computations reachable from the entry, every caller before its callees."""
        seen, post = set(), []

        def visit(comp):
            stack = [(comp, iter(self.calls[comp]))]
            seen.add(comp)
            while stack:
                node, edges = stack[-1]
                for _, _, callee in edges:
                    if callee not in seen:
                        seen.add(callee)
                        stack.append((callee, iter(self.calls[callee])))
                        break
                else:
                    post.append(node)
                    stack.pop()

        if self.entry:
            visit(self.entry)
        return post[::-1]

    def _shares(self, inst: Instruction, n: int) -> list[float]:
        """How often each of a conditional's n branches runs per run of it."""
        table = self.branches.get(branch_table(inst))
        if table is None:
            return [1] * n
        ran = table[table >= 0]
        return [float((ran == i).sum()) / max(ran.size, 1) for i in range(n)]

    def reached(self, computation: str) -> set[str]:
        """The computations a run of `computation` may run: itself and its callees',
        loop bodies and branches included."""
        if computation not in self._reached:
            seen, todo = {computation}, [computation]
            while todo:
                for _, _, callee in self.calls[todo.pop()]:
                    if callee not in seen:
                        seen.add(callee)
                        todo.append(callee)
            self._reached[computation] = seen
        return self._reached[computation]

    @cached_property
    def runs(self) -> dict[str, int]:
        """Runs of each reachable computation per call of the program."""
        runs = defaultdict(int)
        if self.entry:
            runs[self.entry] = 1
        for comp in self._order:
            for trips, _, callee in self.calls[comp]:
                runs[callee] += runs[comp] * trips
        return dict(runs)

    @cached_property
    def in_loop(self) -> dict[str, bool]:
        """Whether each reachable computation runs inside a `while` body."""
        inside = defaultdict(bool)
        for comp in self._order:
            for _, is_loop, callee in self.calls[comp]:
                inside[callee] |= inside[comp] or is_loop
        return {c: inside[c] for c in self._order}

    def instructions(self):
        """(instruction, runs per call, inside a loop) of every reachable instruction."""
        for comp in self._order:
            for inst in self.computations[comp]:
                yield inst, self.runs[comp], self.in_loop[comp]

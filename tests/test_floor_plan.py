"""The package's floor plan holds: the top floor keeps the commands, the API, the
checkpoints and the Hugging Face interop, and everything else lives in a wing; the
training core imports none of the wings `eval`, `plan` and `observe`; and no subpackage
imports one that imports it back.

`python tests/test_floor_plan.py` prints the import graph's size: files, levels (the
longest chain of imports), arrows, and the arrows that run back up (those closing a
cycle between subpackages)."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "jaxmoe"
WINGS = ("jaxmoe.eval", "jaxmoe.plan", "jaxmoe.observe")
# what trains: these import no wing, so a run needs none of them
CORE = ("jaxmoe.model", "jaxmoe.parallel", "jaxmoe.ops", "jaxmoe.step", "jaxmoe.checkpoint",
        "jaxmoe.config", "jaxmoe.optim", "jaxmoe.runtime")
# the modules at the top of the package (jaxmoe/*.py, besides __init__)
TOP_FLOOR = {"api", "checkpoint", "export", "generate", "launch", "train"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _inside(name: str, known: dict[str, Path]) -> str | None:
    """The jaxmoe module `name` refers to (a module, or the package holding a name)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The jaxmoe modules `name` imports, at top level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            if target.startswith("jaxmoe"):
                module = _inside(target, known)
                if module and module != name and module != "jaxmoe":
                    found.add(module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def _group(module: str) -> str:
    """A module's subpackage (or the module itself at the top)."""
    return ".".join(module.split(".")[:2])


def back_arrows(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """File arrows between two subpackages that import each other, directly or round a
    longer cycle."""
    groups: dict[str, set[str]] = {}
    for source, targets in edges.items():
        for target in targets:
            if _group(source) != _group(target):
                groups.setdefault(_group(source), set()).add(_group(target))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            group = todo.pop()
            if group == goal:
                return True
            if group not in seen:
                seen.add(group)
                todo.extend(groups.get(group, ()))
        return False

    return sorted((source, target) for source, targets in edges.items() for target in targets
                  if _group(source) != _group(target) and reaches(_group(target), _group(source)))


def levels(edges: dict[str, set[str]]) -> int:
    """The longest chain of file imports (a cycle counts once)."""
    depth: dict[str, int] = {}

    def walk(module: str, path: frozenset) -> int:
        if module in depth:
            return depth[module]
        below = [walk(t, path | {module}) for t in edges.get(module, ()) if t not in path]
        depth[module] = 1 + max(below, default=0)
        return depth[module]

    return max(walk(m, frozenset()) for m in edges)


def test_the_core_imports_no_wing():
    edges = graph()
    crossing = [(source, target) for source, targets in sorted(edges.items())
                for target in sorted(targets)
                if source.startswith(CORE) and target.startswith(WINGS)]
    assert not crossing, f"the training core imports a wing: {crossing}"
    # the check has teeth: the wings are found, and they do import the core
    assert any(s.startswith(WINGS) and t.startswith(CORE) for s, ts in edges.items() for t in ts)


def test_no_arrow_runs_back_up():
    edges = graph()
    assert back_arrows(edges) == []
    # a planted arrow from ops back into model is caught
    planted = {**edges, "jaxmoe.ops.mx": edges["jaxmoe.ops.mx"] | {"jaxmoe.model.transformer"}}
    assert back_arrows(planted)


def test_the_top_floor_holds_what_it_should():
    top = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == TOP_FLOOR, f"new on the top floor: {top - TOP_FLOOR}; gone: {TOP_FLOOR - top}"
    assert len(TOP_FLOOR) <= 8


def test_every_wing_says_what_it_is_for():
    wings = {".".join(p.relative_to(PACKAGE.parent).parts[:2]) for p in PACKAGE.glob("*/__init__.py")}
    assert {"jaxmoe.step", "jaxmoe.optim", "jaxmoe.runtime", "jaxmoe.model", "jaxmoe.config",
            "jaxmoe.hf"} <= wings
    for wing in sorted(wings):
        path = modules()[wing]
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, f"{path} has no docstring"


# tests at the top of tests/ that are not one top-floor module's: the package's plan, the
# docs, the notebooks, and the faults a training run meets (train.py's, with runtime/'s)
WHOLE_PACKAGE_TESTS = {"floor_plan", "docs", "docs_commands", "notebooks", "faults"}


def test_a_modules_tests_are_found_from_its_name():
    """tests/WING/ holds the tests of jaxmoe/WING/ (one file per module, or per behaviour
    across a wing's modules); tests/ itself those of the top floor's modules and of the
    package as a whole."""
    tests = Path(__file__).parent
    wings = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= wings, f"test folders that are no wing of jaxmoe: {folders - wings}"
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    assert top - TOP_FLOOR <= WHOLE_PACKAGE_TESTS, top - TOP_FLOOR - WHOLE_PACKAGE_TESTS
    assert len(list(tests.glob("*/test_*.py"))) > 30


if __name__ == "__main__":
    edges = graph()
    back = back_arrows(edges)
    print(f"files {len(edges)}  levels {levels(edges)}  "
          f"arrows {sum(len(t) for t in edges.values())}  back up {len(back)}")
    for source, target in back:
        print(f"  {source} -> {target}")
    sys.exit(0)

"""Every notebook runs top to bottom, shows its plots inline, and is stored without outputs."""

import os
from pathlib import Path

import pytest

from jaxmoe.runtime.fake_devices import without_fake_devices

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

SUITE_COMPILE_FLAGS = ("--xla_backend_optimization_level",)
NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_shipped_without_outputs():
    assert {p.stem for p in NOTEBOOKS} == {"quickstart", "routing_explorer", "parallelism"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


# Under test the notebooks train for fewer steps: the same cells, less waiting
# (quickstart spent 29 of its 45 s in its 300 steps, the routing explorer 41 of 59 s
# in its 150).
FEWER_STEPS = {"quickstart": ("STEPS, BATCH, SEQ_LEN = 300,", "STEPS, BATCH, SEQ_LEN = 100,"),
               "routing_explorer": ('"train": {"steps": 150,', '"train": {"steps": 60,')}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    if path.stem in FEWER_STEPS:
        shipped, tested = FEWER_STEPS[path.stem]
        (cell,) = [c for c in nb.cells if shipped in c.source]  # the notebook still says so
        cell.source = cell.source.replace(shipped, tested)
    # as a user's kernel would start: one CPU device unless the notebook asks for more, and
    # XLA's usual optimisation (the suite's compile-speed flags cost these longer runs
    # more than they save: quickstart took 46.5 s with them off, 70.1 s on)
    env = without_fake_devices(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(SUITE_COMPILE_FLAGS))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no inline plot"

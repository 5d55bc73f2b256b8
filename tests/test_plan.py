"""The planner compiles the full-size 47B config on 8 fake devices, allocating nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_plan_47b_on_eight_devices(tmp_path):
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe.plan", "--config", "configs/olmoe_8layer_e128.yaml",
         "--mesh", "data=1,expert=8", "--device", "b300", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["devices"] == 8 and plan["params_total"] == pytest.approx(47e9, rel=0.02)
    mem = plan["bytes_per_device"]
    # experts are resident, 16 of 128 per device: about 1/8 of the expert weights each
    assert 20e9 < mem["parameters"] < 30e9
    assert mem["optimizer_state"] == pytest.approx(2 * mem["parameters"], rel=1e-6)  # Adam: 2 moments
    assert mem["peak"] >= mem["parameters"] + mem["optimizer_state"]
    assert plan["collective_bytes_per_step"]["all-to-all"] > 0
    assert "FITS" in result.stdout and plan["fits"]


def test_plan_rejects_open_mesh(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jaxmoe.plan", "--config",
                             "configs/olmoe_8layer_e128.yaml"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "no -1" in result.stderr

"""The benchmark CLI at tiny shapes: the one-device subcommands run, print their
tables and write the numbers they report. Timings themselves are not tested;
figures come from real runs, recorded in benchmarks/RESULTS.md."""

import json

import pytest

from jaxmoe import bench

# After bench.SMALL_MODEL's overrides: a model that compiles in seconds.
TINY = ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64",
        "moe.expert_hidden=16", "train.batch_size=2", "train.seq_len=16"]
SETS = [arg for o in TINY for arg in ("--set", o)]
ONCE = ["--malloc", "default", "--repeats", "1"]  # no mallopt on the test process


def _run(tmp_path, argv):
    out = tmp_path / "result.json"
    result = bench.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    return result


def test_experts_times_steps_and_updates(tmp_path, capsys):
    result = _run(tmp_path, ["experts", *ONCE, "--experts", "8", "16", *SETS])
    cases = result["cases"]
    assert list(cases) == ["E8", "E16"]
    assert cases["E16"]["params_total"] > 1.5 * cases["E8"]["params_total"]  # the experts double
    # Same expert size and top-k: the active count differs only by the router's column.
    assert cases["E16"]["params_active"] == pytest.approx(cases["E8"]["params_active"], rel=0.02)
    assert all(c["step_s"] > 0 and c["update_s"] > 0 for c in cases.values())
    assert list(result["ratios"]) == list(result["ratio_if_only_update_differed"]) == ["E16/E8"]
    e8, e16 = cases["E8"], cases["E16"]
    assert result["ratio_if_only_update_differed"]["E16/E8"] == pytest.approx(
        e8["step_s"] / (e8["step_s"] + e16["update_s"] - e8["update_s"]))
    table = capsys.readouterr().out.splitlines()
    assert table[-2].startswith("ratio E16/E8") and "if only the update differed" in table[-1]


def test_moe_and_step(tmp_path):
    moe = _run(tmp_path, ["moe", *ONCE, "--tokens", "64", "--d-model", "32", "--expert-hidden", "16",
                          "--top-k", "2", "--experts", "4", "8"])
    assert list(moe["cases"]) == ["dense", "moe_E4", "moe_E8"]
    assert list(moe["ratios"]) == ["moe_E4/dense", "E8/E4"]
    assert all(0 <= c["drop_fraction"] <= 1 for c in moe["cases"].values())
    step = _run(tmp_path, ["step", *ONCE, "--matmul-size", "64", *SETS])
    assert step["train_step"]["model_flops"] > 0 and step["mfu_vs_matmul"] > 0
    assert step["malloc"] == "default"

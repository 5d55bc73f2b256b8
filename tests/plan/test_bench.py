"""The benchmark CLI at tiny shapes: the subcommands run, print their tables and
write the numbers they report, consistent with each other and with arithmetic.
Timings themselves are not tested; figures come from real runs, recorded in
benchmarks/RESULTS.md."""

import json

import jax
import pytest

from jaxmoe.plan import bench

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


def test_muon_times_both_optimizers_and_their_updates(tmp_path, capsys):
    result = _run(tmp_path, ["muon", *ONCE, "--config", "configs/tiny.yaml", *SETS])
    secs = result["seconds"]
    assert list(secs) == ["adamw", "adamw update", "muon", "muon update"]
    assert result["step_ratio_muon_over_adamw"] == pytest.approx(secs["muon"] / secs["adamw"])
    assert result["muon_update_extra_share"] == pytest.approx(
        (secs["muon update"] - secs["adamw update"]) / secs["muon"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("update extra / muon step")


def test_moe_and_step(tmp_path):
    moe = _run(tmp_path, ["moe", *ONCE, "--tokens", "64", "--d-model", "32", "--expert-hidden", "16",
                          "--top-k", "2", "--experts", "4", "8"])
    assert list(moe["cases"]) == ["dense", "moe_E4", "moe_E8"]
    assert list(moe["ratios"]) == ["moe_E4/dense", "E8/E4"]
    assert all(0 <= c["drop_fraction"] <= 1 for c in moe["cases"].values())
    step = _run(tmp_path, ["step", *ONCE, "--matmul-size", "64", *SETS])
    assert step["train_step"]["model_flops"] > 0 and step["mfu_vs_matmul"] > 0
    assert step["malloc"] == "default"


# --- the 8-device subcommands, on a toy config (conftest gives this process 8 devices)

TOY = """\
model: {vocab_size: 256, d_model: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1,
        num_dense_layers: 1, mlp_hidden: 64}
moe: {num_experts: 8, top_k: 2, expert_hidden: 16, capacity_factor: 1.5}
train: {batch_size: 16, seq_len: 16}
optimizer: {warmup_steps: 1}
"""


def _table(lines, header):
    """The printed table from its header row on: {first cell: remaining cells}."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = [line.split("  ") for line in lines[start + 1:]]
    return {cells[0].strip(): [c.strip() for c in cells[1:] if c.strip()] for cells in rows}


@pytest.mark.slow
def test_parallel_reports_consistent_times_and_collective_bytes(tmp_path, capsys):
    from flax import nnx

    from jaxmoe.config import load_config
    from jaxmoe.model.dispatch import capacity
    from jaxmoe.model.transformer import Transformer
    from jaxmoe.plan.collectives import KINDS
    config = tmp_path / "toy.yaml"
    config.write_text(TOY)
    result = _run(tmp_path, ["parallel", *ONCE, "--config", str(config)])
    cases = result["cases"]
    assert list(cases) == list(bench.PARALLEL_CASES)
    first = cases["ddp+alltoall 2x4"]
    for c in cases.values():
        assert c["step_s"] > 0
        assert c["vs_ddp+alltoall 2x4"] == pytest.approx(c["step_s"] / first["step_s"], rel=1e-12)
        assert list(c["collective_bytes"]) == list(KINDS)
        assert min(c["collective_bytes"].values()) >= 0
        assert c["collective_total"] == sum(c["collective_bytes"].values())
    # the printed table carries the same numbers
    table = _table(capsys.readouterr().out.splitlines(), "case")
    for name, c in cases.items():
        assert table[name] == [f"{c['step_s']:.3f}", f"{c['vs_ddp+alltoall 2x4']:.2f}",
                               f"{c['collective_total'] / 1e6:.2f}"] + [
                               f"{c['collective_bytes'][k] / 1e6:.2f}" for k in KINDS] + [
                               str(c["reductions_per_step"]), str(c["reductions_in_loops"])]

    cfg = load_config(config)
    m, moe = cfg.model, cfg.moe
    ddp, fsdp = first["collective_bytes"], cases["fsdp+alltoall 2x4"]["collective_bytes"]
    # alltoall's token exchange: per MoE layer an [E, C, D] f32 buffer out and back,
    # and the same two in the backward pass; C from each device's 256 / 8 tokens; a
    # quarter of each buffer stays on its device (expert group of 4)
    C = capacity(cfg.train.batch_size * cfg.train.seq_len // 8, moe.top_k, moe.num_experts,
                 moe.capacity_factor)
    exchange = cfg.num_moe_layers * 4 * moe.num_experts * C * m.d_model * 4
    assert ddp["all-to-all"] == exchange * 3 // 4
    assert fsdp["all-to-all"] >= exchange * 3 // 4
    # ddp: each fp32 gradient reduce-scattered once over its replicas ((n-1)/n of it
    # sent; dense weights have 8 replicas, experts 2) and its ZeRO-1 shard gathered
    # back (n-1 shards received); what else is reduced (losses, router stats, the
    # norm) is a few kB
    shapes = nnx.state(nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0))), nnx.Param)
    sent = sum(4 * x.size / 4 * (2 - 1) / 2 if "['experts']" in jax.tree_util.keystr(p)
               else 4 * x.size * (8 - 1) / 8 for p, x in jax.tree.leaves_with_path(shapes))
    assert sent <= ddp["reduce-scatter"] + ddp["all-reduce"] <= sent + 64e3
    assert sent <= ddp["all-gather"] <= sent + 64e3
    assert first["reductions_in_loops"] == 0
    # fsdp gathers its weights at every use (this toy has one MoE layer and one
    # micro-batch, so no loop runs more than once: test_spmd shows fsdp's in-loop
    # reductions at a size that has them)
    assert fsdp["all-gather"] > ddp["all-gather"]
    assert cases["fsdp+alltoall 2x4"]["collective_total"] > first["collective_total"]


@pytest.mark.slow
def test_pipeline_reports_ratios_and_the_bubble_formula(tmp_path, capsys):
    config = tmp_path / "toy.yaml"
    config.write_text(TOY)
    M = 4  # the fewest micro-batches circular allows at 4 stages
    # two pipelined layouts beside S=1 (each is a compile of its own)
    # 4 MoE layers: one per stage at S=4, one per virtual stage at S=2 V=2
    result = _run(tmp_path, ["pipeline", *ONCE, "--config", str(config),
                             "--stage-microbatches", str(M), "--layouts", "S=4", "S=2 V=2",
                             "--set", "model.num_layers=5"])
    assert result["stage_microbatches"] == M and result["overrides"] == ["model.num_layers=5"]
    cases = result["cases"]
    # (S - 1) / (V M + S - 1), by hand; one stage has no bubble
    bubbles = {"S=1": 0.0, "S=4": 3 / 7, "S=2 V=2": 1 / 9}
    assert list(cases) == list(bubbles)
    for name, c in cases.items():
        assert c["bubble_predicted"] == pytest.approx(bubbles[name], rel=1e-12)
        assert c["step_s"] > 0
        assert c["vs_S1"] == pytest.approx(c["step_s"] / cases["S=1"]["step_s"], rel=1e-12)
    table = _table(capsys.readouterr().out.splitlines(), "stages")
    for name, c in cases.items():
        assert table[name] == [f"{c['step_s']:.3f}", f"{c['vs_S1']:.2f}",
                               f"{c['bubble_predicted']:.3f}"]

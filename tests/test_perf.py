"""Throughput, MFU, memory and the step-time split in a run's metrics; the profiler window."""

import json

import jax
import pytest
import yaml

from jaxmoe import perf
from jaxmoe.config import ConfigError, config_from_dict, flops_per_token
from jaxmoe.train import profile_override


@pytest.mark.parametrize("kind, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),  # not the SXM part's figure
    ("NVIDIA H200", "fp8", 1979.0),
    ("NVIDIA GB200", "bf16", 2500.0),  # not B200's
    ("NVIDIA L40S", "bf16", 362.0),  # not L4's
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("TPU v5 lite", "bf16", 197.0),
])
def test_table_peaks(kind, precision, tflops):
    assert perf.table_peak(kind, precision) == tflops * 1e12


def test_no_peak_for_unknown_devices_or_missing_precisions():
    assert perf.table_peak("NVIDIA A100-SXM4-80GB", "fp8") is None  # A100 has no fp8
    assert perf.table_peak("Some Accelerator 9000") is None


def test_throughput_arithmetic():
    peak = perf.Peak(2e12, "test")
    out = perf.throughput(flops_per_token=6e6, tokens_per_s=1000.0, num_devices=3, peak=peak)
    assert out["tflops_per_device"] == pytest.approx(6e9 / 3 / 1e12)
    assert out["mfu"] == pytest.approx(2e9 / 2e12)
    assert "mfu" not in perf.throughput(6e6, 1000.0, 3, None)


def test_cpu_peak_is_measured_and_shared_by_the_fake_devices():
    peak = perf.Peak.of(jax.devices())
    assert jax.device_count() == 8
    assert "shared by 8 device(s)" in peak.source
    # a 2-core host does 1e9-1e12 float32 FLOP/s; per device an eighth of that
    assert 1e8 < peak.flops_per_device * 8 < 1e13


def test_step_clock_splits_wall_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(perf.time, "perf_counter", lambda: now[0])
    clock = perf.StepClock()
    with clock.timed("data"):
        now[0] += 1.0
    now[0] += 5.0  # the steps
    with clock.timed("host"):
        now[0] += 2.0
    assert clock.split(4) == {"step_time_s": 2.0, "data_wait_s": 0.25, "host_s": 0.5}
    now[0] += 3.0
    assert clock.split(1) == {"step_time_s": 3.0, "data_wait_s": 0.0, "host_s": 0.0}


def test_a_run_logs_throughput_memory_and_the_time_split(tiny_run):
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    cfg = config_from_dict(yaml.safe_load((tiny_run / "config.yaml").read_text()))
    for r in steps:
        assert r["tflops_per_device"] == pytest.approx(
            flops_per_token(cfg) * r["tokens_per_s"] / 8 / 1e12, rel=1e-6)
        assert 0 < r["mfu"] < 1.5  # a measured CPU peak can be beaten a little by luck, not 1.5x
        assert 0 < r["host_memory_gb"] <= r["host_memory_peak_gb"] < 64
        assert r["tokens_per_s"] == pytest.approx(
            cfg.train.batch_size * cfg.train.seq_len / r["step_time_s"], rel=1e-6)
        assert 0 <= r["data_wait_s"] < r["step_time_s"] and 0 <= r["host_s"] < r["step_time_s"]


def test_the_profile_window_traces_the_scopes(tiny_run):
    (trace,) = (tiny_run / "profile").glob("plugins/profile/*/*.xplane.pb")
    data = trace.read_bytes()
    for scope in (b"attention", b"router", b"dispatch", b"expert_gemms", b"optimizer"):
        assert scope + b"/" in data, scope
    assert b"train" in data  # the step annotations that TensorBoard splits steps by


def test_profile_steps_are_validated():
    assert profile_override("3:5") == ["logging.profile_steps=[3, 5]"]
    assert profile_override(None) == []
    with pytest.raises(ConfigError, match="--profile: expected START:STOP"):
        profile_override("3-5")
    with pytest.raises(ConfigError, match=r"logging.profile_steps: expected \[start, stop\] with "
                                          r"1 <= start <= stop <= train.steps=200, got \[5, 3\]"):
        config_from_dict({"logging": {"profile_steps": [5, 3]}})
    with pytest.raises(ConfigError, match="logging.profile_steps"):
        config_from_dict({"logging": {"profile_steps": [1, 201]}})

"""Throughput, MFU, memory and the step-time split in a run's metrics; the profiler window."""

import json

import jax
import pytest
import yaml
from jax.profiler import ProfileData

from jaxmoe.observe import perf
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.plan.counts import flops_per_token
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
    assert "mfu_fp8" not in out  # a bf16 run
    h200 = perf.Peak(989e12, "h200", 1979e12)
    fp8 = perf.throughput(6e6, 1000.0, 3, h200, fp8=True)
    assert fp8["mfu_fp8"] == pytest.approx(2e9 / 1979e12) and fp8["mfu"] == pytest.approx(2e9 / 989e12)


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
    assert clock.split(4) == {"step_time_s": 2.0, "data_wait_s": 0.25, "host_s": 0.5,
                              "compute_s": 1.25}
    now[0] += 3.0
    assert clock.split(1) == {"step_time_s": 3.0, "data_wait_s": 0.0, "host_s": 0.0,
                              "compute_s": 3.0}


def test_a_run_logs_throughput_memory_and_the_time_split(tiny_run):
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    cfg = config_from_dict(yaml.safe_load((tiny_run / "config.yaml").read_text()))
    peaks = []
    for r in steps:
        assert r["tflops_per_device"] == pytest.approx(
            flops_per_token(cfg) * r["tokens_per_s"] / 8 / 1e12, rel=1e-6)
        peaks.append(r["tflops_per_device"] / r["mfu"])  # the peak's TFLOP/s
        assert 0 < r["host_memory_gb"] <= r["host_memory_peak_gb"] < 64
        assert r["tokens_per_s"] == pytest.approx(
            cfg.train.batch_size * cfg.train.seq_len / r["step_time_s"], rel=1e-6)
        assert min(r["data_wait_s"], r["host_s"], r["compute_s"]) >= 0
        assert r["data_wait_s"] + r["host_s"] + r["compute_s"] == pytest.approx(r["step_time_s"])
    assert peaks == pytest.approx([peaks[0]] * len(peaks), rel=1e-12)  # measured once, at the start
    assert 1e-4 < peaks[0] * 8 < 10  # a 2-core host's float32 TFLOP/s, split 8 ways


def test_the_profile_window_traces_the_scopes(tiny_run):
    (trace,) = (tiny_run / "profile").glob("plugins/profile/*/*.xplane.pb")
    data = trace.read_bytes()
    for scope in (b"attention", b"router", b"dispatch", b"expert_gemms", b"optimizer"):
        assert scope + b"/" in data, scope
    traced = [dict(event.stats)["step_num"]  # the annotations TensorBoard splits steps by
              for plane in ProfileData.from_file(str(trace)).planes for line in plane.lines
              for event in line.events if event.name == "train"]
    assert traced == [2, 3]  # the window, whole steps only


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


def test_the_profile_window_starts_where_a_resumed_run_enters_it(tmp_path):
    window = perf.ProfileWindow(tmp_path, (5, 8))
    assert [s for s in range(1, 12) if window.starts_at(s)] == [5, 6, 7, 8]  # not yet started
    assert not window.ends_at(8)  # nothing to stop
    window.active = True  # as after start() at step 7, a run resumed from step 6
    assert not window.starts_at(8) and window.ends_at(8) and not window.ends_at(7)
    assert not any(perf.ProfileWindow(tmp_path, None).starts_at(s) for s in range(1, 5))

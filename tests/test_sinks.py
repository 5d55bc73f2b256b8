"""Metric sinks: TensorBoard event files and W&B offline runs, chosen in the config."""

import json
import struct
import sys
import time

import pytest

from jaxmoe import sinks
from jaxmoe.config import ConfigError, config_from_dict


def _read_events(directory):
    """{tag: {step: value}} from TFRecord event files (length, crc, payload, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars, histograms = {}, {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("histo"):
                    histograms.setdefault(v.tag, {})[event.step] = v.histo
                else:
                    scalars.setdefault(v.tag, {})[event.step] = v.simple_value
    return scalars, histograms


def test_tensorboard_events_from_a_training_run(tiny_run):
    pytest.importorskip("tensorboardX")
    scalars, histograms = _read_events(tiny_run / "tensorboard")
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert set(scalars["loss"]) == set(losses) == {1, 2, 3, 4}
    for step, loss in losses.items():
        assert scalars["loss"][step] == pytest.approx(loss, rel=1e-6)
    assert set(scalars["eval_ce"]) == {0, 4}
    assert set(scalars["load_max_over_mean/layer1"]) == {1, 2, 3, 4}  # one tag per MoE layer
    assert histograms["expert_load/layer0"][4].num == 4  # one value per expert


def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    cfg = config_from_dict({"logging": {"wandb": True, "wandb_project": "sink-test"}})
    sinks.check_available(cfg)
    (sink,) = sinks.open_sinks(cfg, tmp_path)
    for step in (1, 2):
        sink.log({"step": step, "loss": 3.0 / step, "load_max_over_mean": [1.5, 1.2],
                  "expert_load": [1.0, 1.0, 0.5, 1.5, 2.0, 0.0, 1.0, 1.0]})
    sink.log({"step": 2, "eval_ce": 2.5})
    sink.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while b"eval_ce" not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)  # wandb's service process writes the file after finish() returns
    data = run_file.read_bytes()
    for key in (b"loss", b"eval_ce", b"load_max_over_mean/layer1", b"expert_load/layer0"):
        assert key in data


@pytest.mark.parametrize("sink, package", [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_missing_package_is_a_clear_error(monkeypatch, sink, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    cfg = config_from_dict({"logging": {sink: True}})
    with pytest.raises(ConfigError, match=rf'logging.{sink}: needs the {package} package.*'
                                          rf'pip install "jaxmoe\[{sink}\]"'):
        sinks.check_available(cfg)
    sinks.check_available(config_from_dict({}))  # the default job needs neither


@pytest.mark.parametrize("logging, message", [
    ({"tensorboard": "yes"}, "logging.tensorboard: expected bool, got str 'yes'"),
    ({"sinks": ["tensorboard"]}, "logging.sinks: unknown key"),
    ({"wandb": True, "wandb_project": " "}, "logging.wandb_project: must not be empty"),
])
def test_sink_config_is_validated(logging, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"logging": logging})
    assert message in str(e.value)

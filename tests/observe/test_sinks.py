"""Metric sinks: TensorBoard event files and W&B runs, chosen in the config."""

import json
import re
import struct
import sys
import time
from pathlib import Path

import pytest

from jaxmoe.observe import sinks
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


def test_wandb_run_resumed_in_its_run_directory_continues(tmp_path):
    pytest.importorskip("wandb")
    cfg = config_from_dict({"logging": {"wandb": True, "wandb_project": "sink-test"}})
    run_dir = tmp_path / "run-a"
    ids, parts = [], []
    for step in (1, 2):  # a training run, then the same run directory resumed
        (sink,) = sinks.open_sinks(cfg, run_dir, resuming=step > 1)
        sink.log({"step": step, "loss": 3.0 / step})
        ids.append(sink.run.id)
        parts.append(Path(sink.run.dir).parent)
        assert sink.run.name == "run-a"  # logging.wandb_name's default
        sink.close()
    assert ids[0] == ids[1] == (run_dir / "wandb" / "run_id").read_text().strip()
    # a directory a part, RUN_DIR/wandb/offline-run-TIME-ID (-1 within the same second);
    # `wandb sync` uploads the parts of one run id in order
    assert parts[0] != parts[1]
    for part in parts:
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0]}(-\d+)?", part.name), part
        assert part.parent == run_dir / "wandb"
    (other,) = sinks.open_sinks(cfg, tmp_path / "run-b")
    other.close()
    assert other.run.id != ids[0]  # the id comes from the run directory, not chance
    (restarted,) = sinks.open_sinks(cfg, run_dir)  # from step 0 again: a new W&B run
    restarted.close()
    assert restarted.run.id != ids[0]
    assert (run_dir / "wandb" / "run_id").read_text().strip() == restarted.run.id


class _FakeRun:
    id = "fakeid01"


@pytest.fixture
def wandb_init_calls(monkeypatch):
    """wandb.init replaced (there is no network here): its keyword arguments, one dict a call."""
    wandb = pytest.importorskip("wandb")
    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or _FakeRun())
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # found, never sent
    return calls


def test_wandb_online_run_arguments(tmp_path, wandb_init_calls):
    logging = {"wandb": True, "wandb_mode": "online", "wandb_entity": "moe-team"}
    cfg = config_from_dict({"logging": logging})
    sinks.check_available(cfg)
    run_dir = tmp_path / "run-a"
    sinks.open_sinks(cfg, run_dir)
    assert (run_dir / "wandb" / "run_id").read_text() == "fakeid01\n"
    sinks.open_sinks(cfg, run_dir, resuming=True)
    named = config_from_dict({"logging": logging | {"wandb_name": "ablation"}})
    sinks.open_sinks(named, tmp_path / "run-b")
    keys = ("mode", "project", "entity", "name", "id", "resume")
    assert [tuple(call[k] for k in keys) for call in wandb_init_calls] == [
        ("online", "jaxmoe", "moe-team", "run-a", None, None),
        ("online", "jaxmoe", "moe-team", "run-a", "fakeid01", "allow"),
        ("online", "jaxmoe", "moe-team", "ablation", None, None),
    ]


def test_wandb_online_unreachable_is_a_clear_error(tmp_path, monkeypatch, wandb_init_calls):
    import wandb

    def unreachable(**kwargs):
        raise wandb.errors.CommError("Timed out while retrying: no such host\nConsider ...")

    monkeypatch.setattr(wandb, "init", unreachable)
    cfg = config_from_dict({"logging": {"wandb": True, "wandb_mode": "online"}})
    with pytest.raises(ConfigError, match=r"logging.wandb_mode=online: could not start the W&B "
                                          r"run: Timed out while retrying: no such host; check"):
        sinks.open_sinks(cfg, tmp_path)
    assert not (tmp_path / "wandb" / "run_id").exists()  # no run to continue


@pytest.fixture
def wandb_without_credentials(tmp_path, monkeypatch):
    """wandb with no API key in the environment, no ~/.netrc and no settings file."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.test")
    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("wandb.init was called"))
    wandb.teardown()  # settings and credentials loaded earlier in this process are forgotten
    yield tmp_path
    wandb.teardown()  # before the environment is restored: the next user loads it afresh


def test_wandb_online_without_credentials_fails_before_training(wandb_without_credentials):
    home = wandb_without_credentials
    cfg = config_from_dict({"logging": {"wandb": True, "wandb_mode": "online"}})
    message = (r"logging.wandb_mode=online: no W&B API key found .* run `wandb login` or set "
               r"WANDB_API_KEY, or set logging.wandb_mode=offline")
    with pytest.raises(ConfigError, match=message):
        sinks.check_available(cfg)
    with pytest.raises(ConfigError, match=message):  # train() called without the check
        sinks.open_sinks(cfg, home / "run")
    sinks.check_available(config_from_dict({"logging": {"wandb": True}}))  # offline needs none
    netrc = home / ".netrc"  # what `wandb login` writes, found without the network
    netrc.write_text(f"machine wandb.example.test\n  login user\n  password {'a' * 40}\n")
    netrc.chmod(0o600)
    sinks.check_available(cfg)


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

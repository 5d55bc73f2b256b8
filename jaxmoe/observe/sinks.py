"""Optional metric sinks beside metrics.jsonl: TensorBoard event files and W&B runs.

Chosen with `logging.tensorboard` / `logging.wandb`; each needs its package, from
the matching extra (pip install "jaxmoe[tensorboard]", "jaxmoe[wandb]"). Every
logged record goes to each sink: per-layer lists become one scalar per MoE layer
(`load_max_over_mean/layer0`, ...) and `expert_load` one histogram per layer.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from jaxmoe.config import Config, ConfigError
from jaxmoe.runtime import distributed

PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}
# The W&B run's id, written when the run is created; a training run that resumes in
# the same run directory continues that W&B run. Beside W&B's own files, so that
# removing RUN_DIR/wandb forgets the W&B run together with its local files.
WANDB_RUN_ID = Path("wandb") / "run_id"
NO_CREDENTIALS = ("logging.wandb_mode=online: no W&B API key found (WANDB_API_KEY, ~/.netrc, "
                  "WANDB_IDENTITY_TOKEN_FILE); run `wandb login` or set WANDB_API_KEY, or set "
                  "logging.wandb_mode=offline and upload later with `wandb sync`")


def _import(sink: str):
    try:
        return importlib.import_module(PACKAGES[sink])
    except ImportError:
        raise ConfigError(f"logging.{sink}: needs the {PACKAGES[sink]} package, which is not "
                          f"installed; pip install \"jaxmoe[{sink}]\"") from None


def check_available(cfg: Config) -> None:
    """Fails before training starts when a chosen sink's package is missing, or when an
    online W&B run has no credentials on process 0 (the one that logs); a collective
    then, so that every process stops."""
    for sink in PACKAGES:
        if getattr(cfg.logging, sink):
            _import(sink)
    if cfg.logging.wandb and cfg.logging.wandb_mode == "online":
        problem = None
        if distributed.is_main():
            try:
                problem = None if _has_wandb_credentials(_import("wandb")) else NO_CREDENTIALS
            except ConfigError as e:  # a malformed key
                problem = str(e)
        if distributed.any_process(problem is not None):
            raise ConfigError(problem or "logging.wandb_mode=online: process 0 found no usable "
                                         "W&B credentials")


def _has_wandb_credentials(wandb) -> bool:
    """Whether wandb.init will find credentials, looked up as it does (WANDB_API_KEY, an
    identity token file, the netrc entry `wandb login` writes, the api_key setting).

    Offline and silent: wandb.login(prompt=False) would start W&B's service process and
    ask the server for the account's name once it finds a key (6 s to fail without a
    network), and rewrite the settings file.
    """
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth

    settings = wandb_setup.singleton().settings
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        auth = wbauth.authenticate_session(host=host, source="jaxmoe", prompt=False,
                                           update_session=False)
    except wandb.errors.AuthenticationError as e:  # a key of the wrong form
        raise ConfigError(f"logging.wandb_mode=online: {e}") from None
    return auth is not None


def scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in ("step", "expert_load") or isinstance(value, str):  # text stays in metrics.jsonl
            continue
        if isinstance(value, list):
            out |= {f"{key}/layer{i}": v for i, v in enumerate(value)}
        else:
            out[key] = value
    return out


def histograms(record: dict) -> dict[str, np.ndarray]:
    if "expert_load" not in record:
        return {}
    load_LmxE = np.reshape(record["expert_load"], (len(record["load_max_over_mean"]), -1))
    return {f"expert_load/layer{i}": load_E for i, load_E in enumerate(load_LmxE)}


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        self.writer = _import("tensorboard").SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in histograms(record).items():
            self.writer.add_histogram(tag, values, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run named after the run directory, with its local files in RUN_DIR/wandb.

    Offline (the default): `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later.
    The run's id is kept in RUN_DIR/wandb/run_id; a training run that resumes from a
    checkpoint (`resuming`) passes it back with resume="allow", so the W&B run
    continues (same id, the steps go on); one that starts from step 0 starts a new
    W&B run, whose steps W&B would otherwise drop below the old run's last.
    """

    def __init__(self, run_dir: Path, cfg: Config, resuming: bool = False):
        self.wandb = _import("wandb")
        log = cfg.logging
        if log.wandb_mode == "online" and not _has_wandb_credentials(self.wandb):
            raise ConfigError(NO_CREDENTIALS)  # wandb.init would prompt on a terminal
        id_file = run_dir / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else None
        settings = self.wandb.Settings(silent=True, console="off", disable_git=True)
        try:
            self.run = self.wandb.init(
                project=log.wandb_project, entity=log.wandb_entity,
                name=log.wandb_name or run_dir.resolve().name, mode=log.wandb_mode,
                id=run_id, resume="allow" if run_id else None, dir=str(run_dir),
                config=cfg.to_dict(), settings=settings)
        except self.wandb.errors.Error as e:
            if log.wandb_mode == "offline":
                raise
            reason = str(e).splitlines()[0]  # the rest suggests code to change
            raise ConfigError(
                f"logging.wandb_mode=online: could not start the W&B run: {reason}; check the "
                "network (a slow one: raise WANDB_INIT_TIMEOUT, 90 s by default) and the "
                "credentials, or set logging.wandb_mode=offline and upload later with "
                "`wandb sync`") from None
        if run_id is None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run.id + "\n")

    def log(self, record: dict) -> None:
        data = scalars(record) | {k: self.wandb.Histogram(v) for k, v in histograms(record).items()}
        self.run.log(data, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: Config, run_dir: Path, resuming: bool = False) -> list:
    """The configured sinks, opened on process 0 (an empty list elsewhere). Every
    process calls it: a sink that fails to open on process 0 stops them all."""
    sinks, error = [], None
    if distributed.is_main():
        try:
            if cfg.logging.tensorboard:
                sinks.append(TensorBoardSink(run_dir))
            if cfg.logging.wandb:
                sinks.append(WandbSink(run_dir, cfg, resuming))
        except ConfigError as e:
            error = e
    if distributed.any_process(error is not None):
        raise error or ConfigError("logging: a metric sink failed to open on process 0")
    return sinks

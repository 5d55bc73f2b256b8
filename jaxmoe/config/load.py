"""Configs from YAML files, dicts and `section.key=value` overrides: types checked and
coerced, unknown keys refused, renamed and retired keys named (the tables below), then
the checks of `jaxmoe.config.checks`; each failure a `ConfigError` naming its key."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxmoe.config.checks import ConfigError
from jaxmoe.config.sections import Config, PipelineConfig


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Returns `value` coerced to `tp` (int -> float only), or raises naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is dict:  # dict[str, X]: YAML gives a mapping, copied so the config owns it
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        value_tp = typing.get_args(tp)[1]
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be names, got {type(k).__name__} {k!r}")
        return {k: copy.deepcopy(v) if value_tp is Any else _check_type(v, value_tp, f"{key}.{k}")
                for k, v in value.items()}
    if origin is tuple:  # tuple[X, ...]: YAML gives a list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_check_type(v, typing.get_args(tp)[0], f"{key}[{i}]")
                     for i, v in enumerate(value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


# Keys that meant two things: both are refused, naming the new keys.
_BOTH_MICROBATCHES = ("gradient accumulation is now train.accumulation_steps and the "
                      "micro-batches flowing through pipeline stages pipeline.stage_microbatches")
RENAMED = {"train.microbatches": _BOTH_MICROBATCHES, "pipeline.microbatches": _BOTH_MICROBATCHES}
# Values that older configs and checkpoints spell another way.
LEGACY_VALUES = {"model.qk_norm": {True: "head", False: "none"}}


def _schedule_spelling(pipeline: dict) -> None:
    """pipeline.schedule: "gpipe", as older configs spell the circular schedule of one
    virtual stage."""
    if pipeline["schedule"] != "gpipe":
        return
    W = pipeline.get("virtual_stages", PipelineConfig.virtual_stages)
    if W != 1:
        raise ConfigError(f"pipeline.schedule: 'gpipe' disagrees with virtual_stages={W}, "
                          "which means 'circular'; GPipe is the circular schedule of one "
                          "virtual stage")
    pipeline["schedule"] = "circular"


# Keys whose values older configs and checkpoints spell another way: made current.
RESPELLED = {"pipeline.schedule": _schedule_spelling}


def current_value(key: str, value: Any) -> Any:
    """`value` of the dotted `key` as this jaxmoe spells it."""
    if type(value) is bool and key in LEGACY_VALUES:
        return LEGACY_VALUES[key][value]
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in list(raw):
        key = f"{prefix}.{name}" if prefix else name
        if key in RENAMED:
            raise ConfigError(f"{key}: renamed, {RENAMED[key]}")
        if key in RESPELLED:
            RESPELLED[key](raw)
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{key}: unknown key (valid: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        value = current_value(key, value)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key)
        else:
            kwargs[name] = _check_type(value, tp, key)
    return cls(**kwargs)  # Config.__post_init__ runs validate()


def _apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected section.key=value")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{dotted}: cannot parse value {text!r}: {e}") from None


def config_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds a validated Config from nested dicts plus dotted overrides."""
    raw = copy.deepcopy(raw or {})
    for o in overrides:
        _apply_override(raw, o)
    return _build(Config, raw, "")


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that a mapping repeats (the plain loader keeps
    the last, silently)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise _DuplicateKey(f"key {key!r} appears twice in one section (lines "
                                    f"{lines[key]} and {key_node.start_mark.line + 1})")
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """A validated Config from a YAML file, with dotted overrides ("moe.top_k=4") applied
    after it; ConfigError names the first bad key (unknown, mistyped, repeated or
    inconsistent)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506: a safe loader
    except _DuplicateKey as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    return config_from_dict(raw, overrides)


def override_config(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`cfg` with dotted overrides ("train.steps=100") applied, validated again."""
    return config_from_dict(cfg.to_dict(), overrides)


def dropless(cfg: Config) -> Config:
    """`cfg` with MoE buffers that hold every routed copy: capacity factor E / K, so a
    token's output never depends on the other tokens of its batch."""
    if not cfg.num_moe_layers:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, capacity_factor=cfg.moe.num_experts / cfg.moe.top_k))

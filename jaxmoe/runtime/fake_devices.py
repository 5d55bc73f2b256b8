"""Fake CPU devices: XLA's host-platform device count, which must be set before JAX starts.

Tests, the planner and the local launcher all run multi-device programs on one
CPU this way; this module imports nothing that starts JAX.
"""

from __future__ import annotations

from typing import Mapping

FLAG = "--xla_force_host_platform_device_count"


def _other_flags(env: Mapping[str, str]) -> list[str]:
    return [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]


def cpu_devices_env(env: Mapping[str, str], count: int, *, force_cpu: bool = True) -> dict[str, str]:
    """A copy of `env` whose XLA_FLAGS ask for `count` CPU devices (replacing any
    count already there, keeping the other flags); JAX_PLATFORMS=cpu unless
    `force_cpu` is false and the variable is already set."""
    out = {**env, "XLA_FLAGS": " ".join(_other_flags(env) + [f"{FLAG}={count}"])}
    if force_cpu or "JAX_PLATFORMS" not in env:
        out["JAX_PLATFORMS"] = "cpu"
    return out


def without_fake_devices(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` as a user's shell would start JAX: no fake device count and no
    platform pin, other XLA flags kept."""
    flags = _other_flags(env)
    out = {k: v for k, v in env.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    return out

"""Safetensors checkpoints read one tensor at a time: a sharded checkpoint's index, its
dtypes, DeepSeek's FP8 blocks dequantised as read."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxmoe.hf.family import HFError

INDEX = "model.safetensors.index.json"
_DTYPES = ("F32", "BF16", "F16")  # what jaxmoe reads (as float32)
_FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn}  # block-quantized weights, with their scales


class SafetensorsReader:
    """Tensors of one or many safetensors files (a sharded checkpoint's index names
    each tensor's file), read one at a time through the safetensors library, as
    float32. block: the (rows, columns) of DeepSeek's FP8 blocks, where the
    checkpoint's weights are float8 e4m3 with a float32 `weight_scale_inv` per block
    (None: such a tensor is refused)."""

    def __init__(self, directory: Path, block: tuple[int, int] | None = None):
        self.directory, self.block = directory, block
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        elif (directory / "model.safetensors").is_file():
            weight_map = None
        else:
            raise HFError(f"{directory} holds neither {INDEX} nor model.safetensors")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise HFError(f"{directory}: shard {missing[0]} named by {INDEX} is missing")
        self.where: dict[str, tuple[Path, str, tuple[int, ...]]] = {}  # file, dtype, shape
        for f in files:
            with safe_open(directory / f, framework="numpy") as fh:
                for name in fh.keys():
                    info = fh.get_slice(name)
                    self.where[name] = (directory / f, info.get_dtype(), tuple(info.get_shape()))

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise HFError(f"{self.directory}: tensor {name} is missing")
        path, dtype, _ = self.where[name]
        if dtype in _FP8 and self.block:
            return self._dequantized(name)
        if dtype not in _DTYPES:
            raise HFError(f"{path}: tensor {name} has dtype {dtype}; jaxmoe reads "
                          f"{', '.join(_DTYPES)} (and {', '.join(_FP8)} with block scales, "
                          "as a quantization_config of quant_method fp8 names them)")
        with safe_open(path, framework="numpy") as fh:
            return np.asarray(fh.get_tensor(name), np.float32)

    def _dequantized(self, name: str) -> np.ndarray:
        """An FP8 weight times its blocks' scales: float32, as DeepSeek's own dequant."""
        path, dtype, (rows, cols) = self.where[name]
        scale_name = name + "_scale_inv"
        if scale_name not in self.where:
            raise HFError(f"{path}: tensor {name} is {dtype} without its block scales "
                          f"{scale_name}")
        scale = self(scale_name)
        b0, b1 = self.block
        if scale.shape != (-(-rows // b0), -(-cols // b1)):
            raise HFError(f"{path}: {scale_name} has shape {scale.shape}, not one scale per "
                          f"{b0} x {b1} block of {name}'s {rows} x {cols}")
        scale = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[:rows, :cols]
        return self._raw(name).astype(np.float32) * scale

    def _raw(self, name: str) -> np.ndarray:
        """A tensor's stored values (safetensors' numpy interface has no float8): its
        bytes, at the offsets the file's header gives."""
        path, dtype, shape = self.where[name]
        with open(path, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            start, end = header[name]["data_offsets"]
            fh.seek(fh.tell() + start)
            return np.frombuffer(fh.read(end - start), _FP8[dtype]).reshape(shape)

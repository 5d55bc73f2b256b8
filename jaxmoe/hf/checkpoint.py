"""A Hugging Face checkpoint directory written from a jaxmoe model, and read into one.

Tensors are written as `save_pretrained` writes them, through the safetensors
library's numpy interface (bfloat16 without torch): a shard's converted tensors are
held together while it is written. Reading takes one tensor at a time, so one layer
at a time is converted.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxmoe.api import check_params
from jaxmoe.config import Config, config_from_dict
from jaxmoe.hf.config import config_from_hf, hf_config
from jaxmoe.hf.families import ADAPTERS, adapter, family_for
from jaxmoe.hf.family import HFError
from jaxmoe.hf.files import INDEX, SafetensorsReader
from jaxmoe.hf.tensors import params_of, params_to_hf


def _shapes_only(tree):
    """The tree with each array replaced by a zero-strided one of its shape and dtype:
    free to transpose, slice and reshape."""
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), np.asarray(a).dtype),
                                                  np.shape(a)), tree)


def check_out_dir(out: str | Path) -> Path:
    """`out` as a Path, or HFError where it is a file (an export is a directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HFError(f"--out {out} is a file; give a directory")
    return out


def save_hf(params: dict, cfg: Config, out: str | Path, *, dtype: str = "float32",
            tokenizer=None, shard_bytes: int = 2 << 30) -> dict:
    """Writes a Hugging Face checkpoint directory; returns its config.json. The host
    holds `params` and one converted tensor at a time."""
    family_name = family_for(cfg)
    family = ADAPTERS[family_name]
    wanted = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype("<f4")

    def dtype_of(tensor):
        fp32 = family.router_fp32 and tensor.endswith(("mlp.gate.weight",
                                                       "e_score_correction_bias"))
        return np.dtype("<f4") if fp32 else wanted

    out = check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # a leftover would be read
        stale.unlink(missing_ok=True)
    shards, size = [[]], 0  # the names in each shard, planned from shapes alone
    for name, tensor in params_to_hf(_shapes_only(params), cfg, family):
        nbytes = tensor.size * dtype_of(name).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    shard_of = {name: n for n, names in enumerate(shards) for name in names}
    shapes = dict(params_to_hf(_shapes_only(params), cfg, family))
    for n, file in enumerate(files):
        save_file({name: np.ascontiguousarray(t, dtype_of(name))
                   for name, t in params_to_hf(params, cfg, family) if shard_of[name] == n},
                  out / file, {"format": "pt"})
    total = sum(int(np.prod(t.shape)) * dtype_of(name).itemsize for name, t in shapes.items())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": int(total)},
                                         "weight_map": {k: files[v] for k, v in shard_of.items()}},
                                        indent=1))
    eos = None if tokenizer is None else tokenizer.eos_id
    bos = None if tokenizer is None else tokenizer.bos_id
    config = hf_config(cfg, family_name, eos, bos, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"_from_model_config": True, "eos_token_id": eos, "bos_token_id": bos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    if tokenizer is not None:
        tokenizer.save_hf(out)
    return config


def _check_shared_copies(read, params: dict, m) -> None:
    """The embedding and head copies a checkpoint keeps with each multi-token prediction
    layer must be the model's: jaxmoe shares them."""
    for i in range(m.mtp_layers):
        pre = f"model.layers.{m.num_layers + i}."
        for name, shared in (("embed_tokens.weight", params["embed"]),
                             ("shared_head.head.weight", params["head"].T)):
            if pre + name in read.where and not np.array_equal(read(pre + name), shared):
                raise HFError(f"{read.directory}: {pre + name} differs from the model's "
                              "(jaxmoe's multi-token prediction shares the embedding and head)")


def read_config(directory: str | Path) -> tuple[dict, Config]:
    """(config.json, its jaxmoe Config) of a Hugging Face checkpoint directory."""
    directory = Path(directory).expanduser().absolute()
    if not (directory / "config.json").is_file():
        raise HFError(f"{directory} holds no config.json")
    try:
        hf = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise HFError(f"{directory / 'config.json'} is not valid JSON ({e})") from None
    return hf, config_from_hf(hf)


def load_hf(directory: str | Path) -> tuple[dict, Config]:
    """(params in model order, Config) of a local Hugging Face checkpoint of a supported
    family. Anything the config holds that jaxmoe cannot is refused before any weight
    is read."""
    directory = Path(directory).expanduser().absolute()
    hf, cfg = read_config(directory)
    quantized = hf.get("quantization_config")
    read = SafetensorsReader(directory, quantized and tuple(quantized["weight_block_size"]))
    family, m = adapter(hf["model_type"]), cfg.model
    if m.mtp_layers and f"model.layers.{m.num_layers}.eh_proj.weight" not in read.where:
        warnings.warn(f"{directory}: config.json names {m.mtp_layers} multi-token prediction "
                      "layer(s) and the checkpoint holds none (transformers saves none); "
                      "imported without them", stacklevel=2)
        raw = cfg.to_dict()
        cfg = config_from_dict({**raw, "model": {**raw["model"], "mtp_layers": 0}})
        m = cfg.model
    try:
        params = params_of(read, cfg, family)
        if m.mtp_layers:
            _check_shared_copies(read, params, m)
        check_params(params, cfg)
    except ValueError as e:  # a reshape that does not fit, or check_params's verdict
        if isinstance(e, HFError):
            raise
        raise HFError(f"{directory}: the tensors do not match config.json: {e}") from None
    return params, cfg

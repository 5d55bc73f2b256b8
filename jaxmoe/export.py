"""python -m jaxmoe.export --checkpoint RUN_OR_CHECKPOINT_DIR --out OUT [--format hf]

`--format jaxmoe` (default) writes a checkpoint's parameters and router biases
(fp32) to one safetensors file OUT, one tensor per layer and weight, named for what
it is: `embedding` [vocab, d_model], `layers.{i}.attn.w_q` [d_model, heads,
head_dim], `layers.{i}.moe.experts.w_gate_up` [experts, d_model, 2 x expert_hidden]
(gate then up), `lm_head` [d_model, vocab], ... The file's metadata holds the
config and each tensor's axis names.

`--format hf` writes a Hugging Face checkpoint directory OUT that `transformers`
loads (`AutoModelForCausalLM.from_pretrained(OUT)`): config.json and
generation_config.json for the family that has the model's architecture (see
`jaxmoe.hf`), sharded safetensors with their index (`--dtype bfloat16` or
float32), and the run's tokenizer (`--tokenizer` names another): for a byte-level
run, a tokenizer.json whose ids are the bytes, so `AutoTokenizer` gives the ids the
model trained on. It runs on the host's CPU, converting one layer at a time.

Either is written beside OUT and renamed into its place once whole
(`written_whole`): an export killed midway leaves the old OUT as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from absl import logging as absl_logging
from flax import nnx

from jaxmoe import checkpoint, hf
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import Config
from jaxmoe.data.tokenizer import TokenizerError, check_vocab, load_tokenizer, run_tokenizer
from jaxmoe.runtime.run_lock import alive

_RENAME = {"embed": "embedding", "head": "lm_head", "final_norm.scale": "final_norm"}


def named_tensors(params: nnx.State, cfg: Config) -> dict[str, tuple[np.ndarray, list]]:
    """Flat {name: (array, axis names)} of weights whose MoE layers are in model order
    (as `checkpoint.restore_weights` gives them); stacked layers are split one tensor
    per layer, numbered in model order (multi-token prediction modules as mtp.{i})."""
    num_dense = cfg.model.num_dense_layers
    out = {}
    flat = nnx.to_flat_state(params)
    for path, var in flat:
        keys = [str(k) for k in path]
        value = np.asarray(jax.device_get(var[...]))
        axes = list(var.get_metadata().get("out_sharding") or [])
        if keys[0] in ("dense_layers", "moe_layers", "mtp_layers"):
            for i in range(value.shape[0]):
                layer = {"dense_layers": f"layers.{i}", "moe_layers": f"layers.{num_dense + i}",
                         "mtp_layers": f"mtp.{i}"}[keys[0]]
                out[f"{layer}." + ".".join(keys[1:])] = (value[i], axes[1:])
        else:
            name = ".".join(keys)
            out[_RENAME.get(name, name)] = (value, axes)
    return out


@contextlib.contextmanager
def written_whole(out: str | Path):
    """Yields a path beside `out` to write the export to, and puts it in `out`'s place
    once written: `out` holds the old export or the new one, never half of one. A
    directory replaces the old one, taking along the old one's files it does not write
    itself (old weight shards and their index excepted: they would be read); what a
    killed export leaves is a hidden `.OUT.partial-PID`, removed by the next export."""
    out = Path(out).absolute()
    for left in out.parent.glob(f".{out.name}.partial-*"):  # of a killed export
        pid = left.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and alive(int(pid))):
            _remove(left)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _remove(partial)
    try:
        yield partial
    except BaseException:
        _remove(partial)
        raise
    if not partial.is_dir():
        os.replace(partial, out)
        return
    if out.is_dir():
        for old in out.iterdir():
            if not (partial / old.name).exists() and not old.name.startswith("model") \
                    and old.name != hf.INDEX:
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, partial / old.name)
        previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
        out.rename(previous)
        partial.rename(out)
        _remove(previous)
    else:
        partial.rename(out)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def export(checkpoint_path: str | Path, out: str | Path) -> dict[str, tuple]:
    from safetensors.numpy import save_file

    # router biases steer expert selection, so they belong with the weights
    weights, cfg, step, meta = checkpoint.load_weights(*checkpoint.locate(checkpoint_path))
    tensors = named_tensors(weights, cfg)
    metadata = {"format": "jaxmoe", "step": str(step), "config": json.dumps(meta["config"]),
                "axes": json.dumps({k: axes for k, (_, axes) in tensors.items()})}
    with written_whole(out) as partial:
        save_file({k: np.ascontiguousarray(v) for k, (v, _) in tensors.items()}, str(partial),
                  metadata)
    return tensors


def export_hf(checkpoint_path: str | Path, out: str | Path, dtype: str = "float32",
              shard_bytes: int = 2 << 30, tokenizer: str | None = None) -> dict:
    """A Hugging Face checkpoint directory of a training checkpoint, with the run's
    tokenizer (or `tokenizer`: a tokenizer.json, its directory, or "bytes"); returns
    its config. A run that holds no tokenizer for its ids (raw token shards) is
    written without one, saying so."""
    weights, cfg, step, meta = checkpoint.load_weights(*checkpoint.locate(checkpoint_path))
    saved = checkpoint.saved_config(meta)
    if tokenizer:
        tokenizer = load_tokenizer(tokenizer)
    else:
        try:
            tokenizer = run_tokenizer(checkpoint.run_dir_of(checkpoint_path), saved)
        except TokenizerError as e:
            print(f"note: no tokenizer written: {e}", file=sys.stderr)
            tokenizer = None
    if tokenizer is not None:
        check_vocab(tokenizer, saved.model.vocab_size)
    params = jax.tree.map(np.asarray, weights.to_pure_dict())  # host arrays, not copies
    del weights
    hf.check_out_dir(out)
    with written_whole(out) as partial:
        return hf.save_hf(params, cfg, partial, dtype=dtype, tokenizer=tokenizer,
                          shard_bytes=shard_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.export`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, its checkpoints/ directory, or one step's directory")
    parser.add_argument("--out", required=True,
                        help="the .safetensors file (jaxmoe) or directory (hf) to write")
    parser.add_argument("--format", choices=["jaxmoe", "hf"], default="jaxmoe")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="hf: the weights' dtype")
    parser.add_argument("--tokenizer", default=None,
                        help="hf: the tokenizer to write (a tokenizer.json, its directory, or "
                             "'bytes'); default: the run's")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)
    jax.config.update("jax_platforms", "cpu")  # host memory holds the weights, not a device's
    try:
        if args.format == "hf":
            config = export_hf(args.checkpoint, args.out, args.dtype, tokenizer=args.tokenizer)
            print(f"wrote a {config['architectures'][0]} checkpoint ({args.dtype}) to {args.out}")
            return 0
        tensors = export(args.checkpoint, args.out)
    except (CheckpointError, hf.HFError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(v.size for v, _ in tensors.values())
    print(f"wrote {len(tensors)} tensors, {total:,} parameters, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

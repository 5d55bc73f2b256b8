"""python -m jaxmoe.generate --checkpoint RUN_DIR --prompt "def " [--max-new-tokens N ...]

Samples a continuation of a prompt from a trained model, with a KV cache: the
prompt is prefilled in one call, then one token is decoded per step inside a
`lax.scan`, so the whole generation compiles once per (batch, prompt length,
new tokens). Text maps to tokens byte by byte, as in training; the prompt
starts after a document separator (0x00), so it reads as the start of a file,
and the printed continuation stops at the next separator.

Generation runs the MoE layers dropless: with capacity drops a token's output
would depend on how many tokens share the call, so a cached decode step would
not match the full forward pass.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging

from jaxmoe import api
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import Config, override_config
from jaxmoe.data import SEPARATOR
from jaxmoe.model import kv_cache
from jaxmoe.sampling import sample


def inference_config(config: Config) -> Config:
    """The config with dropless local MoE dispatch: `grouped` with buffers that
    hold every token."""
    if not config.num_moe_layers:
        return config
    factor = config.moe.num_experts / config.moe.top_k
    return override_config(config, ["moe.dispatcher=grouped", f"moe.capacity_factor={factor}"])


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens"))
def _generate(params, prompt_BxP, key, temperature, top_k, top_p, config, max_new_tokens):
    model = api.to_module(params, config)
    B, P = prompt_BxP.shape
    cache = kv_cache.init_cache(config, B, P + max_new_tokens)
    logits_BxPxV, cache, _ = kv_cache.forward(model, prompt_BxP, cache, 0)
    first_B = sample(jax.random.fold_in(key, P), logits_BxPxV[:, -1], temperature, top_k, top_p)

    def step(carry, position):  # feeds the token at `position`, samples the one after it
        token_B, cache = carry
        logits_Bx1xV, cache, _ = kv_cache.forward(model, token_B[:, None], cache, position)
        next_B = sample(jax.random.fold_in(key, position + 1), logits_Bx1xV[:, 0], temperature,
                        top_k, top_p)
        return (next_B, cache), token_B

    (last_B, _), tokens_NxB = jax.lax.scan(step, (first_B, cache),
                                           P + jnp.arange(max_new_tokens - 1))
    return jnp.concatenate([tokens_NxB.T, last_B[:, None]], axis=1)


def generate(params: api.Params, prompt_BxP: jax.Array, config: Config, *, key: jax.Array,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0) -> jax.Array:
    """int32 [B, max_new_tokens] continuations of equal-length prompts.

    Deterministic for a given key: the token at position p is drawn with
    fold_in(key, p). temperature 0 is greedy; top_k 0 and top_p 1 are off.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be at least 1, got {max_new_tokens}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling: need temperature >= 0, top_k >= 0 and top_p in (0, 1], got "
                         f"temperature={temperature}, top_k={top_k}, top_p={top_p}")
    api.check_tokens(prompt_BxP, config)
    config = inference_config(config)
    api.check_params(params, config)
    return _generate(params, jnp.asarray(prompt_BxP, jnp.int32), key, jnp.float32(temperature),
                     jnp.int32(top_k), jnp.float32(top_p), config, max_new_tokens)


def encode(text: str) -> np.ndarray:
    """int32 [1, P]: a document separator, then the text's UTF-8 bytes."""
    return np.frombuffer(SEPARATOR + text.encode("utf-8"), np.uint8).astype(np.int32)[None]


def decode(tokens_N: np.ndarray) -> str:
    """Bytes up to the first document separator, as UTF-8 (bad sequences replaced)."""
    data = bytes(int(t) for t in tokens_N if t < 256)
    return data.split(SEPARATOR)[0].decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, its checkpoints/ directory, or one step's directory")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0: off")
    parser.add_argument("--top-p", type=float, default=0.95,
                        help="keep the smallest set of tokens holding this probability mass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        if not args.prompt:
            raise ValueError("--prompt: empty; give some text to continue")
        params, config = api.load_params(args.checkpoint)
        if config.data.source == "tokens":
            raise ValueError("--prompt: this model was trained on token ids (data.source: tokens), "
                             "not bytes; text prompts need a byte-level model")
        start = time.perf_counter()
        tokens = generate(params, encode(args.prompt), config, key=jax.random.key(args.seed),
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p)
        tokens = np.asarray(tokens)[0]
        seconds = time.perf_counter() - start
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + decode(tokens))
    print(f"[{len(tokens)} tokens in {seconds:.2f} s, compile included]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

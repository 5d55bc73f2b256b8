"""python -m jaxmoe.generate --checkpoint RUN_DIR --prompt "def " [--prompt ...] [--max-new-tokens N ...]

Samples continuations of prompts from a trained model, with a KV cache: the
prompts are prefilled in one call, then one token is decoded per step inside a
`lax.while_loop` that ends when every row has produced an end-of-document token
(or after --max-new-tokens), so generation compiles once per (batch, prompt
length, new tokens). Text maps to tokens with the tokenizer the run trained with
(saved in RUN_DIR/tokenizer/). Each prompt starts after an end-of-document token,
so it reads as the start of a document, as in training. Prompts of different
lengths are left-padded, and the padding is masked out of attention.

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

from jaxmoe import api, checkpoint
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import Config
from jaxmoe.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer, run_tokenizer
from jaxmoe.model import kv_cache
from jaxmoe.model.sampling import sample


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens"))
def _generate(params, prompt_BxP, first_B, eos, key, temperature, top_k, top_p, config,
              max_new_tokens):
    model = api.to_module(params, config)
    B, P = prompt_BxP.shape
    cache = kv_cache.init_cache(config.model, B, P + max_new_tokens)
    logits_BxPxV, cache, _ = kv_cache.forward(model, prompt_BxP, cache, 0, first_B)
    token_B = sample(jax.random.fold_in(key, P), logits_BxPxV[:, -1], temperature, top_k, top_p)
    out_BxN = jnp.full((B, max_new_tokens), eos, jnp.int32).at[:, 0].set(token_B)

    def more(carry):
        n, _, _, done_B = carry
        return (n < max_new_tokens) & ~jnp.all(done_B)

    def step(carry):  # feeds new token n-1 (at position P+n-1), samples new token n
        n, out_BxN, cache, done_B = carry
        position = P + n - 1
        logits_Bx1xV, cache, _ = kv_cache.forward(model, out_BxN[:, n - 1][:, None], cache,
                                                  position, first_B)
        next_B = sample(jax.random.fold_in(key, position + 1), logits_Bx1xV[:, 0], temperature,
                        top_k, top_p)
        next_B = jnp.where(done_B, eos, next_B)
        return n + 1, out_BxN.at[:, n].set(next_B), cache, done_B | (next_B == eos)

    n, out_BxN, _, _ = jax.lax.while_loop(more, step, (1, out_BxN, cache, token_B == eos))
    return out_BxN, n  # n: tokens decoded per row, fewer than max_new_tokens after an early end


def generate(params: api.Params, prompt_BxP: jax.Array, config: Config, *, key: jax.Array,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, first_B: jax.Array | None = None,
             eos_id: int | None = None) -> jax.Array:
    """int32 [B, max_new_tokens] continuations of prompts.

    Prompts of different lengths are left-padded: row b's prompt starts at
    first_B[b] (None: every row is full). With eos_id, a row that produced it
    continues with eos_id only, and decoding ends once every row has.
    Deterministic for a given key: the token at position p is drawn with
    fold_in(key, p). temperature 0 is greedy; top_k 0 and top_p 1 are off.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be at least 1, got {max_new_tokens}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling: need temperature >= 0, top_k >= 0 and top_p in (0, 1], got "
                         f"temperature={temperature}, top_k={top_k}, top_p={top_p}")
    api.check_tokens(prompt_BxP, config)
    B, P = np.shape(prompt_BxP)
    first_B = np.zeros(B, np.int32) if first_B is None else np.asarray(first_B, np.int32)
    if first_B.shape != (B,) or first_B.min() < 0 or first_B.max() >= P:
        raise ValueError(f"first_B: need one start per row in [0, {P}), got {first_B.tolist()}")
    config = api.local_config(config)
    api.check_params(params, config)
    tokens_BxN, _ = _generate(params, jnp.asarray(prompt_BxP, jnp.int32), jnp.asarray(first_B),
                              jnp.int32(-1 if eos_id is None else eos_id), key,
                              jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                              config, max_new_tokens)
    return tokens_BxN


def encode_prompts(tokenizer: Tokenizer, prompts: list[str],
                   max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [B, P] left-padded prompts, int32 [B] first real slot): each prompt's ids
    after an end-of-document token, as a document starts in training (the last
    max_tokens of them, when given)."""
    encoded = [([tokenizer.eos_id] + tokenizer.encode(p))[-(max_tokens or 0):] for p in prompts]
    P = max(len(e) for e in encoded)
    tokens_BxP = np.full((len(encoded), P), tokenizer.eos_id, np.int32)
    first_B = np.array([P - len(e) for e in encoded], np.int32)
    for row, e in enumerate(encoded):
        tokens_BxP[row, P - len(e):] = e
    return tokens_BxP, first_B


def past_trained_length(prompt: int, new: int, config: Config) -> str | None:
    """What goes past the positions the model trained on: rows of `train.seq_len`
    tokens, whose last position predicts the one after (None: nothing does)."""
    trained = config.train.seq_len
    if prompt + new <= trained + 1:
        return None
    where = (f"the prompt ({prompt} tokens with its start) and {new} new tokens go past the "
             f"{trained} positions the model trained on (train.seq_len): what it writes "
             "there is untrained")
    if prompt > trained:
        return f"{where}; shorten the prompt to {trained} tokens at most"
    return f"{where}; ask for at most {trained + 1 - prompt} new tokens"


def _length(new_N: np.ndarray, eos: int) -> int:
    """New tokens up to and including the first EOS."""
    ends = np.flatnonzero(new_N == eos)
    return int(ends[0]) + 1 if len(ends) else len(new_N)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.generate`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, its checkpoints/ directory, or one step's directory")
    parser.add_argument("--prompt", required=True, action="append",
                        help="text to continue; repeat for a batch of prompts")
    parser.add_argument("--tokenizer", default=None,
                        help="override the run's saved tokenizer (a tokenizer.json or 'bytes')")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: as many as the positions the model trained on "
                             "(train.seq_len) leave after the longest prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0: off")
    parser.add_argument("--top-p", type=float, default=0.95,
                        help="keep the smallest set of tokens holding this probability mass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--within-trained-length", action="store_true",
                        help="refuse prompts and generation past the row length the model "
                             "trained on (train.seq_len), instead of warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        if not all(args.prompt):
            raise ValueError("--prompt: empty; give some text to continue")
        params, config = api.load_params(args.checkpoint)
        tokenizer = (load_tokenizer(args.tokenizer) if args.tokenizer
                     else run_tokenizer(checkpoint.run_dir_of(args.checkpoint), config))
        if tokenizer.vocab_size > config.model.vocab_size:
            raise TokenizerError(f"the tokenizer has {tokenizer.vocab_size} ids, the model "
                                 f"{config.model.vocab_size}: not the tokenizer it trained with")
        prompt_BxP, first_B = encode_prompts(tokenizer, args.prompt)
        if args.max_new_tokens is None:
            args.max_new_tokens = max(config.train.seq_len + 1 - prompt_BxP.shape[1], 1)
        past = past_trained_length(prompt_BxP.shape[1], args.max_new_tokens, config)
        if past and args.within_trained_length:
            raise ValueError(f"{past} (--within-trained-length)")
        if past:
            print(f"warning: {past}", file=sys.stderr)
        start = time.perf_counter()
        tokens_BxN = generate(params, prompt_BxP, config, key=jax.random.key(args.seed),
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, first_B=first_B,
                              eos_id=tokenizer.eos_id)
        tokens_BxN = np.asarray(tokens_BxN)
        seconds = time.perf_counter() - start
    except (CheckpointError, ValueError) as e:  # TokenizerError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts = [tokenizer.decode(list(prompt[first + 1:]) + list(new))
             for prompt, first, new in zip(prompt_BxP, first_B, tokens_BxN)]
    print(("\n" + "=" * 40 + "\n").join(texts))
    produced = sum(_length(row, tokenizer.eos_id) for row in tokens_BxN)
    print(f"[{produced} tokens in {seconds:.2f} s, compile included]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generation: the KV cache equals full recomputation, sampling is seeded, the CLI works."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmoe
from jaxmoe import api
from jaxmoe.api import local_config
from jaxmoe.data.tokenizer import BYTE_TOKENIZER
from jaxmoe.generate import _generate, encode_prompts, generate, main
from jaxmoe.model import kv_cache
from jaxmoe.model.sampling import filter_logits

# capacity_factor 1.0 drops copies in the full pass; generation runs dropless
CFG = jaxmoe.config_from_dict({
    "model": {"d_model": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "expert_bias": True,
            "capacity_factor": 1.0}})


@pytest.fixture(scope="module")
def params():
    return jaxmoe.init(CFG, jax.random.key(0))


def test_kv_cache_equals_full_recompute(params):
    """Exact under dropless dispatch (local_config); capacity drops would make a
    token's output depend on how many tokens share the call."""
    cfg = local_config(CFG)
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    full_BxLxV, _ = jaxmoe.apply(params, tokens_BxL, cfg)

    @jax.jit
    def cached(params, tokens_BxL):
        model = api.to_module(params, cfg)
        cache = kv_cache.init_cache(cfg.model, 2, 16)
        logits, cache, _ = kv_cache.forward(model, tokens_BxL[:, :5], cache, 0)  # prefill
        steps = [logits]
        for i in range(5, 12):
            logits, cache, _ = kv_cache.forward(model, tokens_BxL[:, i:i + 1], cache, i)
            steps.append(logits)
        # the last token again, with an empty cache: what a broken cache would give
        empty = kv_cache.init_cache(cfg.model, 2, 16)
        no_cache, _, _ = kv_cache.forward(model, tokens_BxL[:, 11:], empty, 11)
        return jnp.concatenate(steps, axis=1), no_cache

    got_BxLxV, no_cache_Bx1xV = cached(params, tokens_BxL)
    np.testing.assert_allclose(got_BxLxV, full_BxLxV, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(no_cache_Bx1xV[:, 0] - full_BxLxV[:, 11])).max() > 1e-2
    capacity_limited, _ = jaxmoe.apply(params, tokens_BxL, CFG)
    assert np.abs(np.asarray(capacity_limited - full_BxLxV)).max() > 1e-4


def test_greedy_generation_equals_argmax_of_full_recompute(params):
    prompt_BxP = jax.random.randint(jax.random.key(2), (2, 5), 1, 256)
    got = np.asarray(generate(params, prompt_BxP, CFG, key=jax.random.key(0), max_new_tokens=8,
                              temperature=0.0))
    tokens = np.asarray(prompt_BxP)
    for _ in range(8):
        logits, _ = jaxmoe.apply(params, tokens, local_config(CFG))
        tokens = np.concatenate([tokens, np.argmax(logits[:, -1], -1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, tokens[:, 5:])


def encode(text):
    return encode_prompts(BYTE_TOKENIZER, [text])[0]


def test_left_padded_prompts_match_each_prompt_alone(params):
    prompts = ["x = 1", "def f(a, b):", "i"]
    tokens_BxP, first_B = encode_prompts(BYTE_TOKENIZER, prompts)
    assert tokens_BxP.shape == (3, 13) and first_B.tolist() == [7, 0, 11]
    run = lambda t, **kw: np.asarray(generate(params, t, CFG, key=jax.random.key(0),  # noqa: E731
                                              max_new_tokens=6, temperature=0.0, **kw))
    batched = run(tokens_BxP, first_B=first_B)
    for row, p in enumerate(prompts):
        np.testing.assert_array_equal(batched[row], run(encode(p))[0])
    unmasked = run(tokens_BxP)  # the padding attended to: the short prompts change
    assert (unmasked[0] != batched[0]).any() and (unmasked[1] == batched[1]).all()


def test_rows_stop_at_eos(params):
    prompt = encode("def ")
    free = np.asarray(generate(params, prompt, CFG, key=jax.random.key(0), max_new_tokens=8,
                               temperature=0.0))[0]
    eos = int(free[2])  # pretend the third new token ends documents
    stopped = np.asarray(generate(params, prompt, CFG, key=jax.random.key(0), max_new_tokens=8,
                                  temperature=0.0, eos_id=eos))[0]
    np.testing.assert_array_equal(stopped[:3], free[:3])
    assert (stopped[3:] == eos).all() and (free[3:] != eos).any()
    _, decoded = _generate(params, jnp.asarray(prompt), jnp.zeros(1, jnp.int32), jnp.int32(eos),
                           jax.random.key(0), jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0),
                           local_config(CFG), 8)
    assert int(decoded) == 3  # the loop ended at the EOS, not after 8 tokens


def test_sampling_is_seeded_and_filters_compile_once(params):
    prompt = encode("def ")
    run = lambda seed, **kw: np.asarray(generate(  # noqa: E731
        params, prompt, CFG, key=jax.random.key(seed), max_new_tokens=24, **kw))
    a = run(0, temperature=1.0)
    compiled = _generate._cache_size()
    np.testing.assert_array_equal(a, run(0, temperature=1.0))
    assert (a != run(1, temperature=1.0)).any()
    greedy = run(0, temperature=0.0)
    assert (a != greedy).any()
    np.testing.assert_array_equal(run(3, temperature=1.0, top_k=1), greedy)
    np.testing.assert_array_equal(run(4, temperature=1.0, top_p=1e-6), greedy)
    assert _generate._cache_size() == compiled  # knobs and seeds are traced, not static


def test_filter_logits():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, **kw)))[0]  # noqa: E731
    np.testing.assert_array_equal(kept(top_k=2), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(top_p=0.6), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(top_p=0.8), [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(kept(top_k=2, top_p=0.9), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(), [1, 1, 1, 1, 1])


def test_bad_generation_input(params):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(params, encode("x"), CFG, key=jax.random.key(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(params, encode("x"), CFG, key=jax.random.key(0), max_new_tokens=2, top_p=0.0)


def test_cli(tiny_run, tmp_path, capsys):
    cmd = [sys.executable, "-m", "jaxmoe.generate", "--checkpoint", str(tiny_run),
           "--prompt", "import ", "--max-new-tokens", "12", "--seed", "3"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("import ") and re.search(r"\[\d+ tokens in", first.stderr)
    assert main(cmd[3:]) == 0  # in-process, same seed: same text
    assert capsys.readouterr().out == first.stdout
    assert main(["--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["--checkpoint", str(tiny_run), "--prompt", ""]) == 2
    assert "--prompt: empty" in capsys.readouterr().err


def test_generation_past_the_trained_length_warns_or_is_refused(tiny_run, capsys):
    """tiny_run trained rows of 32 positions: a prompt of 8 (with its start token) and
    25 new tokens stay inside them, 26 go past, which warns, or with
    --within-trained-length is refused in one line; a prompt past them says to shorten
    it."""
    base = ["--checkpoint", str(tiny_run), "--prompt", "import ", "--seed", "1"]
    assert main(base + ["--max-new-tokens", "25"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(base + ["--max-new-tokens", "26"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: the prompt (8 tokens with its start) and 26 new tokens go "
                          "past the 32 positions the model trained on (train.seq_len)"), err
    assert "ask for at most 25 new tokens" in err
    assert main(base + ["--max-new-tokens", "26", "--within-trained-length"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the prompt") and err.strip().endswith("(--within-trained-length)")
    assert main(base[:3] + ["x" * 40, "--max-new-tokens", "1"]) == 0
    assert "shorten the prompt to 32 tokens at most" in capsys.readouterr().err

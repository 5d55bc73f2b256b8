"""A small byte-level BPE tokenizer trained in the test, and text to train it on."""

import json
from pathlib import Path

WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and every bird sings a song about rivers mountains and green fields").split()
EOS = "<|endoftext|>"


def sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 4-12 words in a fixed, learnable order (each word is usually
    followed by the next word of WORDS)."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        at = rng.randrange(len(WORDS))
        words = [WORDS[(at + i) % len(WORDS)] for i in range(rng.randrange(4, 13))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def make_tokenizer(directory: Path, vocab_size: int = 300, with_config: bool = True) -> Path:
    """Writes tokenizer.json (and tokenizer_config.json naming EOS) into directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sentences(400), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if with_config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return directory

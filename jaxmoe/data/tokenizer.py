"""Text <-> token ids: raw bytes, or a Hugging Face `tokenizer.json`.

`data.tokenizer: bytes` (the default) maps each UTF-8 byte to its id (0..255);
document ends are marked with 0x00, which never occurs in source code or ordinary
text. Any other value names a `tokenizer.json` file, or a directory holding one
(with its `tokenizer_config.json`, if any, which says which tokens are EOS and BOS).
Nothing is downloaded: the file must be on disk.

A run keeps a copy of its tokenizer in `RUN_DIR/tokenizer/`, so generation reads
the tokenizer the model was trained with, wherever the original went.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

BYTES = "bytes"
BYTE_VOCAB = 256
BYTE_EOS = 0  # the document separator of byte-level corpora
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
RUN_SUBDIR = "tokenizer"
# Tried in order when no tokenizer_config.json names the EOS token.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be found, read or used with this model."""


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer. `spec` is what `data.tokenizer` said; `sha256` identifies
    the tokenizer.json and its tokenizer_config.json (bytes: "bytes"), so a corpus can
    name the tokenizer it needs. `vocab_size` covers the largest id, added tokens too."""
    spec: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    sha256: str
    add_bos: bool = False  # tokenizer_config.json's add_bos_token: BOS starts every text
    _hf: object | None = None  # tokenizers.Tokenizer
    _files: tuple[Path, ...] = ()

    @property
    def is_bytes(self) -> bool:
        return self._hf is None

    def encode(self, text: str) -> list[int]:
        """Ids of the text, with the tokenizer's own special tokens (a BOS its
        post-processor or its config adds); no EOS is appended."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._with_bos(self._hf.encode(text).ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id] + ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Ids of the text alone: no BOS, whatever the tokenizer's config says."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        """Ids of one document followed by exactly one EOS."""
        return self.encode_documents([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._hf is None:
            return [self.encode(t) for t in texts]
        return [self._with_bos(e.ids) for e in self._hf.encode_batch(texts)]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """`encode_document` of each text, encoded as one batch."""
        return [ids if ids[-1:] == [self.eos_id] else ids + [self.eos_id]
                for ids in self.encode_batch(texts)]

    def decode(self, ids) -> str:
        """Text of the ids up to (not including) the first EOS; special tokens dropped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        if self._hf is None:
            return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)

    def text_bytes(self, ids) -> int:
        """UTF-8 bytes of the text the ids stand for, across document ends: a byte-level
        id is a byte (the separator too), a special token of a tokenizer none."""
        ids = [int(i) for i in ids]
        if self._hf is None:
            return sum(i < BYTE_VOCAB for i in ids)
        return len(self._hf.decode(ids, skip_special_tokens=True).encode("utf-8"))

    def describe(self) -> dict:
        """What a corpus index or a run records about its tokenizer."""
        return {"spec": self.spec, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "bos_id": self.bos_id}

    def save(self, directory: str | Path) -> None:
        """Copies the tokenizer's files into `directory` (nothing for bytes)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.is_bytes:
            (directory / "bytes").write_text("byte-level: each UTF-8 byte is a token; 0x00 ends "
                                             "a document\n")
        for f in self._files:
            shutil.copyfile(f, directory / f.name)

    def save_hf(self, directory: str | Path) -> None:
        """tokenizer.json and tokenizer_config.json for `transformers`' AutoTokenizer,
        mapping text to the ids this tokenizer gives: a byte-level one as a BPE model
        with no merges whose ids are the bytes (every byte but 0x00 written as a
        byte-fallback token `<0xNN>`, 0x00 as itself, the special end-of-document
        token)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False, "eos_token": self._token(self.eos_id)}
        if self.bos_id is not None:
            config |= {"bos_token": self._token(self.bos_id), "add_bos_token": self.add_bos}
        if self.is_bytes:
            _byte_level_hf().save(str(directory / TOKENIZER_FILE))
        else:
            self.save(directory)
            if self.add_bos and self.bos_id is not None and \
                    self._hf.encode("a").ids[:1] != [self.bos_id]:
                # the config asks for a BOS its tokenizer.json does not add: add it there,
                # where every reader of the file finds it
                self._with_bos_processor().save(str(directory / TOKENIZER_FILE))
            if (directory / TOKENIZER_CONFIG).is_file():  # the tokenizer's own says it best
                return
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=1))

    def _with_bos_processor(self):
        from tokenizers import Tokenizer as HFTokenizer, processors

        bos = self._token(self.bos_id)
        tok = HFTokenizer.from_str(self._hf.to_str())
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        return tok

    def _token(self, i: int) -> str:
        return chr(i) if self.is_bytes else self._hf.id_to_token(i)


BYTE_TOKENIZER = Tokenizer(BYTES, BYTE_VOCAB, BYTE_EOS, None, BYTES)


def _byte_level_hf():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text: byte 0x00 is a
    token of its own, the special end-of-document token; every other byte falls back to
    `<0xNN>` (no normaliser, no pre-tokenizer, no merges, so nothing regroups them)."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    eos = chr(BYTE_EOS)
    vocab = {eos: BYTE_EOS, **{f"<0x{b:02X}>": b for b in range(BYTE_VOCAB) if b != BYTE_EOS}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    return tok


def _token_content(entry) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`bytes`, a tokenizer.json, or a directory holding one (a run's `tokenizer/` too)."""
    spec = str(spec)
    if spec == BYTES:
        return BYTE_TOKENIZER
    path = Path(spec).expanduser().absolute()
    if path.is_dir():
        if (path / "bytes").is_file() and not (path / TOKENIZER_FILE).exists():
            return BYTE_TOKENIZER  # a run's saved record of a byte-level tokenizer
        file = path / TOKENIZER_FILE
    else:
        file = path
    if not file.is_file():
        raise TokenizerError(f"data.tokenizer: {file} does not exist (give a tokenizer.json, a "
                             f"directory holding one, or 'bytes')")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise TokenizerError("data.tokenizer: reading a tokenizer.json needs the `tokenizers` "
                             "package: pip install tokenizers") from None
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises plain Exception on malformed files
        raise TokenizerError(f"data.tokenizer: {file} is not a readable tokenizer.json "
                             f"({type(e).__name__}: {e})") from None
    config_file = file.parent / TOKENIZER_CONFIG
    special = {}
    if config_file.is_file():
        try:
            special = json.loads(config_file.read_text())
        except ValueError as e:
            raise TokenizerError(f"data.tokenizer: {config_file} is not valid JSON ({e})") from None
    eos_name = _token_content(special.get("eos_token"))
    if eos_name is None:
        eos_name = next((n for n in EOS_NAMES if hf.token_to_id(n) is not None), None)
    eos_id = hf.token_to_id(eos_name) if eos_name is not None else None
    if eos_id is None:
        where = f"{config_file}'s eos_token" if "eos_token" in special else (
            f"no {TOKENIZER_CONFIG} beside it and none of {', '.join(EOS_NAMES)}")
        raise TokenizerError(f"data.tokenizer: {file} has no end-of-document token ({where} "
                             f"names none in its vocabulary); documents need one to be separated")
    bos_name = _token_content(special.get("bos_token"))
    bos_id = hf.token_to_id(bos_name) if bos_name is not None else None
    files = (file,) + ((config_file,) if config_file.is_file() else ())
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    # added tokens may sit above the base vocabulary, with gaps
    vocab_size = max(hf.get_vocab_size(with_added_tokens=True),
                     max(hf.get_vocab(with_added_tokens=True).values()) + 1)
    return Tokenizer(str(spec), vocab_size, eos_id, bos_id, digest,
                     bool(special.get("add_bos_token")), hf, files)


def run_tokenizer(run_dir: str | Path, config) -> Tokenizer:
    """The tokenizer a run trained with (its copy in RUN_DIR/tokenizer/); TokenizerError
    when the run holds none for its ids: a run on token shards with data.tokenizer:
    bytes (raw shards train without one), or a run directory without its copy."""
    saved = Path(run_dir) / RUN_SUBDIR
    data = config.data
    if not saved.is_dir() and data.tokenizer != BYTES:
        raise TokenizerError(f"{run_dir} trained with data.tokenizer {data.tokenizer!r}, but "
                             f"{saved} (the run's copy of it) is missing: pass --tokenizer")
    tokenizer = load_tokenizer(saved) if saved.is_dir() else BYTE_TOKENIZER
    if tokenizer.is_bytes and data.source == "tokens" and config.model.vocab_size > BYTE_VOCAB:
        raise TokenizerError(f"{run_dir} trained on token ids with data.tokenizer: bytes, so it "
                             f"holds no tokenizer for them: pass --tokenizer with its corpus's")
    return tokenizer


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The model's embedding must hold every id the tokenizer can produce."""
    if vocab_size < tokenizer.vocab_size:
        raise TokenizerError(
            f"model.vocab_size {vocab_size} is smaller than the vocabulary of data.tokenizer "
            f"{tokenizer.spec!r} ({tokenizer.vocab_size} ids): set model.vocab_size to at least "
            f"{tokenizer.vocab_size} (a multiple of 128 is faster on accelerators), or use a "
            f"tokenizer with a smaller vocabulary")

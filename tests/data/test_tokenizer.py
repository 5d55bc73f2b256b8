"""Tokenizers: bytes, a tokenizer.json with its EOS, the vocabulary check, the run's copy."""

import json

import pytest

from jaxmoe.data.tokenizer import (BYTE_TOKENIZER, TokenizerError, check_vocab, load_tokenizer)
from tiny_tokenizer import EOS, make_tokenizer, sentences


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_bytes_round_trip():
    t = load_tokenizer("bytes")
    assert t is BYTE_TOKENIZER and t.vocab_size == 256 and t.eos_id == 0
    ids = t.encode_document("héllo")
    assert ids == list("héllo".encode()) + [0]
    assert t.decode(ids + [65]) == "héllo"  # stops at EOS


def test_tokenizer_json_and_its_eos(tok_dir):
    by_dir, by_file = load_tokenizer(tok_dir), load_tokenizer(tok_dir / "tokenizer.json")
    assert by_dir.sha256 == by_file.sha256 and by_dir.vocab_size == 300
    assert by_dir.eos_id == by_dir._hf.token_to_id(EOS) and by_dir.bos_id is None
    text = sentences(1)[0]
    ids = by_dir.encode_document(text)
    assert ids[-1] == by_dir.eos_id and ids.count(by_dir.eos_id) == 1
    assert by_dir.decode(ids) == text and len(ids) < len(text)  # merges happened


def test_eos_found_by_name_without_a_config(tmp_path):
    t = load_tokenizer(make_tokenizer(tmp_path, with_config=False))
    assert t.eos_id == t._hf.token_to_id(EOS)


def test_errors_name_the_problem(tmp_path, tok_dir):
    with pytest.raises(TokenizerError, match="nope.json does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json is not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    odd = make_tokenizer(tmp_path / "odd", with_config=False)
    (odd / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nowhere>"}))
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        load_tokenizer(odd)
    with pytest.raises(TokenizerError, match=r"model.vocab_size 256 is smaller .* \(300 ids\): set "
                                             r"model.vocab_size to at least 300"):
        check_vocab(load_tokenizer(tok_dir), 256)
    check_vocab(load_tokenizer(tok_dir), 384)  # padding the embedding is fine


def test_saved_copy_loads_the_same(tmp_path, tok_dir):
    t = load_tokenizer(tok_dir)
    t.save(tmp_path / "run" / "tokenizer")
    again = load_tokenizer(tmp_path / "run" / "tokenizer")
    assert again.describe()["sha256"] == t.sha256 and again.eos_id == t.eos_id
    BYTE_TOKENIZER.save(tmp_path / "bytes_run")
    assert load_tokenizer(tmp_path / "bytes_run") is BYTE_TOKENIZER


def test_bos_when_the_config_asks_for_it(tmp_path):
    d = make_tokenizer(tmp_path, with_config=False)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": {"content": "<unk>"}, "add_bos_token": True}))
    t = load_tokenizer(d)
    ids = t.encode_document("the dog")
    assert t.bos_id == t._hf.token_to_id("<unk>") and ids[0] == t.bos_id and ids[-1] == t.eos_id
    assert t.encode_batch(["the dog"]) == [ids[:-1]] and t.decode(ids) == "the dog"
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": "<unk>"}))
    assert load_tokenizer(d).encode("the dog")[0] != t.bos_id  # named, not added


TEXTS = ["def f(x):\n    return x  # ok", "héllo wörld ✓ 🙂", "a\x00b", "  two  spaces\t\r\n",
         "<|endoftext|> <0x41> Ā", "x" * 3000]


def test_hf_files_give_the_same_ids_through_autotokenizer(tmp_path, tok_dir):
    """What an export writes: AutoTokenizer maps text to the ids jaxmoe trained on
    (bytes: each UTF-8 byte; a tokenizer.json: its own), names the same EOS and BOS,
    and decodes back; a tokenizer without a config gets one naming its EOS."""
    transformers = pytest.importorskip("transformers")
    bare = make_tokenizer(tmp_path / "bare", with_config=False)
    bos = make_tokenizer(tmp_path / "bos", with_config=False)
    (bos / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": "<unk>", "add_bos_token": True}))
    for ours in (BYTE_TOKENIZER, load_tokenizer(tok_dir), load_tokenizer(bare),
                 load_tokenizer(bos)):
        out = tmp_path / "hf" / ours.sha256[:8]
        ours.save_hf(out)
        theirs = transformers.AutoTokenizer.from_pretrained(out)
        assert theirs.eos_token_id == ours.eos_id and theirs.bos_token_id == ours.bos_id
        for text in TEXTS + sentences(3):
            ids = theirs(text)["input_ids"]
            assert ids == ours.encode(text), (ours.spec, text)
            if ours.is_bytes:
                assert ids == list(text.encode()) and theirs.decode(ids) == text
        # the end of a document is one id, and decoding drops it as the run's decode does
        assert theirs.decode(ours.encode_document("the dog"), skip_special_tokens=True) == "the dog"
    # a GPT-2-style byte-level vocabulary would not do: it writes byte 0x00 as "Ā"
    assert BYTE_TOKENIZER.encode("Ā") == [0xC4, 0x80] and BYTE_TOKENIZER.encode("\x00") == [0]

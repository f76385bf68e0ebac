"""The built-in byte-level BPE (flax_ln.bpe) used by examples/generate_gpt2.py."""

import json

import pytest

from flax_ln.bpe import ByteLevelBPE, bytes_to_unicode, load_tokenizer

MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"),
          ("Ġwor", "ld")]


def tiny_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Every byte (ids 0..255 in byte order), then one token per merge, then ``<|endoftext|>``."""
    vocab = {c: b for b, c in bytes_to_unicode().items()}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, MERGES


def write_vocab_merges(folder) -> ByteLevelBPE:
    vocab, merges = tiny_vocab()
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return ByteLevelBPE.from_files(folder / "vocab.json", folder / "merges.txt")


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"  # GPT-2's space and newline


def test_merges_and_round_trip(tmp_path):
    tok = write_vocab_merges(tmp_path)
    vocab, _ = tiny_vocab()
    assert tok.encode("hello world") == [vocab["hello"], vocab["Ġworld"]]
    assert tok.encode("hello<|endoftext|>world") == [vocab["hello"], vocab["<|endoftext|>"], vocab["w"], vocab["or"],
                                                      vocab["ld"]]
    texts = ["hello world", "  Tabs\tand\nnewlines  ", "naïve café, 日本語 😀 x² don't", "<|endoftext|>", ""]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xE6]) == "\ufffd"  # half a UTF-8 character decodes to U+FFFD instead of failing


def test_tokenizer_json_reads_the_same(tmp_path):
    files = write_vocab_merges(tmp_path)
    vocab, merges = tiny_vocab()
    spec = {
        "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>"}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": [list(m) for m in merges]},  # newer list form
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    from_json = ByteLevelBPE.from_tokenizer_json(tmp_path / "tokenizer.json")
    text = "hello world, hello<|endoftext|>"
    assert from_json.encode(text) == files.encode(text)

    spec["model"]["type"] = "WordPiece"
    (tmp_path / "other.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="only byte-level BPE"):
        ByteLevelBPE.from_tokenizer_json(tmp_path / "other.json")


def test_load_tokenizer_finds_files(tmp_path):
    tok, why = load_tokenizer(tmp_path)
    assert tok is None and "no tokenizer.json" in why
    write_vocab_merges(tmp_path)
    tok, why = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("hello")) == "hello" and "merges.txt" in why


def test_matches_hugging_face_tokenizers(tmp_path):
    """Same ids as the ``tokenizers`` package on a byte-level BPE it trained."""
    import tokenizers

    corpus = ["Hello, world! I'm here; you've got 123 apples.", "naïve café — “quotes” 日本語 😀", "a_b  d\n\n e"]
    corpus *= 20
    trainer = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator(corpus, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save(str(tmp_path / "tokenizer.json"))
    ref = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = ByteLevelBPE.from_tokenizer_json(tmp_path / "tokenizer.json")
    for text in corpus[:3] + ["don't WON'T it's  x²½<|endoftext|>tail"]:
        assert ours.encode(text) == ref.encode(text).ids

"""GPT-2's byte-level BPE tokenizer, read from a Hugging Face model folder, with no dependencies.

Supported files, in the order :func:`load_tokenizer` tries them:

1. ``tokenizer.json`` through the ``tokenizers`` package, when it is installed (any model).
2. ``tokenizer.json`` of a byte-level BPE (GPT-2's: ``model.type == "BPE"`` with a
   ``ByteLevel`` pre-tokenizer), read by :class:`ByteLevelBPE`.
3. ``vocab.json`` + ``merges.txt`` (GPT-2's original files), read by :class:`ByteLevelBPE`.

:class:`ByteLevelBPE` reproduces GPT-2's encoding: text is split by GPT-2's
pre-tokenization pattern, each piece's UTF-8 bytes are mapped to printable characters
(GPT-2's byte-to-unicode table), and the ranked merges are applied, lowest rank first.
Added tokens such as ``<|endoftext|>`` are matched literally before that. Without the
``regex`` package the pattern's Unicode classes ``\\p{L}``/``\\p{N}`` are approximated with
Python's ``re`` (exact for ASCII and for letters and decimal digits; characters such as
superscript digits may split differently); install ``regex`` for the exact pattern.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

try:
    import regex as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
except ImportError:  # stdlib: [^\W\d_] = letters, \d = decimal digits, (?:[^\s\w]|_) = the rest but spaces
    import re as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""


class Tokenizer(Protocol):
    """What the examples need from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Bytes that are printable Latin-1 characters (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map
    to themselves; the other 68 bytes map to ``chr(256)``, ``chr(257)``, ... in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteLevelBPE:
    """GPT-2's byte-level BPE: ``encode(text) -> ids`` and ``decode(ids) -> text``.

    Args:
      vocab: token string (in byte-to-unicode characters) -> id.
      merges: the merge rules, best (rank 0) first, as pairs of token strings.
      added_tokens: literal strings (e.g. ``<|endoftext|>``) encoded as one id each, never split.
    """

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]],
                 added_tokens: dict[str, int] | None = None):
        self.vocab = dict(vocab)
        self.added_tokens = dict(added_tokens or {})
        self.id_to_token = {i: t for t, i in {**self.vocab, **self.added_tokens}.items()}
        self.ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._pattern = _re.compile(_PATTERN)
        self._added = (
            _re.compile("(" + "|".join(_re.escape(t) for t in sorted(self.added_tokens, key=len, reverse=True)) + ")")
            if self.added_tokens else None
        )
        self._cache: dict[str, list[str]] = {}

    @classmethod
    def from_files(cls, vocab_file, merges_file) -> ByteLevelBPE:
        """GPT-2's ``vocab.json`` and ``merges.txt`` (a ``#version`` header line is skipped)."""
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        merges = []
        for lineno, line in enumerate(Path(merges_file).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{merges_file}:{lineno}: expected a merge 'left right', got {line!r}")
            merges.append((parts[0], parts[1]))
        added = {t: vocab[t] for t in ("<|endoftext|>",) if t in vocab}
        return cls(vocab, merges, added)

    @classmethod
    def from_tokenizer_json(cls, path) -> ByteLevelBPE:
        """A Hugging Face ``tokenizer.json`` holding a byte-level BPE (GPT-2's); other kinds raise ``ValueError``."""
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        pre_types = [p.get("type") for p in steps]
        if model.get("type") != "BPE" or pre_types != ["ByteLevel"]:
            raise ValueError(
                f"{path}: only byte-level BPE tokenizers (GPT-2's) are read without the tokenizers package; this "
                f"one has model {model.get('type')!r} and pre-tokenizer {pre_types}. pip install tokenizers"
            )
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        return cls(model["vocab"], merges, added)

    def _bpe(self, piece: str) -> list[str]:
        """Apply the merges to one pre-token (already in byte-to-unicode characters)."""
        if piece in self._cache:
            return self._cache[piece]
        parts = list(piece)
        while len(parts) > 1:
            best = min(zip(parts, parts[1:]), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            left, right = best
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the pair, left to right
                if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self._cache[piece] = parts
        return parts

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises ``KeyError`` naming a token the vocabulary lacks."""
        ids = []
        chunks = self._added.split(text) if self._added else [text]
        for chunk in chunks:
            if chunk in self.added_tokens:
                ids.append(self.added_tokens[chunk])
                continue
            for piece in self._pattern.findall(chunk):
                for token in self._bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8"))):
                    if token not in self.vocab:
                        raise KeyError(f"token {token!r} is not in the vocabulary (incomplete vocab.json?)")
                    ids.append(self.vocab[token])
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        out, buffer = [], bytearray()
        for i in ids:
            token = self.id_to_token.get(int(i))
            if token is None:
                raise KeyError(f"token id {int(i)} is not in the vocabulary (size {len(self.id_to_token)})")
            if token in self.added_tokens:
                out.append(buffer.decode("utf-8", errors="replace") + token)
                buffer = bytearray()
            else:
                buffer += bytes(self.byte_decoder[c] for c in token)
        return "".join(out) + buffer.decode("utf-8", errors="replace")


class _HFTokenizer:
    """``tokenizers.Tokenizer`` behind the :class:`Tokenizer` interface."""

    def __init__(self, path):
        from tokenizers import Tokenizer as _T

        self._tok = _T.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(folder) -> tuple[Tokenizer | None, str]:
    """``(tokenizer, description)`` from a model folder's files, or ``(None, reason)`` when it has none.

    Tries ``tokenizer.json`` with the ``tokenizers`` package, then ``tokenizer.json`` as a
    byte-level BPE, then ``vocab.json`` + ``merges.txt``; see the module docstring.
    """
    folder = Path(folder)
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            return _HFTokenizer(tokenizer_json), f"{tokenizer_json} (tokenizers package)"
        except ImportError:
            return ByteLevelBPE.from_tokenizer_json(tokenizer_json), f"{tokenizer_json} (built-in byte-level BPE)"
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return (ByteLevelBPE.from_files(folder / "vocab.json", folder / "merges.txt"),
                f"{folder / 'vocab.json'} + merges.txt (built-in byte-level BPE)")
    return None, f"no tokenizer.json or vocab.json + merges.txt in {folder}"

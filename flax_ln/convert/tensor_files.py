"""A lazy reader of safetensors files (the headers first, then only the blocks asked for) and a streaming writer.

Nothing here knows a model: :func:`read_headers` lists every tensor's name, shape and dtype
code without reading data, :func:`shard_files` the files a sharded save's index names,
and a :class:`StoredTensor` reads its tensor (or one block of it) when asked, mapping the
file only for that read. :mod:`flax_ln.convert.hf` reads Hugging Face GPT-2 through it.
:func:`write_streamed` writes a file a block at a time, never holding its tensors at once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

# safetensors dtype codes parameters may have (float64/32/16, bfloat16), and NumPy names of the others.
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")
SAFETENSORS_OTHERS = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

# The index of a sharded save, as save_pretrained names it: {"weight_map": {tensor name: shard file name}}.
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: ``name`` in the safetensors ``file``.

    ``shape`` is the tensor's as its reader wants it: the stored shape, with the last two
    axes swapped if ``swapped`` (a matrix the file holds transposed).
    """

    file: Path
    name: str
    shape: tuple[int, ...]
    swapped: bool
    code: str = ""  # the safetensors dtype code ("F32", "BF16", ...) when the reader kept it

    def read(self, index: tuple[slice, ...] | None = None, *, transpose: bool = False) -> np.ndarray:
        """The block ``index`` of the tensor (of its last-two-axes transpose if ``transpose``).

        Only that block is read (``safe_open(...).get_slice``); the file is mapped for
        the duration of this call only, so no file page stays resident afterwards.
        """
        from safetensors import safe_open

        swap = transpose != self.swapped  # the stored array is the wanted one with its last two axes swapped
        if index is not None and swap:
            index = (*index[:-2], index[-1], index[-2])
        with safe_open(str(self.file), framework="numpy") as f:
            block = f.get_tensor(self.name) if index is None else f.get_slice(self.name)[index]
        return np.swapaxes(block, -1, -2) if swap else block


def read_headers(files: Iterable[Path]) -> Iterator[tuple[Path, str, tuple[int, ...], str]]:
    """``(file, tensor name, stored shape, safetensors dtype code)`` of every tensor in ``files``; no data is read.

    Each file's header is read whole before its tensors are given; a file that cannot be
    read as safetensors raises ``ValueError`` naming it.
    """
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:
        raise ImportError(
            "reading Hugging Face checkpoints needs the safetensors package: pip install safetensors"
        ) from err
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                slices = [(name, f.get_slice(name)) for name in f.keys()]
                header = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in slices]
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file}: not a readable safetensors file: {err}") from err
        for name, shape, code in header:
            yield file, name, shape, code


_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"} | {
    name: code for code, name in SAFETENSORS_OTHERS.items()
}


def write_streamed(
    file: str | Path,
    tensors: Iterable[tuple[str, tuple[int, ...], Any, Callable[[], Iterable[np.ndarray]]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors ``file`` from ``(name, shape, dtype, blocks)``, ``blocks()`` yielding the tensor's
    C-order elements in consecutive blocks of ``dtype`` (any sizes, summing to the tensor's): only one block is
    held at a time; ``metadata`` (str -> str) goes into the header's ``__metadata__``. Raises ``ValueError`` naming
    the tensor whose dtype safetensors cannot store or whose blocks do not add up to its shape."""
    entries = list(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype, _ in entries:
        code = _CODES.get(np.dtype(dtype).name)
        if code is None:
            raise ValueError(
                f"write_streamed: tensor {name!r} has dtype {np.dtype(dtype)}, which safetensors "
                f"cannot store; expected one of {sorted(_CODES)}"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape, dtype, blocks in entries:
            written = 0
            for block in blocks():
                block = np.ascontiguousarray(block, dtype=dtype)
                f.write((block.byteswap() if sys.byteorder == "big" else block).tobytes())  # safetensors: little-endian
                written += block.size
            if written != int(np.prod(shape, dtype=np.int64)):
                raise ValueError(
                    f"write_streamed: tensor {name!r} of shape {tuple(shape)} got {written} elements "
                    "from its blocks; expected the shape's element count"
                )


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def read_json_object(file: Path, holds: str) -> dict[str, Any]:
    """``file`` parsed as a JSON object; a ``ValueError`` naming the file for bad syntax or another JSON type."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not UTF-8 text ({err}); expected a JSON object holding {holds}") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}: invalid JSON syntax at line {err.lineno}, column {err.colno} ({err.msg}); "
            f"expected a JSON object holding {holds}"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object ({{...}}) holding {holds}, got a JSON {_json_type(data)}")
    return data


def checkpoint_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors checkpoint by its stored name, headers only: ``path`` is a ``.safetensors``
    file, or a folder holding ``model.safetensors``, a sharded save's index, or ``*.safetensors`` files.

    A name stored twice, a missing path and a folder without safetensors are ``ValueError`` or
    ``FileNotFoundError`` naming them."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / INDEX_FILE).is_file():
        files = shard_files(path, path / INDEX_FILE)
    elif path.is_dir() and sorted(path.glob("*.safetensors")):
        files = sorted(path.glob("*.safetensors"))
    else:
        raise FileNotFoundError(
            f"{path}: no safetensors checkpoint (a .safetensors file, or a folder with model.safetensors, "
            f"{INDEX_FILE} or *.safetensors files); save one with safetensors.torch.save_file(model.state_dict(), ...)"
        )
    tensors: dict[str, StoredTensor] = {}
    for file, name, shape, code in read_headers(files):
        if name in tensors:
            raise ValueError(f"{file}: {name!r} is stored twice (also in {tensors[name].file}); keep one copy")
        tensors[name] = StoredTensor(file, name, shape, False, code)
    return tensors


def shard_files(folder: Path, index_file: Path) -> list[Path]:
    """The shard files ``index_file`` names, each checked to lie inside ``folder`` before anything is opened."""
    index = read_json_object(index_file, '{"weight_map": {tensor name: shard file name}}')
    if "weight_map" not in index:
        raise ValueError(
            f'{index_file}: no "weight_map" entry; expected {{"weight_map": {{tensor name: shard file name}}}} '
            "as save_pretrained writes it"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(
            f'{index_file}: "weight_map" must be a JSON object mapping tensor names to shard file names, '
            f"got a JSON {_json_type(weight_map)}"
        )
    root = folder.resolve()
    files: dict[Path, None] = {}  # ordered set
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ValueError(f'{index_file}: "weight_map" entry {tensor!r}: expected a shard file name, got {shard!r}')
        resolved = (root / shard).resolve()  # an absolute shard replaces root; symlinks are followed
        if Path(shard).is_absolute() or not resolved.is_relative_to(root):
            raise ValueError(
                f'{index_file}: "weight_map" entry {tensor!r} -> {shard!r} leads outside the checkpoint folder '
                f"{folder} (to {resolved}); shard files must lie inside it, named relative to it "
                "(e.g. 'model-00001-of-00002.safetensors'). Nothing was opened; copy the shards into the folder "
                "(cp -L resolves symlinks) and fix the index"
            )
        files[resolved] = None
    return list(files)


def saved_names(model: Any) -> dict[str, str]:
    """torch key -> the name ``save_pretrained`` gives that tensor, where they differ: transformers 5 renames some
    models' modules when it loads a checkpoint (a ViT's ``encoder.layer.0.attention.attention.query`` is its module
    ``layers.0.attention.q_proj``) and renames them back when it saves, so a loader that reads a transformers folder
    (keras-hub's converters) asks for the saved names. Plain renames only (a key whose tensor a save converts, fuses or
    splits keeps its name), found by running transformers' own reversal on shape-only (meta) tensors; ``{}`` for a
    model transformers does not rename, or without transformers."""
    reverse = getattr(sys.modules.get("transformers.core_model_loading"), "revert_weight_conversion", None)
    if reverse is None or not hasattr(model, "config") or "torch" not in sys.modules:
        return {}
    import torch

    placeholders = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    try:
        saved = reverse(model, dict(placeholders))
    except Exception:  # noqa: BLE001 - a conversion that cannot run on shapes alone: the names stay torch's
        return {}
    by_tensor = {id(t): k for k, t in placeholders.items()}
    return {by_tensor[id(t)]: name for name, t in saved.items() if id(t) in by_tensor and by_tensor[id(t)] != name}

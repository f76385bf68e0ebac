"""Reference files: the torch side of a parity run in one safetensors file, checked later without torch.

``flax-ln parity --save-reference FILE`` writes, for every selected model, what the
comparison takes from torch (:class:`flax_ln.parity.sides.torch.TorchSide`): inputs, weights,
cotangents (or tangents), outputs, gradients, every submodule's recorded first call (so
the first divergence and isolated mode work from the file) and, with ``--attribute``,
the float64 values. Arrays are tensors named ``<model index>/<field>/...``; everything
else is one JSON string in the safetensors metadata under :data:`METADATA_KEY`:
the settings, and per model how to rebuild the flax twin (``spec``), its forward, and
the tree of each field with tensors replaced by their names. Nothing is pickled.

``flax-ln parity --reference FILE`` rebuilds each flax model from its ``spec`` and
the file's weights and compares it with the stored torch side. This module and that path
import nothing from torch, so it runs where torch is not installed (a TPU VM).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_ln
from flax_ln._atomic import write_atomically
from flax_ln.book import reference_schema
from flax_ln.parity.core.policy import numerics, parameter_dtype
from flax_ln.parity.records.capture import Unsupported
from flax_ln.parity.sides.torch import TorchSide
from flax_ln.parity.stored import compare_side

METADATA_KEY = "flax_ln_reference"
DIGEST_KEY = "flax_ln_reference_sha256"
FORMAT = "flax-ln parity reference"
VERSION = 2  # 2: each side lists the gradients float64 shows are zero (float64_zero)


class ReferenceFileError(ValueError):
    """A file that is not a readable flax-ln parity reference (a usage error, exit code 2)."""


class ReferenceAlteredError(Exception):
    """A reference file whose tensors or metadata no longer match the digest written with it (exit code 1)."""

    def __init__(self, path: str, expected: str, actual: str):
        super().__init__(
            f"--reference {path!r} was altered after it was written: the SHA-256 digest of its tensors and "
            f"metadata is {actual}, the file's digest says {expected}; write it again with --save-reference"
        )
        self.path, self.expected, self.actual = path, expected, actual


def digest(metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> str:
    """The SHA-256 (hex) of a reference's metadata (canonical JSON) and tensors (name, dtype, shape, bytes).

    :func:`save_reference` stores it under :data:`DIGEST_KEY`; :func:`load_reference` checks it.
    """
    h = hashlib.sha256()
    h.update(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(json.dumps([name, str(array.dtype), list(array.shape), array.nbytes]).encode() + b"\n")
        h.update(array.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# the book's forwards and models, rebuilt without torch


def decoder_output_and_log_probs(model, src, tgt, src_mask, tgt_mask):
    """The encoder-decoder's forward for either framework (the module trees mirror each other)."""
    out = model(src, tgt, src_mask, tgt_mask)
    return {"decoder output": out, "log probs": model.generator(out)}


def logits_and_loss(model, idx, targets):
    """A GPT's forward for either framework, with named outputs."""
    logits, loss = model(idx, targets)
    return {"logits": logits, "loss": loss}


FORWARDS: dict[str, Callable | None] = {
    "call": None,
    "logits_and_loss": logits_and_loss,
    "decoder_output_and_log_probs": decoder_output_and_log_probs,
}


def forward_name(forward: Callable | None) -> str:
    """The name under which a case's forward is stored (it must be one of :data:`FORWARDS`)."""
    for name, fn in FORWARDS.items():
        if fn is forward:
            return name
    raise ValueError(f"forward {forward!r} cannot be stored in a reference file; use one of {list(FORWARDS)}")


def build_flax_model(spec: Mapping[str, Any], dtype: str) -> nnx.Module:
    """The flax twin a case ``spec`` describes, with parameters in ``dtype`` (weights are loaded after).

    Specs: ``{"builder": "LayerNorm" | "TorchLayerNorm", "features", "eps"}``,
    ``{"builder": "GPT" | "Block", "config": GPTConfig fields}``,
    ``{"builder": "make_model", "sizes": make_model's sizes, "ffn_activation"}``.
    """
    param_dtype = getattr(jnp, parameter_dtype(dtype))
    rngs = nnx.Rngs(0)
    builder = spec.get("builder")
    if builder in ("LayerNorm", "TorchLayerNorm"):
        return getattr(flax_ln, builder)(spec["features"], spec["eps"], param_dtype=param_dtype, rngs=rngs)
    if builder in ("GPT", "Block"):
        from flax_ln.models.gpt import Block

        config = flax_ln.GPTConfig(**spec["config"])
        return (flax_ln.GPT if builder == "GPT" else Block)(config, param_dtype=param_dtype, rngs=rngs)
    if builder == "make_model":
        return flax_ln.make_model(
            **spec["sizes"], dropout=0.1, ffn_activation=spec["ffn_activation"], param_dtype=param_dtype, rngs=rngs
        )
    raise ReferenceFileError(
        f"unknown model builder {builder!r} in the reference; expected LayerNorm, TorchLayerNorm, "
        "GPT, Block or make_model"
    )


# ---------------------------------------------------------------------------------------
# packing: a tree of arrays and plain values <-> tensors + JSON


def _pack(value: Any, key: str, tensors: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON, each array moved into ``tensors`` under a name derived from ``key``."""
    if isinstance(value, Unsupported):
        return {"unsupported": str(value)}
    if isinstance(value, (np.ndarray, np.generic)):
        tensors[key] = np.array(value, order="C")  # ascontiguousarray would make a 0-d array 1-d
        return {"tensor": key}
    if isinstance(value, Mapping):
        return {"dict": [[str(k), _pack(v, f"{key}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [_pack(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"cannot store a {type(value).__name__} at {key!r} in a reference file")


def _unpack(packed: Any, tensors: Mapping[str, np.ndarray]) -> Any:
    ((kind, body),) = packed.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {k: _unpack(v, tensors) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_unpack(v, tensors) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "unsupported":
        return Unsupported(body)
    if kind == "value":
        return body
    raise ReferenceFileError(f"unknown entry kind {kind!r}")


# ---------------------------------------------------------------------------------------
# files


@dataclasses.dataclass
class ReferenceModel:
    """One model of a reference file: the stored torch side and how to run the flax side."""

    side: TorchSide
    spec: dict[str, Any]
    forward: str
    lm_logits: str | None
    stored_dtype: str | None = None  # a checkpoint's dtype(s) on disk, named in the report


# TorchSide fields a reference file leaves out: torch's op trace around each recorded module is live-run evidence
# for localisation's layouts; a stored side localises without it (layouts from the key map and the shapes)
NOT_STORED = ("trace",)


def save_reference(path: str, models: Sequence[ReferenceModel], settings: Mapping[str, Any]) -> None:
    """Write ``models`` (their torch sides, with records) and the run's ``settings`` to one safetensors file."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    entries = []
    for index, model in enumerate(models):
        if model.side.records is None:
            raise ValueError(f"model {model.side.name!r}: record the torch side (record=True) before saving it")
        fields = {
            f.name: _pack(getattr(model.side, f.name), f"{index}/{f.name}", tensors)
            for f in dataclasses.fields(model.side)
            if f.name not in NOT_STORED
        }
        entries.append(
            {
                "spec": model.spec,
                "forward": model.forward,
                "lm_logits": model.lm_logits,
                "stored_dtype": model.stored_dtype,
                "side": fields,
            }
        )
    metadata = {"format": FORMAT, "version": VERSION, "settings": dict(settings), "models": entries}
    text = json.dumps(metadata)
    stored = {METADATA_KEY: text, DIGEST_KEY: digest(json.loads(text), tensors)}
    write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=stored))


def load_reference(path: str) -> tuple[dict[str, Any], list[ReferenceModel]]:
    """The settings and models of a reference file written by :func:`save_reference`.

    The digest written with the file is checked first (after the metadata's nesting depth, which
    bounds the walk), then the metadata against the schema
    (:func:`flax_ln.book.reference_schema.validate`), before anything is unpacked or built: a file
    edited after it was written is reported altered, whatever the edit. A file without a digest
    is refused: nothing could tell its edits from a comparison.

    Raises:
      ReferenceFileError: the file is missing, not safetensors, a safetensors file without
        flax-ln's reference metadata or without a digest, or metadata that breaks the schema
        (naming the field).
      ReferenceAlteredError: the tensors or metadata do not match the file's digest.
    """
    import os

    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise ReferenceFileError(f"--reference {path!r}: no such file")
    hint = "write one with `flax-ln parity --save-reference FILE` on a machine with torch"
    try:
        with safe_open(path, framework="numpy") as f:
            stored = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ReferenceFileError(f"--reference {path!r} is not a safetensors file ({err}); {hint}") from err
    metadata = stored.get(METADATA_KEY)
    if metadata is None:
        raise ReferenceFileError(
            f"--reference {path!r} is a safetensors file without {METADATA_KEY!r} metadata, "
            f"so not a flax-ln parity reference; {hint}"
        )
    try:
        data = json.loads(metadata)
    except RecursionError:
        raise ReferenceFileError(
            f"--reference {path!r}: its metadata nests deeper than {reference_schema.MAX_DEPTH} levels "
            f"(the schema's limit); {hint}"
        ) from None
    except ValueError as err:
        raise ReferenceFileError(f"--reference {path!r}: its metadata is not JSON ({err}); {hint}") from err
    try:
        reference_schema.check_depth(data)  # bounded before the digest walks it
    except reference_schema.SchemaError as err:
        raise ReferenceFileError(f"--reference {path!r}: field {err}; {hint}") from err
    expected = stored.get(DIGEST_KEY)
    if expected is None:
        raise ReferenceFileError(
            f"--reference {path!r} has no {DIGEST_KEY!r} digest, so an alteration since it was written cannot "
            "be told from a comparison; write the file again with --save-reference"
        )
    actual = digest(data, tensors)
    if actual != expected:
        raise ReferenceAlteredError(path, expected, actual)
    try:
        reference_schema.validate(
            data, tensors, forwards=FORWARDS, build=build_flax_model, file_format=FORMAT, version=VERSION
        )
    except reference_schema.SchemaError as err:
        raise ReferenceFileError(f"--reference {path!r}: field {err}; {hint}") from err
    models = []
    for entry in data["models"]:
        fields = {name: _unpack(packed, tensors) for name, packed in entry["side"].items()}
        models.append(
            ReferenceModel(
                TorchSide(**fields), entry["spec"], entry["forward"], entry["lm_logits"], entry.get("stored_dtype")
            )
        )
    return data["settings"], models


def check_reference(model: ReferenceModel, tolerances=None, *, capture_modules: bool = False, mesh=None):
    """The flax side, rebuilt from the model's spec and stored weights, against the stored torch side.

    Same report as a live run (first divergence, isolated mode and attribution from the
    stored records and float64 values; on ``mesh``, sharded as in
    :func:`flax_ln.parity.compare_modules`); no torch is imported.
    """
    with numerics(model.side.dtype):
        flax_model = build_flax_model(model.spec, model.side.dtype)
    report = compare_side(
        model.side,
        flax_model,
        forward=FORWARDS[model.forward],
        tolerances=tolerances,
        capture_modules=capture_modules,
        lm_logits=model.lm_logits,
        mesh=mesh,
    )
    report.stored_dtype = model.stored_dtype
    return report

"""Reference files: the torch side of a parity run in one safetensors file, checked later without torch.

``flax-ln parity --save-reference FILE`` writes, for every selected model, what the
comparison takes from torch (:class:`flax_ln.parity.engine.TorchSide`): inputs, weights,
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
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_ln
from flax_ln._deprecated import module_getattr
from flax_ln.parity.capture import Unsupported

METADATA_KEY = "flax_ln_reference"
FORMAT = "flax-ln parity reference"
VERSION = 1


class ReferenceFileError(ValueError):
    """A file that is not a readable flax-ln parity reference (a usage error, exit code 2)."""


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
    param_dtype = jnp.float32 if dtype in ("bfloat16", "float16") else getattr(jnp, dtype)
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

    side: Any  # flax_ln.parity.engine.TorchSide
    spec: dict[str, Any]
    forward: str
    lm_logits: str | None
    stored_dtype: str | None = None  # a checkpoint's dtype(s) on disk, named in the report


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
    save_file(tensors, path, metadata={METADATA_KEY: json.dumps(metadata)})


def load_reference(path: str) -> tuple[dict[str, Any], list[ReferenceModel]]:
    """The settings and models of a reference file written by :func:`save_reference`.

    Raises:
      ReferenceFileError: the file is missing, not safetensors, or a safetensors file without
        flax-ln's reference metadata.
    """
    import os

    from safetensors import SafetensorError, safe_open

    from flax_ln.parity.engine import TorchSide

    if not os.path.isfile(path):
        raise ReferenceFileError(f"--reference {path!r}: no such file")
    hint = "write one with `flax-ln parity --save-reference FILE` on a machine with torch"
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ReferenceFileError(f"--reference {path!r} is not a safetensors file ({err}); {hint}") from err
    if metadata is None:
        raise ReferenceFileError(
            f"--reference {path!r} is a safetensors file without {METADATA_KEY!r} metadata, "
            f"so not a flax-ln parity reference; {hint}"
        )
    try:
        data = json.loads(metadata)
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ReferenceFileError(
                f"--reference {path!r}: format {data.get('format')!r} version "
                f"{data.get('version')!r}, expected {FORMAT!r} version {VERSION}; {hint}"
            )
        if data["settings"]["dtype"] not in ("float32", "float64", "bfloat16", "float16"):
            raise ReferenceFileError(f"--reference {path!r}: unknown dtype {data['settings']['dtype']!r}")
        models = []
        for entry in data["models"]:
            fields = {name: _unpack(packed, tensors) for name, packed in entry["side"].items()}
            if entry["forward"] not in FORWARDS:
                raise ReferenceFileError(f"--reference {path!r}: unknown forward {entry['forward']!r}")
            models.append(
                ReferenceModel(
                    TorchSide(**fields), entry["spec"], entry["forward"], entry["lm_logits"], entry.get("stored_dtype")
                )
            )
    except ReferenceFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ReferenceFileError(
            f"--reference {path!r}: malformed reference metadata ({type(err).__name__}: {err}); {hint}"
        ) from err
    return data["settings"], models


def check_reference(model: ReferenceModel, tolerances=None, *, capture_modules: bool = False, mesh=None):
    """The flax side, rebuilt from the model's spec and stored weights, against the stored torch side.

    Same report as a live run (first divergence, isolated mode and attribution from the
    stored records and float64 values; on ``mesh``, sharded as in
    :func:`flax_ln.parity.engine.compare_modules`); no torch is imported.
    """
    from flax_ln.parity.engine import compare_side, numerics

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


__getattr__ = module_getattr(
    __name__, {"ReferenceError": "ReferenceFileError"}, globals()
)  # deprecated alias, see CHANGELOG.md

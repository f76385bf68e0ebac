"""The schema of a reference file's metadata, checked before anything is built from it.

A reference file (:mod:`flax_ln.book.reference`) is a contract: its JSON metadata says
how to rebuild each flax model and which stored tensors to compare. :func:`validate`
checks it field by field against the stored tensors, so that a careless or hostile edit is a
clear :class:`~flax_ln.book.reference.ReferenceFileError` (exit code 2) naming the file and
the field, never a traceback, a comparison of nothing, or a model built with sizes the tensors
contradict:

- known format, dtype (``float32``/``float64`` only: the tolerance follows from it), forward,
  mode, builder, spec keys and tensor kinds;
- every tensor a name in the metadata points at exists, is named once in the file, with the dtype and shape its role
  needs (weights, outputs and gradients in the file's dtype, the float64 truth in float64 and
  of the expected shapes, no zero-element input or expected tensor, a leading batch axis of
  ``settings.batch``);
- every model compares at least one output and one gradient (``grad`` mode) or one tangent
  (``jvp`` mode);
- every size in a spec is a positive int no larger than the largest dimension of the
  file's weights, and the flax model the spec describes, shaped abstractly
  (``nnx.eval_shape``: nothing is allocated), has exactly as many parameter elements as
  the file's weights;
- the JSON nests at most :data:`MAX_DEPTH` levels.

Torch-free, like the rest of the reference path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

MAX_DEPTH = 64  # a file written by --save-reference nests about 12 levels deep
FILE_DTYPES = ("float32", "float64")
MODES = ("grad", "jvp")
KINDS = ("output", "loss", "input grad", "param grad", "tangent")
ENTRY_KINDS = ("tensor", "dict", "list", "tuple", "unsupported", "value")
SIDE_REQUIRED = (
    "name",
    "dtype",
    "mode",
    "inputs",
    "input_names",
    "kwargs",
    "state_dict",
    "param_names",
    "expected",
    "kinds",
    "cotangents",
    "tangents",
    "float64_zero",
)
SIDE_OPTIONAL = ("truth", "records", "calls", "frozen", "dropped_outputs")
MAX_BATCH = 1 << 20
MAX_LAYERS = 1024
MAX_UNUSED_SIZE = 1 << 24
EXTRA_STATE_ELEMENTS = 1 << 16  # RNG counters and the like that flax keeps beside torch's buffers


class SchemaError(ValueError):
    """A metadata field that breaks the schema; ``field`` names it (``models[0].spec.features``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def nesting_depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed JSON value (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_depth(data: Any) -> None:
    """Raise :class:`SchemaError` when ``data`` nests deeper than :data:`MAX_DEPTH` levels."""
    depth = nesting_depth(data)
    _require(depth <= MAX_DEPTH, "(top level)", f"nests {depth} levels deep, at most {MAX_DEPTH} allowed")


def _type_name(value: Any) -> str:
    return type(value).__name__


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise SchemaError(field, message)


def _mapping(value: Any, field: str) -> dict:
    _require(isinstance(value, dict), field, f"expected a JSON object, got {_type_name(value)}")
    return value


def _positive_int(value: Any, field: str, limit: int) -> int:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit,
        field,
        f"expected an int in [1, {limit}], got {value!r}",
    )
    return value


# ---------------------------------------------------------------------------------------
# packed trees (see reference._pack)


def _check_packed(node: Any, field: str, tensors: Mapping[str, np.ndarray], seen: dict[str, str]) -> None:
    """``node`` is a well-formed packed tree whose tensor names all exist in ``tensors``, each named once in the
    file: ``seen`` (tensor name -> the field that names it) is filled as the file is walked. ``--save-reference``
    stores every entry in a tensor of its own; two entries that name one tensor would read as one torch tensor (a
    tie), so that an entry added to a file could pass as an alias of another."""
    _require(
        isinstance(node, dict) and len(node) == 1 and next(iter(node)) in ENTRY_KINDS,
        field,
        f"expected one entry {{kind: body}} with kind among {list(ENTRY_KINDS)}, got {str(node)[:80]}",
    )
    ((kind, body),) = node.items()
    if kind == "tensor":
        _require(isinstance(body, str) and body in tensors, field, f"names the tensor {body!r}, which the file lacks")
        _require(
            body not in seen,
            field,
            f"names the tensor {body!r}, which {seen.get(body)} names too: --save-reference stores every entry in a "
            "tensor of its own (a tie included), so this entry was added to the file; write it again with "
            "--save-reference",
        )
        seen[body] = field
    elif kind == "dict":
        _require(isinstance(body, list), field, f"a dict entry holds a list of [key, value] pairs, got {body!r:.80}")
        for i, pair in enumerate(body):
            _require(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str),
                f"{field}[{i}]",
                f"expected a [key, value] pair with a string key, got {str(pair)[:80]}",
            )
            _check_packed(pair[1], f"{field}.{pair[0]}", tensors, seen)
    elif kind in ("list", "tuple"):
        _require(isinstance(body, list), field, f"a {kind} entry holds a list, got {_type_name(body)}")
        for i, item in enumerate(body):
            _check_packed(item, f"{field}[{i}]", tensors, seen)
    elif kind == "unsupported":
        _require(isinstance(body, str), field, f"an unsupported entry holds a string, got {_type_name(body)}")
    else:
        _require(
            body is None or isinstance(body, (bool, int, float, str)),
            field,
            f"a value entry holds a JSON scalar, got {_type_name(body)}",
        )


def _plain(node: dict, tensors: Mapping[str, np.ndarray]) -> Any:
    """A checked packed tree unpacked (tensors looked up, tuples as lists)."""
    ((kind, body),) = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {k: _plain(v, tensors) for k, v in body}
    if kind in ("list", "tuple"):
        return [_plain(v, tensors) for v in body]
    return body


def _tensor_dict(value: Any, field: str) -> dict[str, np.ndarray]:
    _require(isinstance(value, dict), field, f"expected a dict of tensors, got {_type_name(value)}")
    for k, v in value.items():
        _require(isinstance(v, np.ndarray), f"{field}.{k}", f"expected a tensor, got {_type_name(v)}")
    return value


def _string_list(value: Any, field: str) -> list[str]:
    _require(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        field,
        f"expected a list of strings, got {str(value)[:80]}",
    )
    return value


def _check_dtype(array: np.ndarray, dtype: str, field: str) -> None:
    _require(str(array.dtype) == dtype, field, f"expected a {dtype} tensor (the file's dtype), got {array.dtype}")


def _check_nonempty(array: np.ndarray, field: str) -> None:
    _require(array.size > 0, field, f"has shape {array.shape}: zero elements, so nothing would be compared")


# ---------------------------------------------------------------------------------------
# the torch side


def _check_side(side: dict, field: str, dtype: str, batch: int) -> dict[str, Any]:
    """Check one model's ``side`` (already well-formed packed trees, unpacked); return it."""
    for name in ("name", "dtype", "mode"):
        _require(isinstance(side[name], str), f"{field}.{name}", f"expected a string, got {side[name]!r}")
    _require(side["dtype"] == dtype, f"{field}.dtype", f"expected {dtype!r} (settings.dtype), got {side['dtype']!r}")
    mode = side["mode"]
    _require(mode in MODES, f"{field}.mode", f"expected one of {list(MODES)}, got {mode!r}")

    input_names = _string_list(side["input_names"], f"{field}.input_names")
    inputs = side["inputs"]
    _require(isinstance(inputs, list) and bool(inputs), f"{field}.inputs", "expected a non-empty list of tensors")
    _require(
        len(inputs) == len(input_names),
        f"{field}.input_names",
        f"names {len(input_names)} inputs, the file holds {len(inputs)}: give one name per input",
    )
    _require(len(set(input_names)) == len(input_names), f"{field}.input_names", f"has duplicates: {input_names}")
    for name, x in zip(input_names, inputs):
        where = f"{field}.inputs[{name}]"
        _require(isinstance(x, np.ndarray), where, f"expected a tensor, got {_type_name(x)}")
        _require(x.ndim >= 1 and x.shape[0] == batch, where, f"has shape {x.shape}, expected a batch of {batch} first")
        _check_nonempty(x, where)
        if x.dtype.kind == "f":
            _check_dtype(x, dtype, where)
    _require(isinstance(side["kwargs"], dict), f"{field}.kwargs", f"expected a dict, got {_type_name(side['kwargs'])}")

    state_dict = _tensor_dict(side["state_dict"], f"{field}.state_dict")
    for k, v in state_dict.items():
        _check_dtype(v, dtype, f"{field}.state_dict.{k}")
    param_names = _string_list(side["param_names"], f"{field}.param_names")
    for k in param_names:
        _require(k in state_dict, f"{field}.param_names", f"names {k!r}, which is not in the state dict")
    _require(bool(param_names), f"{field}.param_names", "is empty: a model without parameters cannot be checked")
    for k in _string_list(side.get("frozen", []), f"{field}.frozen"):
        _require(
            k in state_dict and k not in param_names,
            f"{field}.frozen",
            f"names {k!r}, which is not a state-dict entry outside param_names",
        )
    for k in _string_list(side["float64_zero"], f"{field}.float64_zero"):
        _require(
            k in param_names,
            f"{field}.float64_zero",
            f"names {k!r}, which is not in param_names (it lists the gradients float64 shows are zero)",
        )
    dropped = side.get("dropped_outputs", {})
    _require(
        isinstance(dropped, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in dropped.items()),
        f"{field}.dropped_outputs",
        f"expected a dict of output name -> what was dropped, got {_type_name(dropped)}",
    )

    expected = _tensor_dict(side["expected"], f"{field}.expected")
    kinds = side["kinds"]
    _require(isinstance(kinds, dict), f"{field}.kinds", f"expected a dict, got {_type_name(kinds)}")
    _require(
        set(kinds) == set(expected),
        f"{field}.kinds",
        f"names {sorted(set(kinds) ^ set(expected))[:5]} on one side only: kinds and expected name the same tensors",
    )
    for k, v in expected.items():
        where = f"{field}.expected.{k}"
        kind = kinds[k]
        _require(kind in KINDS, f"{field}.kinds.{k}", f"expected one of {list(KINDS)}, got {kind!r}")
        _check_dtype(v, dtype, where)
        _check_nonempty(v, where)
        if kind == "param grad":
            _require(k in param_names, where, f"is a parameter gradient of {k!r}, which param_names lacks")
            _require(
                v.shape == state_dict[k].shape,
                where,
                f"has shape {v.shape}, the parameter {state_dict[k].shape}",
            )
        if kind == "input grad":
            name = k.removeprefix("grad ")
            _require(name in input_names, where, f"is the gradient of an input {name!r} the file does not have")
            x = inputs[input_names.index(name)]
            _require(v.shape == x.shape, where, f"has shape {v.shape}, the input {x.shape}")
    present = set(kinds.values())
    needed = ("output", ("input grad", "param grad")) if mode == "grad" else ("output", ("tangent",))
    for need in needed:
        options = (need,) if isinstance(need, str) else need
        _require(
            any(kind in present for kind in options),
            f"{field}.expected",
            f"holds no {' or '.join(options)} in {mode} mode: every model compares at least one output and one "
            f"{'gradient' if mode == 'grad' else 'tangent'}; rewrite it with --save-reference",
        )

    cotangents = _tensor_dict(side["cotangents"], f"{field}.cotangents")
    for k, v in cotangents.items():
        _require(k in expected, f"{field}.cotangents.{k}", "is the cotangent of an output the file does not have")
        _require(
            v.shape == expected[k].shape,
            f"{field}.cotangents.{k}",
            f"has shape {v.shape}, the output {expected[k].shape}",
        )
    tangents = _tensor_dict(side["tangents"], f"{field}.tangents")
    if mode == "jvp":
        _require(bool(tangents), f"{field}.tangents", "is empty in jvp mode: forward mode needs the input tangents")

    truth = side.get("truth")
    if truth is not None:
        truth = _tensor_dict(truth, f"{field}.truth")
        for k, v in truth.items():
            where = f"{field}.truth.{k}"
            _require(k in expected, where, "is the float64 truth of a tensor the file does not compare")
            _check_dtype(v, "float64", where)
            _require(v.shape == expected[k].shape, where, f"has shape {v.shape}, the expected {expected[k].shape}")
    for name in ("records", "calls"):
        value = side.get(name)
        _require(
            value is None or isinstance(value, dict),
            f"{field}.{name}",
            f"expected a dict or null, got {_type_name(value)}",
        )
    return side


# ---------------------------------------------------------------------------------------
# the spec, against the weights


def _check_spec(spec: Any, field: str, state_dict: Mapping[str, np.ndarray]) -> None:
    """Check the builder's arguments: known keys and types, sizes that the file's weights could hold."""
    from flax_ln.models.gpt import GPTConfig

    spec = _mapping(spec, field)
    largest = max((max(v.shape, default=1) for v in state_dict.values()), default=1)
    builder = spec.get("builder")

    def keys(mapping: dict, where: str, allowed: set[str], required: set[str]) -> None:
        extra, missing = set(mapping) - allowed, required - set(mapping)
        _require(not extra, where, f"has unknown keys {sorted(extra)}; expected {sorted(allowed)}")
        _require(not missing, where, f"lacks {sorted(missing)}")

    def size(value: Any, where: str, limit: int = largest) -> None:
        _positive_int(value, where, limit)

    if builder in ("LayerNorm", "TorchLayerNorm"):
        keys(spec, field, {"builder", "features", "eps"}, {"builder", "features", "eps"})
        size(spec["features"], f"{field}.features")
        eps = spec["eps"]
        _require(
            isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0,
            f"{field}.eps",
            f"expected a finite number > 0, got {eps!r}",
        )
    elif builder in ("GPT", "Block"):
        keys(spec, field, {"builder", "config"}, {"builder", "config"})
        config = _mapping(spec["config"], f"{field}.config")
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        sizes = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"}
        keys(config, f"{field}.config", fields, sizes)
        for name in sizes:
            limit = MAX_LAYERS if name in ("n_layer", "n_head") else largest
            if builder == "Block" and name == "vocab_size":
                limit = MAX_UNUSED_SIZE  # a Block has no embedding: the size is carried, never allocated
            size(config[name], f"{field}.config.{name}", limit)
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            if name in config:
                value = config[name]
                _require(
                    isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1,
                    f"{field}.config.{name}",
                    f"expected a number in [0, 1), got {value!r}",
                )
        if "ignore_index" in config:
            value = config["ignore_index"]
            _require(
                isinstance(value, int) and not isinstance(value, bool),
                f"{field}.config.ignore_index",
                f"expected an int, got {value!r}",
            )
        if "c_proj_reinit" in config:
            _require(
                isinstance(config["c_proj_reinit"], bool),
                f"{field}.config.c_proj_reinit",
                f"expected true or false, got {config['c_proj_reinit']!r}",
            )
        block_size = config["block_size"]
        for k, v in state_dict.items():  # the causal-mask buffer, derived from block_size when converting
            if k == "attn.bias" or k.endswith(".attn.bias"):
                _require(
                    v.shape == (1, 1, block_size, block_size),
                    f"{field}.config.block_size",
                    f"is {block_size}, but the file's {k} has shape {v.shape}, not the causal mask "
                    f"(1, 1, {block_size}, {block_size}) of that block size",
                )
    elif builder == "make_model":
        keys(spec, field, {"builder", "sizes", "ffn_activation"}, {"builder", "sizes", "ffn_activation"})
        sizes_ = _mapping(spec["sizes"], f"{field}.sizes")
        names = {"src_vocab", "tgt_vocab", "N", "d_model", "d_ff", "h"}
        keys(sizes_, f"{field}.sizes", names, names)
        for name in names:
            size(sizes_[name], f"{field}.sizes.{name}", MAX_LAYERS if name in ("N", "h") else largest)
        _require(
            spec["ffn_activation"] in (None, "relu"),
            f"{field}.ffn_activation",
            f"expected null or 'relu', got {spec['ffn_activation']!r}",
        )
    else:
        raise SchemaError(
            f"{field}.builder",
            f"unknown model builder {builder!r}; expected LayerNorm, TorchLayerNorm, GPT, Block or make_model",
        )


def _check_shapes(spec: dict, field: str, side: dict, build) -> None:
    """The flax model ``spec`` describes, shaped abstractly, holds as many parameters as the file's weights."""
    import jax
    from flax import nnx

    try:
        model = nnx.eval_shape(lambda: build(spec, side["dtype"]))
    except Exception as err:  # noqa: BLE001 - whatever a builder raises on arguments it refuses is a schema error
        raise SchemaError(field, f"does not describe a model ({type(err).__name__}: {err})") from err
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    state = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))
    stored = sum(side["state_dict"][k].size for k in side["param_names"])
    buffers = sum(v.size for k, v in side["state_dict"].items() if k not in side["param_names"])
    _require(
        params == stored,
        field,
        f"describes a model of {params} parameter elements, the file's weights hold {stored}: the sizes contradict "
        "the stored tensors",
    )
    _require(
        state - params <= buffers + EXTRA_STATE_ELEMENTS,
        field,
        f"describes a model with {state - params} buffer elements, the file's buffers hold {buffers}",
    )


# ---------------------------------------------------------------------------------------
# the whole file


def validate(data: Any, tensors: Mapping[str, np.ndarray], *, forwards, build, file_format: str, version: int) -> None:
    """Check a reference file's parsed metadata ``data`` against its ``tensors``; raise :class:`SchemaError`.

    ``forwards``: the known forward names; ``build(spec, dtype)``: the flax builder, called
    only under ``nnx.eval_shape`` (nothing is allocated); ``file_format``/``version``: what
    the file must say it is.
    """
    data = _mapping(data, "(top level)")
    _require(data.get("format") == file_format, "format", f"format {data.get('format')!r}, expected {file_format!r}")
    older = isinstance(data.get("version"), int) and data["version"] < version
    _require(
        data.get("version") == version,
        "version",
        f"version {data.get('version')!r}, expected {version}"
        + (
            " (an older file: its gradients do not carry float64's word on which are zero, which a zero gradient "
            "now needs to pass; write the file again with this flax-ln)"
            if older
            else ""
        ),
    )
    check_depth(data)
    settings = _mapping(data.get("settings"), "settings")
    dtype = str(settings.get("dtype"))
    _require(
        settings.get("dtype") in FILE_DTYPES,
        "settings.dtype",
        f"expected one of {list(FILE_DTYPES)} (all --save-reference writes), got {settings.get('dtype')!r}",
    )
    batch = _positive_int(settings.get("batch"), "settings.batch", MAX_BATCH)
    models = data.get("models")
    _require(
        isinstance(models, list) and bool(models),
        "models",
        f"expected a non-empty list of models, got {str(models)[:80]}: a file that checks nothing is no reference",
    )
    seen: dict[str, str] = {}  # every tensor name -> the field that names it: each is named once
    for index, entry in enumerate(models):
        field = f"models[{index}]"
        entry = _mapping(entry, field)
        missing = {"spec", "forward", "lm_logits", "side"} - set(entry)
        _require(not missing, field, f"lacks {sorted(missing)}")
        _require(
            entry["forward"] in forwards,
            f"{field}.forward",
            f"expected one of {list(forwards)}, got {entry['forward']!r}",
        )
        stored_dtype = entry.get("stored_dtype")
        _require(
            stored_dtype is None or isinstance(stored_dtype, str),
            f"{field}.stored_dtype",
            f"expected a string or null, got {stored_dtype!r}",
        )
        packed = _mapping(entry["side"], f"{field}.side")
        names = set(packed)
        missing = set(SIDE_REQUIRED) - names
        extra = names - set(SIDE_REQUIRED) - set(SIDE_OPTIONAL)
        _require(not missing, f"{field}.side", f"lacks {sorted(missing)}")
        _require(not extra, f"{field}.side", f"has unknown fields {sorted(extra)}")
        for name, node in packed.items():
            _check_packed(node, f"{field}.side.{name}", tensors, seen)
        side = _check_side(
            {name: _plain(node, tensors) for name, node in packed.items()}, f"{field}.side", dtype, batch
        )
        lm_logits = entry["lm_logits"]
        _require(
            lm_logits is None or (isinstance(lm_logits, str) and side["kinds"].get(lm_logits) == "output"),
            f"{field}.lm_logits",
            f"expected null or the name of an output ({[k for k, v in side['kinds'].items() if v == 'output']}), "
            f"got {lm_logits!r}",
        )
        _check_spec(entry["spec"], f"{field}.spec", side["state_dict"])
        _check_shapes(entry["spec"], f"{field}.spec", side, build)

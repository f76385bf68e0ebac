"""What both sides run: a :class:`Call` (inputs, their names, kwargs, each side's forward, the loss), and the
outputs of a forward as named leaves, checked to be the same on both sides. Imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flax_ln.convert.assign import is_floating

Forward = Callable[..., Any]  # forward(module, *inputs, **kwargs) -> the outputs

SELECT_OUTPUTS = (
    "pass forward=(torch_fn, flax_fn), each called as fn(module, *inputs, **kwargs), returning the same "
    "outputs by the same names on both sides (e.g. a dict of the arrays to compare)"
)


def forward_pair(forward: Any) -> tuple[Forward | None, Forward | None]:
    """``(torch_fn, flax_fn)`` from ``forward=``: ``None`` (plain calls), one callable for both sides, or a pair
    whose ``None`` means a plain call on that side."""
    if forward is None or callable(forward):
        return forward, forward
    if isinstance(forward, (tuple, list)) and len(forward) == 2 and all(f is None or callable(f) for f in forward):
        return forward[0], forward[1]
    raise ValueError(
        f"forward must be None, one callable fn(module, *inputs, **kwargs) used on both sides, or a pair "
        f"(torch_fn, flax_fn) of such callables or None; got {forward!r}"
    )


def as_inputs(inputs: Any) -> tuple[np.ndarray, ...]:
    """One array or a sequence of them, as a tuple of NumPy arrays."""
    items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return tuple(np.asarray(x) for x in items)


def is_float(x: Any) -> bool:
    """Whether ``x`` (an array, a jax tracer, a torch tensor or a Python number) holds floating values,
    bfloat16 included."""
    if hasattr(x, "is_floating_point"):  # a torch.Tensor (NumPy cannot take a bfloat16 one)
        return bool(x.is_floating_point())
    dtype = getattr(x, "dtype", None)
    if dtype is not None and not isinstance(dtype, np.dtype) and "key" in str(dtype):  # a typed PRNG key
        return False
    return is_floating(dtype if isinstance(dtype, np.dtype) else np.asarray(x).dtype)


@dataclasses.dataclass(frozen=True)
class Call:
    """The values that travel together through a comparison: what both sides are called on and how.

    ``inputs`` are NumPy arrays in torch's layout, ``input_names`` name them in the report
    (``grad <name>``), ``kwargs`` go to both forwards, ``forward`` is ``(torch_fn, flax_fn)``
    (``None``: a plain call) and ``loss`` is ``(torch_fn, flax_fn)`` or ``None`` (the random projection).
    """

    inputs: tuple[np.ndarray, ...]
    input_names: tuple[str, ...]
    kwargs: dict[str, Any]
    forward: tuple[Forward | None, Forward | None] = (None, None)
    loss: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None

    @classmethod
    def make(
        cls,
        inputs: Any,
        *,
        input_names: Sequence[str] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        forward: Any = None,
        loss: Any = None,
        mode: str = "grad",
    ) -> Call:
        """A checked :class:`Call`: one name per input, no empty input, a valid ``forward`` and ``loss``."""
        arrays = as_inputs(inputs)
        names = tuple(f"input {i}" for i in range(len(arrays))) if input_names is None else tuple(input_names)
        if len(names) != len(arrays):
            raise ValueError(f"input_names has {len(names)} names for {len(arrays)} inputs: give one per input")
        for i, x in enumerate(arrays):
            if x.size == 0:
                raise ValueError(
                    f"inputs[{i}] has shape {x.shape}: an empty batch compares nothing (an axis of size 0); "
                    "give inputs with at least one element"
                )
        if loss is not None and (not isinstance(loss, (tuple, list)) or len(loss) != 2):
            raise ValueError("loss must be a pair (torch_fn, flax_fn), each mapping that side's outputs to a scalar")
        if loss is not None and mode == "jvp":
            raise ValueError("loss is for mode='grad'; mode='jvp' compares every output and its tangent")
        return cls(arrays, names, dict(kwargs or {}), forward_pair(forward), None if loss is None else tuple(loss))


def cast_floats(arrays: Sequence[np.ndarray], dtype: str) -> tuple[tuple[np.ndarray, ...], dict[int, str]]:
    """``arrays`` with every floating one in ``dtype`` (a comparison's parameter dtype), and which were cast:
    ``{position: "float64 -> float32"}``. Integer and boolean arrays (ids, masks) are left as they are."""
    want = np.dtype(dtype)
    cast = {i: f"{x.dtype} -> {want}" for i, x in enumerate(arrays) if is_float(x) and x.dtype != want}
    return tuple(x.astype(want) if i in cast else x for i, x in enumerate(arrays)), cast


def run_forward(forward: Forward | None, module: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``forward(module, *args, **kwargs)``, or ``module(*args, **kwargs)`` when ``forward`` is ``None``."""
    return module(*args, **kwargs) if forward is None else forward(module, *args, **kwargs)


def with_floats(args: Sequence[Any], positions: Sequence[int], floats: Sequence[Any]) -> list[Any]:
    """``args`` with the floating inputs (the ones differentiated) put back at their ``positions``."""
    merged = list(args)
    for i, x in zip(positions, floats):
        merged[i] = x
    return merged


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")  # NumPy, jax (tracers too) and torch arrays


def flatten_outputs(tree: Any, name: str | None = None) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """A forward's result as named leaves, and the leaves that are not compared.

    Names: ``output`` for one array, ``output[i]`` for a tuple's or list's items, the keys of
    a mapping (a ``transformers.ModelOutput`` too) and the fields of a dataclass (nested:
    ``key.sub``, ``key[i]``). Arrays and Python numbers (compared as 0-d arrays) are kept;
    any other leaf (``None``, a string, a cache object) is dropped: ``{name: type name}``.
    """
    if isinstance(tree, Mapping):
        items = [(str(k) if name is None else f"{name}.{k}", v) for k, v in tree.items()]
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = [
            (f.name if name is None else f"{name}.{f.name}", getattr(tree, f.name)) for f in dataclasses.fields(tree)
        ]
    elif isinstance(tree, (tuple, list)):
        base = "output" if name is None else name
        items = [(f"{base}[{i}]", v) for i, v in enumerate(tree)]
    else:
        leaf_name = "output" if name is None else name
        if _is_array(tree) or isinstance(tree, (bool, int, float, complex, np.generic)):
            return [(leaf_name, tree)], {}
        return [], {leaf_name: "None" if tree is None else type(tree).__name__}
    named: list[tuple[str, Any]] = []
    dropped: dict[str, str] = {}
    for key, value in items:
        leaves, skipped = flatten_outputs(value, key)
        named += leaves
        dropped.update(skipped)
    return named, dropped


def numbers_as_arrays(named: Sequence[tuple[str, Any]], dtype: str) -> list[tuple[str, Any]]:
    """``named`` leaves with every Python float as a 0-d NumPy array of ``dtype`` (the comparison's parameter
    dtype) and every Python complex in its complex twin, the same on both sides whatever x64 says: torch's
    ``np.array(0.5)`` would be float64 and JAX's float32 with x64 off. Other leaves are as they are."""
    complex_dtype = np.result_type(np.dtype(dtype), np.complex64)
    return [
        (k, np.asarray(v, complex_dtype if isinstance(v, complex) else dtype))
        if isinstance(v, (float, complex)) and not isinstance(v, np.generic)
        else (k, v)
        for k, v in named
    ]


def named_outputs(tree: Any, name: str | None = None) -> list[tuple[str, Any]]:
    """The compared leaves of :func:`flatten_outputs`, by name."""
    return flatten_outputs(tree, name)[0]


def describe_outputs(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """``name (shape), ...`` for an error message."""
    return ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items()) or "(no array outputs)"


def check_same_outputs(torch_shapes: Mapping[str, tuple[int, ...]], flax_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` unless both sides' forwards give the same output names with the same shapes, matched by
    name (a dict built in another order matches): the names missing on either side and the shapes that differ are
    listed."""
    torch_shapes = {k: tuple(v) for k, v in torch_shapes.items()}
    flax_shapes = {k: tuple(v) for k, v in flax_shapes.items()}
    if torch_shapes == flax_shapes:
        return
    missing = [k for k in torch_shapes if k not in flax_shapes]
    extra = [k for k in flax_shapes if k not in torch_shapes]
    lines = [f"  missing on the flax side: {', '.join(missing)}"] if missing else []
    lines += [f"  only on the flax side: {', '.join(extra)}"] if extra else []
    lines += [
        f"  {k}: torch {torch_shapes[k]}, flax {flax_shapes[k]}"
        for k in torch_shapes
        if k in flax_shapes and torch_shapes[k] != flax_shapes[k]
    ]
    raise ValueError(
        "the two sides' output names or shapes differ, so they cannot be compared:\n"
        f"  torch: {describe_outputs(torch_shapes)}\n  flax: {describe_outputs(flax_shapes)}\n"
        + "".join(line + "\n" for line in lines)
        + f"To compare some outputs, or to give them the same names, {SELECT_OUTPUTS}."
    )


def merge_dropped(torch_dropped: Mapping[str, str], flax_dropped: Mapping[str, str]) -> dict[str, str]:
    """``{name: "torch <type>, flax <type>"}`` for the output leaves either side dropped."""
    merged: dict[str, str] = {}
    for key in [*torch_dropped, *(k for k in flax_dropped if k not in torch_dropped)]:
        merged[key] = ", ".join(
            f"{label} {dropped[key]}"
            for label, dropped in (("torch", torch_dropped), ("flax", flax_dropped))
            if key in dropped
        )
    return merged

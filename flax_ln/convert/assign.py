"""What every way of loading shares: torch values as NumPy, the dtype check, and the write into a variable."""

from __future__ import annotations

import mmap
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ModuleT = TypeVar("ModuleT", bound=nnx.Module)

# Variable kinds that torch saves (parameters and running statistics): each must be covered by a rule.
SAVED_KINDS = (nnx.Param, nnx.BatchStat)


def as_numpy(value: Any) -> np.ndarray:
    """A NumPy view of a torch tensor or array-like, without importing torch unless given one."""
    if hasattr(value, "detach"):  # a torch.Tensor
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is floating, bfloat16 and the float8 kinds too (ml_dtypes types NumPy does not rank)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def dtype_problem(got: np.dtype, want: np.dtype) -> str | None:
    """Why a ``got`` value cannot replace a ``want`` variable: floats stay floating, integers stay integer."""
    if is_floating(want) and not is_floating(got):
        return (
            f"dtype {got} is not floating, but the parameter is {want}; pass floating-point weights "
            "(e.g. tensor.float()), an integer or bool tensor here is usually the wrong key"
        )
    if jnp.issubdtype(want, jnp.integer) and not jnp.issubdtype(got, jnp.integer):
        return f"dtype {got} is not an integer dtype, but the buffer is {want}; pass an integer tensor"
    return None


ALIGNMENT = 64  # bytes: a host buffer aligned like this is one JAX on the CPU can use in place
BASE_PAGES_FROM = 1 << 22  # bytes: NumPy advises transparent huge pages for an array this large (see host_buffer)


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array aligned to :data:`ALIGNMENT` bytes: filled and given to :func:`assign` with
    ``owned=True``, it becomes the variable's value without another copy (JAX on the CPU aliases it).

    One of :data:`BASE_PAGES_FROM` bytes or more is a private anonymous memory map of its own (page-aligned),
    faulted in base pages: NumPy would advise huge pages for it, and on a virtual machine whose balloon hands
    free 2 MiB blocks back to the host (free page reporting) each fresh huge page is faulted in from the host
    again. Measured on the 2-core CI machine: 1.3 GiB written in 2.9 s through huge pages, 0.45 s in base
    pages. The map is unmapped when the last array over it goes."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size >= BASE_PAGES_FROM:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(memory, dtype).reshape(shape)
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + size].view(dtype).reshape(shape)


TILE = 256  # a tile of TILE x TILE float64 elements (512 KiB) stays in a core's cache while it is copied


def copy_into(dest: np.ndarray, source: np.ndarray) -> None:
    """``dest[...] = source`` (cast as needed). A matrix read across its rows (a transposed view, as a layout
    gives) is copied tile by tile: an element-by-element strided copy misses the cache on every read, and
    took three times as long for a GPT-2 XL projection."""
    if source.ndim < 2 or source.flags.c_contiguous or source.strides[-1] == source.itemsize:
        np.copyto(dest, source, casting="unsafe")
        return
    rows, cols = source.shape[-2:]
    for i in range(0, rows, TILE):
        for j in range(0, cols, TILE):
            np.copyto(dest[..., i : i + TILE, j : j + TILE], source[..., i : i + TILE, j : j + TILE], casting="unsafe")


def owned_copy(source: np.ndarray, dtype: Any = None) -> np.ndarray:
    """An owned C-contiguous copy of ``source`` in ``dtype`` (default: its own), in a :func:`host_buffer`
    (:func:`copy_into`)."""
    out = host_buffer(source.shape, source.dtype if dtype is None else dtype)
    copy_into(out, source)
    return out


def assign(var: nnx.Variable, new: np.ndarray, *, owned: bool = False) -> None:
    """Set ``var`` to an owned copy of ``new`` in its own dtype, placed with its sharding. ``owned``: ``new`` is
    already a copy no one else holds, in that dtype (from :func:`host_buffer`): it is used as it is."""
    old = var.get_value()  # also a ShapeDtypeStruct, for a model made by nnx.eval_shape
    # An owned copy: torch's state_dict() shares memory with its parameters, and JAX
    # on the CPU may alias a NumPy buffer, so a later in-place torch update (an
    # optimizer step) would otherwise change the flax model behind its back.
    # One copy, into an aligned buffer that JAX on the CPU then uses in place (may_alias).
    # Placed with the variable's sharding: kept by a sharded model, named by an abstract
    # one from flax_ln.sharding.abstract_model(make, mesh); None is the default device.
    if not (owned and new.dtype == np.dtype(old.dtype)):
        copy = host_buffer(np.shape(new), old.dtype)
        copy_into(copy, np.asarray(new))
        new = copy
    var.set_value(placed_like(new, old))


def placed_like(values: np.ndarray, like: Any) -> jax.Array:
    """``values`` placed with ``like``'s sharding (a ``jax.Array``, or a ``ShapeDtypeStruct`` that names one; none:
    the default device), and uncommitted where ``like`` is an uncommitted array: an eager op on a committed and an
    uncommitted array is a program of its own, so localisation's op-by-op runs would compile each op again. JAX on
    the CPU may use the NumPy buffer in place (``may_alias``)."""
    sharding = None if isinstance(like, jax.Array) and not like.committed else getattr(like, "sharding", None)
    return jax.device_put(values, sharding, may_alias=True)

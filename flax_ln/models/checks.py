"""Validation of token ids, shared by the GPT, the encoder-decoder, their decoding loops and the losses.

An id indexes an embedding table (or a row of logits), so it must lie in ``[0, vocab)``.
``nnx.Embed`` looks ids up with ``jnp.take(table, ids, axis=0)`` in its default ``"fill"``
mode, and the losses use ``jnp.take_along_axis``, which behaves the same way:

- an id in ``[-vocab, 0)`` wraps around to row ``vocab + id`` (``-1`` is the last row),
  giving finite, wrong results;
- an id ``>= vocab`` or ``< -vocab`` reads a row of NaN, so the logits or the loss are NaN.

torch raises ``IndexError`` for both. :func:`check_token_ids` therefore checks, before any
compute:

- always, from static shapes and dtypes (so also while tracing under ``jax.jit``): an
  integer dtype, rank 2 ``(batch, seq_len)``, an expected batch size, ``1 <= seq_len <= max_len``;
- when the ids are concrete (eager calls, NumPy inputs): every value, raising a
  ``ValueError`` that names the argument, the bad values with their positions and the valid
  range;
- when the ids are traced (inside ``jit``, ``vmap``, ``scan``) the values are unknown, and
  they are checked only if asked (``debug_checks=True`` on the model or loss), with
  ``jax.experimental.checkify.check``. The traced function must then be functionalised,
  and the error thrown on the host::

      from jax.experimental import checkify
      model = flax_ln.GPT(config, debug_checks=True, rngs=nnx.Rngs(0))
      err, logits = checkify.checkify(jax.jit(lambda idx: model(idx)[0]))(idx)
      err.throw()  # JaxRuntimeError: GPT: idx holds an id outside [0, 50): -1 at index [0 1] ...

  Staging a ``checkify.check`` without ``checkify.checkify`` is itself an error in JAX
  ("Cannot abstractly evaluate a checkify.check which was not functionalized"), so a
  debug-checked model cannot be run under a bare ``jit`` by mistake. Without
  ``debug_checks`` traced ids are not checked, and bad ones behave as listed above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

_SHOWN = 5  # bad values listed in an error message


def _range_text(vocab: int, ignore: tuple[str, int] | None) -> str:
    text = f"[0, {vocab})"
    return text if ignore is None else f"{text} (or {ignore[0]}={ignore[1]})"


def _out_of_range(ids, vocab: int, ignore: tuple[str, int] | None):
    """Boolean mask (NumPy or JAX, as ``ids``) of the ids outside ``[0, vocab)`` that are not the ignore value."""
    bad = (ids < 0) | (ids >= vocab)
    return bad if ignore is None else bad & (ids != ignore[1])


def check_id_values(
    ids, name: str, *, owner: str, vocab: int, ignore: tuple[str, int] | None = None, debug: bool = False
) -> None:
    """Check that every id is in ``[0, vocab)`` or equals the ``ignore`` value (e.g. a loss's ignore_index).

    Concrete ``ids`` are checked on the host: a ``ValueError`` lists the first bad values
    with their positions and the count. Traced ``ids`` are checked with
    ``checkify.check`` only if ``debug`` (see the module docstring); otherwise not at all.

    Args:
      ids: integer array of any shape (a NumPy or JAX array, or a tracer).
      name: the argument's name in the caller (``idx``, ``targets``, ``src``, ...).
      owner: the public function or class the argument was given to, for the message.
      vocab: the number of valid ids.
      ignore: ``(name, value)`` of one more legal value outside the range, e.g. ``("ignore_index", -1)``.
      debug: check traced ids with ``checkify.check``.
    """
    valid = _range_text(vocab, ignore)
    if isinstance(ids, jax.core.Tracer):
        if debug:
            bad = _out_of_range(ids, vocab, ignore)
            first = jnp.unravel_index(jnp.argmax(bad), ids.shape)  # the first bad id, in row-major order
            checkify.check(
                ~jnp.any(bad),
                f"{owner}: {name} holds an id outside {valid}: {{value}} at index {{index}}",
                value=ids[first],
                index=jnp.stack(first) if first else jnp.zeros(0, jnp.int32),
            )
        return
    host = np.asarray(ids)
    bad = _out_of_range(host, vocab, ignore)
    if not bad.any():
        return
    if host.ndim == 0:
        what = f"{name}={host} is not a valid id"
    else:
        where = np.argwhere(bad)
        shown = ", ".join(f"{host[tuple(p)]} at {tuple(int(i) for i in p)}" for p in where[:_SHOWN])
        more = f" (and {len(where) - _SHOWN} more)" if len(where) > _SHOWN else ""
        what = f"{name} holds {len(where)} id(s) outside the valid range: {shown}{more}"
    raise ValueError(
        f"{owner}: {what}. Expected ids in {valid}: they index a table of {vocab} rows (torch raises "
        f"IndexError; JAX would silently wrap negative ids around and read NaN past the end). Check the "
        f"tokenizer or the data against the vocabulary size."
    )


def check_token_ids(
    ids,
    name: str,
    *,
    owner: str,
    vocab: int | None,
    max_len: int | None = None,
    limit_name: str = "max_len",
    batch: int | None = None,
    crop_hint: bool = False,
    ignore: tuple[str, int] | None = None,
    debug: bool = False,
) -> jax.Array:
    """``ids`` as a JAX array, once it is checked to be integer (batch, seq_len) ids in range (:func:`check_id_values`).

    Static checks (they also run while tracing): integer dtype, rank 2, ``batch`` rows if
    given, ``1 <= seq_len <= max_len`` if ``max_len`` is given. Then the values, unless
    ``vocab`` is None.

    Args:
      ids: token ids, a NumPy or JAX array (or anything ``np.asarray`` takes).
      name, owner, ignore, debug: as :func:`check_id_values`.
      vocab: number of valid ids; ``None`` checks shapes and dtypes only.
      max_len: longest allowed sequence.
      limit_name: what ``max_len`` is called in the caller (``block_size``, ``max_len``).
      batch: required batch size (e.g. that of the encoder memory).
      crop_hint: suggest cropping to the last ``max_len`` tokens when too long (GPT);
        otherwise suggest a larger positional table.
    """
    if not isinstance(ids, jax.Array):
        ids = np.asarray(ids)
    shape, dtype = tuple(ids.shape), ids.dtype
    want = f"({'batch' if batch is None else batch}, {'seq_len' if max_len is None else f'seq_len <= {max_len}'})"
    problem = None
    if not jnp.issubdtype(dtype, jnp.integer):
        problem = f"cast with {name}.astype(jnp.int32)"
    elif ids.ndim != 2:
        problem = f"add a batch axis with {name}[None] if it is one sequence" if ids.ndim == 1 else None
        problem = problem or f"{name} must have exactly two axes"
    elif batch is not None and shape[0] != batch:
        problem = f"{name} must have {batch} rows, one per sequence of the batch"
    elif shape[1] < 1:
        problem = f"{name} has an empty time axis; pass at least one token"
    elif max_len is not None and shape[1] > max_len:
        fix = (
            f"crop to the last {max_len} tokens ({name}[:, -{max_len}:])"
            if crop_hint
            else f"a longer sequence needs a larger {limit_name}"
        )
        problem = f"sequence length {shape[1]} exceeds {limit_name} {max_len}; {fix}"
    if problem is not None:
        raise ValueError(
            f"{owner}: {name}: expected integer token ids of shape {want}, got shape {shape} dtype {dtype}; {problem}"
        )
    if vocab is not None:
        check_id_values(ids, name, owner=owner, vocab=vocab, ignore=ignore, debug=debug)
    return jnp.asarray(ids)


def check_scalar_id(value, name: str, *, owner: str, vocab: int) -> int:
    """A single token id given as a Python or NumPy integer (not traced), checked to be in ``[0, vocab)``."""
    array = np.asarray(value) if not isinstance(value, jax.core.Tracer) else None
    if array is None or array.ndim != 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{owner}: {name} must be one integer token id in [0, {vocab}), got {value!r}")
    check_id_values(array, name, owner=owner, vocab=vocab)
    return int(array)


def config_fields(cls: type, config: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``config`` holds, read as attributes or, from a mapping, as keys:
    how a config crosses between the frameworks as plain data."""
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(config, Mapping):
        return {name: config[name] for name in names if name in config}
    return {name: getattr(config, name) for name in names if hasattr(config, name)}

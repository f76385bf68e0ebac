"""Data and FSDP parallelism with JAX's own SPMD: a ``(data, fsdp)`` mesh and partition rules.

Nothing here communicates by hand: arrays carry a ``NamedSharding`` and ``jax.jit``
(with ``in_shardings``/``out_shardings``) lets XLA insert the all-gathers and
reduce-scatters. The rules:

- the mesh spans every visible device (on every host): ``fsdp`` devices per group,
  ``data = n_devices // fsdp`` groups; the ``fsdp`` axis is the inner (fastest) one;
- every array of the train state (parameters, optimizer moments, RNG state) is split
  along its largest axis whose size the ``fsdp`` size divides (the first such axis on a
  tie) and replicated over ``data``; arrays with no such axis, and scalars, are replicated;
- a parameter whose largest axis the ``fsdp`` size does not divide (GPT-2's 50257-row token
  embedding) is stored split along a smaller axis, and the train step gathers it whole where it
  is used (:func:`gather_uneven_parameters`);
- a batch is split along its first (batch) axis over ``data`` and ``fsdp`` together (every device
  holds ``batch / n_devices`` examples), as FSDP does: replicating it over ``fsdp`` instead would
  give each device the activations of ``fsdp`` times as many examples. The global batch must
  therefore be a multiple of the device count. (The parity engine splits its inputs over ``data``
  only: ``batch_sharding(mesh, axes=(DATA,))``.)

With ``fsdp=1`` this is plain data parallelism; with ``data=1`` plain FSDP. Typical use::

    mesh = make_mesh(fsdp=2)
    graphdef, abstract = jax.eval_shape(lambda: init_train_state(make_model(), tx))
    shardings = state_shardings(abstract, mesh)
    state = jax.jit(lambda: init_train_state(make_model(), tx)[1], out_shardings=shardings)()
    step = make_train_step(loss_fn, tx, state_sharding=shardings, batch_sharding=batch_sharding(mesh))
    state, loss = step(graphdef, state, shard_batch(batch, batch_sharding(mesh)))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, FSDP = "data", "fsdp"
ModuleT = TypeVar("ModuleT", bound=nnx.Module)


def initialize_distributed(**kwargs) -> None:
    """``jax.distributed.initialize(**kwargs)``: join the other hosts (TPU pod slices detect their peers).

    Call it before anything else touches JAX; afterwards ``jax.devices()`` lists every
    host's devices and :func:`make_mesh` spans them all.
    """
    jax.distributed.initialize(**kwargs)


def make_mesh(fsdp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp)`` mesh over ``devices`` (default: every visible device), ``data = len(devices) // fsdp``.

    Both axes are ``AxisType.Auto``: XLA's sharding propagation places the
    intermediates, the shardings given to ``jax.jit`` fix inputs and outputs.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(fsdp, int) or fsdp < 1 or len(devices) % fsdp:
        raise ValueError(
            f"--fsdp: expected a positive divisor of the device count {len(devices)}, got {fsdp!r}; "
            f"the mesh is (data, fsdp) = ({len(devices)} // fsdp, fsdp)"
        )
    return jax.make_mesh((len(devices) // fsdp, fsdp), (DATA, FSDP), axis_types=(AxisType.Auto,) * 2, devices=devices)


def fsdp_spec(shape: Sequence[int], fsdp_size: int) -> P:
    """The ``PartitionSpec`` of one state array: its largest axis divisible by ``fsdp_size`` over ``fsdp``.

    The first such axis wins a tie; replicated (``P()``) when ``fsdp_size == 1`` or no axis divides.
    """
    divisible = [i for i, n in enumerate(shape) if fsdp_size > 1 and n % fsdp_size == 0]
    if not divisible:
        return P()
    axis = max(divisible, key=lambda i: (shape[i], -i))
    return P(*[FSDP if i == axis else None for i in range(len(shape))])


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` per array of ``abstract_state`` (arrays or ``ShapeDtypeStruct``), by :func:`fsdp_spec`."""
    size = mesh.shape[FSDP]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, size)), abstract_state)


def abstract_model(make: Callable[[], ModuleT], mesh: Mesh | None = None) -> ModuleT:
    """``make()`` with abstract parameters, to be filled by a loader; nothing is randomly initialised.

    Every ``nnx.Param`` holds a ``jax.ShapeDtypeStruct`` (from ``nnx.eval_shape``) that
    carries the ``NamedSharding`` training would give it (:func:`state_shardings`) when
    ``mesh`` is given, and no sharding (the default device) otherwise. The rest of the
    state (dropout RNG keys and counts) is computed for real, placed by the same rules:
    ``make`` runs once under ``jax.jit``, whose dead-code elimination drops the parameter
    initialisers, so no parameter is ever materialised. Loaders such as
    :func:`flax_ln.load_torch_state_dict` and :func:`flax_ln.load_hf_gpt2` then create
    each parameter directly with the sharding its abstract value names.

    Args:
      make: builds the module, e.g. ``lambda: GPT(config, rngs=nnx.Rngs(0))``.
      mesh: a ``(data, fsdp)`` mesh from :func:`make_mesh`, or ``None``.
    """
    graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)  # type: ignore[misc]  # split's result is typed as a variadic tuple
    rest_shardings = None if mesh is None else state_shardings(rest, mesh)
    rest = jax.jit(
        lambda: nnx.split(make(), nnx.Param, ...)[2],  # type: ignore[misc]  # as above
        out_shardings=rest_shardings,
    )()
    if mesh is not None:
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, state_shardings(params, mesh)
        )
    return nnx.merge(graphdef, params, rest)


def gather_uneven_parameters(params: Any, shardings: Any) -> Any:
    """``params`` with each array whose largest axis the ``fsdp`` size does not divide constrained to be whole.

    :func:`fsdp_spec` stores such an array split along a smaller axis: for a token embedding
    ``(vocab, d_model)`` with an odd vocabulary, ``d_model``, the axis the output head contracts
    over. Left to XLA's sharding propagation, a contraction over an ``fsdp``-split axis against
    activations whose batch is split over ``fsdp`` too is resolved by gathering the activations of
    the whole batch onto every device, not the weight: the logits of every example on every chip.
    Gathering the weight instead (one all-gather forward, a reduce-scatter of its gradient) keeps
    each device's activations to its own share of the batch. Every other array is returned as it
    is: XLA gathers those per use already (inside a layer ``scan``, one layer at a time).

    Args:
      params: the parameters inside the jitted step (traced arrays).
      shardings: their shardings, a pytree like ``params`` (:func:`state_shardings`).
    """

    def constrain(x, sharding):
        fsdp = sharding.mesh.shape.get(FSDP, 1) if isinstance(sharding, NamedSharding) else 1
        if fsdp == 1 or not np.ndim(x) or max(np.shape(x)) % fsdp == 0:
            return x
        return jax.lax.with_sharding_constraint(x, replicated(sharding.mesh))

    return jax.tree.map(constrain, params, shardings)


def batch_sharding(mesh: Mesh, axes: Sequence[str] = (DATA, FSDP)) -> NamedSharding:
    """Batch arrays split along axis 0 over the mesh ``axes``: by default ``data`` and ``fsdp``, every device.

    ``axes=(DATA,)`` splits over ``data`` only and replicates over ``fsdp`` (each of a group's
    ``fsdp`` devices then holds the group's whole share of the batch).
    """
    axes = tuple(axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown:
        raise ValueError(f"batch_sharding: axes must be a non-empty subset of {mesh.axis_names}, got {axes}")
    return NamedSharding(mesh, P(axes))


def batch_split(sharding: NamedSharding) -> int:
    """How many ways ``sharding`` (from :func:`batch_sharding`) splits the batch axis: its axes' sizes multiplied."""
    first = sharding.spec[0] if len(sharding.spec) else None
    names = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return int(np.prod([sharding.mesh.shape[a] for a in names], dtype=int))


def batch_shardings(batch: Any, mesh: Mesh, axes: Sequence[str] = (DATA, FSDP)) -> Any:
    """A sharding per array of ``batch`` (arrays or ``ShapeDtypeStruct``): :func:`batch_sharding` for every array
    with a batch axis, replicated for scalars (a token count)."""
    split, whole = batch_sharding(mesh, axes), replicated(mesh)
    return jax.tree.map(lambda x: split if np.ndim(x) else whole, batch)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def shard_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Global NumPy batch arrays -> global ``jax.Array``s with ``sharding``.

    Every process passes the same whole (global) batch and each one places only the
    slices its own devices hold (``jax.make_array_from_callback``), so this works
    unchanged on one host and on many. The batch axis must divide evenly over the
    sharding's axes (:func:`batch_split`: every device with the default :func:`batch_sharding`).
    """
    n_split = batch_split(sharding)

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % n_split:
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by the {n_split} ways the batch is split "
                f"(the mesh axes {sharding.spec[0]}); pick a --batch-size that is a multiple of {n_split}"
            )
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, batch)

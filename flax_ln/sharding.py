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

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, FSDP = "data", "fsdp"
ModuleT = TypeVar("ModuleT", bound=nnx.Module)


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
) -> None:
    """Join the other processes of a multi-host run (``jax.distributed.initialize``), gloo collectives on CPU.

    Call it before anything else touches JAX; afterwards ``jax.devices()`` lists every
    process's devices and :func:`make_mesh` spans them all. With no address, JAX detects
    the cluster itself (Cloud TPU pod slices, SLURM, ...); otherwise give all three.
    The CPU backend's cross-process collectives are set to gloo, so several processes on
    one machine (or several CPU hosts) rehearse a pod slice.

    A process that has not joined within ``timeout_s`` (the coordinator unreachable, a peer
    missing) prints one line saying so to stderr and exits with status 1; the same bound is
    the heartbeat timeout after which JAX ends every process of a run whose peer died.

    Args:
      coordinator: ``HOST:PORT`` of process 0, which serves the coordinator there.
      num_processes: how many processes the run has.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      timeout_s: seconds to wait for every process to join (and for a silent peer).

    Raises:
      ValueError: some but not all of the three address arguments given, or a bad value.
    """
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    missing = [name for name, value in given.items() if value is None]
    if 0 < len(missing) < 3:
        raise ValueError(
            f"initialize_distributed: give coordinator, num_processes and process_id together; missing {missing}"
        )
    if not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(f"initialize_distributed: timeout_s must be a positive int of seconds, got {timeout_s!r}")
    if not missing:
        host, _, port = str(coordinator).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"initialize_distributed: coordinator must be HOST:PORT, got {coordinator!r}")
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"initialize_distributed: num_processes must be >= 1, got {num_processes!r}")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"initialize_distributed: process_id must be in [0, {num_processes}), got {process_id!r}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    where = f"the coordinator {coordinator}" if coordinator else "the cluster JAX detects"
    who = "" if process_id is None else f"process {process_id} of {num_processes}: "

    def give_up():  # JAX itself would abort with a C++ stack trace, and later
        print(
            f"error: {who}could not join the distributed run through {where} within {timeout_s} s "
            "(--distributed-timeout): the coordinator is unreachable, or not every process started",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=2 * timeout_s,  # a backstop: the watchdog above answers first
            heartbeat_timeout_seconds=timeout_s,
            shutdown_timeout_seconds=timeout_s,
        )
    finally:
        watchdog.cancel()


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


def process_rows(sharding: NamedSharding, batch_size: int) -> np.ndarray:
    """The rows of a global batch of ``batch_size`` examples that this process's devices hold, ascending.

    With one process every row; with several, each process reads just these rows of every
    global batch and :func:`shard_process_batch` assembles the global arrays. ``batch_size``
    must divide evenly over the sharding's batch axes (:func:`batch_split`).
    """
    n_split = batch_split(sharding)
    if batch_size % n_split:
        raise ValueError(
            f"batch size {batch_size} is not divisible by the {n_split} ways the batch is split "
            f"(the mesh axes {sharding.spec[0]}); pick a --batch-size that is a multiple of {n_split}"
        )
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(batch_size)[index[0] if index else slice(None)])
    return np.array(sorted(rows), dtype=np.int64)


def shard_process_batch(local_batch: Any, shardings: Any, batch_size: int) -> Any:
    """This process's rows of a global batch (:func:`process_rows`) -> global ``jax.Array`` s (one call per process).

    ``shardings`` is a tree like the batch (:func:`batch_shardings`): an array with a batch axis
    holds this process's rows of it, a scalar (a token count) the global value, the same on
    every process. Built with ``jax.make_array_from_process_local_data``; on one process this
    is ``jax.device_put``.
    """

    def put(x, sharding):
        x = np.asarray(x)
        shape = (batch_size, *x.shape[1:]) if x.ndim else ()
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(put, local_batch, shardings)


def local_copy(tree: Any, mesh: Mesh) -> Any:
    """Every array of ``tree`` (global arrays on ``mesh``) whole on this process's first device of ``mesh``.

    A collective: every process calls it. For work one process does alone (sampling, evaluation)
    on a run's state, whose arrays span the devices of every process.
    """
    whole = jax.jit(lambda t: t, out_shardings=replicated(mesh))(tree)
    return jax.tree.map(lambda x: x.addressable_data(0), whole)

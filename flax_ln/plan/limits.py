"""Hard limits checked before the compiler's child process starts: integer sizes, topology bounds, the model's own
length limits, and a lower bound on the bytes a step needs (:func:`too_big`). Imports no JAX.

The topology bounds were probed with libtpu 0.0.42.1 (``get_topology_desc`` and a one-op compile, in a child
process with a raised stack limit): v5e's compiler aborts the process (``Check failed:
chip_bounds().x <= 16``) for an axis past 16 chips, after building the topology, which for ``v5e:1000x1000``
took 80 s and 4 GB. v4, v5p and v6e compiled with 256 chips along one axis; for them the planner's bound is the
largest slice Cloud TPU offers (:data:`TOPOLOGY_LIMITS`), so that an absurd topology is refused at once.
"""

from __future__ import annotations

import math

INT32_MAX = 2**31 - 1  # token ids and positions are int32 on the device, and XLA indexes with int32 on TPU


# chip kind: (axes in its topology name, longest axis libtpu compiles for, most chips in one Cloud TPU slice)
TOPOLOGY_LIMITS: dict[str, tuple[int, int | None, int]] = {
    "v4": (3, None, 4096),  # a v4 pod: 16x16x16
    "v5e": (2, 16, 256),  # libtpu: chip_bounds x <= 16 and y <= 16
    "v5p": (3, None, 8960),  # a v5p pod: 16x20x28
    "v6e": (2, None, 256),  # a v6e pod: 16x16
}
# the chips one host holds along each axis (libtpu's default chips_per_host_bounds); a smaller topology is one host
HOST_BOUNDS = (2, 2, 1)


def topology_shape(topology: str) -> tuple[int, ...]:
    """The axes of ``CHIP:SHAPE`` (``v5e:2x4`` -> ``(2, 4)``); the topology must be checked first."""
    return tuple(int(n) for n in topology.partition(":")[2].split("x"))


def host_bounds(topology: str) -> tuple[int, int, int] | None:
    """``chips_per_host_bounds`` for a topology smaller than one host along some axis (``v5e:1x1`` -> ``(1, 1, 1)``,
    ``v5e:1x2`` -> ``(1, 2, 1)``), ``None`` where libtpu's default (2x2x1) applies."""
    shape = topology_shape(topology) + (1,) * 3
    bounds = tuple(1 if dim == 1 else default for dim, default in zip(shape[:3], HOST_BOUNDS))
    return None if bounds == HOST_BOUNDS else (bounds[0], bounds[1], bounds[2])


def topology_problem(topology: str) -> str | None:
    """What is wrong with a ``CHIP:SHAPE`` of a known chip (its axis count, an axis or the chip count past the
    limit), or ``None``."""
    chip = topology.partition(":")[0]
    axes, max_axis, max_chips = TOPOLOGY_LIMITS[chip]
    shape = topology_shape(topology)
    example = "x".join(["2"] * axes)
    if len(shape) != axes or min(shape) < 1:
        return f"--topology: a {chip} topology has {axes} axes of at least 1 chip ({chip}:{example}), got {topology!r}"
    if max_axis is not None and max(shape) > max_axis:
        return (
            f"--topology: libtpu compiles {chip} topologies of at most {max_axis} chips along each axis "
            f"(a {chip} pod is {max_axis}x{max_axis}), got {topology!r}; give a smaller shape, e.g. {chip}:16x16"
        )
    if math.prod(shape) > max_chips:
        return (
            f"--topology: the largest {chip} slice has {max_chips} chips, got {topology!r} "
            f"({math.prod(shape)} chips); give a smaller shape"
        )
    return None


def int_problem(name: str, value) -> str | None:
    """``--batch``, ``--seq-len``, ``--fsdp``, ``--vocab-size``: a positive integer that int32 holds, else why not."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return f"{name}: expected a positive integer, got {value!r}"
    if value > INT32_MAX:
        return (
            f"{name}: expected at most {INT32_MAX} (2**31 - 1: sizes and token ids are int32 on a TPU), got {value}; "
            "give a smaller value"
        )
    return None


def lower_bound_bytes(request: dict, batch: int) -> int:
    """Bytes the step needs on all chips together, at least: the float32 parameters and (training) Adam's two
    moments, the int32 batch, and the activations the backward pass keeps (each layer's input, ``L x B x T x d``
    in the compute dtype, kept with remat too); for a decode step the parameters and the KV cache. Biases,
    norms, temporaries and padding are left out, so the compiled total is always larger."""
    itemsize = 2 if request["dtype"] == "bfloat16" else 4
    t = request["seq_len"]
    if request["kind"] in ("gpt", "decode"):
        c = request["config"]
        d, layers = c["n_embd"], c["n_layer"]
        params = 2 * c["vocab_size"] * d + c["block_size"] * d + layers * 12 * d * d
        if request["kind"] == "decode":
            return 4 * params + 2 * layers * batch * t * d * itemsize
        return 12 * params + 8 * batch * t + layers * batch * t * d * itemsize
    s = request["setup"]
    d, ff, layers = s["d_model"], s["d_ff"], s["layers"]
    src, tgt = s.get("src_len", t), s.get("tgt_len", t + 1)
    params = (s["src_vocab"] + 2 * s["tgt_vocab"]) * d + layers * (12 * d * d + 4 * d * ff)
    return 12 * params + 4 * batch * (src + tgt) + layers * batch * (src + tgt - 1) * d * itemsize


def too_big(request: dict, capacity_per_chip: int, batch_per_chip: int) -> str | None:
    """The "does not fit" message when :func:`lower_bound_bytes` at the request's (first) batch already exceeds
    the HBM of all its chips together, else ``None``: such a step is not compiled. ``batch_per_chip``: the
    default batch's sequences per chip (training; a decode step's default is one per chip)."""
    chips = request.get("devices") or math.prod(topology_shape(request["topology"]))
    decode = request["kind"] == "decode"
    if request["search"] == "batch":  # the search's first compile: one sequence (decode) or one per chip
        batch = 1 if decode else chips
    else:
        batch = request["batch"] or (chips if decode else batch_per_chip * chips)
    need = lower_bound_bytes(request, batch)
    have = chips * capacity_per_chip
    if need <= have:
        return None
    return (
        f"does not fit, without compiling: at batch {batch} the parameters, optimizer state, batch and kept "
        f"activations alone need at least {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of "
        f"HBM of all {chips} chips together; give a smaller --batch or --seq-len, or a larger --topology"
    )

"""Compiling for TPU: libtpu, the child process that compiles, and the compile of one traced step.

The compile runs in a child process (``python -m flax_ln.plan``) whose stack limit is
raised: libtpu's compiler threads take their stack size from the process's limit and
overflow the usual 8 MiB on real models (a SIGSEGV). The child runs JAX with
``JAX_PLATFORMS=cpu`` and ``TPU_SKIP_MDS_QUERY=1``: it never opens a real TPU and never
waits on the TPU metadata server.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from flax_ln.plan.hardware import CHIPS, MEGACORE
from flax_ln.plan.limits import host_bounds, too_big, topology_shape
from flax_ln.plan.request import BATCH_PER_CHIP, DEFAULT_TIMEOUT, EXIT_DOES_NOT_FIT, EXIT_USAGE, PlanError, failed

INSTALL = 'pip install "jax[tpu]==JAX_VERSION"'  # JAX_VERSION: the installed jax's version (filled in at use)


def libtpu_missing() -> str | None:
    """``None`` when libtpu is installed, else the message saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return None
    try:
        from importlib.metadata import version

        jax_version = version("jax")
    except Exception:  # noqa: BLE001 - jax's metadata missing: still say what to install
        jax_version = "<your jax version>"
    return (
        "libtpu is not installed: it compiles for TPU topologies on any machine. Install it at your jax's version: "
        + INSTALL.replace("JAX_VERSION", jax_version)
    )


# ----------------------------------------------------------------------------- the parent: run the child


def raised_stack() -> None:
    """``preexec_fn`` of the child: the stack limit raised as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))


def child_env() -> dict:
    """The child's environment: JAX on the CPU only (no real TPU opened), no TPU metadata lookup."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def run(request: dict, *, timeout: float | None = DEFAULT_TIMEOUT) -> dict:
    """Make the plan of ``request`` (from :func:`make_request`) in a child process; returns the result dict.

    The result has the pinned JSON keys of ``flax-ln plan``, and ``"exit_code"`` and
    ``"error"`` (``None`` when the plan was made; a message otherwise). ``timeout``: seconds
    the child may take (``None``: no limit); past it the child is killed and the plan fails with exit code 2.
    """
    return run_many([request], timeout=timeout)[0]


def child_failure(returncode: int, stderr: str) -> str:
    """The message for a child that ended without its results: a crash of libtpu's compiler (a signal), which a
    second run has compiled, or an error of the planner itself, which a second run repeats."""
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    if returncode == -signal.SIGSEGV:
        why = (
            "libtpu's compiler crashed (SIGSEGV in a compiler thread); it does so now and then on large steps "
            "and compiled the same plan when run again: run the same command again"
        )
    elif returncode == -signal.SIGKILL:
        why = "the TPU compiler process was killed (SIGKILL: often this machine running out of memory)"
    elif returncode < 0:
        why = f"the TPU compiler process was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    else:
        why = (
            f"the TPU compiler process failed (exit status {returncode}): an error of the planner, not of your "
            "arguments; report it with these messages"
        )
    return f"{why}; its last messages:\n{tail}"


def run_many(requests: list[dict], *, timeout: float | None = DEFAULT_TIMEOUT) -> list[dict]:
    """:func:`run` for several requests in one child process (JAX and libtpu start once); results in order.

    A request whose parameters, optimizer state, batch and kept activations alone exceed the HBM of all its chips
    (:func:`flax_ln.plan.limits.too_big`) is answered "does not fit" (exit code 1) without compiling.
    """
    missing = libtpu_missing()
    if missing:
        return [failed(request, missing, EXIT_USAGE) for request in requests]
    answers: dict[int, dict] = {}
    for i, request in enumerate(requests):
        big = too_big(request, CHIPS[request["topology"].partition(":")[0]].hbm_bytes, BATCH_PER_CHIP)
        if big:
            chips = request.get("devices") or math.prod(topology_shape(request["topology"]))
            answers[i] = failed(request, big, EXIT_DOES_NOT_FIT, chips=chips)
    todo = [request for i, request in enumerate(requests) if i not in answers]
    results = iter(_run_child(todo, timeout) if todo else [])
    return [answers[i] if i in answers else next(results) for i in range(len(requests))]


def _run_child(requests: list[dict], timeout: float | None) -> list[dict]:
    """The child process's results for ``requests``, or each request failed with the reason."""
    with tempfile.TemporaryDirectory(prefix="flax-ln-plan-") as tmp:
        request_file, result_file = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(request_file, "w") as f:
            json.dump(requests, f)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "flax_ln.plan", request_file, result_file],
                env=child_env(),
                preexec_fn=raised_stack,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:  # subprocess.run has killed the child
            message = (
                f"--timeout: the TPU compile took longer than {timeout:g} s and was stopped; give a larger "
                f"--timeout (e.g. --timeout {2 * (timeout or 0):g}) if the step is that large"
            )
            return [failed(r, message, EXIT_USAGE) for r in requests]
        if proc.returncode == 0 and os.path.exists(result_file):
            with open(result_file) as f:
                return json.load(f)
    return [failed(r, child_failure(proc.returncode, proc.stderr), EXIT_USAGE) for r in requests]


# ----------------------------------------------------------------------------- the child: compile


class Compiled(NamedTuple):
    """One compile's figures."""

    memory: dict
    seconds: float
    oom: bool


def find_not_lowerable(jaxpr) -> str | None:
    """The first op of ``jaxpr`` (and its sub-jaxprs) that a TPU cannot run as asked: float64 values or a host
    callback; ``None`` if there is none. The message names the op and the code that created it."""
    callbacks = {"pure_callback", "io_callback", "debug_callback", "callback"}

    def where(eqn) -> str:
        frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or []
        library = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/contextlib.py", "/functools.py")
        frame = next((fr for fr in frames if not any(part in fr.file_name for part in library)), None)
        stack = str(getattr(eqn.source_info, "name_stack", "") or "")
        at = f"{frame.file_name}:{frame.line_num} ({frame.function_name})" if frame else "an unknown place"
        return at + (f", inside {stack}" if stack else "")

    def walk(jx) -> str | None:
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name in callbacks:
                return (
                    f"a host callback ({name}) at {where(eqn)}: the compiled TPU step cannot call back into "
                    "Python on the host; remove it (jax.debug.print/callback) from the step"
                )
            for var in eqn.outvars:
                dtype = getattr(getattr(var, "aval", None), "dtype", None)
                if dtype is not None and str(dtype) in ("float64", "complex128"):
                    return (
                        f"{name} produces {dtype} at {where(eqn)}: TPUs have no float64 arithmetic; "
                        "run with jax_enable_x64 off or cast to float32"
                    )
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        found = walk(inner)
                        if found:
                            return found
        return None

    return walk(getattr(jaxpr, "jaxpr", jaxpr))


_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory|exceeds? .*memory|Exceeded hbm capacity")
_USED = re.compile(r"Used ([0-9.]+)([KMGT]?)i?B? of ([0-9.]+)([KMGT]?)i?B? hbm")


def _compiler_bytes(message: str) -> int | None:
    """The compiler's own figure for the memory it needed, from its out-of-memory message (``Used 20.1G of ...``)."""
    found = _USED.search(message)
    if not found:
        return None
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return int(float(found.group(1)) * scale[found.group(2)])


def compile_traced(traced) -> Compiled:
    """Lower and compile a ``jax.jit(...).trace(...)`` for its TPU devices; the memory per chip, or the compiler's
    out-of-memory figure. Raises :class:`PlanError` for what cannot lower for TPU."""
    bad = find_not_lowerable(traced.jaxpr)
    if bad:
        raise PlanError(f"cannot compile for TPU: {bad}")
    start = time.perf_counter()
    try:
        compiled = traced.lower().compile()
    except Exception as e:  # noqa: BLE001 - XLA raises its runtime error type; it is classified by its message
        message = str(e)
        if _OOM.search(message):
            total = _compiler_bytes(message)
            return Compiled(
                {"total_bytes": total, "compiler_message": message[:2000]}, time.perf_counter() - start, True
            )
        custom = re.search(r"[Cc]ustom (?:emitter|call target|call) (?:for )?['\"]?([\w.:-]+)", message)
        if custom or "NotImplemented" in type(e).__name__ or "translation rule" in message:
            what = f"the custom call {custom.group(1)!r} has no TPU implementation" if custom else message[:800]
            location = re.search(r"Suspected Python Code Location:\s*\n\s*(\S.*)", message)
            raise PlanError(
                f"cannot compile for TPU: {what}" + (f" (at {location.group(1).strip()})" if location else "")
            ) from None
        raise PlanError(f"the TPU compiler refused the step: {type(e).__name__}: {message[:2000]}") from None
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }
    memory["total_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"] - memory["alias_bytes"]
    )
    return Compiled(memory, seconds, False)


def topology_devices(topology: str):
    """The abstract devices of a libtpu topology (``v5e:2x4``); :class:`PlanError` naming it when libtpu refuses."""
    from jax.experimental import topologies

    try:
        # v4 and v5p chips have two TensorCores that JAX drives as one device ("megacore"), as on a TPU VM
        options: dict = {"chip_config_name": "megacore"} if topology.partition(":")[0] in MEGACORE else {}
        bounds = host_bounds(topology)  # a topology smaller than one host (v5e:1x1) is one host of its size
        if bounds:
            options["chips_per_host_bounds"] = bounds
        return topologies.get_topology_desc(topology_name=topology, platform="tpu", **options).devices
    except Exception as e:  # noqa: BLE001 - libtpu reports an unknown topology with a runtime error
        raise PlanError(
            f"--topology {topology!r}: libtpu does not know this topology ({str(e).splitlines()[0][:300]}); "
            "give CHIP:SHAPE as Cloud TPU names it, e.g. v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4"
        ) from None

"""The JAX internals that float32 lifting (:mod:`flax_ln.parity.islands.jax`) reaches, all in one place, each guarded.

Lifting answers float32 with float64 while the flax side is traced, which no public JAX API offers; it uses:

* ``jax._src.dtypes.check_and_canonicalize_user_dtype(dtype, fun_name)``: the one function that canonicalises
  every dtype a caller names (patched: the lifting itself);
* ``jax._src.lax.control_flow.loops._promote_weak_typed_input(in_val, in_aval, out_aval)``: a loop carry's
  promotion (patched: a float32 carry whose body returns float64);
* ``jax._src.interpreters.partial_eval.DynamicJaxprTrace.new_const``/``pure``/``lift``: a concrete value
  entering a trace (patched: to name captured float32 constants);
* ``.bind`` of lax primitives that demand one dtype (an instance attribute shadows the class's bind: a
  float32 operand meeting a lifted float64 one is promoted), and of ``bitcast_convert_type`` and
  ``reduce_precision`` (a bit-level view keeps float32's width; rounding to float32's precision is lifted);
* ``jax.make_user_context`` (a token in every JAX cache key), ``jax._src.core.trace_state_clean``,
  ``jax._src.dtypes.is_weakly_typed``, ``jax.extend.source_info_util.register_exclusion``.

Internals move between JAX releases. Each is looked up here, and the whole signature of each patched one checked
(:func:`signature_problem`), when this module is imported. The wrappers take and forward every parameter JAX passes
beyond the ones they read (jax 0.12's canonicaliser gained a keyword-only ``allow_non_jax_dtypes``): a later
parameter with a default is forwarded (one that no tested release has is named in :data:`FORWARDED`), and one
without a default, a new required input, marks the internal changed. :data:`MISSING` names what this JAX lacks or
has changed, and :func:`unsupported` gives the reason lifting cannot run
(``"jax 0.11: lifting not supported"``) or ``None``. A JAX whose internals are all there but behave differently
is found by :func:`probe` (a small lifted trace whose result must be float64), which the first lifting context
runs once. Where lifting cannot run, ``islands="lift"`` runs the flax side as written and lists what it could
not lift (:func:`flax_ln.parity.islands.jax.lift_float32`); it never raises.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# The JAX releases lifting is tested on (docs/tolerances.md); outside them it runs when every internal is
# found and the probe passes, and falls back otherwise.
TESTED = "0.8.2, 0.10.2 and 0.12.1"

MISSING: list[str] = []  # the internals this JAX lacks, or whose signature differs: lifting is not supported


def signature_problem(
    found: Callable[..., Any], parameters: tuple[str, ...], known: tuple[str, ...] = ()
) -> tuple[str | None, list[str]]:
    """Whether a wrapper written for ``found``'s leading ``parameters`` can stand in for it, checked on the whole
    signature: ``(problem, forwarded)``. ``problem`` is ``None`` when the leading parameters are ``parameters``
    (positional, in that order) and every later one is ``known`` (the tested releases have it), has a default, or is
    ``*args``/``**kwargs``: the wrapper forwards those as JAX passes them, so an old call keeps its meaning. An
    unknown later parameter without a default is a new required input whose meaning lifting does not know: the
    problem names it, and lifting falls back. ``forwarded`` lists the unknown later parameters (with defaults)."""
    try:
        signature = tuple(inspect.signature(found).parameters.values())
    except (TypeError, ValueError):
        return f"signature unreadable, expected {parameters}", []
    names = tuple(p.name for p in signature)
    leading = signature[: len(parameters)]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if tuple(p.name for p in leading) != parameters or any(p.kind not in positional for p in leading):
        return f"signature {names}, expected {parameters}", []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    later = [p for p in signature[len(parameters) :] if p.name not in known and p.kind not in variadic]
    required = [p for p in later if p.default is p.empty]
    if required:
        words = ", ".join(f"{p.name} ({p.kind.description})" for p in required)
        return f"signature {names}, expected {parameters}: a new parameter without a default: {words}", []
    return None, [p.name for p in later]


FORWARDED: list[str] = []  # parameters of a patched internal that no tested release has, forwarded as JAX passes them


def _find(
    path: str, getter: Callable[[], Any], parameters: tuple[str, ...] | None = None, known: tuple[str, ...] = ()
) -> Any:
    """``getter()`` when it gives an object (whose whole signature a wrapper for ``parameters`` can stand in for,
    when given: :func:`signature_problem`), else ``None`` with ``path`` listed in :data:`MISSING`."""
    try:
        found = getter()
    except Exception:  # noqa: BLE001 - a moved internal raises ImportError, AttributeError or worse: all mean missing
        found = None
    if found is not None and parameters is not None:
        problem, forwarded = signature_problem(found, parameters, known)
        if problem is not None:
            MISSING.append(f"{path} ({problem})")
            return None
        FORWARDED.extend(f"{path}: {name}" for name in forwarded)
    if found is None:
        MISSING.append(path)
    return found


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


_dtypes = _find("jax._src.dtypes", lambda: _module("jax._src.dtypes"))
_loops = _find("jax._src.lax.control_flow.loops", lambda: _module("jax._src.lax.control_flow.loops"))
_pe = _find("jax._src.interpreters.partial_eval", lambda: _module("jax._src.interpreters.partial_eval"))
_core = _find("jax._src.core", lambda: _module("jax._src.core"))
_prims = _find("jax.extend.core.primitives", lambda: _module("jax.extend.core.primitives"))

ORIGINAL_CANONICALIZE = _find(
    "jax._src.dtypes.check_and_canonicalize_user_dtype",
    lambda: _dtypes.check_and_canonicalize_user_dtype,
    ("dtype", "fun_name"),
    known=("allow_non_jax_dtypes",),  # keyword-only since jax 0.12 (a ShapeDtypeStruct's dtype is checked with it)
)
ORIGINAL_CARRY_PROMOTION = _find(
    "jax._src.lax.control_flow.loops._promote_weak_typed_input",
    lambda: _loops._promote_weak_typed_input,
    ("in_val", "in_aval", "out_aval"),
)
CONST_NAMES = ("new_const", "pure", "lift")  # a concrete value entering a trace: a captured constant
_TRACE = _find("jax._src.interpreters.partial_eval.DynamicJaxprTrace", lambda: _pe.DynamicJaxprTrace)
ORIGINAL_CONSTS: dict[str, Any] = {}
for _name in CONST_NAMES:
    _const = _find(
        f"DynamicJaxprTrace.{_name}", functools.partial(getattr, _TRACE, _name), ("self", "c"), ("source_info", "aval")
    )
    if _const is not None:
        ORIGINAL_CONSTS[_name] = _const
_trace_state_clean = _find("jax._src.core.trace_state_clean", lambda: _core.trace_state_clean)
_is_weakly_typed = _find("jax._src.dtypes.is_weakly_typed", lambda: _dtypes.is_weakly_typed)
_make_user_context = _find("jax.make_user_context", lambda: jax.make_user_context)

# lax primitives that demand one dtype of their floating operands: where a lifted float64 value meets a
# float32 one that could not be lifted, the float32 operand is promoted (and listed) instead of refused
_MIXING_NAMES = (
    *("add_p", "sub_p", "mul_p", "div_p", "rem_p", "pow_p", "max_p", "min_p"),
    *("atan2_p", "nextafter_p", "complex_p", "clamp_p", "select_n_p"),
    *("eq_p", "ne_p", "lt_p", "le_p", "gt_p", "ge_p"),
    *("concatenate_p", "pad_p", "dynamic_update_slice_p", "dot_general_p"),
    *("conv_general_dilated_p", "add_jaxvals_p"),
    *("scatter_p", "scatter_add_p", "scatter_mul_p", "scatter_min_p", "scatter_max_p"),
)
MIXING: tuple[Any, ...] = tuple(
    p
    for p in (_find(f"jax.extend.core.primitives.{n}", functools.partial(getattr, _prims, n)) for n in _MIXING_NAMES)
    if p is not None
)
CONVERT = _find("jax.extend.core.primitives.convert_element_type_p", lambda: _prims.convert_element_type_p)
# primitives whose precision is kept as the port's own run has it: a bit-level view, a rounding to a format
KEEPING: tuple[Any, ...] = tuple(
    p
    for p in (
        _find(f"jax.extend.core.primitives.{n}", functools.partial(getattr, _prims, n))
        for n in ("bitcast_convert_type_p", "reduce_precision_p")
    )
    if p is not None
)


def register_exclusion(path: str) -> None:
    """A promotion's source line is its caller's, not ``path``'s (nothing where JAX has no such registry: the
    lines then name flax-ln's file)."""
    try:
        from jax.extend import source_info_util

        source_info_util.register_exclusion(path)
    except Exception:  # noqa: BLE001 - only the source lines in islands' words depend on it
        pass


def version() -> str:
    """This JAX's ``major.minor`` (``"0.10"``)."""
    return ".".join(jax.__version__.split(".")[:2])


_probe_failure: list[str] = []  # what the probe found wrong, once it ran
_probed = threading.Event()


def unsupported() -> str | None:
    """Why lifting cannot run on this JAX (``"jax 0.11: lifting not supported"``), or ``None``."""
    if MISSING or _probe_failure:
        return f"jax {version()}: lifting not supported"
    return None


def why_unsupported() -> str:
    """What is missing or wrong, in words (empty when lifting is supported)."""
    return "; ".join([*(f"missing {m}" for m in MISSING), *_probe_failure])


def can_list() -> bool:
    """Whether the dtype requests can be listed without lifting them (the canonicaliser and the cache token are
    there), where lifting itself is not supported."""
    return ORIGINAL_CANONICALIZE is not None and _make_user_context is not None


def user_context(default: Any) -> Any:
    """``jax.make_user_context(default)``: a context whose value is part of every JAX cache key (``None`` where
    this JAX has none)."""
    return None if _make_user_context is None else _make_user_context(default)


def trace_state_clean() -> bool:
    """Whether no JAX trace is running on this thread (``True`` where this JAX cannot say)."""
    return True if _trace_state_clean is None else bool(_trace_state_clean())


def is_weakly_typed(value: Any) -> bool:
    """Whether ``value`` is weakly typed (a Python number): JAX's own answer."""
    return False if _is_weakly_typed is None else bool(_is_weakly_typed(value))


def install(
    canonicalize: Callable[..., Any],
    carry: Callable[..., Any] | None,
    naming: Callable[[Callable[..., Any]], Callable[..., Any]] | None,
    promoting: Callable[[Any], Callable[..., Any]] | None,
    keeping: Callable[[Any], Callable[..., Any]] | None,
) -> None:
    """Patch JAX: the canonicaliser with ``canonicalize``, the loop carry's promotion with ``carry``, each
    constant entry with ``naming(original)``, each mixing primitive's bind with ``promoting(primitive)``, each
    precision-keeping one's with ``keeping(primitive)`` (``None``: left as it is; listing without lifting patches
    only the canonicaliser)."""
    _dtypes.check_and_canonicalize_user_dtype = canonicalize
    if carry is not None:
        _loops._promote_weak_typed_input = carry
    if naming is not None:
        for name, original in ORIGINAL_CONSTS.items():
            setattr(_TRACE, name, naming(original))
    if promoting is not None:
        for primitive in MIXING:
            primitive.bind = promoting(primitive)
    if keeping is not None:
        for primitive in KEEPING:
            primitive.bind = keeping(primitive)


def uninstall() -> None:
    """Undo :func:`install`: every patched internal is JAX's own again."""
    _dtypes.check_and_canonicalize_user_dtype = ORIGINAL_CANONICALIZE
    if ORIGINAL_CARRY_PROMOTION is not None:
        _loops._promote_weak_typed_input = ORIGINAL_CARRY_PROMOTION
    for name, original in ORIGINAL_CONSTS.items():
        setattr(_TRACE, name, original)
    for primitive in (*MIXING, *KEEPING):
        if "bind" in vars(primitive):
            del primitive.bind


def probe(lifted: Callable[[], Any]) -> None:
    """Run ``lifted()`` once per process (the first lifting context): it traces a small float32 computation under
    lifting and returns its result's dtype, which must be float64. Anything else (a wrong dtype, an exception)
    marks lifting unsupported, with what happened in :func:`why_unsupported`."""
    if _probed.is_set() or MISSING:
        return
    try:
        dtype = lifted()
        if np.dtype(dtype) != np.float64:
            _probe_failure.append(f"a lifted float32 request gave {dtype}, not float64")
    except Exception as err:  # noqa: BLE001 - an internal that behaves differently may fail in any way
        _probe_failure.append(f"a lifted trace raised {type(err).__name__}: {str(err)[:200]}")
    _probed.set()


def forget_traces() -> None:
    """Clear JAX's caches of traced functions (``jax._src.interpreters.partial_eval.trace_to_jaxpr`` and
    ``jax._src.ad_checkpoint._trace_to_jaxpr``; compiled ``jit`` functions keep theirs): a ``jax.checkpoint`` or
    scan applied once (``nnx.remat`` as a decorator) is traced again at its next call, so that a recording run
    sees the modules in it. Not part of lifting; a JAX without them is left as it is."""
    for name, attr in (
        ("jax._src.interpreters.partial_eval", "trace_to_jaxpr"),
        ("jax._src.ad_checkpoint", "_trace_to_jaxpr"),
    ):
        try:
            getattr(_module(name), attr).cache_clear()
        except Exception:  # noqa: BLE001 - an internal that moved: the recording names fewer traced modules
            pass

"""Float32 islands on the JAX side: lifted while a computation is traced, and listed.

A float64 comparison (x64 enabled) proves "exact" only when a faithful port computes everything in
float64, yet real code asks for float32 on purpose: ``x.astype(jnp.float32)`` in an RMSNorm, a softmax
in float32 (``jax.nn.dot_product_attention``, which ``nnx.dot_product_attention`` calls),
``nnx.Embed``'s default compute dtype, rotary tables from ``jnp.arange(..., dtype=jnp.float32)``.
Under :func:`lift_float32` each such request is answered with float64 *while the computation is
traced*, so the Python constants that follow (``x.astype(jnp.float32) * 48 ** -0.5``) meet a float64
array and keep float64 precision. A rewrite of the finished jaxpr could not do that: there the
constant is already the float32 literal ``0.14433756470680237:f32[]``.

How: JAX canonicalises every dtype its caller names (``astype``, ``asarray``, ``array``, ``zeros``,
``full``, ``arange``, ``linspace``, ``eye``, ``lax.convert_element_type``, ``lax.iota``, reductions'
``dtype=``, and ``preferred_element_type`` of ``lax.dot_general``, ``dot``, ``matmul``, ``einsum`` and
``conv_general_dilated``) in one function, ``jax._src.dtypes.check_and_canonicalize_user_dtype``.
While a context is active on the calling thread, that function answers float32 with float64 (and
complex64 with complex128), whatever the operands' dtype (a bfloat16 dot asked to accumulate in
float32 accumulates in float64). Every traced path calls it while the context is active: eager
calls, ``jit``/``pjit`` bodies, ``scan``/``while_loop``/``fori_loop``/``cond`` bodies,
``checkpoint``, ``custom_jvp`` and ``custom_vjp`` functions and their rules (traced when
``jax.jvp``/``jax.grad`` run under the context), NNX and Linen modules and their transforms.

Not lifted: bfloat16 and float16 (a port's own computation); bit-level reinterpretations (``view``,
``bitcast_convert_type``: a view of a lifted value as a 32-bit type reads the float32 value's bits, as the
port's own run does; ``reduce_precision`` to float32's precision is a float32 request, lifted); random draws
(``jax.random``: a float64 draw is another sample, not a finer one); numbers already rounded to float32
before JAX sees them (``np.float32(c)``, a NumPy float32 table, a float32 array built before the context,
e.g. at a module's construction: each one a trace captures is listed, not lifted); ``pallas_call`` and
foreign calls (``ffi_call``, callbacks). Where such a float32 value meets a lifted float64 one,
JAX's own promotion (``jnp``) gives float64; a lax-level op, which would refuse the mix, gets its
float32 operand promoted, and a ``scan``/``while_loop`` carry that starts in float32 and comes back
float64 starts in float64 (the loop is traced again, as JAX does for weak types); each promotion is
listed as an island with ``lifted=False`` (its value stays float32-rounded). Not handled: ``cond``
branches that return such a float32 value beside a lifted one (JAX's type error). :func:`unlifted_float32`
lists what a traced jaxpr still computes in float32.

Caches: each context enters a fresh value of a ``jax.make_user_context`` context, which is part of
every JAX tracing, lowering and compilation cache key. A function traced (or jitted) before is traced
again inside the context, and nothing traced inside is reused after it: no caller needs a fresh
function or ``jax.clear_caches()``. The price is one more trace and compile per context."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import jax
import numpy as np
from flax import linen, nnx
from jax.extend import core as jex_core
from jax.extend import source_info_util

import flax_ln.parity.islands.jax_internals as internals
from flax_ln.parity.islands.constants import held_float32_arrays, is_held
from flax_ln.parity.islands.island import Island
from flax_ln.parity.records.capture import WHOLE_MODEL

internals.register_exclusion(__file__)  # a promotion's source line is its caller's, not this file's

WIDER: dict[Any, np.dtype] = {
    np.dtype(np.float32): np.dtype(np.float64),
    np.dtype(np.complex64): np.dtype(np.complex128),
}
"""The dtypes :func:`lift_float32` lifts, each to the one it becomes."""
_WIDE = frozenset(WIDER.values())

_BIT_LEVEL = frozenset({"view", "bitcast_convert_type"})  # dtype requests that reinterpret bits: never lifted
_DRAWS = ("jax._src.random", "jax._src.prng", "jax.random")  # modules whose float32 requests are random draws
# the requests that name a preferred_element_type ("dot" is lax.dot_general's and jnp.dot's)
_PREFERRED = frozenset({"dot", "matmul", "tensordot", "einsum", "conv_general_dilated", "scaled_matmul"})
_OPAQUE = frozenset({"pallas_call", "ffi_call", "custom_call", "pure_callback", "io_callback", "triton_kernel_call"})


@dataclasses.dataclass
class Lifting:
    """What one :func:`lift_float32` context lifted: ``islands``, one per (module, kind), in order found.

    ``unsupported``: why this JAX cannot lift (``"jax 0.11: lifting not supported"``, see
    :mod:`flax_ln.parity.islands.jax_internals`), else ``None``; then nothing was lifted, and every island is
    ``lifted=False``, the first saying so. ``ports``: the models whose module paths name the islands
    (:func:`name_modules_of`), latest first; without one, a path is taken from the outermost NNX module running."""

    islands: list[Island] = dataclasses.field(default_factory=list)
    ports: list[nnx.Module] = dataclasses.field(default_factory=list)
    unsupported: str | None = None
    held: frozenset[int] | None = None  # the float32 arrays the port held before its run (hold_constants_of)
    _roots: dict[int, tuple[nnx.Module, dict[int, tuple[str, nnx.Module]]]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )  # id(root) -> (root, id(module) -> (path, module))

    def add(self, module: str | None, what: str, lifted: bool) -> None:
        """Record one island, or count it again where this (module, kind) is already listed."""
        if self.unsupported is not None and lifted:  # only listed: the request ran as written
            what, lifted = f"{what} ({self.unsupported})", False
        island = Island(side="flax", module=module, what=what, lifted=lifted)
        if island in self.islands:  # met again: one entry, counted
            at = self.islands.index(island)
            self.islands[at] = dataclasses.replace(self.islands[at], count=self.islands[at].count + 1)
        else:
            self.islands.append(island)

    def module_path(self, frame: FrameType | None) -> str | None:
        """The dotted path of the innermost flax module whose method is running at ``frame`` or above.

        NNX: the path in the port (:attr:`ports`, the model the comparison runs, whatever function calls which
        of its submodules; ``"(whole model)"`` for its root), else from the outermost NNX module on the stack.
        A module that a lifted transform (``nnx.scan``/``nnx.vmap`` over stacked layers) hands in as a copy is
        placed by its type: at the one module of that type under the nearest module known, else ``None``.
        Linen: the bound module's own path. ``None`` when no flax module of the port is running (so under a
        backward rule traced after the forward returned).
        """
        chain: list[nnx.Module] = []  # innermost first
        linen_path: str | None = None
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                owner = frame.f_locals.get("self")
                if isinstance(owner, nnx.Module):
                    chain.append(owner)
                elif isinstance(owner, linen.Module) and linen_path is None and not chain:
                    scope = getattr(owner, "scope", None)
                    linen_path = None if scope is None else ".".join(map(str, scope.path))
            frame = frame.f_back
        if linen_path is not None or not chain:
            return (linen_path or WHOLE_MODEL) if linen_path is not None else None
        for root in self.ports or [chain[-1]]:
            known = self._known(root)
            depth = next((k for k, m in enumerate(chain) if id(m) in known), None)
            if depth is not None:
                break
        else:
            return None  # no module of the port is running
        path = known[id(chain[depth])][0]
        if depth == 0:
            return path or WHOLE_MODEL
        copy = chain[depth - 1]  # the outermost module on the stack that is not the root's own
        places = [p for p, m in known.values() if type(m) is type(copy) and (not path or p.startswith(path + "."))]
        inner = _modules(copy).get(id(chain[0]))
        if len(places) != 1 or inner is None:
            return None
        return ".".join(part for part in (places[0], inner[0]) if part) or WHOLE_MODEL

    def _known(self, root: nnx.Module) -> dict[int, tuple[str, nnx.Module]]:
        if id(root) not in self._roots or self._roots[id(root)][0] is not root:
            self._roots[id(root)] = (root, _modules(root))
        return self._roots[id(root)][1]


def name_modules_of(port: Any) -> Any:
    """Name the islands that tracing meets in ``port`` (an NNX module) by its module paths, in the active
    :func:`lift_float32` context (none: nothing); returns ``port``. The flax side calls it on the model it runs,
    and on each copy a jitted function merges, so that a path is the port's however its forward calls it."""
    session = _active()
    if session is not None and isinstance(port, nnx.Module) and not any(p is port for p in session.ports):
        session.ports.insert(0, port)
    return port


def hold_constants_of(port: Any) -> Any:
    """Note, in the active :func:`lift_float32` context (none: nothing), the float32 arrays ``port`` (any flax side:
    an NNX, Linen, Equinox or Keras model, a function) holds now, before it runs: a float32 constant a trace then
    captures is one of them (built at construction: a rebuild under lifting makes it float64, ``flax_factory=``),
    or one the port's own code makes while it runs (said so, with where: no rebuild changes it). Returns ``port``."""
    session = _active()
    if session is not None:
        session.held = held_float32_arrays(port)
    return port


def _constant_words(session: Lifting, value: Any, caller: FrameType | None) -> str:
    """What a float32 constant a trace captured is, and what can lift it: by whether the port held it before."""
    kind = f"a {value.dtype} constant {tuple(np.shape(value))}"
    if session.held is None or is_held(value, session.held):
        rounded = f"{kind} built before the comparison: its value is already rounded"
        return f"{rounded} (build the port under lifting: flax_factory=)"
    where = (
        ""
        if caller is None
        else f" at {caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno} ({caller.f_code.co_name})"
    )
    return (
        f"{kind} made in float32 by the port's own code during its call{where} (NumPy float32 or a float32 "
        "global, not held by the model): the port itself computes it in float32, and no rebuild (flax_factory=) "
        "changes that; compute it in float64 there, or admit the difference"
    )


def _modules(root: nnx.Module) -> dict[int, tuple[str, nnx.Module]]:
    return {id(m): (".".join(map(str, p)), m) for p, m in nnx.iter_modules(root)}


_LIFT_TOKEN = internals.user_context(None)  # the active context's token: a key of every JAX cache
_SESSIONS: dict[int, Lifting] = {}
_TOKENS = itertools.count(1)
_LOCK = threading.Lock()
_installed = [0]  # how many contexts are active, over all threads: the patches live while one is


def _active() -> Lifting | None:
    token = None if _LIFT_TOKEN is None else _LIFT_TOKEN.value
    return None if token is None else _SESSIONS.get(token)


def _module_name(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "")


def _is_public(name: str) -> bool:
    return any(hasattr(api, name) for api in (jax.numpy, jax.nn, jax.lax))


def _call_site(frame: FrameType | None) -> tuple[str | None, bool, FrameType | None]:
    """(the outermost public JAX function running, whether a random draw runs, the caller's frame).

    The caller's frame is the first one, going out from ``frame``, that is not JAX's own (nor this module's).
    """
    entry, drawing = None, False
    while frame is not None and (_module_name(frame).startswith("jax.") or _module_name(frame) == __name__):
        drawing = drawing or _module_name(frame).startswith(_DRAWS)
        entry = frame.f_code.co_name if _is_public(frame.f_code.co_name) else entry
        frame = frame.f_back
    return entry, drawing, frame


def _words(fun_name: str | None, entry: str | None, dtype: np.dtype) -> str:
    """``fun_name``: the JAX function that asked for ``dtype``; ``entry``: the public one the caller called."""
    name = (entry if fun_name == "dot" else fun_name) or entry or "dtype request"
    if name in ("astype", "convert_element_type"):
        words = f"{name} to {dtype}"
    elif fun_name in _PREFERRED:
        words = f"{name} with preferred_element_type={dtype}"
    else:
        words = f"{name} with dtype {dtype}"
    return words if entry in (None, name) else f"{words} (in {entry})"  # a public function's own request


def _initialising(frame: FrameType | None) -> bool:
    """Whether Linen's own shape check of a parameter's initialiser runs (``scope.param`` evaluates ``init_fn``
    abstractly on every apply): initialisation, not the model's computation."""
    while frame is not None:
        if frame.f_code.co_name == "param" and _module_name(frame) == "flax.core.scope":
            return True
        frame = frame.f_back
    return False


def _lifting_canonicalize(dtype: Any, fun_name: str | None = None, *args: Any, **kwargs: Any) -> Any:
    # every parameter beyond the two read here is JAX's to pass (jax 0.12: allow_non_jax_dtypes=), forwarded as is
    canonical = internals.ORIGINAL_CANONICALIZE(dtype, fun_name, *args, **kwargs)
    wider = WIDER.get(canonical) if isinstance(canonical, np.dtype) else None
    session = _active() if wider is not None and fun_name not in _BIT_LEVEL else None
    if session is None:
        return canonical
    entry, drawing, caller = _call_site(sys._getframe(1))
    if drawing or _initialising(caller):
        return canonical
    session.add(session.module_path(caller), _words(fun_name, entry, canonical), lifted=True)
    return wider if session.unsupported is None else canonical


def _promoting_bind(primitive: Any) -> Callable[..., Any]:
    bind = primitive.bind  # the class's own bind, bound to this primitive

    def promoting(*args: Any, **params: Any) -> Any:
        session = _active()
        if session is not None:
            dtypes = [d if isinstance(d := getattr(a, "dtype", None), np.dtype) else None for a in args]
            if any(d in _WIDE for d in dtypes) and any(d in WIDER for d in dtypes):  # (None == float64 in NumPy)
                caller = _call_site(sys._getframe(1))[2]
                args = tuple(_widen(a, WIDER[d]) if d in WIDER else a for a, d in zip(args, dtypes, strict=True))
                what = f"float32 operand of {primitive.name}, promoted to float64 (its value stays float32)"
                session.add(session.module_path(caller), what, lifted=False)
        return bind(*args, **params)

    return promoting


def _precision_keeping_bind(primitive: Any) -> Callable[..., Any]:
    """``bitcast_convert_type`` and ``reduce_precision`` of a lifted value, as the port's own run computes them:
    a bit-level view as a 32-bit type reads a float32 value's bits (the operand narrowed to float32 first, not
    lifted), and rounding to float32's precision is a float32 request (lifted: float64's precision)."""
    bind = primitive.bind

    def keeping(operand: Any, **params: Any) -> Any:
        session = _active()
        dtype = getattr(operand, "dtype", None)
        if session is None or dtype not in _WIDE:
            return bind(operand, **params)
        caller = _call_site(sys._getframe(1))[2]
        if primitive.name == "bitcast_convert_type" and np.dtype(params["new_dtype"]).itemsize == 4:
            narrow = _NARROWER[np.dtype(dtype)]
            what = f"bitcast_convert_type of a {narrow} value to {np.dtype(params['new_dtype'])}: kept in {narrow}"
            session.add(session.module_path(caller), what, lifted=False)
            operand = internals.CONVERT.bind(operand, new_dtype=narrow, weak_type=False, sharding=None)
        elif primitive.name == "reduce_precision" and (params["exponent_bits"], params["mantissa_bits"]) == (8, 23):
            session.add(session.module_path(caller), "reduce_precision to float32's precision", lifted=True)
            return operand  # float64's own precision: nothing to round
        return bind(operand, **params)

    return keeping


_NARROWER = {wide: narrow for narrow, wide in WIDER.items()}


def _promoting_carry(in_val: Any, in_aval: Any, out_aval: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    # scan and while_loop trace their body again when this promotes an initial carry (as for a weak type):
    # a float32 carry whose body now returns float64 starts in float64 instead of failing the type check
    wider = WIDER.get(getattr(in_aval, "dtype", None))
    session = _active()
    same_shape = getattr(in_aval, "shape", None) == getattr(out_aval, "shape", None)
    if wider is None or session is None or getattr(out_aval, "dtype", None) != wider or not same_shape:
        return internals.ORIGINAL_CARRY_PROMOTION(in_val, in_aval, out_aval, *args, **kwargs)
    what = "float32 loop carry, promoted to float64 (its value stays float32)"
    session.add(session.module_path(_call_site(sys._getframe(1))[2]), what, lifted=False)
    return _widen(in_val, wider), True


def _not_captured(frame: FrameType | None) -> bool:
    """Whether a constant entering the trace at ``frame`` was not captured from outside it: :func:`_widen` promoting
    a float32 value (listed as that promotion), or an inner jaxpr inlined into the trace (its constants were met
    when it was traced, and its folded ones are computed inside)."""
    while frame is not None and _module_name(frame).startswith(("jax.", __name__)):
        if frame.f_code is _widen.__code__ or frame.f_code.co_name == "inline_jaxpr_into_trace":
            return True
        frame = frame.f_back
    return False


def _naming_new_const(new_const: Callable[..., Any]) -> Callable[..., Any]:
    def naming(trace: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        session = _active()
        dtype = getattr(value, "dtype", None)
        weak = internals.is_weakly_typed(value) or getattr(kwargs.get("aval"), "weak_type", False)
        # a Python number is weak; a weak float32 *array* was rounded to float32 before (keras-hub's Gemma:
        # ops.cast(ops.sqrt(hidden_dim), "float32") made when the functional model was built)
        array = isinstance(value, jax.Array)
        captured = isinstance(dtype, np.dtype) and dtype in WIDER and (array or not weak)
        if session is not None and captured and not _not_captured(sys._getframe(1)):
            _, drawing, caller = _call_site(sys._getframe(1))
            if not drawing and not _initialising(caller):
                session.add(session.module_path(caller), _constant_words(session, value, caller), lifted=False)
        return new_const(trace, value, *args, **kwargs)

    return naming


def _widen(value: Any, dtype: np.dtype) -> Any:
    weak = internals.is_weakly_typed(value)
    return internals.CONVERT.bind(value, new_dtype=dtype, weak_type=weak, sharding=None)


def _install() -> None:
    with _LOCK:
        _installed[0] += 1
        if _installed[0] == 1:
            if internals.unsupported() is None:
                internals.install(
                    _lifting_canonicalize, _promoting_carry, _naming_new_const, _promoting_bind, _precision_keeping_bind
                )
            else:  # listing only: the requests are named, and answered as written
                internals.install(_lifting_canonicalize, None, None, None, None)


def _uninstall() -> None:
    with _LOCK:
        _installed[0] -= 1
        if _installed[0] == 0:
            internals.uninstall()


@contextlib.contextmanager
def lift_float32() -> Iterator[Lifting]:
    """Within this context, computations JAX traces on this thread run float32 requests in float64.

    Yields a :class:`Lifting` whose ``islands`` fill as tracing meets float32 requests (see the
    module docstring for what is lifted and what is not). Use around the tracing itself: an eager
    call, ``jax.jit(f)(...)``/``.lower(...)``, ``jax.grad``, ``jax.jvp`` (a backward rule is traced
    when the gradient is computed, so compute it inside too). Needs x64 (``jax.enable_x64(True)``):
    without it there is no float64 to lift to, and the context raises ``ValueError``. Entered
    inside a trace (a jit, grad, vmap or scan already running) it raises ``RuntimeError``: the
    outer trace would be cached as if nothing were lifted.

    On a JAX whose internals lifting needs are missing or behave differently
    (:mod:`flax_ln.parity.islands.jax_internals`), it lifts nothing and never raises: the computation runs as
    written, ``Lifting.unsupported`` says why, the first island says so, and every float32 request met
    is listed ``lifted=False`` (where even listing is impossible, that first island is all).
    """
    if jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise ValueError("lift_float32() needs float64: enter it under jax.enable_x64(True)")
    if not internals.trace_state_clean():  # a trace begun outside would be cached under a key without lifting
        raise RuntimeError("enter lift_float32() outside any jit/grad/vmap/scan tracing, around the whole call")
    internals.probe(_probe)
    session = Lifting(unsupported=internals.unsupported())
    if session.unsupported is not None:
        what = f"{session.unsupported}: the flax side runs as written, its float32 stays float32"
        session.islands.append(Island("flax", None, f"{what} ({internals.why_unsupported()})", lifted=False))
        if not internals.can_list():
            yield session
            return
    with _session(session):
        yield session


def _probe() -> Any:
    """The dtype a small float32 computation gets, traced under lifting: float64 where lifting works."""
    with _session(Lifting()):
        return jax.make_jaxpr(lambda x: x.astype(np.float32) * 0.1)(np.ones(2)).out_avals[0].dtype


@contextlib.contextmanager
def _session(session: Lifting) -> Iterator[None]:
    assert _LIFT_TOKEN is not None  # checked by internals.can_list() or internals.unsupported()
    token = next(_TOKENS)
    _SESSIONS[token] = session
    _install()
    try:
        with _LIFT_TOKEN(token):
            yield
    finally:
        _uninstall()
        del _SESSIONS[token]


def unlifted_float32(jaxpr: jex_core.Jaxpr | jex_core.ClosedJaxpr) -> list[Island]:
    """What a traced (closed) jaxpr still computes in float32, as ``lifted=False`` islands.

    Walks ``jaxpr`` and every sub-jaxpr in its equations' parameters (``pjit``, ``scan``, ``while``,
    ``cond``, ``remat``/``checkpoint``, ``custom_jvp_call``/``custom_vjp_call``'s primal function,
    ``shard_map``...). Lists float32 (complex64) inputs and closed-over constants, float32 literals,
    ops with a float32 result, and opaque calls (``pallas_call``, ``ffi_call``, callbacks), which no
    lifting reaches. One entry per kind and source line; ``module`` is ``None`` (a jaxpr knows no
    module paths), ``what`` names the user line that traced it. A custom rule that was not traced
    (the backward of a forward-only jaxpr) is not in the jaxpr: walk the jaxpr of the gradient instead.
    """
    found: list[Island] = []

    def add(what: str) -> None:
        island = Island(side="flax", module=None, what=what, lifted=False)
        if island not in found:
            found.append(island)

    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
    for var in open_jaxpr.invars:
        if _is_float32(var.aval):
            add(f"float32 input {var.aval.str_short()}")
    _walk(open_jaxpr, add)
    return found


def _value(val: Any) -> Any:
    """A literal's value as a Python number, whatever JAX wraps it in (a ``TypedNdArray`` from jax 0.8.2)."""
    try:
        return np.asarray(val).item()
    except (TypeError, ValueError):
        return val


def _is_float32(aval: Any) -> bool:
    return getattr(aval, "dtype", None) in WIDER


def _where(eqn: Any) -> str:
    line = source_info_util.summarize(eqn.source_info)  # "path/file.py:line:column (function)"
    return "" if not line or line == "unknown" else f" at {line.rsplit('/', 1)[-1]}"


def _walk(jaxpr: jex_core.Jaxpr, add: Callable[[str], None]) -> None:
    for const in jaxpr.constvars:
        if _is_float32(const.aval):
            add(f"float32 constant {const.aval.str_short()} (a closed-over array, built before lifting)")
    for eqn in jaxpr.eqns:
        name, where = eqn.primitive.name, _where(eqn)
        if name in _OPAQUE:
            add(f"{name} (opaque to lifting){where}")
            continue
        for operand in eqn.invars:
            if isinstance(operand, jex_core.Literal) and _is_float32(operand.aval):
                add(f"float32 literal {_value(operand.val)} in {name}{where}")
        subs = [
            sub
            for value in eqn.params.values()
            for sub in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr))
        ]
        for sub in subs:  # a call, loop or branch: its own ops are listed, not the call
            _walk(sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub, add)
        if not subs and any(_is_float32(var.aval) for var in eqn.outvars):
            add(f"{name} in float32{where}")

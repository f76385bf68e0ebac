"""Float32 islands on the torch side of a float64 comparison: lifted at run time, rebuilt, or listed.

A float64 run of a real model still computes parts of itself in float32: transformers' RMSNorm
casts ``hidden.to(torch.float32)``, attention takes ``softmax(..., dtype=torch.float32)``, rotary
tables multiply ``.float()`` operands, and buffers built at construction (rotary ``inv_freq``)
hold float32-rounded values that ``.double()`` keeps. Three tools, one for each:

* :func:`lift_float32`: a scope under which float32 computations run in float64, forward,
  backward and ``torch.func.jvp`` alike, each island found listed as an :class:`Island`;
* :func:`build_lifted` (with :func:`default_factory` for a transformers model): a float64 copy
  of a module built under lifting, so that its construction-time buffers are float64, holding
  the given module's state;
* :func:`rounded_buffers`: without a way to rebuild, the float64 buffers that still hold
  float32-rounded values the weights do not overwrite.

Only float32 (and complex64, its complex form) is lifted: a cast to bfloat16 or float16 is the
model's own computation and stays. torch is imported when these run, not when this module is.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from flax_ln.parity.core.structure import Rebuild
from flax_ln.parity.islands.held import plain_attributes
from flax_ln.parity.islands.island import Island, float32_rounded
from flax_ln.parity.records.capture import WHOLE_MODEL

_BIT_LEVEL = frozenset({"view", "frombuffer"})  # torch functions whose dtype= reinterprets bits: never lifted


def _torch():
    import torch

    return torch


def _lift_map() -> dict[Any, Any]:
    """The dtypes lifted, to what: float32 to float64, complex64 to complex128."""
    torch = _torch()
    return {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class Lifting:
    """What one :func:`lift_float32` scope found: ``islands``, one per module and kind, in the order first seen.

    ``stack`` (the paths of the modules being called, kept by hooks) and :meth:`note` are how the
    scope's modes record; a caller reads ``islands``.
    """

    islands: list[Island] = dataclasses.field(default_factory=list)
    default_was_float32: bool = False  # the caller's default dtype, which the scope sets to float64
    stack: list[str] = dataclasses.field(default_factory=list)  # innermost last
    _seen: set[Island] = dataclasses.field(default_factory=set)

    paused: bool = False  # a conversion to float32 the scope itself makes (a bit-level view's operand)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No lifting at the dispatch level within (the scope's own conversions)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def note(self, what: str, lifted: bool = True) -> None:
        """Record an island of kind ``what`` in the module being called now (once per module and kind)."""
        island = Island("torch", self.stack[-1] if self.stack else None, what, lifted)
        if island not in self._seen:
            self._seen.add(island)
            self.islands.append(island)


@functools.cache
def _modes() -> tuple[type, type]:
    """The two torch modes behind :func:`lift_float32`, built on first use (they subclass torch's)."""
    torch = _torch()
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves, tree_map_only

    lift = _lift_map()

    @functools.cache
    def schema_of(func) -> tuple[str, tuple[tuple[int, str], ...], tuple[str, ...]]:
        """An aten op's name, the (index, name) of each argument it writes into, and its arguments' names: read
        from its schema once per op, not on every call (a GPT-2's forward and backward dispatch thousands)."""
        arguments = func._schema.arguments
        writes = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        return str(func.overloadpacket), writes, tuple(a.name for a in arguments)

    def tensors(tree) -> list[Any]:
        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    class FunctionLift(TorchFunctionMode):
        """``dtype=torch.float32`` on any torch function (``softmax``, ``arange``, ``tensor``, ``to``) asks for float64.

        Seen here, at the level the model's code calls, the island is named by the function; a
        positional dtype (``x.to(torch.float32)``) reaches :class:`DispatchLift` as ``aten._to_copy``.
        """

        def __init__(self, lifting: Lifting):
            super().__init__()
            self.lifting = lifting

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dtype = kwargs.get("dtype")
            name = getattr(func, "__name__", str(func))
            if name == "view" and self.narrowing_view(args, kwargs):  # x.view(torch.int32) of a float32 value
                with self.lifting.suspended():
                    narrow = args[0].to(torch.float32)
                self.lifting.note(f"view of a float32 value as {_dtype_name(args[1])}: kept in float32", False)
                return func(narrow, *args[1:], **kwargs)
            if isinstance(dtype, torch.dtype) and dtype in lift and name not in _BIT_LEVEL:
                kwargs = {**kwargs, "dtype": lift[dtype]}
                self.lifting.note(f"{name} with dtype={_dtype_name(dtype)}")
            return func(*args, **kwargs)

        @staticmethod
        def narrowing_view(args, kwargs) -> bool:
            """A bit-level view of a lifted (float64) tensor as a 32-bit dtype: in the model's own run a float32
            value, whose bits it reads; the float64 run must read the same width."""
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            source = args[0] if args else None
            return (
                isinstance(target, torch.dtype)
                and isinstance(source, torch.Tensor)
                and source.dtype == torch.float64
                and target.itemsize == 4
            )

    class DispatchLift(TorchDispatchMode):
        """Every aten op, backward and forward-mode derivatives included, run with float32 lifted to float64.

        Views are left as written (they compute nothing, and ``view(dtype)`` reinterprets bits);
        an op that writes into a float32 tensor runs as written and is listed as not lifted.
        """

        def __init__(self, lifting: Lifting):
            super().__init__()
            self.lifting = lifting

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.is_view or self.lifting.paused:
                return func(*args, **kwargs)
            op, writes, _ = schema_of(func)
            written = [args[index] if index < len(args) else kwargs.get(name) for index, name in writes]
            if any(t.dtype in lift for t in tensors(written)):
                self.lifting.note(f"{op} writes into a float32 tensor", lifted=False)
                return func(*args, **kwargs)
            floating_input = any(t.is_floating_point() or t.is_complex() for t in tensors((args, kwargs)))
            args, kwargs = self.lift_arguments(func, op, list(args), dict(kwargs))
            out = func(*args, **kwargs)
            produced = tensors(out)
            if any(t.dtype in lift for t in produced):
                self.lifting.note(f"{op} returns float32", lifted=False)
            elif self.lifting.default_was_float32 and not floating_input and not self.explicit_dtype(args, kwargs):
                if any(t.is_floating_point() for t in produced):
                    self.lifting.note(f"{op} with the default dtype float32")
            return out

        @staticmethod
        def explicit_dtype(args: list[Any], kwargs: dict[str, Any]) -> bool:
            """Some argument names a dtype (then the default dtype did not choose the result's)."""
            return any(isinstance(v, torch.dtype) for v in itertools.chain(args, kwargs.values()))

        def lift_arguments(self, func, op: str, args: list[Any], kwargs: dict[str, Any]):
            """The op's arguments with float32 dtypes, ``half_to_float`` and float32 tensors lifted."""
            names = schema_of(func)[2]
            args = [self.lift_dtype(op, name, value) for name, value in zip(names, args)]
            kwargs = {name: self.lift_dtype(op, name, value) for name, value in kwargs.items()}
            if op in ("aten._softmax", "aten._log_softmax") and args[2] is True:  # of a half input, in float32
                args[0], args[2] = args[0].to(torch.float64), False
                self.lifting.note(f"{op} with half_to_float=True")
            widened: list[str] = []

            def widen(t):
                if t.dtype not in lift:
                    return t
                widened.append(_dtype_name(t.dtype))
                return t.to(lift[t.dtype])

            args, kwargs = tree_map_only(torch.Tensor, widen, (args, kwargs))
            for dtype in dict.fromkeys(widened):  # made before the run, or by an op that could not be lifted
                self.lifting.note(f"{dtype} input to {op} (a value made in {dtype}: widened, still rounded)", False)
            return args, kwargs

        def lift_dtype(self, op: str, name: str, value: Any) -> Any:
            """``value`` (the op's argument ``name``), float64 where it is the dtype float32."""
            if not (isinstance(value, torch.dtype) and value in lift):
                return value
            how = "to " if op == "aten._to_copy" else f"with {name}="
            self.lifting.note(f"{op} {how}{_dtype_name(value)}")
            return lift[value]

    return FunctionLift, DispatchLift


def _follow_modules(root, stack: list[str]) -> list[Any]:
    """Hooks that keep ``stack`` at the path of the module being called (``root`` itself: ``WHOLE_MODEL``)."""
    handles = []
    for name, module in root.named_modules():

        def enter(mod, args, path=name or WHOLE_MODEL):
            stack.append(path)

        def leave(mod, args, output):
            stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


@contextlib.contextmanager
def lift_float32(root=None) -> Iterator[Lifting]:
    """A scope in which float32 computations run in float64; yields the :class:`Lifting` that lists them.

    Under it, at the torch-function level and at the dispatch level (every aten op, the backward
    pass and ``torch.func.jvp`` included):

    * a ``dtype`` that asks for float32 (``x.to(torch.float32)``, ``.float()``,
      ``softmax(..., dtype=torch.float32)``, ``arange``/``zeros``/``full``/``tensor``/... with
      ``dtype=torch.float32``, ``_softmax``'s ``half_to_float``) gets float64;
    * a float32 tensor that an op reads is widened to float64 first;
    * the default dtype is float64 (restored after), so ``torch.tensor(0.1)`` is not rounded.

    bfloat16 and float16 are never touched: a cast to half precision is the model's own
    computation. Views are left as written, ``view(dtype)`` (a bit-level reinterpretation)
    included, and so are integer and bool ops. An op that writes into an existing float32 tensor
    (a float32 buffer updated in place) runs as written and is listed with ``lifted=False``, as is
    an op that still returns float32.

    It is meant for a float64 model: float32 parameters are widened in the forward, but a
    gradient cannot flow back into a float32 leaf (torch's engine refuses the float64 gradient:
    ``expected dtype Float but got double``); run backward on a float64 copy (:func:`build_lifted`,
    ``.double()``). A tensor created lifted and then viewed as bits has float64's bits.

    ``lifting.islands`` holds one :class:`Island` per module and kind (``side="torch"``), the
    module being the path in ``root.named_modules()`` of the module being called
    (:data:`~flax_ln.parity.records.capture.WHOLE_MODEL` for ``root``'s own code), ``None`` outside
    ``root``'s modules, during backward, or when ``root`` is ``None``.
    """
    torch = _torch()
    function_mode, dispatch_mode = _modes()
    previous = torch.get_default_dtype()
    lifting = Lifting(default_was_float32=previous == torch.float32)
    handles = [] if root is None else _follow_modules(root, lifting.stack)
    torch.set_default_dtype(torch.float64)
    try:
        with function_mode(lifting), dispatch_mode(lifting):
            yield lifting
    finally:
        torch.set_default_dtype(previous)
        for handle in handles:
            handle.remove()


# the functions torch's autocast runs in its lower precision (bfloat16 or float16); autocast leaves float64 tensors
# alone, so a float64 run would compute them in float64: KeepAutocast casts them as autocast casts float32 ones
AUTOCAST_LOWER = frozenset(
    {
        *("linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "vecdot"),
        *("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc"),
        *("prelu", "scaled_dot_product_attention"),
    }
)


@functools.cache
def _keep_autocast_mode() -> type:
    torch = _torch()
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves, tree_map_only

    class KeepAutocast(TorchFunctionMode):
        """Under ``torch.autocast``, an autocast function's float64 tensors are cast to autocast's dtype first, so
        that a float64 run computes in bfloat16 (float16) where the model's own run does."""

        def __init__(self, lifting: Lifting):
            super().__init__()
            self.lifting = lifting

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name in AUTOCAST_LOWER:
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                device = next((t.device.type for t in tensors if t.dtype == torch.float64), None)
                if device is not None and torch.is_autocast_enabled(device):
                    low = torch.get_autocast_dtype(device)
                    args, kwargs = tree_map_only(
                        torch.Tensor, lambda t: t.to(low) if t.dtype == torch.float64 else t, (args, kwargs)
                    )
                    self.lifting.note(f"{name} under autocast({_dtype_name(low)}): kept in {_dtype_name(low)}", False)
            return func(*args, **kwargs)

    return KeepAutocast


@contextlib.contextmanager
def keep_autocast(root=None) -> Iterator[Lifting]:
    """A scope in which a float64 run keeps the model's ``torch.autocast`` regions: each autocast function
    (:data:`AUTOCAST_LOWER`: ``linear``, ``matmul``, convolutions, ...) called under autocast has its float64
    tensors cast to autocast's dtype, as autocast casts float32 ones. Yields the :class:`Lifting` listing each
    such function per module (``lifted=False``: it computes in half precision, as the model does)."""
    lifting = Lifting()
    handles = [] if root is None else _follow_modules(root, lifting.stack)
    try:
        with _keep_autocast_mode()(lifting):
            yield lifting
    finally:
        for handle in handles:
            handle.remove()


def default_factory(module) -> Callable[[], Any] | None:
    """For a transformers model (a ``PreTrainedModel``), ``lambda: type(module)(config)``; else ``None``.

    Recognised by what it has (a ``config``, ``post_init`` and a ``config_class`` on its class),
    so that transformers is not imported; the factory builds from a copy of the config.
    """
    config = getattr(module, "config", None)
    cls = type(module)
    if config is None or not hasattr(module, "post_init") or getattr(cls, "config_class", None) is None:
        return None
    return lambda: cls(copy.deepcopy(config))


def _owner_and_leaf(name: str) -> tuple[str, str]:
    """``"model.rotary_emb.inv_freq"`` -> (``"model.rotary_emb"``, ``"inv_freq"``); the root's as ``WHOLE_MODEL``."""
    owner, _, leaf = name.rpartition(".")
    return owner or WHOLE_MODEL, leaf


def _same_values(rebuilt, given) -> bool:
    """Same shape and values, ``given`` read in ``rebuilt``'s dtype and device."""
    return rebuilt.shape == given.shape and bool(_torch().equal(rebuilt, given.to(rebuilt)))


def _float32_rounded(rebuilt, given) -> bool:
    """``given`` is the float64 ``rebuilt`` rounded to float32 (or coarser), within a few of its ulps."""
    torch = _torch()
    if rebuilt.shape != given.shape or not (rebuilt.is_floating_point() and given.is_floating_point()):
        return False
    eps = max(torch.finfo(torch.float32).eps, torch.finfo(given.dtype).eps)
    given = given.to(rebuilt)
    return bool(torch.all((rebuilt - given).abs() <= 4 * eps * given.abs()))


def build_lifted(factory: Callable[[], Any], like, *, same_model: bool = True) -> tuple[Any, list[Island]]:
    """A float64 copy of ``like``, built by ``factory()`` under lifting, holding ``like``'s state; and its islands.

    ``factory()`` runs under :func:`lift_float32` with the default dtype float64 (restored after,
    on error too), so that buffers built at construction (transformers' rotary ``inv_freq``,
    ``.to(dtype=torch.float)`` at construction) are computed in float64; the result is made
    ``.double()``, moved to ``like``'s device, given ``like``'s parameters and persistent buffers
    (``like.state_dict()``, floating ones cast to float64, loaded ``strict=True``) and ``like``'s
    training modes and ``requires_grad`` flags. ``like`` is not changed.

    Non-persistent buffers are the rebuilt ones. For each that ``like`` has too and that differs:
    if ``like``'s is the rebuilt one rounded to float32, the rebuilt one stays, listed as
    ``Island(module=owner, what="buffer NAME rebuilt in float64", lifted=True)``; otherwise (the
    buffer was changed after construction, or the factory builds something else) ``like``'s
    values are kept, cast to float64, listed with ``lifted=False``. One that is the same in both
    and still float32-rounded (read from float32 data at construction: ``torch.from_numpy``) is
    listed with ``lifted=False`` too.

    Raises ``ValueError`` naming the keys when ``like``'s state does not load (missing, unexpected
    or mis-shaped keys) or a loaded parameter or persistent buffer then differs from ``like``'s
    (a load hook or a tie that changes it), or (``same_model``: a factory the caller gave) when the model built is
    not ``like`` built again as it is now: another module
    tree, class or attribute that is not an array (:meth:`~flax_ln.parity.core.structure.Rebuild.confirm`; only
    dtypes may differ); the copy would not compute ``like``'s function. A comparison checks after the copy's first
    call instead (``same_model=False``, then a :class:`~flax_ln.parity.core.structure.Rebuild` made at once), so that
    a cache the call fills is told apart. ``TypeError`` when ``factory()`` returns no
    torch module. A factory that returns ``like`` itself (or a part of it) is given a deep copy: ``like`` is never
    converted.

    Persistent buffers (in the state dict) computed at construction, whose float64 value float32 cannot hold: where
    ``like``'s is the rebuilt one rounded to float32, the rebuilt one is kept, listed as ``"buffer NAME (in the
    state dict) rebuilt in float64"`` (lifted); else ``like``'s is loaded, listed with ``lifted=False``.
    """
    torch = _torch()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with lift_float32(), kept_as_it_is(like):  # a factory that returns like, even converted, leaves it as it is
            built = _own_model(factory(), like)
    finally:
        torch.set_default_dtype(previous)
    built = built.double()
    first = next(itertools.chain(like.parameters(), like.buffers()), None)
    if first is not None:
        built = built.to(first.device)
    state = {k: v.detach().double() if v.is_floating_point() else v for k, v in like.state_dict().items()}
    islands = _persistent_buffers(built, state)
    try:
        built.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"the model built by the factory does not take the given model's state: {error}") from None
    differ = [k for k, v in built.state_dict().items() if not torch.equal(v, state[k])]
    if differ:
        raise ValueError(f"the model built by the factory holds other values than the given model's: {differ}")
    if same_model:
        Rebuild(like, built).confirm("torch_factory", "torch_module")
    like_modules = dict(like.named_modules())
    for name, module in built.named_modules():
        if name in like_modules:
            module.training = like_modules[name].training
    like_parameters = dict(like.named_parameters())
    for name, parameter in built.named_parameters():
        parameter.requires_grad_(like_parameters[name].requires_grad)
    return built, islands + _rebuilt_buffers(built, like, persistent=set(state))


def _own_model(built, like):
    """``built``, what ``torch_factory()`` returned, checked to be a torch module (else ``TypeError``); a copy where
    it holds any module, parameter or buffer of ``like`` (``lambda: model``: the float64 copy must not be made of
    the caller's own tensors)."""
    torch = _torch()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(
            f"torch_factory returned {'None' if built is None else 'a ' + type(built).__name__}, not a "
            "torch.nn.Module: it must build the torch module afresh (a zero-argument callable such as "
            "lambda: MyModel(config))"
        )
    held = {id(t) for t in itertools.chain(like.modules(), like.parameters(), like.buffers())}
    if any(id(t) in held for t in itertools.chain(built.modules(), built.parameters(), built.buffers())):
        try:
            return copy.deepcopy(built)
        except Exception as error:  # noqa: BLE001 - whatever deepcopy raises, the factory is what to fix
            raise ValueError(
                f"torch_factory returned torch_module itself (or a part of it), which cannot be copied "
                f"({type(error).__name__}: {error}); make it build a new module, or leave torch_factory out"
            ) from error
    return built


def _persistent_buffers(built, state: dict[str, Any]) -> list[Island]:
    """The float64 ``built``'s persistent floating buffers computed at construction (values float32 cannot hold)
    against the caller's state dict ``state`` (cast to float64): where the state's value is the rebuilt one rounded
    to float32, the rebuilt one replaces it in ``state`` (it is loaded then) and is listed as lifted; else the
    state's is kept, listed as not lifted."""
    torch = _torch()
    islands = []
    parameters = {name for name, _ in built.named_parameters()}
    for name, mine in built.named_buffers():
        given = state.get(name)
        if name in parameters or given is None or not mine.is_floating_point() or _same_values(mine, given):
            continue
        if bool(torch.equal(mine, mine.float().to(mine.dtype))):  # float32 holds it: data, not a float64 computation
            continue
        owner, leaf = _owner_and_leaf(name)
        if _float32_rounded(mine, given):
            state[name] = mine.detach().clone()
            what = f"buffer {leaf} (in the state dict) rebuilt in float64: the state dict holds it rounded to float32"
            islands.append(Island("torch", owner, what, lifted=True))
        else:
            what = (
                f"buffer {leaf} (in the state dict) kept from the given model: the rebuilt one rounded to float32 is "
                "not its value"
            )
            islands.append(Island("torch", owner, what, lifted=False))
    return islands


def _rebuilt_buffers(built, like, persistent: set[str]) -> list[Island]:
    """Non-persistent buffers of ``built`` against ``like``'s: rebuilt (float32-rounded in ``like``), kept, rounded."""
    islands = []
    rebuilt = dict(built.named_buffers())
    for name, given in like.named_buffers():
        if name in persistent or name not in rebuilt:
            continue
        mine = rebuilt[name]
        owner, leaf = _owner_and_leaf(name)
        if _same_values(mine, given):
            if mine.dtype == _torch().float64 and _float32_evidence(mine):
                what = f"buffer {leaf} holds float32-rounded values even when built under lifting"
                islands.append(Island("torch", owner, what, lifted=False))
        elif _float32_rounded(mine, given):
            islands.append(Island("torch", owner, f"buffer {leaf} rebuilt in float64", lifted=True))
        else:
            kept = given.detach().to(mine.device, mine.dtype if given.is_floating_point() else given.dtype, copy=True)
            setattr(built.get_submodule(name.rpartition(".")[0]), leaf, kept)
            what = f"buffer {leaf} kept from the given model: the rebuilt one differs beyond float32 rounding"
            islands.append(Island("torch", owner, what, lifted=False))
    return islands


def _float32_evidence(t) -> bool:
    """:func:`~flax_ln.parity.islands.island.float32_rounded` of the float64 tensor ``t``."""
    return float32_rounded(t.detach().cpu().numpy())


def rounded_buffers(module, weights_keys: set[str]) -> list[Island]:
    """The float64 buffers of ``module`` that hold float32-rounded values the weights do not overwrite, as islands.

    For a float64 module that cannot be rebuilt (no factory): each float64 buffer whose values
    are all float32-representable, with at least one value that is not an integer and needs more
    significant bits than float16 has (integers and short fractions prove nothing), and whose
    name is not in ``weights_keys`` (the state the comparison loads), is listed as
    ``Island(module=owner, what="buffer NAME holds float32-rounded values: pass torch_factory= to
    rebuild it in float64", lifted=False)``; ``owner`` is the buffer's module path
    (:data:`~flax_ln.parity.records.capture.WHOLE_MODEL` for the root's own).
    """
    torch = _torch()
    islands = []
    for name, buffer in module.named_buffers():
        if buffer.dtype != torch.float64 or name in weights_keys or not _float32_evidence(buffer.detach()):
            continue
        owner, leaf = _owner_and_leaf(name)
        what = f"buffer {leaf} holds float32-rounded values: pass torch_factory= to rebuild it in float64"
        islands.append(Island("torch", owner, what, lifted=False))
    return islands


class Float64Parameters:
    """The float64 parameters :func:`torch_in_float64` gave a module, which a comparison may give back before its
    scope ends (:meth:`release`: each such parameter holds its own tensor again, and the float64 copy is freed
    once nothing else holds it) and take again when the float64 module is needed (:meth:`restore`: the same
    float64 values, since float64 holds every value of a narrower float exactly)."""

    def __init__(self, doubled: list[tuple[Any, Any]]) -> None:
        self._doubled = doubled  # (parameter, its own tensor) for each parameter the scope cast
        self.released = False

    def release(self) -> None:
        for p, own in self._doubled:
            p.data = own
        self.released = True

    def restore(self) -> None:
        if self.released:
            for p, own in self._doubled:
                p.data = own.double()
            self.released = False


@contextlib.contextmanager
def torch_in_float64(module) -> Iterator[Float64Parameters]:
    """``module`` in float64 for this scope, then exactly as it was (:func:`kept_as_it_is`). (A deep copy is not
    always possible: torch refuses to copy non-leaf tensors held as attributes.) Yields the parameters it cast
    (:class:`Float64Parameters`)."""
    with kept_as_it_is(module):
        for p in module.parameters():
            p.grad = None
        torch = _torch()
        doubled = [(p, p.data) for p in module.parameters() if p.is_floating_point() and p.dtype != torch.float64]
        module.double()
        yield Float64Parameters(doubled)


@contextlib.contextmanager
def kept_as_it_is(module) -> Iterator[None]:
    """``module`` exactly as it is now after this scope, whatever the scope does to it: each parameter gets its own
    tensor back (``.data``, whatever its dtype: float64 buffers beside float32 weights, complex parameters), each
    buffer its own object, each ``.grad`` its own, and every plain attribute (:func:`plain_attributes`) its own."""
    parameters = [(p, p.data, p.grad) for p in module.parameters()]
    buffers = [(m._buffers, name, b) for m in module.modules() for name, b in m._buffers.items()]
    attributes = plain_attributes(module)
    try:
        yield
    finally:
        for p, data, grad in parameters:
            p.data, p.grad = data, grad
        for store, name, buffer in buffers:
            store[name] = buffer
        for held in attributes:
            held.restore()

"""The torch side of a comparison: run it (outputs, gradients or tangents, records) into a :class:`TorchSide`.

torch is imported lazily, inside the functions that run it: a :class:`TorchSide` read from
a reference file needs no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from flax_ln.convert.assign import host_buffer, owned_copy
from flax_ln.parity.core.call import (
    Call,
    flatten_outputs,
    is_float,
    named_outputs,
    numbers_as_arrays,
    run_forward,
    with_floats,
)
from flax_ln.parity.core.policy import HALF_PRECISION, TOLERANCES, parameter_dtype, zero_gradient_names
from flax_ln.parity.core.spill import to_file
from flax_ln.parity.islands.torch import lift_float32, torch_in_float64
from flax_ln.parity.records.capture import Calls, Records, capture_torch
from flax_ln.parity.records.torch_trace import TorchTrace, tracing


def _torch():
    import torch

    return torch


def output_cotangents(outputs: Mapping[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """Fixed random cotangents for the floating outputs, shared by both sides: drawn in float64, then cast to
    each output's dtype (into :func:`~flax_ln.convert.assign.host_buffer` s: a vocabulary's logits are large)."""
    rng = np.random.default_rng(seed)
    drawn = {k: rng.standard_normal(out=host_buffer(v.shape, np.float64)) for k, v in outputs.items() if is_float(v)}
    return {k: d if outputs[k].dtype == d.dtype else owned_copy(d, outputs[k].dtype) for k, d in drawn.items()}


def to_numpy(value: Any) -> np.ndarray:
    """A torch tensor or a Python number as a NumPy array of its own (a copy: later in-place ops cannot change it)."""
    if hasattr(value, "detach"):
        return owned_copy(value.detach().cpu().numpy())
    return np.array(value)


def torch_outputs(outputs: Any, numbers: str) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, str]]:
    """A torch forward's result: its compared leaves as NumPy copies and as they are (tensors), and the dropped.
    Python numbers become 0-d arrays of ``numbers``, the comparison's parameter dtype (as on the flax side)."""
    named, dropped = flatten_outputs(outputs)
    named = numbers_as_arrays(named, numbers)
    return {k: to_numpy(v) for k, v in named}, dict(named), dropped


@contextlib.contextmanager
def _torch_eval_untouched(module) -> Iterator[None]:
    """``module`` in eval mode with fresh gradients for this scope; its modes and ``.grad`` are restored after.

    And torch's fused attention fast path off (``torch.backends.mha``): ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` take ``aten::_native_multi_head_attention`` when autograd is off, which has no
    forward-mode derivative (``mode="jvp"``) and calls no submodule (localisation records none). The composite
    path computes the same function."""
    mha = getattr(_torch().backends, "mha", None)
    fast_path = mha.get_fastpath_enabled() if mha is not None else None
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    module.eval()
    module.zero_grad(set_to_none=True)
    if mha is not None:
        mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fast_path)
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad


def torch_tensors(inputs: Sequence[Any], kwargs: Mapping[str, Any], *, grad: bool = False, double: bool = False):
    """The inputs and kwargs as torch tensors (the one place they are converted); ``double`` casts floating
    ones to float64, ``grad`` tracks the floating inputs. Keyword values that are not arrays stay as they are."""
    torch = _torch()

    def tensor(x, track):
        x = np.array(x)
        if double and is_float(x):
            x = x.astype(np.float64)
        return torch.from_numpy(x).requires_grad_(track and is_float(x))

    return (
        [tensor(x, grad) for x in inputs],
        {k: tensor(v, False) if isinstance(v, (np.ndarray, np.generic)) else v for k, v in kwargs.items()},
    )


def trainable_and_frozen(module) -> tuple[list[str], list[str]]:
    """The torch parameter names that require gradients, and those that do not (frozen)."""
    named = list(module.named_parameters())
    return [n for n, p in named if p.requires_grad], [n for n, p in named if not p.requires_grad]


def _forward_name(forward: Any) -> str:
    """How an error names the torch function of ``forward=``."""
    if forward is None:
        return "the torch module's own forward (forward=None)"
    return f"the torch function of forward= ({getattr(forward, '__qualname__', repr(forward))})"


def _check_graph(value, module, tensors, call: Call, differentiated: bool) -> None:
    """Raise when the differentiated scalar has no autograd graph though something should have a gradient
    (a trainable parameter or a floating input) and the outputs it weighs are floating (``differentiated``):
    a forward run under ``torch.no_grad()``/``torch.inference_mode()``, or detached outputs, would otherwise
    compare no gradient at all and pass a port whose gradients are wrong."""
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    floating = [n for n, t in zip(call.input_names, tensors) if t.requires_grad]
    if value.requires_grad or not differentiated or not (trainable or floating):
        return
    what = " or the ".join(
        part
        for part in (
            f"{len(trainable)} trainable parameters ({', '.join(trainable[:3])}{', ...' if len(trainable) > 3 else ''})"
            if trainable
            else "",
            f"floating inputs ({', '.join(floating)})" if floating else "",
        )
        if part
    )
    source = _forward_name(call.forward[0]) + (" with the torch loss= function" if call.loss is not None else "")
    raise ValueError(
        f"{source} returned outputs with no autograd graph: the differentiated scalar depends on none of the "
        f"{what}, so no gradient could be compared. Was it run under torch.no_grad() or torch.inference_mode(), "
        "or were its outputs .detach()ed? Remove that, so the outputs keep their graph; to compare outputs only, "
        "freeze the parameters (torch_module.requires_grad_(False)) and give no floating input"
    )


def _run_torch(module, call: Call, cotangents=None, *, double=False, numbers="float32", spill=False):
    """Outputs, dropped outputs, cotangents, loss and gradients (inputs by ``grad <name>``, trainable parameters
    by name) of the torch side.

    ``cotangents`` (default: drawn by :func:`output_cotangents`) weight the outputs in the
    differentiated scalar; ``double`` runs in float64 (the module must be float64 then);
    ``numbers``: the dtype of Python numbers among the outputs; ``spill``: the parameter gradients are moved into
    files one at a time (:func:`flax_ln.parity.core.spill.to_file`), each freed in torch at once. When that scalar
    depends on nothing that requires a gradient (every parameter frozen, no floating input, or no
    floating output), there are no gradients; a forward whose floating outputs lost their
    graph is an error (:func:`_check_graph`).
    """
    torch = _torch()
    tensors, t_kwargs = torch_tensors(call.inputs, call.kwargs, grad=True, double=double)
    with _torch_eval_untouched(module):
        outputs = run_forward(call.forward[0], module, tensors, t_kwargs)
        named, raw, dropped = torch_outputs(outputs, "float64" if double else numbers)
        if call.loss is None:
            if cotangents is None:
                cotangents = output_cotangents({k: v for k, v in named.items() if hasattr(raw[k], "detach")})
            terms = [(raw[k] * torch.from_numpy(c).to(raw[k].dtype)).sum() for k, c in cotangents.items()]
            # summed from the first term, so the scalar has the outputs' dtype (no float32 zero of its own)
            value = sum(terms[1:], terms[0]) if terms else torch.zeros((), dtype=torch.float64 if double else None)
        else:
            cotangents = {}
            value = call.loss[0](outputs)
        _check_graph(value, module, tensors, call, call.loss is not None or bool(cotangents))
        grads: dict[str, np.ndarray] = {}
        if value.requires_grad:
            value.backward()
            grads = {f"grad {n}": t.grad.numpy() for n, t in zip(call.input_names, tensors) if t.requires_grad}
            for name, p in module.named_parameters():  # a parameter the forward does not use has gradient zero
                if p.requires_grad:
                    grads[name] = np.zeros(p.shape, p.detach().numpy().dtype) if p.grad is None else p.grad.numpy()
                    if spill:
                        grads[name], p.grad = to_file(grads[name]), None
    return named, dropped, cotangents, value.detach().numpy(), grads


def _tangents(
    inputs, input_names, params: Mapping[str, np.ndarray], with_params: bool, seed: int = 1
) -> dict[str, np.ndarray]:
    """Fixed random tangents shared by both sides: ``tangent <input>`` for floating inputs, and
    every parameter by torch name when ``with_params`` (or when no input is floating)."""
    rng = np.random.default_rng(seed)
    tangents = {
        f"tangent {n}": rng.standard_normal(x.shape).astype(x.dtype) for n, x in zip(input_names, inputs) if is_float(x)
    }
    if with_params or not tangents:
        tangents.update({k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()})
    return tangents


@contextlib.contextmanager
def _composite_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` on its math backend (composite ops) for this scope: the fused kernels
    (flash, memory-efficient) have no forward-mode derivative, so ``torch.func.jvp`` through them raises."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # a torch without the selector: nothing to choose
        yield
        return
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _run_torch_jvp(module, call: Call, tangents, *, double=False, numbers="float32"):
    """Outputs and output tangents (``tangent <output>``) of the torch side by ``torch.func.jvp``.

    The forward runs through ``torch.func.functional_call`` over the parameters named in
    ``tangents`` (the others and the buffers stay as they are), so the parameters are
    primal inputs of the function that is differentiated.
    """
    torch = _torch()
    from torch.func import functional_call, jvp

    input_names = call.input_names
    tensors, t_kwargs = torch_tensors(call.inputs, call.kwargs, double=double)
    float_positions = [i for i, n in enumerate(input_names) if f"tangent {n}" in tangents]
    params = {n: p.detach() for n, p in module.named_parameters() if n in tangents}

    class Forward(torch.nn.Module):  # type: ignore[name-defined]  # torch is imported lazily; functional_call replaces parameters only in a module's own call
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, *args):
            return run_forward(call.forward[0], self.model, args, t_kwargs)

    wrapper = Forward()

    def run(param_values, *floats):
        args = with_floats(tensors, float_positions, floats)
        return functional_call(wrapper, {f"model.{n}": v for n, v in param_values.items()}, tuple(args))

    def tangent(key, like):
        return torch.from_numpy(np.array(tangents[key])).to(like.dtype)

    primal_in = (params, *(tensors[i] for i in float_positions))
    tangent_in = (
        {n: tangent(n, p) for n, p in params.items()},
        *(tangent(f"tangent {input_names[i]}", tensors[i]) for i in float_positions),
    )
    with _torch_eval_untouched(module), torch.no_grad(), _composite_attention():
        outputs, output_tangents = jvp(run, primal_in, tangent_in)  # type: ignore[misc]  # jvp returns a pair here (no has_aux)
    named, _, dropped = torch_outputs(outputs, "float64" if double else numbers)
    named.update({f"tangent {k}": to_numpy(v) for k, v in named_outputs(output_tangents) if is_float(named[k])})
    return named, dropped


def resolve_dtype(torch_module, dtype: str | None) -> str:
    """The dtype of a comparison: ``dtype``, checked against the torch parameters' dtype (default: theirs).
    ``"float64"`` takes float32 parameters too: that comparison runs on a float64 copy."""
    found = sorted({str(p.dtype).removeprefix("torch.") for p in torch_module.parameters() if p.is_floating_point()})
    if dtype is None:
        if len(found) > 1:
            raise ValueError(f"compare_modules: the torch module mixes parameter dtypes {found}; pass dtype=")
        dtype = found[0] if found else "float32"
    if dtype not in TOLERANCES:
        raise ValueError(f"compare_modules: dtype must be one of {list(TOLERANCES)}, got {dtype!r}")
    want = parameter_dtype(dtype)
    if dtype == "float64" and found == ["float32"]:
        return dtype  # float64 in one argument: the comparison runs on float64 copies (torch_in_float64)
    if found and found != [want]:
        raise ValueError(
            f"compare_modules(dtype={dtype!r}) needs torch parameters in {want}, found {found}: "
            f"call torch_module.to(torch.{want})"
            + (" (half precision compares against a float32 torch reference)" if dtype in HALF_PRECISION else "")
        )
    return dtype


@dataclasses.dataclass
class TorchSide:
    """Everything a comparison takes from torch, from a live run (:func:`run_torch_side`) or a
    reference file (:mod:`flax_ln.book.reference`). Arrays are NumPy; parameters go by torch name.

    ``expected`` holds, by report name, what flax must reproduce (outputs, then ``loss``,
    gradients, or output tangents) and ``kinds`` their kinds; ``truth`` the same from a
    float64 run (``attribute``); ``records``/``calls`` every submodule's first call (for
    the first divergence and isolated mode), captured on demand, with ``trace``: torch's own code around them.
    """

    name: str
    dtype: str
    mode: str  # "grad": outputs and reverse-mode gradients; "jvp": outputs and forward-mode tangents
    inputs: list[np.ndarray]
    input_names: list[str]
    kwargs: dict[str, Any]
    state_dict: dict[str, np.ndarray]
    param_names: list[str]
    expected: dict[str, np.ndarray]
    kinds: dict[str, str]
    cotangents: dict[str, np.ndarray]
    tangents: dict[str, np.ndarray]
    truth: dict[str, np.ndarray] | None = None
    records: Records | None = None
    calls: Calls | None = None
    trace: TorchTrace | None = None  # torch's own code around each recorded module (its op trace), when recorded
    float64_zero: list[str] | None = None  # gradients float64 shows are zero (a reference file's; None: unknown)
    frozen: list[str] = dataclasses.field(default_factory=list)  # parameters without requires_grad: no gradient
    dropped_outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # output leaves not compared: type

    def call(self, forward=None, loss=None) -> Call:
        """The :class:`~flax_ln.parity.core.call.Call` of this side's inputs, with a ``forward`` and ``loss``."""
        return Call.make(
            self.inputs, input_names=self.input_names, kwargs=self.kwargs, forward=forward, loss=loss, mode=self.mode
        )


MODES = ("grad", "jvp")


def torch_results(module, call: Call, mode, cotangents, tangents, *, double=False, dtype="float32", spill=False):
    """``(expected, kinds, cotangents, dropped outputs)`` of one torch run (see :class:`TorchSide`) in a comparison at
    ``dtype`` (``double``: in float64; ``spill``: parameter gradients kept in files)."""
    numbers = parameter_dtype(dtype)
    if mode == "jvp":
        expected, dropped = _run_torch_jvp(module, call, tangents, double=double, numbers=numbers)
        return expected, {k: "tangent" if k.startswith("tangent ") else "output" for k in expected}, {}, dropped
    param_names = trainable_and_frozen(module)[0]
    outputs, dropped, cotangents, value, grads = _run_torch(
        module, call, cotangents, double=double, numbers=numbers, spill=spill
    )
    expected, kinds = dict(outputs), dict.fromkeys(outputs, "output")
    if call.loss is not None:
        expected["loss"], kinds["loss"] = value, "loss"
    for k, g in grads.items():
        expected[k], kinds[k] = g, "param grad" if k in param_names else "input grad"
    return expected, kinds, cotangents, dropped


def run_torch_side(
    torch_module,
    inputs,
    *,
    input_names=None,
    kwargs=None,
    forward=None,
    loss=None,
    dtype: str,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    record: bool = False,
    name: str | None = None,
    share_weights: bool = False,
    spill_gradients: bool = False,
) -> TorchSide:
    """Run the torch side once (and, with ``attribute``, once more on a float64 copy, the same
    cotangents or tangents in float64). ``record`` captures every submodule's call too.
    ``share_weights``: ``state_dict`` holds read-only views of the module's tensors instead of copies (one copy
    of the weights fewer; for a side compared at once, while the module is not changed, as
    :func:`~flax_ln.parity.compare_modules` does). ``spill_gradients``: the parameter gradients are kept in
    files (:mod:`flax_ln.parity.core.spill`), for a comparison that would not fit in memory otherwise.

    ``inputs`` is a :class:`~flax_ln.parity.core.call.Call` (then ``input_names``, ``kwargs``,
    ``forward`` and ``loss`` come from it), or the inputs of one, as in
    :func:`~flax_ln.parity.compare_modules`. Frozen parameters (``requires_grad=False``)
    get no gradient and no tangent; they are listed in ``frozen``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    call = (
        inputs
        if isinstance(inputs, Call)
        else Call.make(inputs, input_names=input_names, kwargs=kwargs, forward=forward, loss=loss, mode=mode)
    )
    state_dict = _state_dict(torch_module, share_weights)
    param_names, frozen = trainable_and_frozen(torch_module)
    tangents = (
        _tangents(call.inputs, call.input_names, {k: state_dict[k] for k in param_names}, tangent_params)
        if mode == "jvp"
        else {}
    )
    expected, kinds, cotangents, dropped, truth = _results_and_truth(
        torch_module, call, mode, tangents, dtype, attribute, spill_gradients
    )
    side = TorchSide(
        name or type(torch_module).__name__,
        dtype,
        mode,
        list(call.inputs),
        list(call.input_names),
        dict(call.kwargs),
        state_dict,
        param_names,
        expected,
        kinds,
        cotangents,
        tangents,
        truth=truth,
        frozen=frozen,
        dropped_outputs=dropped,
    )
    if record:
        record_torch_side(side, torch_module, call.forward[0])
    return side


def _results_and_truth(torch_module, call: Call, mode: str, tangents, dtype: str, attribute: bool, spill=False):
    """:func:`torch_results` of one run and, with ``attribute``, the expected values of a float64 run (the same
    cotangents or tangents in float64; ``None`` without)."""
    expected, kinds, cotangents, dropped = torch_results(
        torch_module, call, mode, None, tangents, dtype=dtype, spill=spill
    )
    truth = None
    if attribute:
        with torch_in_float64(torch_module):
            truth = torch_results(torch_module, call, mode, cotangents, tangents, double=True)[0]
    return expected, kinds, cotangents, dropped, truth


def with_tangents(side: TorchSide, torch_module, call: Call, tangents: Mapping[str, np.ndarray]) -> TorchSide:
    """``side`` (a ``"jvp"`` one) run again on ``torch_module`` with ``tangents`` instead of its own (torch-named; a
    frozen parameter named in them takes its tangent too): its expected values, and its truth when it has one."""
    expected, kinds, _, dropped, truth = _results_and_truth(
        torch_module, call, "jvp", dict(tangents), side.dtype, side.truth is not None
    )
    return dataclasses.replace(
        side, expected=expected, kinds=kinds, tangents=dict(tangents), truth=truth, dropped_outputs=dropped
    )


def float64_gradients(side: TorchSide, torch_module, call: Call) -> dict[str, np.ndarray]:
    """The torch side's parameter gradients in float64, by torch name: from ``side.truth`` when it holds them, else
    from one float64 run of the torch side (the same cotangents, float32 islands lifted); none in ``"jvp"`` mode,
    which has no gradients."""
    if side.mode != "grad":
        return {}
    truth = side.truth
    if truth is None:  # float32 islands lifted: a float32 softmax would leave ~1e-8 noise where the math has zero
        with torch_in_float64(torch_module), lift_float32(torch_module):
            truth = torch_results(torch_module, call, "grad", side.cotangents, {}, double=True)[0]
    return {k: truth[k] for k in side.param_names if k in truth}


def float64_zero_gradients(side: TorchSide, torch_module, call: Call) -> list[str]:
    """The parameter gradients float64 shows are zero in the mathematics
    (:func:`~flax_ln.parity.zero_gradient_names` of :func:`float64_gradients`)."""
    return sorted(zero_gradient_names(float64_gradients(side, torch_module, call)))


def read_only_view(tensor) -> np.ndarray:
    """A CPU torch tensor's memory as a read-only NumPy array (no copy): nothing written through it reaches torch."""
    view = tensor.detach().numpy()
    view.flags.writeable = False
    return view


def _state_dict(torch_module, share: bool = False, parameters_only: bool = False) -> dict[str, np.ndarray]:
    """The module's state dict as NumPy copies (``share``: the parameters as read-only views, no copy, for a side
    used at once while the module is not changed; buffers, which a forward may update in place, are copied);
    keys that hold one torch tensor (a tie) hold one array, so that :func:`flax_ln.convert.find_ties` finds the
    tie in the copy too. ``parameters_only`` (with ``share``): the shared parameters' entries alone."""
    params = {p.data_ptr() for p in torch_module.parameters()} if share else set()
    copies: dict[tuple, np.ndarray] = {}
    out = {}
    for k, v in torch_module.state_dict().items():
        shared = bool(v.numel()) and v.data_ptr() in params and v.device.type == "cpu"
        if parameters_only and not shared:
            continue
        address = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), str(v.dtype)) if v.numel() else (k,)
        if address not in copies:
            copies[address] = read_only_view(v) if shared else to_numpy(v)
        out[k] = copies[address]
    return out


def share_parameters(side: TorchSide, torch_module) -> None:
    """Point ``side.state_dict``'s parameter entries at ``torch_module``'s parameters as they are now (read-only
    views; a tie one view): after a float64 run gave back the float64 copies it made
    (:meth:`~flax_ln.parity.islands.torch.Float64Parameters.release`), the caller's own values, which a loader
    casts to float64 exactly, and the copies are freed."""
    side.state_dict.update(_state_dict(torch_module, share=True, parameters_only=True))


def record_torch_side(side: TorchSide, torch_module, forward) -> None:
    """Fill ``side.records`` and ``side.calls``: every torch submodule's first call, on the side's inputs."""
    tensors, t_kwargs = torch_tensors(side.inputs, side.kwargs)
    side.calls, side.trace = {}, (trace := TorchTrace())
    with _torch_eval_untouched(torch_module):
        side.records = capture_torch(
            torch_module,
            lambda: run_forward(forward, torch_module, tensors, t_kwargs),
            side.calls,
            lambda: tracing(torch_module, trace),
        )

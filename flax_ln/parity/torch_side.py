"""The torch side of a comparison: run it (outputs, gradients or tangents, records) into a :class:`TorchSide`.

torch is imported lazily, inside the functions that run it: a :class:`TorchSide` read from
a reference file needs no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from flax_ln.parity.call import _call, _is_float, named_outputs
from flax_ln.parity.capture import Calls, Records, capture_torch
from flax_ln.parity.policy import HALF_PRECISION, TOLERANCES


def _torch():
    import torch

    return torch


def _cotangents(outputs: list[tuple[str, np.ndarray]], seed: int = 0) -> dict[str, np.ndarray]:
    """Fixed random cotangents for the floating outputs, shared by both sides."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in outputs if _is_float(v)}


@contextlib.contextmanager
def _torch_eval_untouched(module) -> Iterator[None]:
    """``module`` in eval mode with fresh gradients for this scope; its modes and ``.grad`` are restored after."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    module.eval()
    module.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad


def _torch_tensors(inputs, kwargs, *, grad: bool = False, double: bool = False):
    """The inputs and kwargs as torch tensors; ``double`` casts floating ones to float64, ``grad`` tracks them."""
    torch = _torch()

    def tensor(x, track):
        x = np.array(x)
        if double and _is_float(x):
            x = x.astype(np.float64)
        return torch.from_numpy(x).requires_grad_(track and _is_float(x))

    return (
        [tensor(x, grad) for x in inputs],
        {k: tensor(v, False) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()},
    )


def _run_torch(module, inputs, input_names, kwargs, forward, loss, cotangents=None, *, double=False):
    """Outputs, cotangents, loss and gradients (inputs by ``grad <name>``, parameters by name) of the torch side.

    ``cotangents`` (default: drawn by :func:`_cotangents`) weight the outputs in the
    differentiated scalar; ``double`` runs in float64 (the module must be float64 then).
    """
    torch = _torch()
    tensors, t_kwargs = _torch_tensors(inputs, kwargs, grad=True, double=double)
    with _torch_eval_untouched(module):
        outputs = _call(forward, module, tensors, t_kwargs)
        named = [(k, v.detach().numpy()) for k, v in named_outputs(outputs)]
        if loss is None:
            if cotangents is None:
                cotangents = _cotangents(named)
            value = sum(
                (v * torch.from_numpy(cotangents[k]).to(v.dtype)).sum()
                for k, v in named_outputs(outputs)
                if k in cotangents
            )
        else:
            cotangents = {}
            value = loss[0](outputs)
        value.backward()
        grads = {f"grad {n}": t.grad.numpy() for n, t in zip(input_names, tensors) if t.requires_grad}
        for name, p in module.named_parameters():  # a parameter the forward does not use has gradient zero
            grads[name] = np.zeros(p.shape, p.detach().numpy().dtype) if p.grad is None else p.grad.numpy()
    return dict(named), cotangents, value.detach().numpy(), grads


def _tangents(
    inputs, input_names, params: Mapping[str, np.ndarray], with_params: bool, seed: int = 1
) -> dict[str, np.ndarray]:
    """Fixed random tangents shared by both sides: ``tangent <input>`` for floating inputs, and
    every parameter by torch name when ``with_params`` (or when no input is floating)."""
    rng = np.random.default_rng(seed)
    tangents = {
        f"tangent {n}": rng.standard_normal(x.shape).astype(x.dtype)
        for n, x in zip(input_names, inputs)
        if _is_float(x)
    }
    if with_params or not tangents:
        tangents.update({k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()})
    return tangents


def _run_torch_jvp(module, inputs, input_names, kwargs, forward, tangents, *, double=False):
    """Outputs and output tangents (``tangent <output>``) of the torch side by ``torch.func.jvp``.

    The forward runs through ``torch.func.functional_call`` over the parameters named in
    ``tangents`` (the others and the buffers stay as they are), so the parameters are
    primal inputs of the function that is differentiated.
    """
    torch = _torch()
    from torch.func import functional_call, jvp

    tensors, t_kwargs = _torch_tensors(inputs, kwargs, double=double)
    float_positions = [i for i, n in enumerate(input_names) if f"tangent {n}" in tangents]
    params = {n: p.detach() for n, p in module.named_parameters() if n in tangents}

    class Forward(torch.nn.Module):  # functional_call replaces parameters only in a module's own call
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, *args):
            return _call(forward, self.model, args, t_kwargs)

    wrapper = Forward()

    def run(param_values, *floats):
        args = list(tensors)
        for i, x in zip(float_positions, floats):
            args[i] = x
        return functional_call(wrapper, {f"model.{n}": v for n, v in param_values.items()}, tuple(args))

    def tangent(key, like):
        return torch.from_numpy(np.array(tangents[key])).to(like.dtype)

    primal_in = (params, *(tensors[i] for i in float_positions))
    tangent_in = (
        {n: tangent(n, p) for n, p in params.items()},
        *(tangent(f"tangent {input_names[i]}", tensors[i]) for i in float_positions),
    )
    with _torch_eval_untouched(module), torch.no_grad():
        outputs, output_tangents = jvp(run, primal_in, tangent_in)
    named = {k: v.detach().numpy() for k, v in named_outputs(outputs)}
    named.update({f"tangent {k}": v.detach().numpy() for k, v in named_outputs(output_tangents) if _is_float(named[k])})
    return named


def _resolve_dtype(torch_module, dtype: str | None) -> str:
    found = sorted({str(p.dtype).removeprefix("torch.") for p in torch_module.parameters() if p.is_floating_point()})
    if dtype is None:
        if len(found) > 1:
            raise ValueError(f"compare_modules: the torch module mixes parameter dtypes {found}; pass dtype=")
        dtype = found[0] if found else "float32"
    if dtype not in TOLERANCES:
        raise ValueError(f"compare_modules: dtype must be one of {list(TOLERANCES)}, got {dtype!r}")
    want = "float32" if dtype in HALF_PRECISION else dtype
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
    reference file (:mod:`flax_ln.parity.reference`). Arrays are NumPy; parameters go by torch name.

    ``expected`` holds, by report name, what flax must reproduce (outputs, then ``loss``,
    gradients, or output tangents) and ``kinds`` their kinds; ``truth`` the same from a
    float64 run (``attribute``); ``records``/``calls`` every submodule's first call (for
    the first divergence and isolated mode), captured on demand.
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


MODES = ("grad", "jvp")


def _torch_results(module, inputs, input_names, kwargs, forward, loss, mode, cotangents, tangents, *, double=False):
    """``(expected, kinds, cotangents)`` of one torch run (see :class:`TorchSide`)."""
    param_names = [n for n, _ in module.named_parameters()]
    if mode == "jvp":
        expected = _run_torch_jvp(module, inputs, input_names, kwargs, forward, tangents, double=double)
        return expected, {k: "tangent" if k.startswith("tangent ") else "output" for k in expected}, {}
    outputs, cotangents, value, grads = _run_torch(
        module, inputs, input_names, kwargs, forward, loss, cotangents, double=double
    )
    expected, kinds = dict(outputs), dict.fromkeys(outputs, "output")
    if loss is not None:
        expected["loss"], kinds["loss"] = value, "loss"
    for k, g in grads.items():
        expected[k], kinds[k] = g, "param grad" if k in param_names else "input grad"
    return expected, kinds, cotangents


def run_torch_side(
    torch_module,
    inputs,
    *,
    input_names,
    kwargs,
    forward,
    loss,
    dtype: str,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    record: bool = False,
    name: str | None = None,
) -> TorchSide:
    """Run the torch side once (and, with ``attribute``, once more on a float64 copy, the same
    cotangents or tangents in float64). ``record`` captures every submodule's call too."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    state_dict = {k: v.detach().numpy().copy() for k, v in torch_module.state_dict().items()}
    param_names = [n for n, _ in torch_module.named_parameters()]
    tangents = (
        _tangents(inputs, input_names, {k: state_dict[k] for k in param_names}, tangent_params) if mode == "jvp" else {}
    )
    expected, kinds, cotangents = _torch_results(
        torch_module, inputs, input_names, kwargs, forward, loss, mode, None, tangents
    )
    side = TorchSide(
        name or type(torch_module).__name__,
        dtype,
        mode,
        list(inputs),
        list(input_names),
        dict(kwargs),
        state_dict,
        param_names,
        expected,
        kinds,
        cotangents,
        tangents,
    )
    if attribute:
        with _torch_in_float64(torch_module):
            side.truth = _torch_results(
                torch_module, inputs, input_names, kwargs, forward, loss, mode, cotangents, tangents, double=True
            )[0]
    if record:
        record_torch_side(side, torch_module, forward)
    return side


@contextlib.contextmanager
def _torch_in_float64(module) -> Iterator[None]:
    """``module`` in float64 for this scope, then back in its dtype: float32/16 -> float64 -> back is exact.
    (A deep copy is not always possible: torch refuses to copy non-leaf tensors held as attributes.)"""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:
        p.grad = None
    module.double()
    try:
        yield
    finally:
        if dtype is not None:
            module.to(dtype)
        for p, grad in grads:
            p.grad = grad


def record_torch_side(side: TorchSide, torch_module, forward) -> None:
    """Fill ``side.records`` and ``side.calls``: every torch submodule's first call, on the side's inputs."""
    tensors, t_kwargs = _torch_tensors(side.inputs, side.kwargs)
    side.calls = {}
    with _torch_eval_untouched(torch_module):
        side.records = capture_torch(torch_module, lambda: _call(forward, torch_module, tensors, t_kwargs), side.calls)

"""A model with its inputs and training step as one parity case: :class:`Case`, :class:`TrainSpec`,
:func:`check_case`, :func:`check_training` and :func:`torch_side_of_case`. The book's models are built
as cases in :mod:`flax_ln.book.cases`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import load_torch_state_dict, to_torch_state_dict
from flax_ln.parity.compare import compare_modules
from flax_ln.parity.core.call import Call, forward_pair, run_forward
from flax_ln.parity.core.policy import Tolerance, compare_tensors, numerics, zero_gradient_names
from flax_ln.parity.islands.torch import torch_in_float64
from flax_ln.parity.report.data import ParityReport
from flax_ln.parity.sides.torch import (
    TorchSide,
    float64_zero_gradients,
    resolve_dtype,
    run_torch_side,
    torch_tensors,
)


@dataclasses.dataclass
class TrainSpec:
    """How to train a case for ``--train-steps``: the loss on both sides and the two optimizers.

    ``loss`` is ``(torch_fn, flax_fn)``, each mapping that side's forward outputs to a
    scalar, as in :func:`compare_modules`. ``torch_optimizer(model)`` returns
    ``(optimizer, scheduler_or_None)``; ``clip_norm`` applies
    ``torch.nn.utils.clip_grad_norm_`` before each torch step, and the optax side must
    contain the matching clip (:func:`flax_ln.train.clip_by_global_norm_like_torch`).
    """

    loss: tuple[Callable[[Any], Any], Callable[[Any], jax.Array]]
    torch_optimizer: Callable[[Any], tuple[Any, Any]]
    optax_optimizer: Any
    clip_norm: float | None = None


@dataclasses.dataclass
class Case:
    """A torch module, its flax twin and the inputs to run them on, for :func:`check_case`.

    ``forward`` is as in :func:`compare_modules`: ``forward(module, *inputs, **kwargs)`` runs
    either module (default: calling it; the module trees mirror each other, so one function
    serves both frameworks), or a pair ``(torch_fn, flax_fn)``.
    """

    name: str
    torch_model: Any
    flax_model: nnx.Module
    inputs: Sequence[np.ndarray]
    input_names: Sequence[str]
    dtype: str = "float32"
    forward: Any = None  # one callable for both sides, or (torch_fn, flax_fn)
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    train: TrainSpec | None = None
    lm_logits: str | None = None  # the output holding next-token logits, for the LM metrics
    spec: Mapping[str, Any] | None = None  # how to rebuild the flax side without torch (flax_ln.book.reference)
    stored_dtype: str | None = None  # a checkpoint's dtype(s) on disk, named in the report


def check_case(
    case: Case,
    tolerances: Mapping[str, Tolerance] | None = None,
    *,
    localize_failures: bool = True,
    capture_modules: bool = False,
    mode: str = "grad",
    attribute: bool = False,
    mesh=None,
    quiet: bool = False,
) -> ParityReport:
    """:func:`compare_modules` on a case (its ``forward``, LM metrics on ``case.lm_logits``). ``capture_modules``
    records every submodule's error even when all pass; ``mode``, ``attribute``, ``mesh`` and ``quiet`` (no
    progress bar) as in :func:`compare_modules`; the report names ``case.stored_dtype``."""
    report = compare_modules(
        case.torch_model,
        case.flax_model,
        case.inputs,
        kwargs=case.kwargs,
        tolerances=tolerances,
        dtype=case.dtype,
        forward=case.forward,
        input_names=case.input_names,
        name=case.name,
        localize_failures=localize_failures,
        capture_modules=capture_modules,
        mode=mode,
        attribute=attribute,
        lm_logits=case.lm_logits,
        mesh=mesh,
        quiet=quiet,
    )
    report.stored_dtype = case.stored_dtype
    return report


def torch_side_of_case(case: Case, *, mode: str = "grad", attribute: bool = False, record: bool = False) -> TorchSide:
    """The torch side of a case (for a reference file: ``record=True``), compared later by :func:`compare_side`."""
    dtype = resolve_dtype(case.torch_model, case.dtype)
    call = Call.make(case.inputs, input_names=case.input_names, kwargs=case.kwargs, forward=case.forward, mode=mode)
    with numerics(dtype):
        side = run_torch_side(
            case.torch_model, call, dtype=dtype, mode=mode, attribute=attribute, record=record, name=case.name
        )
        side.float64_zero = float64_zero_gradients(side, case.torch_model, call)  # float64's word, kept in the file
    return side


def check_training(case: Case, steps: int, tolerances: Mapping[str, Tolerance]) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps on both sides from the same weights, dropout off.

    After every step, the loss and every parameter (torch names) are compared; each
    record holds the step's loss on both sides, their relative error and the worst
    parameter's relative error: the drift per step.

    Parameters whose gradient float64 shows is zero in the mathematics (torch's float64
    gradient at the starting weights, :func:`~flax_ln.parity.zero_gradient_names`) are listed
    as ``noise_only`` and not compared: their float32 gradients are rounding noise, which
    Adam divides by its own magnitude, so it moves them by about the learning rate in
    directions set by that noise, differently in each framework. They cannot affect the
    loss, which is compared. Any other gradient, however small, is compared.
    """
    if case.train is None:
        raise ValueError(f"model {case.name!r} has no training setup for --train-steps")
    import optax
    import torch

    spec = case.train
    torch_loss, flax_loss = spec.loss
    with numerics(case.dtype):
        load_torch_state_dict(case.flax_model, case.torch_model.state_dict())
        torch_model = case.torch_model.train(False)
        optimizer, scheduler = spec.torch_optimizer(torch_model)
        torch_forward, flax_forward = forward_pair(case.forward)
        t_inputs, t_kwargs = torch_tensors(case.inputs, case.kwargs)

        flax_model = case.flax_model
        flax_model.eval()
        graphdef, params, rest = nnx.split(flax_model, nnx.Param, ...)  # type: ignore[misc]  # nnx.split's result is typed as a variadic tuple
        opt_state = spec.optax_optimizer.init(params)
        f_inputs = [jnp.asarray(x) for x in case.inputs]
        f_kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}

        @jax.jit
        def flax_step(params, opt_state, inputs):
            def loss_fn(p):
                return flax_loss(run_forward(flax_forward, nnx.merge(graphdef, p, rest), inputs, f_kwargs))

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = spec.optax_optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        with torch_in_float64(torch_model):  # float64's word on which gradients are zero, at the starting weights
            d_inputs, d_kwargs = torch_tensors(case.inputs, case.kwargs, double=True)
            torch_loss(run_forward(torch_forward, torch_model, d_inputs, d_kwargs)).backward()
            noise_only = zero_gradient_names(
                {name: p.grad.numpy() for name, p in torch_model.named_parameters() if p.grad is not None}
            )
        records = []
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            t_loss = torch_loss(run_forward(torch_forward, torch_model, t_inputs, t_kwargs))
            t_loss.backward()
            if spec.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(torch_model.parameters(), spec.clip_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            params, opt_state, f_loss = flax_step(params, opt_state, f_inputs)

            flax_params = to_torch_state_dict(nnx.merge(graphdef, params, rest))
            param_results = [
                compare_tensors(name, "param", flax_params[name], p.detach().numpy(), tolerances["grad"])
                for name, p in torch_model.named_parameters()
                if name not in noise_only
            ]
            worst = max(param_results, key=lambda r: r.excess)
            loss_result = compare_tensors(
                "loss", "loss", np.asarray(f_loss), t_loss.detach().numpy(), tolerances["output"]
            )
            records.append(
                {
                    "step": step,
                    "loss_flax": float(f_loss),
                    "loss_torch": float(t_loss.detach()),
                    "noise_only": sorted(noise_only),
                    "loss_rel_error": loss_result.relative_error,
                    "param_rel_error": worst.relative_error,
                    "worst_param": worst.name,
                    "passed": loss_result.passed and all(r.passed for r in param_results),
                }
            )
    return records

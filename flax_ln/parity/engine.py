"""Cross-framework parity: run a torch module and its flax twin on the same weights and compare.

The harness copies the torch weights through :func:`flax_ln.load_torch_state_dict`,
runs both models in eval mode, and compares every output, the gradient of a scalar
loss with respect to every floating input and every parameter (keyed by torch name).
When anything is out of tolerance it replays the forward pass with every submodule's
inputs and outputs captured on both sides (torch forward hooks; a temporary wrapper of
the NNX classes' ``__call__``) and names the first submodule, in execution order,
whose output diverges.

torch is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import load_torch_state_dict, to_torch_state_dict


# ---------------------------------------------------------------------------------------
# metrics and tolerances


def relative_error(actual, expected) -> float:
    """Relative Frobenius error ``||actual - expected|| / ||expected||`` in float64.

    NaN or Inf anywhere in either array gives ``inf`` unless both arrays have them at
    the same positions with the same values (NaN matching NaN), in which case the error
    of the finite entries is returned. ``expected == 0`` falls back to the absolute norm.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {b.shape}")
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(finite_a, finite_b):
        return float("inf")
    nonfinite = ~finite_a
    if nonfinite.any() and not np.array_equal(a[nonfinite], b[nonfinite], equal_nan=True):
        return float("inf")
    diff = np.linalg.norm(a[finite_a] - b[finite_b])
    scale = np.linalg.norm(b[finite_b])
    return float(diff / scale) if scale > 0 else float(diff)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """When a tensor passes: any one of

    * its relative Frobenius error is at most ``rtol``;
    * its largest absolute error is at most ``atol`` (tensors that are zero up to rounding);
    * for gradients, its error norm is at most ``gtol`` times the norm of the whole
      gradient (every parameter together). A parameter whose exact gradient is zero,
      such as the encoder-decoder's key-projection bias (adding a constant to a row of
      scores does not change its softmax), holds only rounding noise on both sides;
      measured against the whole gradient that noise is at the dtype's rounding level.
    """

    rtol: float
    atol: float
    gtol: float = 0.0


# Per-dtype policy. float64: both frameworks evaluate the same math, so differences are
# op-order rounding at ~1e-16 amplified by depth; 1e-11 / 1e-9 flags any real bug.
# float32: reduction order differs between XLA and torch kernels; outputs of small
# stacks agree to ~1e-6, gradients (two passes, more accumulation) to ~1e-5.
# gtol sits a few orders above each dtype's unit roundoff (1.1e-16, 6e-8).
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float64": {"output": Tolerance(1e-11, 1e-13), "grad": Tolerance(1e-9, 1e-13, gtol=1e-13)},
    "float32": {"output": Tolerance(2e-5, 1e-7), "grad": Tolerance(2e-4, 1e-7, gtol=1e-5)},
}


@dataclasses.dataclass
class TensorResult:
    """The comparison of one tensor: flax (actual) against torch (expected)."""

    name: str
    kind: str  # "output", "input grad", "param grad", "param", "loss", "module output", ...
    shape: tuple[int, ...]
    max_abs_error: float
    max_error_index: tuple[int, ...] | None
    relative_error: float
    tolerance: Tolerance
    nonfinite: str | None  # e.g. "NaN in flax: 3, in torch: 0"
    passed: bool
    passed_by: str | None = None  # which criterion held: "rtol", "atol" or "gtol"

    @property
    def excess(self) -> float:
        """How far past its tolerance the tensor is (> 1 fails), for ranking."""
        if self.nonfinite or not math.isfinite(self.relative_error):
            return math.inf

        if self.passed_by == "gtol":
            return 0.0  # a zero gradient's rounding noise: within tolerance by the gtol criterion

        def ratio(error: float, tol: float) -> float:
            return error / tol if tol > 0 else (math.inf if error > 0 else 0.0)

        return min(ratio(self.relative_error, self.tolerance.rtol), ratio(self.max_abs_error, self.tolerance.atol))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tolerance"] = dataclasses.asdict(self.tolerance)
        d["shape"] = list(self.shape)
        d["max_error_index"] = None if self.max_error_index is None else list(self.max_error_index)
        return {k: _json_number(v) for k, v in d.items()}


def _json_number(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; "inf"/"nan" stay explicit
    return v


def compare(name: str, kind: str, actual, expected, tolerance: Tolerance, *, gradient_norm: float = 0.0
            ) -> TensorResult:
    """Compare ``actual`` (flax) with ``expected`` (torch). NaN/Inf are flagged and fail.

    ``gradient_norm`` is the norm of the whole gradient this tensor belongs to, for ``tolerance.gtol``.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        return TensorResult(name, kind, tuple(b.shape), math.inf, None, math.inf, tolerance,
                            f"shape mismatch: flax {a.shape}, torch {b.shape}", False)
    counts = {
        label: (int(np.isnan(x).sum()), int(np.isinf(x).sum())) for label, x in (("flax", a), ("torch", b))
    }
    nonfinite = None
    if any(n or i for n, i in counts.values()):
        nonfinite = ", ".join(
            f"{kind_} in {label}: {c[k]}" for k, kind_ in enumerate(("NaN", "Inf")) for label, c in counts.items()
        )
    finite = np.isfinite(a) & np.isfinite(b)
    diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))
    if diff.size and finite.any():
        flat = int(np.argmax(diff))
        index = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
        max_abs = float(diff.reshape(-1)[flat])
    else:
        index, max_abs = None, 0.0
    rel = relative_error(a, b)
    criteria = {
        "rtol": rel <= tolerance.rtol,
        "atol": max_abs <= tolerance.atol,
        "gtol": float(np.linalg.norm(diff)) <= tolerance.gtol * gradient_norm,
    }
    passed_by = next((c for c, held in criteria.items() if held), None) if nonfinite is None else None
    return TensorResult(name, kind, tuple(b.shape), max_abs, index, rel, tolerance, nonfinite,
                        passed_by is not None, passed_by)


# ---------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    """A torch module, its flax twin and the inputs to run them on.

    ``inputs`` are NumPy arrays passed positionally to both ``torch_call`` and
    ``flax_call``; each returns a dict of named outputs. Floating inputs are
    differentiated. The scalar loss is ``sum_i sum(output_i * cotangent_i)`` over the
    floating outputs, with fixed random cotangents shared by both sides.
    """

    name: str
    torch_model: Any
    flax_model: nnx.Module
    inputs: Sequence[np.ndarray]
    input_names: Sequence[str]
    torch_call: Callable[..., Mapping[str, Any]]
    flax_call: Callable[..., Mapping[str, jax.Array]]
    dtype: str = "float32"
    train: TrainSpec | None = None


@dataclasses.dataclass
class TrainSpec:
    """How to train a case for ``--train-steps``: the loss on both sides and the two optimizers.

    ``torch_optimizer(model)`` returns ``(optimizer, scheduler_or_None)``; ``clip_norm``
    applies ``torch.nn.utils.clip_grad_norm_`` before each torch step, and the optax side
    must contain the matching clip (:func:`flax_ln.train.clip_by_global_norm_like_torch`).
    """

    torch_loss: Callable[..., Any]
    flax_loss: Callable[..., jax.Array]
    torch_optimizer: Callable[[Any], tuple[Any, Any]]
    optax_optimizer: Any
    clip_norm: float | None = None


@dataclasses.dataclass
class FirstDivergence:
    """The first submodule, in execution order, whose output is out of tolerance."""

    module: str
    inputs: list[TensorResult]
    outputs: list[TensorResult]

    def describe(self) -> str:
        out = max(self.outputs, key=lambda r: r.excess)
        ins = ", ".join(f"{r.name} rel {r.relative_error:.2e}" for r in self.inputs) or "none compared"
        return (
            f"first divergence: {self.module}  (output rel {out.relative_error:.2e}, "
            f"max |d| {out.max_abs_error:.2e} at {out.max_error_index}; inputs: {ins})"
        )


@dataclasses.dataclass
class CaseReport:
    name: str
    dtype: str
    results: list[TensorResult]
    first_divergence: FirstDivergence | None = None
    train_steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    module_errors: list[TensorResult] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results) and all(s["passed"] for s in self.train_steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "tensors": [r.to_json() for r in self.results],
            "first_divergence": None
            if self.first_divergence is None
            else {
                "module": self.first_divergence.module,
                "inputs": [r.to_json() for r in self.first_divergence.inputs],
                "outputs": [r.to_json() for r in self.first_divergence.outputs],
            },
            "module_errors": [r.to_json() for r in self.module_errors],
            "train_steps": [{k: _json_number(v) for k, v in s.items()} for s in self.train_steps],
        }


def _torch():
    import torch

    return torch


def _cotangents(outputs: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        k: rng.standard_normal(np.shape(v)).astype(np.asarray(v).dtype)
        for k, v in outputs.items()
        if np.issubdtype(np.asarray(v).dtype, np.floating)
    }


def run_torch(case: Case, cotangent_seed: int = 0):
    """Outputs, cotangents and gradients (inputs and parameters) of the torch side."""
    torch = _torch()
    model = case.torch_model.eval()
    model.zero_grad(set_to_none=True)
    tensors = []
    for x in case.inputs:
        t = torch.from_numpy(np.array(x))
        if t.is_floating_point():
            t.requires_grad_(True)
        tensors.append(t)
    outputs = case.torch_call(model, *tensors)
    outputs_np = {k: v.detach().numpy() for k, v in outputs.items()}
    cotangents = _cotangents(outputs_np, cotangent_seed)
    loss = sum((outputs[k] * torch.from_numpy(c)).sum() for k, c in cotangents.items())
    loss.backward()
    grads = {
        f"grad {name}": t.grad.numpy() for name, t in zip(case.input_names, tensors) if t.grad is not None
    }
    grads.update({name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None})
    return outputs_np, cotangents, grads


def run_flax(case: Case, cotangents: Mapping[str, np.ndarray]):
    """Outputs and gradients (inputs and parameters, torch names) of the flax side, jitted."""
    model = case.flax_model
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    float_positions = [i for i, x in enumerate(case.inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]

    def loss_fn(params, float_inputs, other_inputs):
        merged = nnx.merge(graphdef, params, rest)
        args = list(other_inputs)
        for i, x in zip(float_positions, float_inputs):
            args[i] = x
        outputs = case.flax_call(merged, *args)
        loss = sum(jnp.sum(outputs[k] * c) for k, c in cotangents.items())
        return loss, outputs

    float_inputs = [jnp.asarray(case.inputs[i]) for i in float_positions]
    other_inputs = [None if i in float_positions else jnp.asarray(x) for i, x in enumerate(case.inputs)]
    grad_fn = jax.jit(jax.grad(loss_fn, argnums=(0, 1), has_aux=True))
    (param_grads, input_grads), outputs = grad_fn(params, float_inputs, other_inputs)
    grads = {f"grad {case.input_names[i]}": np.asarray(g) for i, g in zip(float_positions, input_grads)}
    named = to_torch_state_dict(nnx.merge(graphdef, param_grads, rest))
    grads.update(named)
    return {k: np.asarray(v) for k, v in outputs.items()}, grads


def _global_norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays)))


def check_case(
    case: Case,
    tolerances: Mapping[str, Tolerance] | None = None,
    *,
    localize_failures: bool = True,
    capture_modules: bool = False,
) -> CaseReport:
    """Load weights, run both sides and compare everything.

    On failure (``localize_failures``), or always with ``capture_modules``, every
    submodule's output is compared too and the first divergence is named.
    """
    tolerances = tolerances or TOLERANCES[case.dtype]
    load_torch_state_dict(case.flax_model, case.torch_model.state_dict())
    t_out, cotangents, t_grads = run_torch(case)
    f_out, f_grads = run_flax(case, cotangents)
    results = [compare(k, "output", f_out.get(k, np.full(np.shape(v), np.nan)), v, tolerances["output"])
               for k, v in t_out.items()]
    param_names = {name for name, _ in case.torch_model.named_parameters()}
    norm = _global_norm(v for k, v in t_grads.items() if k in param_names)
    for k, v in t_grads.items():
        kind = "param grad" if k in param_names else "input grad"
        if k not in f_grads:
            results.append(TensorResult(k, kind, tuple(v.shape), math.inf, None, math.inf,
                                        tolerances["grad"], "missing on the flax side", False))
            continue
        results.append(compare(k, kind, f_grads[k], v, tolerances["grad"],
                               gradient_norm=norm if kind == "param grad" else 0.0))
    report = CaseReport(case.name, case.dtype, results)
    if capture_modules or (localize_failures and not report.passed):
        report.module_errors, report.first_divergence = localize(case, tolerances["output"])
    return report


# ---------------------------------------------------------------------------------------
# per-submodule capture and first divergence


def _leaves(tree) -> list[np.ndarray]:
    """Floating array leaves of a (possibly nested) module input or output, as NumPy."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _leaves(item)]
    if hasattr(tree, "detach"):
        tree = tree.detach().numpy()
    if isinstance(tree, (np.ndarray, jax.Array)) and np.issubdtype(np.asarray(tree).dtype, np.floating):
        return [np.asarray(tree)]
    return []


WHOLE_MODEL = "(whole model)"  # the path under which the root module's own call is recorded


def capture_torch(model, call: Callable[[], Any]) -> dict[str, tuple[list, list]]:
    """Run ``call`` with forward hooks on every submodule of ``model``: path -> (inputs, outputs).

    Dict order is execution order (a module is recorded when its forward returns).
    """
    records: dict[str, tuple[list, list]] = {}
    handles = []
    for name, module in model.named_modules():
        name = name or WHOLE_MODEL

        def hook(mod, args, output, name=name):
            records.setdefault(name, (_leaves(args), _leaves(output)))

        handles.append(module.register_forward_hook(hook))
    try:
        with _torch().no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return records


# NNX methods whose call is a module's forward pass. The GPT's blocks and attention run
# through ``attend(x, cache, pos) -> (y, cache)`` so that generation can share them.
FORWARD_METHODS = ("__call__", "attend")


@contextlib.contextmanager
def _recording_nnx_calls(model: nnx.Module, records: dict[str, tuple[list, list]]) -> Iterator[None]:
    """Temporarily wrap the forward methods of every NNX class in ``model`` to record
    (inputs, outputs) by path; the first completed call of a module is kept."""
    paths = {id(m): ".".join(map(str, p)) or WHOLE_MODEL for p, m in nnx.iter_modules(model)}
    patched: dict[tuple[type, str], Callable] = {}
    for _, module in nnx.iter_modules(model):
        for method in FORWARD_METHODS:
            owner = next((c for c in type(module).__mro__ if method in c.__dict__), None)
            if owner is None or owner is object or (owner, method) in patched:
                continue
            original = owner.__dict__[method]

            def wrapper(self, *args, __original=original, **kwargs):
                out = __original(self, *args, **kwargs)
                path = paths.get(id(self))
                if path is not None:
                    records.setdefault(path, (_leaves(args), _leaves(out)))
                return out

            patched[(owner, method)] = original
            setattr(owner, method, wrapper)
    try:
        yield
    finally:
        for (owner, method), original in patched.items():
            setattr(owner, method, original)


def capture_flax(model: nnx.Module, call: Callable[[], Any]) -> dict[str, tuple[list, list]]:
    """Run ``call`` eagerly with every NNX submodule's (inputs, outputs) recorded by path."""
    records: dict[str, tuple[list, list]] = {}
    with _recording_nnx_calls(model, records):
        call()
    return records


def localize(case: Case, tolerance: Tolerance) -> tuple[list[TensorResult], FirstDivergence | None]:
    """Every submodule's output error, in torch execution order, and the first that diverges.

    Only submodules present on both sides by the same torch path are compared. The
    first divergence also reports the errors of that submodule's inputs, so a user can
    tell a broken module from one fed broken data.
    """
    torch = _torch()
    t_inputs = [torch.from_numpy(np.array(x)) for x in case.inputs]
    torch_records = capture_torch(case.torch_model, lambda: case.torch_call(case.torch_model, *t_inputs))
    f_inputs = [jnp.asarray(x) for x in case.inputs]
    flax_records = capture_flax(case.flax_model, lambda: case.flax_call(case.flax_model, *f_inputs))

    def pairwise(label: str, flax_arrays: list, torch_arrays: list) -> list[TensorResult]:
        return [compare(f"{label} {i}", f"module {label}", f, t, tolerance)
                for i, (f, t) in enumerate(zip(flax_arrays, torch_arrays)) if np.shape(f) == np.shape(t)]

    errors, divergence = [], None
    for path, (t_ins, t_outs) in torch_records.items():
        if path not in flax_records:
            continue
        f_ins, f_outs = flax_records[path]
        outputs = pairwise("output", f_outs, t_outs)
        if not outputs:
            continue
        worst = max(outputs, key=lambda r: r.excess)
        errors.append(dataclasses.replace(worst, name=path))
        if divergence is None and not worst.passed:
            divergence = FirstDivergence(path, pairwise("input", f_ins, t_ins), outputs)
    return errors, divergence


# ---------------------------------------------------------------------------------------
# report


def environment() -> dict[str, Any]:
    """Backend, devices, versions and numerics settings the comparison ran under."""
    import flax
    import optax

    env = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }
    try:
        env["torch"] = _torch().__version__
    except ImportError:  # pragma: no cover - the harness cannot run without torch anyway
        env["torch"] = None
    return env


def format_environment(env: Mapping[str, Any]) -> str:
    devices = ", ".join(env["devices"])
    return (
        f"flax-ln parity | backend {env['backend']} ({devices}) | jax {env['jax']}, flax {env['flax']}, "
        f"torch {env['torch']}, optax {env['optax']} | matmul precision {env['matmul_precision']}"
    )


def _fmt(v: float) -> str:
    return f"{v:.2e}" if math.isfinite(v) else str(v)


def format_case(report: CaseReport, *, worst: int = 8, quiet: bool = False) -> str:
    """A readable table of the worst tensors by distance to tolerance, then a summary row.

    ``quiet`` keeps only the summary, training and first-divergence lines.
    """
    results = report.results
    failed = [r for r in results if not r.passed]
    # every output, then the other tensors closest to (or past) their tolerance
    outputs = [r for r in results if r.kind == "output"]
    others = sorted((r for r in results if r.kind != "output"), key=lambda r: -r.excess)
    shown = outputs + others[:worst]
    header = f"{'tensor':<44} {'kind':<11} {'shape':<16} {'max |d|':>9} {'at':<14} {'rel err':>9} {'rtol':>8}  status"
    lines = [f"== {report.name} ({report.dtype}) " + "=" * max(0, 80 - len(report.name)), header]
    for r in shown:
        status = {None: "ok", "rtol": "ok", "atol": "ok (abs)", "gtol": "ok (zero grad)"}[r.passed_by] if r.passed \
            else ("NONFINITE" if r.nonfinite else "FAIL")
        at = "" if r.max_error_index is None else str(r.max_error_index).replace(" ", "")
        lines.append(
            f"{r.name[:44]:<44} {r.kind:<11} {str(r.shape).replace(' ', '')[:16]:<16} {_fmt(r.max_abs_error):>9} "
            f"{at[:14]:<14} {_fmt(r.relative_error):>9} {r.tolerance.rtol:>8.0e}  {status}"
            + (f"  [{r.nonfinite}]" if r.nonfinite else "")
        )
    if len(shown) < len(results):
        lines.append(f"... {len(results) - len(shown)} more tensors, all shown with --json")
    if any(r.passed_by == "gtol" for r in shown):
        lines.append("(zero grad): exact gradient is 0, only rounding noise differs; its error is within "
                     "gtol of the whole gradient's norm")
    by_kind: dict[str, list[TensorResult]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)
    def kind_summary(kind: str, rs: list[TensorResult]) -> str:
        zero = sum(r.passed_by == "gtol" for r in rs)
        rels = [r.relative_error for r in rs if r.passed_by != "gtol"] or [0.0]
        return f"{kind}: {len(rs)} tensors, worst rel {_fmt(max(rels))}" + (f" ({zero} zero-gradient)" if zero else "")

    summary = "; ".join(kind_summary(kind, rs) for kind, rs in by_kind.items())
    lines.append(f"summary: {len(results) - len(failed)}/{len(results)} within tolerance ({summary}) "
                 f"in {report.seconds:.1f}s -> {'PASS' if report.passed else 'FAIL'}")
    for step in report.train_steps:
        lines.append(
            f"train step {step['step']}: loss flax {step['loss_flax']:.8g} torch {step['loss_torch']:.8g} "
            f"(rel {_fmt(step['loss_rel_error'])}), worst param rel {_fmt(step['param_rel_error'])} "
            f"({step['worst_param']}) -> {'ok' if step['passed'] else 'FAIL'}"
            + (f"; {len(step['noise_only'])} zero-gradient params not compared" if step["noise_only"] else "")
        )
    if report.first_divergence is not None:
        lines.append(report.first_divergence.describe())
    elif not report.passed and report.module_errors:
        lines.append("no submodule output diverges: the difference arises in the backward pass or the loss")
    if quiet:
        lines = [line for line in lines if line.startswith(("summary:", "train step", "first divergence", "no submodule"))]
        lines[0] = f"{report.name} ({report.dtype}) {lines[0]}"
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# training-step parity


def check_training(case: Case, steps: int, tolerances: Mapping[str, Tolerance]) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps on both sides from the same weights, dropout off.

    After every step, the loss and every parameter (torch names) are compared; each
    record holds the step's loss on both sides, their relative error and the worst
    parameter's relative error: the drift per step.

    Parameters whose torch gradient stays within ``gtol`` of the whole gradient's norm
    (exactly zero but for rounding) are listed as ``noise_only`` and not compared: Adam
    divides by the gradient's magnitude, so it moves them by about the learning rate in
    directions set by rounding noise, differently in each framework. They cannot
    affect the loss, which is compared.
    """
    if case.train is None:
        raise ValueError(f"model {case.name!r} has no training setup for --train-steps")
    import optax

    torch = _torch()
    spec = case.train
    load_torch_state_dict(case.flax_model, case.torch_model.state_dict())
    torch_model = case.torch_model.train(False)
    optimizer, scheduler = spec.torch_optimizer(torch_model)
    t_inputs = [torch.from_numpy(np.array(x)) for x in case.inputs]

    flax_model = case.flax_model
    flax_model.eval()
    graphdef, params, rest = nnx.split(flax_model, nnx.Param, ...)
    opt_state = spec.optax_optimizer.init(params)
    f_inputs = [jnp.asarray(x) for x in case.inputs]

    @jax.jit
    def flax_step(params, opt_state, inputs):
        loss, grads = jax.value_and_grad(lambda p: spec.flax_loss(nnx.merge(graphdef, p, rest), *inputs))(params)
        updates, opt_state = spec.optax_optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    records = []
    noise_only: set[str] = set()
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        t_loss = spec.torch_loss(torch_model, *t_inputs)
        t_loss.backward()
        grads = {name: p.grad.numpy() for name, p in torch_model.named_parameters() if p.grad is not None}
        norm = _global_norm(grads.values())
        noise_only |= {name for name, g in grads.items() if np.linalg.norm(g) <= tolerances["grad"].gtol * norm}
        if spec.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(torch_model.parameters(), spec.clip_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        params, opt_state, f_loss = flax_step(params, opt_state, f_inputs)

        flax_params = to_torch_state_dict(nnx.merge(graphdef, params, rest))
        param_results = [compare(name, "param", flax_params[name], p.detach().numpy(), tolerances["grad"])
                         for name, p in torch_model.named_parameters() if name not in noise_only]
        worst = max(param_results, key=lambda r: r.excess)
        loss_result = compare("loss", "loss", np.asarray(f_loss), t_loss.detach().numpy(), tolerances["output"])
        records.append({
            "step": step,
            "loss_flax": float(f_loss),
            "loss_torch": float(t_loss.detach()),
            "noise_only": sorted(noise_only),
            "loss_rel_error": loss_result.relative_error,
            "param_rel_error": worst.relative_error,
            "worst_param": worst.name,
            "passed": loss_result.passed and all(r.passed for r in param_results),
        })
    return records


# ---------------------------------------------------------------------------------------
# picture


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def plot_errors(reports: Sequence[CaseReport], path: str) -> None:
    """Save a chart, one panel per model: each submodule's output error and the worst
    gradient error of its parameters, in execution order, on a log scale with the tolerances."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib ships with the test extra
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from err

    fig, axes = plt.subplots(len(reports), 1, figsize=(14, 3.6 * len(reports)), squeeze=False)
    tiny = 1e-18  # exact zeros are drawn at the bottom of the log scale
    for ax, report in zip(axes[:, 0], reports):
        modules = [r.name for r in report.module_errors]
        grads: dict[str, float] = {}
        for r in report.results:
            if r.kind == "param grad" and r.passed_by != "gtol":  # zero gradients: noise, not error
                key = _module_of(r.name)
                grads[key] = max(grads.get(key, 0.0), r.relative_error)
        for name in grads:
            if name not in modules:
                modules.append(name)
        x = np.arange(len(modules))
        outputs = {r.name: r.relative_error for r in report.module_errors}
        ax.plot(x, [max(outputs.get(m, np.nan), tiny) for m in modules], "o-", label="module output rel. error")
        ax.plot(x, [max(grads.get(m, np.nan), tiny) for m in modules], "s--", label="param grad rel. error (worst)")
        for color, kind, label in (("C0", "output", "output tolerance"), ("C1", "param grad", "gradient tolerance")):
            tol = next((r.tolerance.rtol for r in report.results if r.kind == kind), None)
            if tol is not None:
                ax.axhline(tol, color=color, lw=0.8, ls=":", label=label)
        ax.set_yscale("log")
        ax.set_title(f"{report.name} ({report.dtype}): {'PASS' if report.passed else 'FAIL'}")
        step = max(1, len(modules) // 40)
        ax.set_xticks(x[::step])
        ax.set_xticklabels(modules[::step], rotation=75, fontsize=6)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""A comparison of a model larger than memory, stage by stage from a checkpoint: :func:`compare_streamed`.

A Transformer is a chain of stages (the embedding, each block, the final norm and head). Each side runs
its forward pass stage by stage, its weights read from the checkpoint while the stage runs, keeping only
the activations between stages; then its backward pass stage by stage, from the last, each stage's
vector-Jacobian product taken with its own upstream cotangent (the stage's forward recomputed). By the chain
rule every parameter gradient is the whole model's, so the report is the one a whole-model
:func:`~flax_ln.parity.compare.compare_modules` gives: the same outputs, gradients under torch's names,
tolerances and verdict. On failure each stage is run alone on torch's activations and cotangent, in order,
until one differs: the first stage whose own computation differs, localised within as ``compare_modules``
localises a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_ln.convert import KeyMap
from flax_ln.parity.compare import compare_modules
from flax_ln.parity.core.call import as_inputs, cast_floats, flatten_outputs, forward_pair, is_float, merge_dropped
from flax_ln.parity.core.policy import (
    HALF_PRECISION,
    TensorResult,
    Tolerance,
    compare_tensors,
    numerics,
    passes_as_zero,
    tolerances_for,
    zero_by_norms,
)
from flax_ln.parity.core.progress import Progress
from flax_ln.parity.core.tensor_stats import pair_stats
from flax_ln.parity.islands.island import Island
from flax_ln.parity.islands.lifting import Found, check_island_mode, flax_lifted, torch_lifted
from flax_ln.parity.islands.torch import default_factory, lift_float32
from flax_ln.parity.report.data import ParityReport, environment
from flax_ln.parity.sides.torch import output_cotangents, resolve_dtype, to_numpy
from flax_ln.parity.streamed.sides import (
    Checkpoint,
    FlaxRunner,
    check_buffers,
    check_models,
    check_whole,
    flax_stage,
    float_grad,
    naming_the_stage,
    parameters_on_meta,
    project,
    single_output,
    stage_of_a_key_map,
    tie_names,
    torch_stage,
)
from flax_ln.parity.streamed.stages import (
    BoundStage,
    Stages,
    flax_submodule,
    flax_wrapper,
    gpt_stages,
    materialized,
    torch_modules,
    wrapper_path,
)


def compare_streamed(
    torch_module,
    flax_module,
    inputs,
    *,
    checkpoint: str | Path,
    stages: Stages | None = None,
    weights: KeyMap | None = None,
    dtype: str | None = None,
    forward: Any = None,
    quiet: bool = False,
    tolerances: Mapping[str, Tolerance] | None = None,
    islands: str = "lift",
    torch_factory: Callable[[], Any] | None = None,
    input_names: Sequence[str] | None = None,
    name: str | None = None,
    localize_failures: bool = True,
) -> ParityReport:
    """:func:`~flax_ln.parity.compare.compare_modules`'s comparison (every output, every parameter gradient under
    torch's names, the same tolerances and verdict) with only a stage's weights in memory at a time.

    Args:
      torch_module: the torch model; its parameters may be on the ``meta`` device (build it with
        :func:`~flax_ln.parity.streamed.sides.parameters_on_meta` to keep its constructor's buffers).
        Its weights are not read: they come from ``checkpoint``.
      flax_module: its NNX port, abstract (``nnx.eval_shape(lambda: Model(...))``) or not.
      inputs: one NumPy array or a tuple of them, given to the first stage (floating ones are differentiated).
      checkpoint: a safetensors file, or a folder of them, holding every key of ``torch_module.state_dict()``
        (a tied key may be stored once), read lazily, stage by stage.
      stages: the model as a chain (:class:`~flax_ln.parity.streamed.stages.Stages`); found by themselves for the
        book's GPT (either ``scan_layers``), else required.
      weights: the port's :class:`~flax_ln.convert.KeyMap`; ``None``: the converter's rules (mirrored modules).
      dtype: ``"float32"`` or ``"float64"``; default: the torch parameters' dtype, and a float64 check with
        islands lifted beside it (``report.float64_check``), as ``compare_modules`` does.
      forward: what is compared of the last stage's result: ``fn(outputs)`` for both sides, or a pair
        ``(torch_fn, flax_fn)``; default: the outputs as they are.
      quiet: no progress on the terminal (it is shown only on a terminal, never in captured output).
      tolerances: as :func:`~flax_ln.parity.compare_modules`'s.
      islands: as :func:`~flax_ln.parity.compare_modules`'s.
      torch_factory: as :func:`~flax_ln.parity.compare_modules`'s.
      input_names: as :func:`~flax_ln.parity.compare_modules`'s.
      name: as :func:`~flax_ln.parity.compare_modules`'s.
      localize_failures: on failure, run the stages alone to find the first that differs, and localise in it.

    Reverse mode only (no ``mode="jvp"``). A gradient passes as zero only on float64's word: in float64 from
    both sides' gradient norms; in float32 from the default's float64 check, or, with an explicit
    ``dtype="float32"``, from a streamed float64 run made only when some failing gradient needs it.
    """
    started = time.perf_counter()
    check_island_mode(islands)
    check_models(torch_module, flax_module)
    stages = stages if stages is not None else gpt_stages(torch_module, flax_module)
    if stages is None:
        raise ValueError(
            f"compare_streamed knows the stages of the book's GPT only; declare those of "
            f"{type(torch_module).__name__} with stages=Stages([...]) (see flax_ln.parity.Stage)"
        )
    explicit = dtype is not None
    dtype = resolve_dtype(torch_module, dtype)
    if dtype in HALF_PRECISION:
        raise ValueError(f"compare_streamed runs in float32 or float64, got dtype={dtype!r}")
    options = dict(
        torch_module=torch_module,
        flax_module=flax_module,
        inputs=as_inputs(inputs),
        checkpoint=Path(checkpoint),
        bound=stages.bound(),
        stages=stages,
        weights=weights,
        forward=forward_pair(forward),
        quiet=quiet,
        tolerances=tolerances,
        islands=islands,
        torch_factory=torch_factory,
        input_names=input_names,
        name=name or type(torch_module).__name__,
        localize_failures=localize_failures,
    )
    float64_check, zero = None, None
    if not explicit and dtype != "float64":
        float64_check, zero = Streamed(dtype="float64", **options).run(set)
    # only which gradients are zero is asked of it, with float32 islands lifted (as compare_modules asks torch)
    evidence = {**options, "localize_failures": False, "islands": "lift"}
    report, _ = Streamed(dtype=dtype, **options).run(
        (lambda: zero) if zero is not None else lambda: Streamed(dtype="float64", **evidence).run(set)[1]
    )
    report.float64_check = float64_check
    report.seconds = time.perf_counter() - started
    return report


def torch_skeleton(torch_module: Any, dtype: str, islands: str, factory, found: Found) -> Any:
    """The torch model whose buffers a float64 comparison that lifts runs with: rebuilt by the factory (``factory``,
    or a transformers model's own) with its parameters on meta, default dtype float64 and lifting on, so that the
    buffers its constructor computes are float64 (listed as islands); else ``torch_module``."""
    factory = factory or default_factory(torch_module)
    if dtype != "float64" or islands != "lift" or factory is None:
        return torch_module
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with lift_float32(), parameters_on_meta():
            built = factory()
    finally:
        torch.set_default_dtype(previous)
    persistent = set(built.state_dict())
    found.add(
        [
            Island("torch", owner or None, f"buffer {leaf} rebuilt in float64", True)
            for full, b in built.named_buffers()
            if full not in persistent and b.is_floating_point()
            for owner, _, leaf in [full.rpartition(".")]
        ]
    )
    flags = dict(torch_module.named_parameters())
    for pname, p in built.named_parameters():
        if pname in flags:
            p.requires_grad_(flags[pname].requires_grad)
    return built


@dataclasses.dataclass
class Gradients:
    """The parameter gradients' results as the backward pass gives them, and what judging a gradient as zero needs."""

    tolerance: Tolerance
    torch_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    flax_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    results: dict[str, TensorResult] = dataclasses.field(default_factory=dict)
    diff_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    pending: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # tied: [torch sum, flax sum, stages left]

    def add(self, name: str, torch_grad: np.ndarray, flax_grad: Any, stages_left: int) -> None:
        """One stage's gradient of parameter ``name`` on each side (``flax_grad`` ``None``: the flax side has none),
        judged once its last stage (``stages_left``, counting this one) has given it."""
        if name in self.pending or stages_left > 1:
            entry = self.pending.setdefault(name, [0, 0, stages_left])
            flax_sum = None if flax_grad is None or entry[1] is None else entry[1] + np.asarray(flax_grad)
            entry[0], entry[1], entry[2] = entry[0] + torch_grad, flax_sum, entry[2] - 1
            if entry[2] > 0:
                return
            torch_grad, flax_grad = self.pending.pop(name)[:2]
        torch_grad = np.asarray(torch_grad)
        flax_grad = None if flax_grad is None else np.asarray(flax_grad)
        same_shape = flax_grad is not None and flax_grad.shape == torch_grad.shape
        stats = pair_stats(flax_grad, torch_grad) if same_shape else None
        self.results[name] = compare_tensors(
            name, "param grad", flax_grad, torch_grad, self.tolerance, dtype=str(torch_grad.dtype), stats=stats
        )
        if stats is not None:  # each side's norm and the error's, read in the same pass as the verdict's
            self.torch_norms[name], self.flax_norms[name] = stats.expected_norm, stats.actual_norm
            self.diff_norms[name] = stats.diff_norm

    def zero_in_float64(self) -> set[str]:
        """The gradients both sides' float64 norms show are zero in the mathematics."""
        return zero_by_norms(self.torch_norms) & zero_by_norms(self.flax_norms)

    def could_pass_as_zero(self) -> list[str]:
        """The failing gradients whose error is within ``gtol`` of the whole gradient's norm (torch's): those that
        pass if float64 shows they are zero in the mathematics."""
        norm = math.sqrt(sum(n * n for n in self.torch_norms.values()))
        return [
            name
            for name, diff in self.diff_norms.items()
            if not self.results[name].passed and passes_as_zero(diff, self.tolerance, norm, True)
        ]

    def judged(self, zero: set[str]) -> dict[str, TensorResult]:
        """Every result, a failing one passed as zero where float64 says it is zero (``zero``) and it could pass
        as zero, as the whole-model comparison judges it."""
        out = dict(self.results)
        for name in self.could_pass_as_zero():
            if name in zero:
                out[name] = dataclasses.replace(out[name], passed=True, passed_by="zero")
        return out


@dataclasses.dataclass
class Streamed:
    """One streamed comparison in one dtype (:meth:`run`)."""

    torch_module: Any
    flax_module: Any
    inputs: tuple[np.ndarray, ...]
    checkpoint: Path
    bound: list[BoundStage]
    stages: Stages
    weights: KeyMap | None
    forward: tuple[Any, Any]
    quiet: bool
    tolerances: Mapping[str, Tolerance] | None
    islands: str
    torch_factory: Any
    input_names: Sequence[str] | None
    name: str
    localize_failures: bool
    dtype: str

    def run(self, zero_evidence: Callable[[], set[str]]) -> tuple[ParityReport, set[str]]:
        """The report, and the gradients float64 shows are zero: in float64 from both sides' norms; else
        ``zero_evidence()``'s, asked only when some failing gradient could pass as zero."""
        import torch

        self.found = Found()
        self.tol = tolerances_for(self.dtype, self.tolerances)
        inputs, cast = cast_floats(self.inputs, self.dtype)
        names = tuple(self.input_names or (f"input {i}" for i in range(len(inputs))))
        n = len(self.bound)
        steps = 2 * n + (n if self.localize_failures else 0)
        with (
            numerics(self.dtype),
            Progress(steps, label=f"{self.name} {self.dtype}", quiet=self.quiet) as self.progress,
        ):
            self.skeleton = torch_skeleton(self.torch_module, self.dtype, self.islands, self.torch_factory, self.found)
            check_buffers(self.skeleton)
            check_whole(self.skeleton, self.flax_module, self.weights, self.dtype)
            self.ckpt = Checkpoint(self.checkpoint, self.skeleton, self.dtype)
            self.canonical = tie_names(self.skeleton)
            self.stage_params = self._stage_params()
            self.runner = FlaxRunner()
            torch_inputs = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in inputs)
            flax_inputs = tuple(jnp.asarray(x) for x in inputs)
            self.torch_extras, self.flax_extras = {}, {}
            if self.stages.torch_extras is not None:
                lifted = torch_lifted(self.skeleton, self.dtype, self.islands, self.found)
                with naming_the_stage("torch_extras"), lifted:
                    dt = getattr(torch, self.dtype)
                    self.torch_extras = dict(self.stages.torch_extras(self.skeleton, *torch_inputs, dtype=dt))
            if self.stages.flax_extras is not None:
                with naming_the_stage("flax_extras"), flax_lifted(self.dtype, self.islands, self.found):
                    dt = jnp.dtype(self.dtype)
                    self.flax_extras = dict(self.stages.flax_extras(self.flax_module, *flax_inputs, dtype=dt))
            torch_acts, flax_acts, outputs = self._forward(torch_inputs, flax_inputs)
            results, dropped, cotangents = outputs
            grads, input_grads, torch_cots = self._backward(torch_acts, flax_acts, cotangents, names)
            if self.dtype == "float64":
                zero_found = grads.zero_in_float64()
            else:
                zero_found = set(zero_evidence()) if grads.could_pass_as_zero() else set()
            judged = grads.judged(zero_found)
            order = [self.canonical[k] for k, p in self.skeleton.named_parameters() if p.requires_grad]
            results += input_grads + [judged[k] for k in dict.fromkeys(order)]
            report = ParityReport(self.name, self.dtype, results, mode="grad")
            report.dropped_outputs = dropped
            report.frozen = [k for k, p in self.skeleton.named_parameters() if not p.requires_grad]
            report.input_casts = {names[i]: how for i, how in cast.items()}
            report.environment = environment()
            report.localization_note = (
                f"streamed in {n} stages ({self.bound[0].name} .. {self.bound[-1].name}) from {self.checkpoint.name}"
            )
            if not report.passed and self.localize_failures:
                self._isolate(report, inputs, torch_acts, torch_cots)
        report.islands = self.found.islands
        return report, zero_found

    # -----------------------------------------------------------------------------------------

    def _stage_params(self) -> list[list[str]]:
        """Each stage's torch parameters (canonical names); every stage's paths name modules on both sides, and
        every parameter is in some stage: checked before any stage runs."""
        out = []
        names = list(self.canonical)
        for b in self.bound:
            torch_modules(self.skeleton, b.torch_paths)
            for path in b.flax_paths:
                flax_submodule(self.flax_module, path)
            prefixes = tuple(p + "." for p in b.torch_paths)
            out.append(list(dict.fromkeys(self.canonical[k] for k in names if k.startswith(prefixes))))
        covered = {k for s in out for k in s}
        left = [k for k in dict.fromkeys(self.canonical.values()) if k not in covered]
        if left:
            raise ValueError(
                f"the stages hold no module with torch parameters {left[:5]}{' ...' if len(left) > 5 else ''}: every "
                "parameter must be in some stage's torch paths, or its gradient would not be compared"
            )
        return out

    def _load(self, k: int):
        b = self.bound[k]
        t, tensors = torch_stage(self.skeleton, b, self.ckpt, self.dtype)
        f = flax_stage(self.flax_module, b, tensors, self.dtype, self.weights, frozenset(tensors))
        return t, f

    def _phase(self, k: int, what: str) -> contextlib.AbstractContextManager[None]:
        """Shows stage ``k``'s step ``what`` as the progress phase; an error raised in the block names it."""
        where = f"{self.sweep} stage {k + 1}/{len(self.bound)} {self.bound[k].name!r}: {what}"
        self.progress.phase(where)
        return naming_the_stage(where)

    def _forward(self, torch_inputs, flax_inputs):
        """Both sides' forward pass: the activations entering each stage, and the outputs' results."""
        self.sweep = "forward:"
        torch_acts: list[Any] = [torch_inputs]
        flax_acts: list[Any] = [flax_inputs]
        last = len(self.bound) - 1
        for k, b in enumerate(self.bound):
            with self._phase(k, "loading its weights"):
                t, f = self._load(k)
            with self._phase(k, "torch forward"), torch_lifted(t.wrapper, self.dtype, self.islands, self.found):
                t_out = t.forward(torch_acts[-1], self.torch_extras)
                torch_acts.append(single_output(t_out, b.name) if k < last else None)
            with self._phase(k, "flax forward (compiled once per kind of stage)"):
                with flax_lifted(self.dtype, self.islands, self.found):
                    f_out = self.runner.forward(f, flax_acts[-1], self.flax_extras)
                flax_acts.append(single_output(f_out, b.name) if k < last else None)
            del t, f
            self.progress.advance()
        torch_fn, flax_fn = self.forward
        t_named, t_dropped = flatten_outputs(t_out if torch_fn is None else torch_fn(t_out))
        f_named, f_dropped = flatten_outputs(f_out if flax_fn is None else flax_fn(f_out))
        torch_values = {k: to_numpy(v) for k, v in t_named}
        flax_values = dict(f_named)
        results = [
            compare_tensors(
                k, "output", flax_values.get(k), v, self.tol["output"], dtype=str(v.dtype) if is_float(v) else None
            )
            for k, v in torch_values.items()
        ]
        cotangents = output_cotangents(torch_values)
        return torch_acts, flax_acts, (results, merge_dropped(t_dropped, f_dropped), cotangents)

    def _backward(self, torch_acts, flax_acts, cotangents, names):
        """Both sides' backward pass, from the last stage: the gradients' results, the inputs' gradients' results,
        and the torch cotangent of each stage's output (for running the stages alone)."""
        self.sweep = "backward:"
        grads = Gradients(self.tol["grad"])
        stages_of: dict[str, int] = {}
        for params in self.stage_params:
            for p in params:
                stages_of[p] = stages_of.get(p, 0) + 1
        torch_cot, flax_cot = dict(cotangents), dict(cotangents)
        torch_cots: list[Any] = [None] * len(self.bound)
        input_results: list[TensorResult] = []
        for k in reversed(range(len(self.bound))):
            torch_cots[k] = torch_cot
            with self._phase(k, "loading its weights"):
                t, f = self._load(k)
            with self._phase(k, "torch backward"), torch_lifted(t.wrapper, self.dtype, self.islands, self.found):
                t_grads, t_x = t.gradients(torch_acts[k], self.torch_extras, torch_cot)
            with self._phase(k, "flax backward (compiled once per kind of stage)"):
                with flax_lifted(self.dtype, self.islands, self.found):
                    f_params, f_x = self.runner.gradients(f, flax_acts[k], self.flax_extras, flax_cot)
            with self._phase(k, "comparison"):
                f_grads = f.torch_gradients(f_params)
                for key, g in t_grads.items():  # by the stage's names; compared under the model's
                    name = self.canonical.get(key, key)
                    grads.add(name, g, f_grads.get(key), stages_of.get(name, 1))
            if k > 0:
                torch_cot, flax_cot = {"output": t_x.detach().numpy()}, {"output": f_x}
            else:
                x_t = t_x if isinstance(t_x, tuple) else (t_x,)
                x_f = f_x if isinstance(f_x, tuple) else (f_x,)
                for i, (gt, gf) in enumerate(zip(x_t, x_f)):
                    if gt is not None:
                        expected = gt.detach().numpy()
                        got = float_grad(gf)
                        input_results.append(
                            compare_tensors(
                                f"grad {names[i]}",
                                "input grad",
                                got,
                                expected,
                                self.tol["grad"],
                                dtype=str(expected.dtype),
                            )
                        )
            del t, f, f_params
            self.progress.advance()
        return grads, input_results, torch_cots

    def _isolate(self, report: ParityReport, inputs, torch_acts, torch_cots) -> None:
        """Each stage alone on torch's activations and cotangent, in order, until one differs: its localisation
        becomes the report's, and the note names it. An error in running a stage alone ends the search with a
        note: localisation never costs the verdict."""
        self.sweep = "alone:"
        for k, b in enumerate(self.bound):
            try:
                with self._phase(k, "on torch's activation and cotangent"):
                    sub = self._alone(k, inputs, torch_acts, torch_cots[k])
            except Exception as err:  # noqa: BLE001 - the verdict and every result stand; the error is reported
                report.localization_note = (
                    f"{report.localization_note}; running stage {k + 1}/{len(self.bound)} {b.name!r} alone failed "
                    f"({type(err).__name__}: {str(err)[:300]}); the verdict and every tensor's result stand"
                )
                return
            self.progress.advance()
            if not sub.passed:
                report.first_divergence, report.isolation = sub.first_divergence, sub.isolation
                report.module_skipped = sub.module_skipped
                report.localization_note = (
                    f"{report.localization_note}; stage {k + 1}/{len(self.bound)} {b.name!r} (torch "
                    f"{', '.join(b.torch_paths)}) is the first whose own computation differs, run alone on torch's "
                    f"activations and cotangent"
                    + (f"; stages 1-{k} agree alone" if k else "")
                    + (f"; in it: {sub.localization_note}" if sub.localization_note else "")
                )
                return
        report.localization_note = (
            f"{report.localization_note}; every stage agrees alone on torch's activations and cotangent: the "
            "differences compound from rounding across stages"
        )

    def _alone(self, k: int, inputs, torch_acts, cotangents) -> ParityReport:
        """:func:`compare_modules` on stage ``k``'s modules, torch's activation in, torch's cotangent on its output."""
        import torch

        b = self.bound[k]
        t, _ = torch_stage(self.skeleton, b, self.ckpt, self.dtype)
        flax_paths = [wrapper_path(p) for p in b.flax_paths]
        f = flax_wrapper(
            b.flax_paths, [materialized(*flax_submodule(self.flax_module, p), self.dtype) for p in b.flax_paths]
        )
        x = inputs if k == 0 else (torch_acts[k].numpy(),)
        first = k == 0
        torch_run, flax_run = b.stage.torch_run, b.stage.flax_run
        t_extras, f_extras = self.torch_extras, self.flax_extras

        def torch_fn(wrapper, *a):
            return torch_run([wrapper.get_submodule(p) for p in b.torch_paths], a if first else a[0], t_extras)

        def flax_fn(wrapper, *a):
            return flax_run([flax_submodule(wrapper, p)[0] for p in flax_paths], a if first else a[0], f_extras)

        t_cot = {n: torch.from_numpy(np.asarray(c)) for n, c in cotangents.items()}
        f_cot = {n: jnp.asarray(c) for n, c in cotangents.items()}
        with stage_of_a_key_map():
            return compare_modules(
                t.wrapper,
                f,
                x,
                forward=(torch_fn, flax_fn),
                loss=(lambda out: project(out, t_cot), lambda out: project(out, f_cot)),
                dtype=self.dtype,
                weights=self.weights,
                islands=self.islands,
                tolerances=self.tolerances,
                name=f"{self.name} stage {b.name}",
                quiet=True,  # the streamed comparison's own bar shows this stage
            )

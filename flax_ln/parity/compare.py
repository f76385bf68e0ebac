"""The comparison: :func:`compare_modules` (the one public entry point) and :func:`assert_parity`; what a
stored torch side is compared with (:func:`load_and_judge`) is shared with :mod:`flax_ln.parity.stored`."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from flax_ln.convert import KeyMap, KeyPlan
from flax_ln.convert.keymap_syntax import describe_value
from flax_ln.parity.core.call import Call, as_inputs, cast_floats
from flax_ln.parity.core.failure import describe_failure, note_failure
from flax_ln.parity.core.policy import Tolerance, numerics, parameter_dtype, tolerances_for, zero_gradient_names
from flax_ln.parity.core.progress import Progress
from flax_ln.parity.core.spill import should_spill
from flax_ln.parity.core.structure import Rebuild
from flax_ln.parity.islands.jax import hold_constants_of
from flax_ln.parity.islands.lifting import Found, check_island_mode, flax_lifted, torch_lifted, torch_model_for
from flax_ln.parity.judge import DROPPED_BUT_USED, add_lm_metrics, attribute_errors, judge, without_dropped
from flax_ln.parity.localize.locate import Carried, check_torch_paths, localize
from flax_ln.parity.report.data import ParityReport, environment
from flax_ln.parity.sides.flax import FlaxSide, Function, Linen
from flax_ln.parity.sides.kinds import built_by_flax_factory, check_factories, flax_side_kind
from flax_ln.parity.sides.shared import as_shared, one_variable_for_distinct_parameters, zero_shared
from flax_ln.parity.sides.split import as_split
from flax_ln.parity.sides.torch import (
    MODES,
    TorchSide,
    float64_gradients,
    record_torch_side,
    resolve_dtype,
    run_torch_side,
    share_parameters,
    with_tangents,
)
from flax_ln.pytest_plugin import page_path


def load_and_judge(
    kind: type[FlaxSide],
    side: TorchSide,
    flax_module,
    call: Call,
    flax_inputs,
    tolerances,
    lm_logits,
    mesh,
    weights,
    zero_evidence: Callable[[], set[str]],
    plan=None,
    rerun: Callable[[dict[str, np.ndarray]], TorchSide] | None = None,
    want_zero: bool = False,
    judging: Callable[[], None] = lambda: None,
    float64_gradients: Callable[[], Mapping[str, np.ndarray]] | None = None,
):
    """Load the flax side of ``kind`` with ``side``'s weights (through ``weights``, a key map, when given), run
    and compare it, add the ties, LM metrics and attribution. ``rerun``: the torch side again with other tangents
    (:func:`~flax_ln.parity.sides.torch.with_tangents`), for :func:`~flax_ln.parity.sides.shared.as_shared`;
    ``judging()`` is called when the flax side has run, before its values are compared (a progress phase);
    ``float64_gradients()``: torch's float64 parameter gradients, for float64's word on zero slab by slab
    (:func:`~flax_ln.parity.sides.split.as_split`)."""
    flax = kind.load(flax_module, side, flax_inputs, weights, plan)
    shared = {} if flax.plan is None else flax.plan.shared()
    one_variable = one_variable_for_distinct_parameters(side, shared, tolerances["grad"])
    if flax.plan is not None and shared:
        side = as_shared(side, flax.plan, rerun)
        evidence = zero_evidence
        zero_evidence = lambda: zero_shared(evidence(), shared)  # noqa: E731
    if flax.plan is not None:  # a torch tensor split across several variables: its gradient slab by slab
        side, zero_evidence = as_split(side, flax.plan, zero_evidence, float64_gradients)
    values = flax.values(side, call, mesh)
    judging()
    side, dropped = without_dropped(side, flax.plan, zero_evidence)
    report, actual, zero = judge(side, values, tolerances, zero_evidence, want_zero)
    report.results = [
        r if r.name not in dropped else dataclasses.replace(r, problem=DROPPED_BUT_USED) for r in report.results
    ]
    report.dropped_parameters = [k for k, used in dropped.items() if not used]
    zero |= set(report.dropped_parameters)
    report.results += one_variable
    report.ties = flax.ties()
    report.shared = shared
    report.constants = {} if flax.plan is None else {p: describe_value(v) for p, v in flax.plan.constants.items()}
    report.environment = environment()  # inside the comparison's numerics settings
    if lm_logits is not None:
        add_lm_metrics(report, side, actual, lm_logits)
    if side.truth is not None:
        attribute_errors(report, side, actual, flax, call)
    return report, flax, zero


def stamp(report: ParityReport, started: float) -> ParityReport:
    """The one place a report is timed (from ``started``, a ``time.perf_counter()``)."""
    report.seconds = time.perf_counter() - started
    return report


def compare_modules(
    torch_module,
    flax_module: nnx.Module | Linen | Function,
    inputs,
    *,
    flax_inputs=None,
    kwargs=None,
    forward: Any = None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    dtype: str | None = None,
    mode: str = "grad",
    tangent_params: bool = True,
    attribute: bool = False,
    lm_logits: str | None = None,
    mesh=None,
    input_names: Sequence[str] | None = None,
    name: str | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    weights: KeyMap | None = None,
    modules: Mapping[str, Any] | None = None,
    islands: str = "lift",
    torch_factory: Callable[[], Any] | None = None,
    flax_factory: Callable[[], Any] | None = None,
    quiet: bool = False,
) -> ParityReport:
    """Compare a torch module with its NNX twin: every output, and the gradient of every floating input and parameter.

    The torch module's ``state_dict()`` is copied into ``flax_module`` through the strict
    converter (every key must match; the flax module is updated in place). Both run in
    eval mode (neither module's mode is changed), the torch side eagerly and the flax side
    under ``jax.jit``, with matmul precision ``highest`` and, for float64, x64 on, for this
    call only. The scalar that is differentiated is, by default,
    ``sum_i sum(output_i * c_i)`` over the floating outputs with fixed random cotangents
    ``c_i`` shared by both sides. Parameter gradients are keyed by torch name.

    On failure the first submodule whose output diverges is named
    (``report.first_divergence``), and every submodule is also run alone on its torch
    twin's recorded inputs (``report.isolation``, :func:`isolate`), which names the
    module whose own computation differs even when errors compound down the stack.

    Args:
      torch_module: a ``torch.nn.Module`` whose parameters are in ``dtype``.
      flax_module: its NNX twin, with the same module tree (a path names the same module
        in both) and parameters in ``dtype``; or a :class:`~flax_ln.parity.sides.flax.Linen` module
        with its variables, or a :class:`~flax_ln.parity.sides.flax.Function` over a parameter
        pytree: both need ``weights``, are filled on copies, and ``forward``'s flax function
        receives ``run`` (``run(*a, **k)`` applies the module or the function to the filled
        variables). A ``Function`` has no modules to localise (``report.localization_note``
        says so) and takes no ``mesh``.
      inputs: one NumPy array or a tuple of them, passed positionally to both forwards.
        Floating inputs are differentiated.
      flax_inputs: the flax side's inputs when their layout differs (NLC against NCL):
        the same values in another axis order. Default: ``inputs``.
      kwargs: keyword arguments for both forwards (masks and the like); NumPy arrays are
        converted for each side; they are not differentiated.
      forward: how each side is run and what it returns: one callable ``fn(module, *inputs,
        **kwargs)`` for both sides, or a pair ``(torch_fn, flax_fn)`` (``None`` in it: a
        plain call). Side-specific arguments (a port's cache, RNGs, ``deterministic=True``)
        go into that side's function. Default: calling each module. Outputs are named
        leaves: ``output``, ``output[i]``, dict keys, dataclass and ``ModelOutput`` fields;
        Python numbers compare as 0-d arrays; other leaves (``None``, strings, cache
        objects) are dropped and listed in ``report.dropped_outputs``. Both sides must give
        the same names with the same shapes, else ``ValueError`` (before the flax side's
        derivatives are taken).
      loss: ``(torch_fn, flax_fn)``, each mapping that side's outputs to a scalar, instead
        of the random projection. The loss value is compared too.
      tolerances: ``{"output": Tolerance, "grad": Tolerance}`` (and, in half precision, ``"grads"``: every
        parameter gradient as one vector) to override the policy; a partial dict overrides the kinds it names
        and the policy fills the rest (``{"output": ...}`` keeps the policy's ``"grad"``). Another key is a
        ``ValueError``.
      dtype: ``"float32"`` or ``"float64"``, or ``"bfloat16"``/``"float16"`` for a flax module
        that computes in half precision with float32 parameters, against the float32 torch
        module. ``"float64"`` takes float32 modules too: both sides then run on float64
        copies (the caller's objects are unchanged). Floating inputs are cast to the
        comparison's parameter dtype on both sides (``report.input_casts`` says which).
        Default: the torch parameters' dtype (``report.dtype``, ``report.results``) **and**
        a float64 check with islands lifted (``report.float64_check``, a whole
        :class:`ParityReport`), which sees a changed function that the default
        initialisation's small activations hide below float32's tolerance (tanh for erf
        GELU, a bfloat16 rotary table); ``report.passed`` needs both. It costs a second
        comparison in float64. An explicit ``dtype`` runs that dtype only.
      mode: ``"grad"`` (reverse mode, above) or ``"jvp"``: forward mode, the outputs and
        their tangents (``tangent <output>``, the ``"grad"`` tolerance) for fixed random
        tangents of the floating inputs and, with ``tangent_params``, of every parameter
        (always when no input is floating): ``torch.func.jvp`` over
        ``torch.func.functional_call`` against ``jax.jvp``.
      tangent_params: in ``"jvp"`` mode, also push tangents of the parameters.
      attribute: also run both models in float64 (a ``.double()`` copy of the torch
        module; a float64 copy of the flax module under x64, same weights) and give every
        tensor torch's and flax's relative error against torch's float64 values
        (``torch_vs_float64``, ``flax_vs_float64``): which side is wrong.
      lm_logits: the name of an output holding next-token logits (or log-probabilities),
        vocabulary last: adds ``report.lm_metrics`` (:func:`lm_metrics`).
      mesh: a ``(data, fsdp)`` mesh from :func:`flax_ln.sharding.make_mesh`: the flax side
        then runs sharded (in either mode), parameters by the training FSDP rule and inputs
        split over ``data`` along their first (batch) axis where it divides;
        ``report.sharding`` records each parameter's ``PartitionSpec``. The torch side is
        unchanged.

      input_names: the inputs' names in the report (``grad <name>``); default ``input <i>``.
      name: the report's name (default: the torch module's class name).
      localize_failures: on failure, localise (first divergence and isolated mode).
      capture_modules: record every submodule's error even when everything passes.
      weights: the port's own :class:`~flax_ln.convert.KeyMap`, for a port whose tree does not
        mirror torch's: the weights load through it (strictly: every problem listed at once, the
        model unchanged on error), parameter gradients come back under ``named_parameters()``'s
        names through each layout's inverse (tied copies summed), ``jvp`` parameter tangents go
        into the flax layout through it, ``report.ties`` lists the ties, and localisation pairs
        modules by their parameters (:func:`~flax_ln.parity.localize.pair.pair_modules`). Distinct
        torch parameters that fill one flax variable (``report.shared``,
        :meth:`~flax_ln.convert.KeyPlan.shared`) fail: the port holds one variable where torch
        keeps two (equal at initialisation, apart after training), said in a failing result under
        the second key; the rest is compared with them as one (in ``"jvp"`` they all take the
        first one's tangent, torch running again with it; in ``"grad"`` the variable's gradient
        against the sum of torch's, under the first key). ``None``: the converter's rules and
        mirrored trees.
      modules: with ``weights``, ``{torch_path: flax_path | (flax_path, layout) | None}``: add a
        pair (a parameter-free module), give a pair's activation layout (an einops pattern,
        torch -> flax), or remove an automatic pair (``None``).
      islands: in float64, ``"lift"`` (default) runs both sides' float32 computations in
        float64 (transformers' RMSNorm, softmax and rotary tables; flax's float32 softmax and
        compute dtypes; a port's ``astype(float32)``), so that a faithful port agrees to
        float64 rounding; casts to bfloat16 or float16 are the port's own and stay.
        ``"keep"`` runs each side as written. ``report.islands`` lists each island lifted
        (:class:`~flax_ln.parity.islands.island.Island`: side, module, what, lifted), and the
        built-in ones either way.
      torch_factory: a zero-argument callable that builds the torch module afresh: with
        ``islands="lift"`` the float64 copy is built by it with lifting on (so buffers made
        at construction, like rotary ``inv_freq``, are float64), loaded with the caller's
        weights and checked equal to them. A transformers model (with a ``config``) is
        rebuilt as ``type(m)(m.config)`` without it; any other module without it has its
        float32-rounded float64 buffers listed in ``report.islands`` (not lifted). It must build
        ``torch_module`` again (module tree, classes, attributes that are not arrays, ties; only dtypes
        may differ), else the float64 check's error names it; one that returns ``torch_module`` itself
        is given a copy. Not callable: ``TypeError`` before any work.
      flax_factory: a zero-argument callable that builds the flax side afresh (an NNX module, or a ``Linen`` or
        ``Function`` of the same kind as ``flax_module``): with ``islands="lift"`` the float64 run builds it with
        lifting active and x64 on, so that float32 constants the port makes at construction (``jnp.array(d **
        -0.5, jnp.float32)``, an ``nnx.data`` table) are float64 (listed as lifted), then fills its variables
        with the weights as usual. Without it such constants are listed in ``report.islands`` as not lifted. It
        must build ``flax_module`` again (structure and static configuration; a ``Function``'s code and parameter
        structure; only dtypes may differ), else the float64 check's error names it.
      quiet: no progress bar. Without it, a comparison that runs longer than two seconds shows a bar of its
        phases on a terminal (:class:`~flax_ln.parity.core.progress.Progress`; never when ``sys.stderr`` is not a
        terminal, or with the environment variable ``FLAX_LN_PROGRESS=0``).

    Frozen torch parameters (``requires_grad=False``) are loaded and compared through the
    outputs, but have no gradient: they are listed in ``report.frozen``. An input with
    an axis of size 0 is a ``ValueError``: nothing compared is not a pass. A gradient
    passes as zero (``passed_by="zero"``) only where float64 shows it is zero in the
    mathematics (:func:`zero_gradient_names`: from the float64 comparison, else a float64
    run of the torch side; slab by slab for a torch tensor split across variables); any other gradient is held
    to the relative tolerance. A trainable torch parameter the key map drops whose float64 gradient is zero is
    listed in ``report.dropped_parameters`` and not compared; one whose gradient is not zero fails.

    Returns:
      a :class:`ParityReport`: ``.passed``, ``.results`` (``report[name]``), ``.first_divergence``.
    """
    started = time.perf_counter()
    kind = flax_side_kind(flax_module)
    weights = kind.weights_for(flax_module, torch_module, weights)
    kind.check(flax_module, weights, mesh)
    check_island_mode(islands)
    check_torch_paths(torch_module, modules)
    check_factories(torch_factory=torch_factory, flax_factory=flax_factory)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    comparison = Comparison(
        kind=kind,
        torch_module=torch_module,
        flax_module=flax_module,
        weights=weights,
        torch_factory=torch_factory,
        flax_factory=flax_factory,
        inputs=as_inputs(inputs),
        flax_inputs=None if flax_inputs is None else as_inputs(flax_inputs),
        kwargs=dict(kwargs or {}),
        call_options=dict(
            forward=forward, loss=loss, mode=mode, input_names=input_names, tangent_params=tangent_params, name=name
        ),
        tolerances=tolerances,
        islands=islands,
        attribute=attribute,
        lm_logits=lm_logits,
        mesh=mesh,
        localize_failures=localize_failures,
        capture_modules=capture_modules,
        modules=modules,
    )
    explicit = dtype is not None
    dtype = resolve_dtype(torch_module, dtype)
    float64_check, zero, plan = None, None, None
    checked = not explicit and dtype != "float64"  # the default: the float64 check, islands lifted, beside it
    label = name or type(torch_module).__name__
    carried = Carried()  # what the float64 check's localisation found that the run's may reuse
    with Progress(comparison.phases * (1 + checked), label=label, quiet=quiet) as progress:
        if checked:
            check_started = time.perf_counter()
            try:
                float64_check, zero, plan = comparison.run(
                    "float64", None, None, True, progress, "float64 check: ", carried
                )
            except Exception as err:  # noqa: BLE001 - a float64 check that cannot run is a finding; float32 stands
                float64_check = ParityReport(label, "float64", [], error=describe_failure(err))
            stamp(float64_check, check_started)
        report, _, _ = comparison.run(dtype, zero, plan, progress=progress, carried=carried)
    report.float64_check = float64_check
    report.discovery = getattr(weights, "discovery", None)
    return stamp(report, started)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """One :func:`compare_modules` call's arguments, run in a dtype (:meth:`run`); built by keyword only."""

    # what is compared: the two sides, how the flax side is filled, and how each side is rebuilt in float64
    kind: type[FlaxSide]
    torch_module: Any
    flax_module: Any
    weights: KeyMap | None
    torch_factory: Callable[[], Any] | None
    flax_factory: Callable[[], Any] | None = None
    # what each side is called with: the inputs, keyword arguments, and the call's options (forward, loss, mode,
    # input_names, tangent_params, name)
    inputs: tuple[np.ndarray, ...]
    flax_inputs: tuple[np.ndarray, ...] | None
    kwargs: dict[str, Any]
    call_options: dict[str, Any]
    # how the results are judged
    tolerances: Mapping[str, Tolerance] | None
    islands: str
    attribute: bool
    lm_logits: str | None
    mesh: Any
    # what localisation does
    localize_failures: bool
    capture_modules: bool
    modules: Mapping[str, Any] | None

    def flax_side_for(self, dtype: str) -> tuple[Any, Rebuild | None]:
        """The flax side a run in ``dtype`` loads: the caller's, or, in a float64 run that lifts, the one
        ``flax_factory`` builds now (call inside :func:`~flax_ln.parity.islands.lifting.flax_lifted`), so that
        constants it makes at construction are float64 (listed as lifted), with its
        :class:`~flax_ln.parity.core.structure.Rebuild`: it must be the caller's model built again, confirmed after
        its call (:func:`~flax_ln.parity.sides.kinds.built_by_flax_factory`)."""
        if self.flax_factory is None or dtype != "float64" or self.islands != "lift":
            return self.flax_module, None
        return built_by_flax_factory(self.flax_factory, self.flax_module)

    @property
    def phases(self) -> int:
        """The progress phases of one :meth:`run`: torch, flax, the comparison, and localisation when it may run."""
        return 3 + (self.capture_modules or self.localize_failures)

    def run(
        self,
        dtype: str,
        zero: set[str] | None,
        plan: KeyPlan | None,
        want_zero: bool = False,
        progress: Progress | None = None,
        prefix: str = "",
        carried: Carried | None = None,
    ) -> tuple[ParityReport, set[str], Any]:
        """The comparison in ``dtype`` (floating inputs cast to its parameter dtype; in float64 on float64
        copies, islands lifted or kept): the report, the gradients float64 shows are zero, and the key map's
        plan. ``zero``: those gradients from a float64 check already run, else a float64 run of the torch side
        says, when asked; ``plan``: that check's plan (the same variables and keys), not built again;
        ``want_zero``: in float64, find those gradients even when no gradient of this run needs them (for a run
        in another dtype to come). ``progress``: the bar its phases advance, each shown after ``prefix``. ``carried``:
        what a localisation of another run of this comparison found, reused where it holds (and filled)."""
        stage = ["building the float64 copies" if dtype == "float64" else "preparing the inputs"]
        try:
            return self._run(dtype, zero, plan, want_zero, progress, prefix, stage, carried)
        except Exception as err:
            if dtype == "float64":  # say where it came from: a port that runs in float32 may not be x64-safe
                note_failure(err, f"compare_modules: raised in the float64 run (x64 on), {stage[0]}")
            raise

    def _run(
        self,
        dtype: str,
        zero: set[str] | None,
        plan: KeyPlan | None,
        want_zero: bool,
        progress: Progress | None,
        prefix: str,
        stage: list[str],  # the stage running now, in words, kept up to date for an error's note
        carried: Carried | None,
    ) -> tuple[ParityReport, set[str], Any]:
        bar = progress or Progress(0, label="", quiet=True)
        shown = 0
        stages = {
            "torch forward and backward": "running the torch side",
            "flax load, compile and run": "loading, tracing and running the flax side",
            "comparison": "comparing",
            "localisation": "localising",
        }

        def phase(text: str) -> None:  # the phase before (if any) is done; ``text`` runs now
            nonlocal shown
            bar.advance(min(shown, 1))
            bar.phase(prefix + text)
            stage[0] = stages[text]
            shown += 1

        opts = self.call_options
        want = parameter_dtype(dtype)
        inputs, cast = cast_floats(self.inputs, want)
        flax_inputs = None if self.flax_inputs is None else cast_floats(self.flax_inputs, want)[0]
        kwargs = {k: cast_floats((v,), want)[0][0] if isinstance(v, np.ndarray) else v for k, v in self.kwargs.items()}
        call = Call.make(
            inputs,
            input_names=opts["input_names"],
            kwargs=kwargs,
            forward=opts["forward"],
            loss=opts["loss"],
            mode=opts["mode"],
        )
        casts = {call.input_names[i]: how for i, how in cast.items()}
        tolerances = tolerances_for(dtype, self.tolerances)
        found = Found()
        with (
            numerics(dtype),
            torch_model_for(self.torch_module, dtype, self.islands, self.torch_factory, found) as (
                model,
                copied,
                torch_rebuild,
            ),
        ):
            phase("torch forward and backward")
            with torch_lifted(model, dtype, self.islands, found):
                side = run_torch_side(
                    model,
                    call,
                    dtype=dtype,
                    mode=opts["mode"],
                    tangent_params=opts["tangent_params"],
                    attribute=self.attribute,
                    name=opts["name"] or type(self.torch_module).__name__,
                    share_weights=True,  # read at once, while the module is not changed: no copy of the weights
                    spill_gradients=should_spill(sum(p.nbytes for p in model.parameters())),
                )
            if torch_rebuild is not None:  # after its call, so that a cache the call filled is told apart
                torch_rebuild.confirm("torch_factory", "torch_module")

            if copied is not None and self.weights is None and opts["mode"] == "grad" and not self.attribute:
                # the rule table loads torch's values as they are (no arithmetic): from the caller's own parameters,
                # cast exactly, so the float64 copies are freed now and the flax side's weights take their memory
                copied.release()
                share_parameters(side, model)

            def float64_model():  # the torch model as the run had it, for a run after the flax side's load (its
                if copied is not None:  # parameters cast again outside any lifting scope, which would list the casts)
                    copied.restore()
                return model

            def rerun(tangents: dict[str, np.ndarray]) -> TorchSide:
                again = float64_model()
                with torch_lifted(again, dtype, self.islands, found):
                    return with_tangents(side, again, call, tangents)

            float64_grads = functools.cache(lambda: float64_gradients(side, float64_model(), call))  # zero's word
            phase("flax load, compile and run")
            with flax_lifted(dtype, self.islands, found):
                if self.flax_factory is not None:
                    stage[0] = "building the flax side with flax_factory="
                flax_module, flax_rebuild = self.flax_side_for(dtype)
                flax_module = hold_constants_of(flax_module)  # what it holds before it runs
                stage[0] = stages["flax load, compile and run"]
                report, flax, zero_found = load_and_judge(
                    self.kind,
                    side,
                    flax_module,
                    call,
                    flax_inputs,
                    tolerances,
                    self.lm_logits,
                    self.mesh,
                    self.weights,
                    (lambda: zero) if zero is not None else (lambda: zero_gradient_names(float64_grads())),
                    plan,
                    rerun,
                    want_zero,
                    lambda: phase("comparison"),
                    None if zero is not None else float64_grads,
                )
                if flax_rebuild is not None:  # after its call, so that a cache the call filled is told apart
                    flax_rebuild.confirm("flax_factory", "flax_module")
            if dtype == "float64":
                found.add(flax.rounded_tables())
            if self.capture_modules or (self.localize_failures and not report.passed):
                phase("localisation")
                try:
                    if self.kind.localization_note is None:  # a kind without modules has no pairs for the records
                        again = float64_model()
                        with torch_lifted(again, dtype, self.islands, found):
                            record_torch_side(side, again, call.forward[0])
                except Exception as err:  # noqa: BLE001 - localisation never costs the verdict; the error is reported
                    side.records = None
                    report.localization_note = (
                        f"recording torch's submodules failed ({type(err).__name__}: {str(err)[:300]}); the verdict "
                        "and every tensor's result stand"
                    )
                with flax_lifted(dtype, self.islands, found):
                    localize(report, side, flax, call, tolerances["output"], self.modules, carried)
        bar.advance(self.phases - shown + 1)  # past the last phase, and a localisation not needed
        report.input_casts = casts
        report.islands = found.islands
        return report, zero_found, flax.plan


def assert_parity(torch_module, flax_module: nnx.Module | Linen | Function, inputs, **options) -> ParityReport:
    """:func:`compare_modules` (same arguments, ``mesh`` included) for tests: raises ``AssertionError``
    with the readable report (the worst tensors and the localisation) unless everything is within
    tolerance. Returns the report when it passes. Under ``pytest --parity-html DIR`` (:mod:`flax_ln.pytest_plugin`) a
    failure also writes the report's HTML page and names it in the message."""
    report = compare_modules(torch_module, flax_module, inputs, **options)
    if not report.passed:
        try:
            page = page_path()
            if page is not None:
                with open(page, "w", encoding="utf-8") as f:
                    f.write(report.to_html())
            where = "" if page is None else f"\nHTML report: {page}"
        except OSError as err:  # the page is lost, never the assertion and its report
            where = f"\nHTML report not written: {err}"
        raise AssertionError("parity failed:\n" + str(report) + where)
    return report

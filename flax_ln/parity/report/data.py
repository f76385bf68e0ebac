"""The parity report's data: per-tensor results, the first divergence, isolated mode, JSON, the environment.

:meth:`ParityReport.sections` is the one walk over a report's contents, in the order they
are shown, as plain data (:class:`flax_ln.parity.report.text.Section`); every renderer reads the
report through it (:mod:`flax_ln.parity.report.text`: the text of ``str(report)`` and
``flax-ln parity``, the chart of ``--plot``). torch is imported lazily (only to print its version).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np

from flax_ln.convert import Tie
from flax_ln.parity.core.policy import TensorResult, Tolerance, json_number
from flax_ln.parity.islands.island import Island
from flax_ln.parity.report.schema import check_report, check_reports_file
from flax_ln.parity.report.text import Section, format_sections, section_text


@dataclasses.dataclass
class FirstDivergence:
    """The first submodule, in execution order, whose output is out of tolerance.

    ``module`` is its torch path, ``flax_module`` the dotted path of the flax module paired with it
    (equal to ``module`` for mirrored trees, the renamed path under ``register_rename``);
    ``by_parameters``: the pair was found by the parameters each module holds (through a key map),
    not by mirrored paths, so the two paths may differ and the printed line names both.

    When the difference arises in a module's own code between its paired children, ``module`` and
    ``flax_module`` are that module, and ``between`` holds the torch paths of the paired children just
    before and just after the gap (``None`` at the start or the end of its code), ``flax_between`` their
    flax paths; ``between`` is ``None`` when the module itself differs (no paired child, or a child that
    differs). ``seen_at`` is the torch path of the module whose output was first out of tolerance, and
    ``inputs`` and ``outputs`` are its errors: the evidence. ``unrecorded``: the flax paths of the module's
    submodules that ran but were not recorded (inside a scan or vmap): with a gap, the difference is in them or
    in the module's own code, which the recorded values cannot tell apart.
    """

    module: str
    inputs: list[TensorResult]
    outputs: list[TensorResult]
    flax_module: str = ""
    by_parameters: bool = False
    between: tuple[str | None, str | None] | None = None
    flax_between: tuple[str | None, str | None] | None = None
    seen_at: str = ""
    unrecorded: list[str] = dataclasses.field(default_factory=list)

    def section(self) -> Section:
        """The report's ``"first divergence"`` section."""
        return Section(
            "first divergence",
            {
                "module": self.module,
                "flax_module": self.flax_module,
                "by_parameters": self.by_parameters,
                "inputs": self.inputs,
                "outputs": self.outputs,
                "between": self.between,
                "flax_between": self.flax_between,
                "seen_at": self.seen_at or self.module,
                "unrecorded": self.unrecorded,
            },
        )

    def describe(self) -> str:
        """The report's line: the module, its worst output error and where, its inputs' errors."""
        return section_text(self.section())


@dataclasses.dataclass
class Isolation:
    """Isolated mode: each flax submodule run alone on its torch twin's recorded inputs.

    ``results`` holds each module's own output error (by torch path, execution order),
    ``skipped`` why a module could not be run alone, ``culprits`` the failing modules
    none of whose submodules fails: the modules whose own computation differs (torch paths);
    ``flax_culprits`` the dotted paths of their flax twins, in the same order; ``own_code``: the culprits
    that have paired children, each of which agrees alone: the difference is in the module's own code
    between them; ``kept``: the floating arguments of each module's call (every module run alone, agreeing or not)
    that kept the port's own value: those that are not activations (a mask or table built from constants or
    integer inputs, an empty cache), and those neither an earlier pair's output nor torch's input stood for;
    ``unrecorded``:
    the flax modules that ran but were not recorded (inside a scan or vmap), each with the reason: a culprit
    holding one is not in ``own_code`` (the difference may be in them).
    """

    results: list[TensorResult]
    skipped: dict[str, str]
    culprits: list[str]
    flax_culprits: list[str] = dataclasses.field(default_factory=list)
    own_code: list[str] = dataclasses.field(default_factory=list)
    kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # torch path -> port arguments kept
    unrecorded: dict[str, str] = dataclasses.field(default_factory=dict)  # flax path -> why it was not recorded

    def section(self) -> Section:
        """The report's ``"isolation"`` section."""
        return Section(
            "isolation",
            {
                "results": self.results,
                "skipped": self.skipped,
                "culprits": self.culprits,
                "flax_culprits": self.flax_culprits,
                "own_code": self.own_code,
                "kept": self.kept,
                "unrecorded": self.unrecorded,
            },
        )

    def describe(self) -> str:
        """The report's line: the culprits with their own output error, or that every module agrees."""
        return section_text(self.section())

    def to_json(self) -> dict[str, Any]:
        return {
            "culprits": self.culprits,
            "flax_culprits": self.flax_culprits,
            "own_code": self.own_code,
            "kept": self.kept,
            "unrecorded": self.unrecorded,
            "modules": [r.to_json() for r in self.results],
            "skipped": self.skipped,
        }


@dataclasses.dataclass
class ParityReport:
    """Everything one comparison found: ``passed``, every tensor's result and, on failure, the first divergence.

    ``report[name]`` is the result of one tensor (an output, ``"grad <input>"``, a torch
    parameter name, or ``"loss"``); ``str(report)`` is the readable table.
    """

    name: str
    dtype: str
    results: list[TensorResult]
    first_divergence: FirstDivergence | None = None
    train_steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    module_errors: list[TensorResult] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    mode: str = "grad"  # "grad": reverse-mode gradients; "jvp": forward-mode output tangents
    isolation: Isolation | None = None
    lm_metrics: dict[str, Any] | None = None
    attribution: dict[str, Any] | None = None  # the float64 truth and how far flax's float64 twin is from it
    stored_dtype: str | None = None  # a checkpoint's dtype(s) on disk, when it was upcast to ``dtype``
    sharding: dict[str, Any] | None = None  # on a mesh: its axes and each flax parameter's PartitionSpec
    frozen: list[str] = dataclasses.field(default_factory=list)  # torch parameters without requires_grad
    # trainable torch parameters the key map drops (an ignore rule, allow_dropped=) whose float64 gradient is zero:
    # the output does not depend on them, so they are not compared
    dropped_parameters: list[str] = dataclasses.field(default_factory=list)
    dropped_outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # output leaves not compared: types
    ties: dict[str, Tie] = dataclasses.field(default_factory=dict)  # torch keys holding one tensor -> flax copies
    shared: dict[str, Tie] = dataclasses.field(default_factory=dict)  # distinct torch tensors filling one variable
    module_skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # pairs localisation could not compare
    localization_note: str | None = None  # why localisation did not run (a Function has no modules)
    islands: list[Island] = dataclasses.field(default_factory=list)  # float32 computations found in float64
    input_casts: dict[str, str] = dataclasses.field(default_factory=dict)  # input -> "float64 -> float32"
    constants: dict[str, str] = dataclasses.field(default_factory=dict)  # key map constants: path -> its value
    discovery: Any = None  # the key map's discovery (how it was measured from a port's loader), when it has one
    float64_check: ParityReport | None = None  # the default's float64 comparison, islands lifted
    error: str | None = None  # why this comparison could not run (a float64 check that raised), with its stage
    # every recorded torch submodule, execution order -> the dotted path of its flax twin (None: unpaired)
    module_pairs: dict[str, str | None] = dataclasses.field(default_factory=dict)
    module_inputs: list[TensorResult] = dataclasses.field(default_factory=list)  # each pair's worst input error
    gradient_only: dict[str, str] = dataclasses.field(default_factory=dict)  # parameter -> its torch module
    environment: dict[str, Any] | None = None  # what the comparison ran under (:func:`environment`)

    @property
    def passed(self) -> bool:
        """Every tensor within tolerance, at least one compared (nothing compared is not a pass), and the
        float64 check passed when one ran."""
        return self.run_passed and (self.float64_check is None or self.float64_check.passed)

    @property
    def run_passed(self) -> bool:
        """This run's own verdict, its float64 check aside: every tensor within tolerance, at least one compared."""
        return (
            self.error is None
            and bool(self.results)
            and all(r.passed for r in self.results)
            and all(s["passed"] for s in self.train_steps)
        )

    def __getitem__(self, name: str) -> TensorResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no tensor {name!r} in the report; it has {[r.name for r in self.results]}")

    def __str__(self) -> str:
        return format_sections(self.sections())

    def to_html(self) -> str:
        """The report as one self-contained HTML page (:func:`flax_ln.parity.report.html.render_html`): the module
        trees side by side, every module shaded by its error, every tensor in a sortable table."""
        from flax_ln.parity.report.html import render_html

        return render_html([self])

    def _repr_html_(self) -> str:
        """A notebook shows the report as its HTML page, in a frame of its own (its style and script stay
        out of the notebook's)."""
        from flax_ln.parity.report.html import framed

        return framed(self.to_html())

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
                "flax_module": self.first_divergence.flax_module,
                "by_parameters": self.first_divergence.by_parameters,
                "between": self.first_divergence.between,
                "flax_between": self.first_divergence.flax_between,
                "seen_at": self.first_divergence.seen_at or self.first_divergence.module,
                "unrecorded": self.first_divergence.unrecorded,
                "inputs": [r.to_json() for r in self.first_divergence.inputs],
                "outputs": [r.to_json() for r in self.first_divergence.outputs],
            },
            "module_errors": [r.to_json() for r in self.module_errors],
            "isolated": None if self.isolation is None else self.isolation.to_json(),
            "lm_metrics": self.lm_metrics,
            "attribution": None
            if self.attribution is None
            else {k: json_number(v) for k, v in self.attribution.items()},
            "mode": self.mode,
            "train_steps": [{k: json_number(v) for k, v in s.items()} for s in self.train_steps],
            "stored_dtype": self.stored_dtype,
            "sharding": self.sharding,
            "frozen": self.frozen,
            "dropped_parameters": self.dropped_parameters,
            "dropped_outputs": self.dropped_outputs,
            "ties": {name: tie.to_json() for name, tie in self.ties.items()},
            "shared": {name: tie.to_json() for name, tie in self.shared.items()},
            "localization_note": self.localization_note,
            "islands": [dataclasses.asdict(island) for island in self.islands],
            "input_casts": self.input_casts,
            "constants": self.constants,
            "discovery": None if self.discovery is None else str(self.discovery),
            "float64_check": None if self.float64_check is None else self.float64_check.to_json(),
            "error": self.error,
            "module_pairs": self.module_pairs,
            "module_inputs": [r.to_json() for r in self.module_inputs],
            "module_skipped": self.module_skipped,
            "gradient_only": self.gradient_only,
            "environment": self.environment,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | os.PathLike) -> ParityReport:
        """A report read back from :meth:`to_json`'s dict, or from a ``--json`` file's path holding one model
        (a file of several: :func:`reports_from_json`). What the renderers read comes back whole; a JSON
        written before a field existed leaves it empty."""
        if not isinstance(data, dict):
            reports = reports_from_json(data)
            if len(reports) != 1:
                raise ValueError(
                    f"{data!s} holds {len(reports)} reports; ParityReport.from_json reads one: use "
                    "reports_from_json for them all"
                )
            return reports[0]
        return report_from_dict(data)

    @property
    def title(self) -> str:
        """``name (dtype)``, with the mode when it is not ``"grad"``, the stored dtype when it differs
        and the mesh when sharded."""
        notes = [self.dtype] + ([] if self.mode == "grad" else [self.mode])
        if self.stored_dtype is not None and self.stored_dtype != self.dtype:
            notes.append(f"stored {self.stored_dtype}")
        if self.sharding is not None:
            notes.append("mesh " + " x ".join(f"{axis} {size}" for axis, size in self.sharding["mesh"].items()))
        return f"{self.name} ({', '.join(notes)})"

    def sections(self, worst: int = 8) -> list[Section]:
        """The report as plain data, section by section in the order it is shown: the one traversal
        every renderer reads (the kinds and their data: :data:`flax_ln.parity.report.text.KINDS`).

        ``"tensors"`` holds every output, then the ``worst`` other tensors closest to (or past)
        their tolerance.
        """
        results = self.results
        failed = [r for r in results if not r.passed]
        others = sorted((r for r in results if r.kind != "output"), key=lambda r: -r.excess)
        shown = [r for r in results if r.kind == "output"] + others[:worst]
        by_kind: dict[str, list[TensorResult]] = {}
        for r in results:
            by_kind.setdefault(r.kind, []).append(r)
        sections = [
            Section("title", {"title": self.title, "passed": self.passed}),
            Section("tensors", {"rows": shown, "hidden": len(results) - len(shown)}),
            Section(
                "summary",
                {
                    "passed": self.passed,
                    "run_passed": self.run_passed,
                    "checked": self.float64_check is not None,
                    "compared": len(results),
                    "within": len(results) - len(failed),
                    "seconds": self.seconds,  # the whole call's, a float64 check it ran included
                    "check_seconds": None if self.float64_check is None else self.float64_check.seconds,
                    "kinds": [
                        {
                            "kind": kind,
                            "count": len(rs),
                            "worst": worst_error(rs),
                            "zero": sum(r.passed_by == "zero" for r in rs),
                        }
                        for kind, rs in by_kind.items()
                    ],
                },
            ),
        ]
        sections += [Section("train step", step) for step in self.train_steps]
        if self.lm_metrics is not None:
            sections.append(Section("lm metrics", self.lm_metrics))
        if self.attribution is not None:
            shown_ids = {id(r) for r in shown}
            attributed = [  # the failing tensors, with torch's and flax's error against float64 truth
                (id(r) in shown_ids, {"name": r.name, "torch": r.torch_vs_float64, "flax": r.flax_vs_float64})
                for r in failed
                if r.torch_vs_float64 is not None and r.flax_vs_float64 is not None
            ]
            sections.append(
                Section(
                    "attribution",
                    {
                        "truth": self.attribution["truth"],
                        "flax_float64_rel": self.attribution["flax_float64_rel"],
                        "flax_float64_worst": self.attribution["flax_float64_worst"],
                        "shown": [a for in_table, a in attributed if in_table],
                        "rest": [a for in_table, a in attributed if not in_table],
                    },
                )
            )
        if self.error is not None:
            sections.append(Section("could not run", {"error": self.error}))
        elif not results:
            sections.append(Section("nothing compared"))
        if self.mode == "grad" and results and not any(r.kind in ("param grad", "input grad") for r in results):
            sections.append(Section("no gradients", {"frozen": len(self.frozen)}))
        elif self.frozen:
            sections.append(Section("frozen", {"names": self.frozen}))
        if self.dropped_parameters:
            sections.append(Section("dropped parameters", {"names": self.dropped_parameters}))
        if self.dropped_outputs:
            sections.append(Section("dropped outputs", {"outputs": self.dropped_outputs}))
        if self.first_divergence is not None:
            sections.append(self.first_divergence.section())
        elif not self.passed and self.module_errors:
            failed_outputs = [r.name for r in failed if r.kind == "output"]
            held = {p: (t, self.module_pairs.get(t)) for p, t in self.gradient_only.items()}
            sections.append(Section("no first divergence", {"failed_outputs": failed_outputs, "gradient_only": held}))
        if self.isolation is not None:
            sections.append(self.isolation.section())
        if self.localization_note is not None:
            sections.append(Section("localization note", {"note": self.localization_note}))
        if self.input_casts:
            sections.append(Section("input casts", {"casts": self.input_casts}))
        if self.islands:
            sections.append(Section("islands", {"islands": self.islands}))
        if self.constants:
            sections.append(Section("constants", {"constants": self.constants}))
        if self.discovery is not None:
            sections.append(Section("discovery", {"text": str(self.discovery)}))
        sections.append(self._modules_section())
        if self.ties or self.shared:
            sections.append(Section("ties", {"ties": self.ties, "shared": self.shared}))
        if self.environment is not None:
            sections.append(Section("environment", self.environment))
        if self.float64_check is not None:
            sections.append(Section("float64 check", {"sections": self.float64_check.sections(worst)}))
            sections.append(
                Section(
                    "verdict",
                    {"passed": self.passed, "run": (self.dtype, self.run_passed), "check": self.float64_check.passed},
                )
            )
        return sections

    def _modules_section(self) -> Section:
        """Per submodule, in execution order: its output error, the worst error of its parameters' gradients
        (zero gradients left out: noise, not error) and, in isolated mode, its own error."""
        names = [r.name for r in self.module_errors]
        grads: dict[str, float] = {}
        for r in self.results:
            if r.kind == "param grad" and r.passed_by != "zero":
                module = r.name.rsplit(".", 1)[0] if "." in r.name else r.name
                grads[module] = max(grads.get(module, 0.0), r.relative_error)
        names += [name for name in grads if name not in names]

        def rtol(kind: str) -> float | None:
            return next((r.tolerance.rtol for r in self.results if r.kind == kind), None)

        return Section(
            "modules",
            {
                "names": names,
                "outputs": {r.name: r.relative_error for r in self.module_errors},
                "grads": grads,
                "isolated": None
                if self.isolation is None
                else {r.name: r.relative_error for r in self.isolation.results},
                "output_rtol": rtol("output"),
                "grad_rtol": rtol("param grad"),
                "tree": list(self.module_pairs) or names,
                "flax_paths": self.module_pairs,
                "inputs": {r.name: r.relative_error for r in self.module_inputs},
                "skipped": self.module_skipped,
            },
        )


def worst_error(results: list[TensorResult]) -> float:
    """The worst relative error among ``results`` (those passed as a zero gradient aside), NaN when any is NaN (which
    ``max`` would drop or keep by the order it meets them) or a tensor fails on NaN or Inf whatever its error over
    the finite values: a summary never says less than a tensor it fails."""
    errors = [math.nan if r.nonfinite and not r.passed else r.relative_error for r in results if r.passed_by != "zero"]
    return math.nan if any(math.isnan(e) for e in errors) else max(errors, default=0.0)


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
        # jax's Config sets its flags as attributes at run time, which type checkers cannot see
        "x64": bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined]
        "matmul_precision": str(jax.config.jax_default_matmul_precision),  # type: ignore[attr-defined]
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - the harness cannot run without torch anyway
        env["torch"] = None
    return env


def _number(v: Any) -> Any:
    """A number as :func:`~flax_ln.parity.core.policy.json_number` wrote it, back: ``"inf"``/``"nan"`` as floats."""
    return float(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v


def result_from_json(d: dict[str, Any]) -> TensorResult:
    """A :class:`~flax_ln.parity.core.policy.TensorResult` from its ``to_json`` dict."""
    fields = {k: _number(v) for k, v in d.items()}
    fields["tolerance"] = Tolerance(**{k: _number(v) for k, v in d["tolerance"].items()})
    fields["shape"] = tuple(d["shape"])
    fields["max_error_index"] = None if d["max_error_index"] is None else tuple(d["max_error_index"])
    return TensorResult(**fields)


def report_from_dict(d: dict[str, Any]) -> ParityReport:
    """One report from its :meth:`ParityReport.to_json` dict (a model of a ``--json`` file's ``"models"``);
    ``ValueError`` naming the first field that is missing or of the wrong type."""
    check_report(d)
    results = [result_from_json(r) for r in d["tensors"]]
    fd = d.get("first_divergence")
    first = None
    if fd is not None:

        def pair(v: Any) -> tuple[str | None, str | None] | None:
            return None if v is None else (v[0], v[1])

        first = FirstDivergence(
            fd["module"],
            [result_from_json(r) for r in fd["inputs"]],
            [result_from_json(r) for r in fd["outputs"]],
            fd.get("flax_module", fd["module"]),
            fd.get("by_parameters", False),
            pair(fd.get("between")),
            pair(fd.get("flax_between")),
            fd.get("seen_at", fd["module"]),
            fd.get("unrecorded", []),
        )
    iso = d.get("isolated")
    isolation = None
    if iso is not None:
        isolation = Isolation(
            [result_from_json(r) for r in iso["modules"]],
            iso["skipped"],
            iso["culprits"],
            iso.get("flax_culprits", []),
            iso.get("own_code", []),
            iso.get("kept", {}),
            iso.get("unrecorded", {}),
        )

    def tie(t: dict[str, list[str]]) -> Tie:
        return Tie(tuple(t["torch_aliases"]), tuple(t["flax_paths"]))

    attribution = d.get("attribution")
    return ParityReport(
        name=d["name"],
        dtype=d["dtype"],
        results=results,
        first_divergence=first,
        train_steps=[{k: _number(v) for k, v in s.items()} for s in d.get("train_steps", [])],
        module_errors=[result_from_json(r) for r in d.get("module_errors", [])],
        seconds=d.get("seconds", 0.0),
        mode=d.get("mode", "grad"),
        isolation=isolation,
        lm_metrics=d.get("lm_metrics"),
        attribution=None if attribution is None else {k: _number(v) for k, v in attribution.items()},
        stored_dtype=d.get("stored_dtype"),
        sharding=d.get("sharding"),
        frozen=d.get("frozen", []),
        dropped_parameters=d.get("dropped_parameters", []),
        dropped_outputs=d.get("dropped_outputs", {}),
        ties={k: tie(t) for k, t in d.get("ties", {}).items()},
        shared={k: tie(t) for k, t in d.get("shared", {}).items()},
        module_skipped=d.get("module_skipped", {}),
        localization_note=d.get("localization_note"),
        islands=[Island(**i) for i in d.get("islands", [])],
        input_casts=d.get("input_casts", {}),
        float64_check=None if d.get("float64_check") is None else report_from_dict(d["float64_check"]),
        error=d.get("error"),
        constants=d.get("constants", {}),
        discovery=d.get("discovery"),
        module_pairs=d.get("module_pairs", {}),
        gradient_only=d.get("gradient_only", {}),
        module_inputs=[result_from_json(r) for r in d.get("module_inputs", [])],
        environment=d.get("environment"),
    )


def reports_from_json(source: dict[str, Any] | str | os.PathLike) -> list[ParityReport]:
    """Every report of a ``flax-ln parity --json`` file (its path, or its parsed dict), or the one report of a
    :meth:`ParityReport.to_json` dict; each takes the file's ``"environment"`` when it has none of its own."""
    if isinstance(source, dict):
        data = source
    else:
        with open(source) as f:
            try:
                data = json.load(f)
            except RecursionError:  # json's parser recurses once per level
                raise ValueError(f"{source}: JSON nested too deeply to be a parity report") from None
    if not isinstance(data, dict):
        raise ValueError(f"the top level: expected an object, got {type(data).__name__}")
    if "models" not in data:
        if "tensors" not in data:
            raise ValueError(
                f"{source if not isinstance(source, dict) else 'the dict'} is neither a flax-ln parity --json file "
                f"(a 'models' list) nor one report (a 'tensors' list); it has the keys {sorted(data)[:8]}"
            )
        return [report_from_dict(data)]
    check_reports_file(data)
    reports = [report_from_dict(m) for m in data["models"]]
    for r in reports:
        if r.environment is None:
            r.environment = data.get("environment")
    return reports

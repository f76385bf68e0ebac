"""The parity report: per-tensor results, the first divergence, text, JSON and a chart.

torch is imported lazily (only to print its version).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flax_ln.convert.keymap import Tie
from flax_ln.parity.policy import TensorResult, json_number


@dataclasses.dataclass
class FirstDivergence:
    """The first submodule, in execution order, whose output is out of tolerance.

    ``module`` is its torch path, ``flax_module`` the dotted path of the flax module paired with it
    (equal to ``module`` for mirrored trees, the renamed path under ``register_rename``);
    ``key_map``: the pair was found through a key map (the printed line names both paths).
    """

    module: str
    inputs: list[TensorResult]
    outputs: list[TensorResult]
    flax_module: str = ""
    key_map: bool = False

    def describe(self) -> str:
        out = max(self.outputs, key=lambda r: r.excess)
        ins = ", ".join(f"{r.name} rel {r.relative_error:.2e}" for r in self.inputs) or "none compared"
        where = f"{self.module} <-> {self.flax_module}" if self.key_map else self.module
        return (
            f"first divergence: {where}  (output rel {out.relative_error:.2e}, "
            f"max |d| {out.max_abs_error:.2e} at {out.max_error_index}; inputs: {ins})"
        )


@dataclasses.dataclass
class Isolation:
    """Isolated mode: each flax submodule run alone on its torch twin's recorded inputs.

    ``results`` holds each module's own output error (by torch path, execution order),
    ``skipped`` why a module could not be run alone, ``culprits`` the failing modules
    none of whose submodules fails: the modules whose own computation differs (torch paths);
    ``flax_culprits`` the dotted paths of their flax twins, in the same order.
    """

    results: list[TensorResult]
    skipped: dict[str, str]
    culprits: list[str]
    flax_culprits: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        by_name = {r.name: r for r in self.results}
        if not self.culprits:
            return (
                f"isolated: every module agrees on torch's inputs ({len(self.results)} run alone, "
                f"{len(self.skipped)} skipped)"
            )
        named = ", ".join(f"{m} (own output rel {_fmt(by_name[m].relative_error)})" for m in self.culprits)
        return f"isolated: {named}"

    def to_json(self) -> dict[str, Any]:
        return {
            "culprits": self.culprits,
            "flax_culprits": self.flax_culprits,
            "modules": [r.to_json() for r in self.results],
            "skipped": self.skipped,
        }


def _side_further_off(t: float, f: float) -> str:
    """Which side is further from float64 truth, by how much: torch's error ``t`` against flax's ``f``."""
    if f > t:
        return f"flax is further off (x{f / t:.3g})" if t > 0 else "flax is further off (torch exact)"
    if t > f:
        return f"torch is further off (x{t / f:.3g})" if f > 0 else "torch is further off (flax exact)"
    return "both equally far"


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
    dropped_outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # output leaves not compared: types
    ties: dict[str, Tie] = dataclasses.field(default_factory=dict)  # torch keys holding one tensor -> flax copies
    module_skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # pairs localisation could not compare
    localization_note: str | None = None  # why localisation did not run (a Function has no modules)

    @property
    def passed(self) -> bool:
        """Every tensor within tolerance, and at least one compared: nothing compared is not a pass."""
        return bool(self.results) and all(r.passed for r in self.results) and all(s["passed"] for s in self.train_steps)

    def __getitem__(self, name: str) -> TensorResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no tensor {name!r} in the report; it has {[r.name for r in self.results]}")

    def __str__(self) -> str:
        return format_report(self)

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
            "dropped_outputs": self.dropped_outputs,
            "ties": {name: tie.to_json() for name, tie in self.ties.items()},
            "localization_note": self.localization_note,
        }

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


def format_environment(env: Mapping[str, Any]) -> str:
    """The header line of a run: backend, devices, versions, matmul precision, dtype and x64."""
    devices = ", ".join(env["devices"])
    return (
        f"flax-ln parity | backend {env['backend']} ({devices}) | jax {env['jax']}, flax {env['flax']}, "
        f"torch {env['torch']}, optax {env['optax']} | matmul precision {env['matmul_precision']}"
    )


def _fmt(v: float) -> str:
    return f"{v:.2e}" if math.isfinite(v) else str(v)


def format_report(report: ParityReport, *, worst: int = 8, quiet: bool = False) -> str:
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
    lines = [f"== {report.title} " + "=" * max(0, 80 - len(report.title)), header]
    for r in shown:
        status = (
            {None: "ok", "rtol": "ok", "atol": "ok (abs)", "gtol": "ok (zero grad)"}[r.passed_by]
            if r.passed
            else ("MISMATCH" if r.problem else "NONFINITE" if r.nonfinite else "FAIL")
        )
        at = "" if r.max_error_index is None else str(r.max_error_index).replace(" ", "")
        lines.append(
            f"{r.name[:44]:<44} {r.kind:<11} {str(r.shape).replace(' ', '')[:16]:<16} {_fmt(r.max_abs_error):>9} "
            f"{at[:14]:<14} {_fmt(r.relative_error):>9} {r.tolerance.rtol:>8.0e}  {status}"
            + "".join(f"  [{note}]" for note in (r.problem, r.nonfinite) if note)
        )
    if len(shown) < len(results):
        lines.append(f"... {len(results) - len(shown)} more tensors, all shown with --json")
    if any(r.passed_by == "gtol" for r in shown):
        lines.append(
            "(zero grad): exact gradient is 0, only rounding noise differs; its error is within "
            "gtol of the whole gradient's norm"
        )
    by_kind: dict[str, list[TensorResult]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)

    def kind_summary(kind: str, rs: list[TensorResult]) -> str:
        zero = sum(r.passed_by == "gtol" for r in rs)
        rels = [r.relative_error for r in rs if r.passed_by != "gtol"] or [0.0]
        return f"{kind}: {len(rs)} tensors, worst rel {_fmt(max(rels))}" + (f" ({zero} zero-gradient)" if zero else "")

    summary = "; ".join(kind_summary(kind, rs) for kind, rs in by_kind.items())
    lines.append(
        f"summary: {len(results) - len(failed)}/{len(results)} within tolerance ({summary}) "
        f"in {report.seconds:.1f}s -> {'PASS' if report.passed else 'FAIL'}"
    )
    for step in report.train_steps:
        lines.append(
            f"train step {step['step']}: loss flax {step['loss_flax']:.8g} torch {step['loss_torch']:.8g} "
            f"(rel {_fmt(step['loss_rel_error'])}), worst param rel {_fmt(step['param_rel_error'])} "
            f"({step['worst_param']}) -> {'ok' if step['passed'] else 'FAIL'}"
            + (f"; {len(step['noise_only'])} zero-gradient params not compared" if step["noise_only"] else "")
        )
    if report.lm_metrics is not None:
        lines.append(format_lm_metrics(report.lm_metrics))
    if report.attribution is not None:
        lines.append(
            f"attribution: float64 truth = {report.attribution['truth']}; flax's float64 twin is "
            f"{_fmt(report.attribution['flax_float64_rel'])} from it "
            f"(worst: {report.attribution['flax_float64_worst']})"
        )
        attributed = [
            (r, t, f)  # the tensor, torch's and flax's error against float64 truth
            for r in failed
            if (t := r.torch_vs_float64) is not None and (f := r.flax_vs_float64) is not None
        ]
        shown_ids = {id(r) for r in shown}
        for r, t, f in (a for a in attributed if id(a[0]) in shown_ids):
            lines.append(
                f"attribution: {r.name}: flax {_fmt(f)}, torch {_fmt(t)} from float64 -> {_side_further_off(t, f)}"
            )
        rest = [(t, f) for r, t, f in attributed if id(r) not in shown_ids]
        if rest:
            flax_worse = sum(f > t for t, f in rest)
            lines.append(
                f"attribution: {len(rest)} more failing tensors (all in --json): flax further off on "
                f"{flax_worse}, torch on {len(rest) - flax_worse}"
            )
    if not results:
        lines.append("nothing compared: no tensor in this report, which is not a pass")
    if report.mode == "grad" and results and not any(r.kind in ("param grad", "input grad") for r in results):
        lines.append(
            "no gradients: no floating input"
            + (f" and every parameter frozen ({len(report.frozen)})" if report.frozen else " and no parameter")
            + "; the outputs are compared"
        )
    elif report.frozen:
        lines.append(
            f"frozen: {len(report.frozen)} parameters (requires_grad=False) loaded and compared through the "
            f"outputs, not as gradients: {', '.join(report.frozen[:4])}" + (", ..." if len(report.frozen) > 4 else "")
        )
    if report.dropped_outputs:
        lines.append(
            "dropped outputs (not arrays or numbers, not compared): "
            + ", ".join(f"{k} ({v})" for k, v in report.dropped_outputs.items())
        )
    failed_outputs = [r.name for r in failed if r.kind == "output"]
    if report.first_divergence is not None:
        lines.append(report.first_divergence.describe())
    elif not report.passed and report.module_errors and failed_outputs:
        lines.append(
            f"no submodule output diverges, yet {', '.join(failed_outputs)} differ: the difference arises in the "
            "forward pass, in values no submodule's floating output holds (an integer output, or the model's own "
            "computation between submodules)"
        )
    elif not report.passed and report.module_errors:
        lines.append("no submodule output diverges: the difference arises in the backward pass or the loss")
    if report.isolation is not None:
        lines.append(report.isolation.describe())
    if report.localization_note is not None:
        lines.append(report.localization_note)
    if quiet:
        kept = (
            "summary:",
            "train step",
            "first divergence",
            "no submodule",
            "isolated:",
            "LM metrics",
            "attribution:",
            "nothing compared",
            "localisation needs",
        )
        lines = [line for line in lines if line.startswith(kept)]
        lines[0] = f"{report.title} {lines[0]}"
    return "\n".join(lines)


def format_lm_metrics(m: Mapping[str, Any]) -> str:
    """One line: per-position KL (mean, max, where), top-1 and top-k agreement."""
    top_k = next(k for k in m if k.startswith("top") and k != "top1_agreement")
    return (
        f"LM metrics ({m['output']}, {m['positions']} positions): KL mean {_fmt(m['kl_mean'])}, max "
        f"{_fmt(m['kl_max'])} at position {tuple(m['worst_position'])}; top-1 agreement {m['top1_agreement']:.3f}, "
        f"{top_k.split('_')[0]} agreement {m[top_k]:.3f}"
    )


# ---------------------------------------------------------------------------------------
# picture


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def plot_errors(reports: Sequence[ParityReport], path: str) -> None:
    """Save a chart, one row per model: each submodule's output error, its own error run alone
    (isolated mode) and the worst gradient error of its parameters, in execution order, on a
    log scale with the tolerances; beside it, for language models, the KL divergence per position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib ships with the test extra
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from err

    lm = any(r.lm_metrics is not None for r in reports)
    fig, axes = plt.subplots(
        len(reports),
        2 if lm else 1,
        figsize=(19 if lm else 14, 3.6 * len(reports)),
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if lm else None,
    )
    tiny = 1e-18  # exact zeros are drawn at the bottom of the log scale
    for row, report in enumerate(reports):
        if lm:
            _plot_lm_metrics(axes[row, 1], report.lm_metrics, tiny)
        ax = axes[row, 0]
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
        if report.isolation is not None:  # each module run alone on torch's inputs: its own error
            own = {r.name: r.relative_error for r in report.isolation.results}
            ax.plot(
                x,
                [max(own.get(m, np.nan), tiny) for m in modules],
                "^",
                color="C3",
                ms=4,
                label="isolated: module's own output rel. error",
            )
        for color, kind, label in (("C0", "output", "output tolerance"), ("C1", "param grad", "gradient tolerance")):
            tol = next((r.tolerance.rtol for r in report.results if r.kind == kind), None)
            if tol is not None:
                ax.axhline(tol, color=color, lw=0.8, ls=":", label=label)
        ax.set_yscale("log")
        ax.set_title(f"{report.title}: {'PASS' if report.passed else 'FAIL'}")
        step = max(1, len(modules) // 40)
        ax.set_xticks(x[::step])
        ax.set_xticklabels(modules[::step], rotation=75, fontsize=6)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lm_metrics(ax, metrics: Mapping[str, Any] | None, tiny: float) -> None:
    """KL divergence per position (flattened batch x position), with top-1/top-k agreement in the title."""
    if metrics is None:
        ax.axis("off")
        return
    kl = np.maximum(np.asarray(metrics["kl_per_position"]), tiny)
    ax.plot(np.arange(kl.size), kl, ".-", color="C2")
    ax.set_yscale("log")
    top_k = next(k for k in metrics if k.startswith("top") and k != "top1_agreement")
    ax.set_title(
        f"KL(torch || flax) per position ({metrics['output']}): mean {_fmt(metrics['kl_mean'])}\n"
        f"top-1 {metrics['top1_agreement']:.3f}, {top_k.split('_')[0]} {metrics[top_k]:.3f}, worst "
        f"{tuple(metrics['worst_position'])}",
        fontsize=8,
    )
    ax.set_xlabel("position (batch-major)", fontsize=7)

"""Rendering a parity report: the text of ``flax-ln parity`` and ``str(report)``, and the chart of ``--plot``.

A renderer reads a report through its one traversal, :meth:`flax_ln.parity.ParityReport.sections`:
:class:`Section` s in the order the text prints them, each a kind and plain data (numbers,
names, :class:`~flax_ln.parity.TensorResult` s). :func:`format_sections` turns them into
text and :func:`plot_errors` draws the ``"modules"`` section; a new renderer (HTML, ...)
is one more function over the same sections. This module does not import the report's
classes: the report imports it, for ``str(report)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from flax_ln.parity.core.policy import TensorResult
from flax_ln.parity.records.capture import WHOLE_MODEL
from flax_ln.parity.report.names import distinct_cuts

# The kinds of section, in the order a report yields them (each at most once, "train step" once
# per step), and the data each holds:
#   "title":               title (``name (dtype, ...)``), passed
#   "tensors":             rows (every output, then the ``worst`` other tensors closest to their
#                          tolerance: TensorResult s), hidden (how many more the report holds)
#   "summary":             passed, compared, within (counts), seconds, kinds (per tensor kind:
#                          kind, count, worst relative error, zero (zero-gradient count))
#   "train step":          one optimizer step's comparison (loss, worst parameter, passed, noise_only)
#   "lm metrics":          the report's lm_metrics (KL per position, top-1/top-k agreement)
#   "attribution":         truth, flax_float64_rel, flax_float64_worst, shown and rest (failing tensors
#                          in and out of "tensors": name, torch and flax error against float64 truth)
#   "nothing compared":    no data
#   "no gradients":        frozen (how many parameters are frozen)
#   "frozen":              names (the frozen torch parameters)
#   "dropped parameters":  names (trainable torch parameters the key map drops, their float64 gradient zero)
#   "dropped outputs":     outputs (output leaf -> its type)
#   "first divergence":    module, flax_module, by_parameters, inputs, outputs (TensorResult s, at seen_at),
#                          between, flax_between (the paired children around a gap in module's own code), seen_at,
#                          unrecorded (flax modules in that gap that ran without a record: inside a scan or vmap)
#   "no first divergence": failed_outputs (the failing outputs; empty: the backward pass differs), gradient_only
#                          (parameter -> (torch module, flax module): failing gradients while every output agrees)
#   "isolation":           results, skipped, culprits, flax_culprits, own_code, kept, unrecorded (flax path -> why)
#   "localization note":   note (why localisation did not run)
#   "input casts":         casts (input name -> "float64 -> float32": floating inputs cast to the comparison's dtype)
#   "islands":             islands (Island s: side, module, what, lifted)
#   "constants":           constants (flax path -> a short description of the value: the key map's flax-only
#                          constants, filled without a torch key and not compared as gradients)
#   "discovery":           text (``str()`` of the key map's discovery: how the map was measured from a loader)
#   "modules":             names (execution order), outputs, grads, isolated (name -> relative error;
#                          isolated None without isolated mode), output_rtol, grad_rtol (chart data only)
#   "ties":                ties, shared (torch key -> Tie: torch keys holding one tensor and its flax copies; distinct
#                          torch tensors filling one flax variable), a line each
#   "environment":         the comparison's environment (flax_ln.parity.report.data.environment: backend, devices,
#                          versions, x64, matmul precision); not printed: flax-ln parity prints it once as its header
#   "float64 check":       sections (the float64 comparison's own sections, islands lifted, which the default
#                          runs beside the comparison in the torch parameters' dtype)
#   "could not run":       error (why the comparison raised: its exception and stage; the float64 check's)
#   "verdict":             passed, run ((dtype, passed) of the run), check (the float64 check passed): the overall
#                          line of a report with a float64 check
KINDS = (
    "title",
    "tensors",
    "summary",
    "train step",
    "lm metrics",
    "attribution",
    "nothing compared",
    "no gradients",
    "frozen",
    "dropped parameters",
    "dropped outputs",
    "first divergence",
    "no first divergence",
    "isolation",
    "localization note",
    "input casts",
    "islands",
    "constants",
    "discovery",
    "modules",
    "ties",
    "environment",
    "float64 check",
    "could not run",
    "verdict",
)
QUIET_KINDS = frozenset(
    {
        "summary",
        "train step",
        "first divergence",
        "no first divergence",
        "isolation",
        "lm metrics",
        "attribution",
        "nothing compared",
        "localization note",
        "float64 check",
        "could not run",
        "verdict",
    }
)  # what ``--quiet`` prints


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of a report, as plain data: its ``kind`` (one of :data:`KINDS`) and what it shows."""

    kind: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Sectioned(Protocol):
    """What a renderer reads: a report's sections (:meth:`flax_ln.parity.ParityReport.sections`)."""

    def sections(self, worst: int = 8) -> list[Section]:
        """The report's sections, with at most ``worst`` tensors besides the outputs in ``"tensors"``."""
        ...


# ---------------------------------------------------------------------------------------
# text


def fmt(v: float) -> str:
    """A relative or absolute error in the report's text: ``1.23e-07``, or ``nan``/``inf``."""
    return f"{v:.2e}" if math.isfinite(v) else str(v)


TABLE_HEADER = f"{'tensor':<44} {'kind':<11} {'shape':<16} {'max |d|':>9} {'at':<14} {'rel err':>9} {'rtol':>8}  status"
STATUS = {None: "ok", "rtol": "ok", "atol": "ok (abs)", "zero": "ok (zero in float64)"}  # a pass, by criterion


def status(r: TensorResult) -> str:
    """A tensor's verdict: ``ok``, ``ok (abs)``, ``ok (zero in float64)``, ``MISMATCH``, ``NONFINITE`` or ``FAIL``."""
    if r.passed:
        return STATUS[r.passed_by]
    return "MISMATCH" if r.problem else "NONFINITE" if r.nonfinite else "FAIL"


def _row(r: TensorResult, name: str) -> str:
    at = "" if r.max_error_index is None else str(r.max_error_index).replace(" ", "")
    return (
        f"{name:<44} {r.kind:<11} {str(r.shape).replace(' ', '')[:16]:<16} {fmt(r.max_abs_error):>9} "
        f"{at[:14]:<14} {fmt(r.relative_error):>9} {r.tolerance.rtol:>8.0e}  {status(r)}"
        + "".join(f"  [{note}]" for note in (r.problem, r.nonfinite) if note)
    )


def _title(d: Mapping[str, Any]) -> list[str]:
    return [f"== {d['title']} " + "=" * max(0, 80 - len(d["title"])), TABLE_HEADER]


def _tensors(d: Mapping[str, Any]) -> list[str]:
    names = distinct_cuts([r.name for r in d["rows"]], 44)  # each row's name its own, however cut
    lines = [_row(r, name) for r, name in zip(d["rows"], names, strict=True)]
    if d["hidden"]:
        lines.append(
            f"... {d['hidden']} more tensors: every one in report.results (report.to_json(); on the command line, "
            "--json)"
        )
    if any(r.passed_by == "zero" for r in d["rows"]):
        lines.append(
            "(zero in float64): float64 shows the exact gradient is 0, so only rounding noise differs; "
            "its error is within gtol of the whole gradient's norm"
        )
    return lines


def _summary(d: Mapping[str, Any]) -> list[str]:
    kinds = "; ".join(
        f"{k['kind']}: {k['count']} tensors, worst rel {fmt(k['worst'])}"
        + (f" ({k['zero']} zero in float64)" if k["zero"] else "")
        for k in d["kinds"]
    )
    passed = d.get("run_passed", d["passed"]) if d.get("checked") else d["passed"]  # this run's own verdict
    check = d.get("check_seconds")  # report.seconds holds both runs: this run's own time is the rest
    took = (
        f"{d['seconds']:.1f}s"
        if check is None
        else f"{d['seconds'] - check:.1f}s, {d['seconds']:.1f}s with the float64 check"
    )
    return [
        f"summary: {d['within']}/{d['compared']} within tolerance ({kinds}) in {took} -> {'PASS' if passed else 'FAIL'}"
    ]


def _ties(d: Mapping[str, Any]) -> list[str]:
    lines = [
        f"tie: {' = '.join(tie.torch_aliases)} (one torch tensor) -> flax {', '.join(tie.flax_paths)}"
        for tie in d["ties"].values()
    ]
    lines += [
        f"shared: {', '.join(tie.torch_aliases)} (distinct torch parameters) -> one flax variable "
        f"{', '.join(tie.flax_paths)}"
        for tie in d["shared"].values()
    ]
    return lines


def _verdict(d: Mapping[str, Any]) -> list[str]:
    dtype, run = d["run"]
    words = f"{dtype} {'PASS' if run else 'FAIL'}, float64 check {'PASS' if d['check'] else 'FAIL'}"
    return [f"verdict: {'PASS' if d['passed'] else 'FAIL'} ({words})"]


def _could_not_run(d: Mapping[str, Any]) -> list[str]:
    return [
        f"could not run: {d['error']}",
        '  (the float32 results stand; to check float32 alone, pass dtype="float32"; a port that is not '
        "x64-safe is a finding in itself: docs/ports.md, 'When the port is not x64-safe')",
    ]


def _train_step(step: Mapping[str, Any]) -> list[str]:
    return [
        f"train step {step['step']}: loss flax {step['loss_flax']:.8g} torch {step['loss_torch']:.8g} "
        f"(rel {fmt(step['loss_rel_error'])}), worst param rel {fmt(step['param_rel_error'])} "
        f"({step['worst_param']}) -> {'ok' if step['passed'] else 'FAIL'}"
        + (f"; {len(step['noise_only'])} zero-gradient params not compared" if step["noise_only"] else "")
    ]


def format_lm_metrics(m: Mapping[str, Any]) -> str:
    """One line: per-position KL (mean, max, where), top-1 and top-k agreement."""
    top_k = next(k for k in m if k.startswith("top") and k != "top1_agreement")
    return (
        f"LM metrics ({m['output']}, {m['positions']} positions): KL mean {fmt(m['kl_mean'])}, max "
        f"{fmt(m['kl_max'])} at position {tuple(m['worst_position'])}; top-1 agreement {m['top1_agreement']:.3f}, "
        f"{top_k.split('_')[0]} agreement {m[top_k]:.3f}"
    )


def _side_further_off(t: float, f: float) -> str:
    """Which side is further from float64 truth, by how much: torch's error ``t`` against flax's ``f``."""
    if f > t:
        return f"flax is further off (x{f / t:.3g})" if t > 0 else "flax is further off (torch exact)"
    if t > f:
        return f"torch is further off (x{t / f:.3g})" if f > 0 else "torch is further off (flax exact)"
    return "both equally far"


def _attribution(d: Mapping[str, Any]) -> list[str]:
    lines = [
        f"attribution: float64 truth = {d['truth']}; flax's float64 twin is "
        f"{fmt(d['flax_float64_rel'])} from it (worst: {d['flax_float64_worst']})"
    ]
    for a in d["shown"]:
        lines.append(
            f"attribution: {a['name']}: flax {fmt(a['flax'])}, torch {fmt(a['torch'])} from float64 -> "
            f"{_side_further_off(a['torch'], a['flax'])}"
        )
    if rest := d["rest"]:
        flax_worse = sum(a["flax"] > a["torch"] for a in rest)
        lines.append(
            f"attribution: {len(rest)} more failing tensors (all in --json): flax further off on "
            f"{flax_worse}, torch on {len(rest) - flax_worse}"
        )
    return lines


def _no_gradients(d: Mapping[str, Any]) -> list[str]:
    return [
        "no gradients: no floating input"
        + (f" and every parameter frozen ({d['frozen']})" if d["frozen"] else " and no parameter")
        + "; the outputs are compared"
    ]


def _frozen(d: Mapping[str, Any]) -> list[str]:
    names = d["names"]
    return [
        f"frozen: {len(names)} parameters (requires_grad=False) loaded and compared through the "
        f"outputs, not as gradients: {', '.join(names[:4])}" + (", ..." if len(names) > 4 else "")
    ]


def _dropped_parameters(d: Mapping[str, Any]) -> list[str]:
    names = d["names"]
    return [
        f"dropped parameters: {len(names)} trainable torch parameters the key map drops, not compared: float64 "
        f"shows their gradient is zero (the output does not depend on them): {', '.join(names[:4])}"
        + (", ..." if len(names) > 4 else "")
    ]


def _first_divergence(d: Mapping[str, Any]) -> list[str]:
    out = max(d["outputs"], key=lambda r: r.excess)
    ins = ", ".join(f"{r.name} rel {r.relative_error:.2e}" for r in d["inputs"]) or "none compared"
    named_apart = d["by_parameters"] or "[" in d.get("flax_module", "")  # a scanned layer (h[2]): both named
    where = f"{d['module']} <-> {d['flax_module']}" if named_apart else d["module"]
    if d.get("between") is None and d.get("flax_between") is not None:  # torch's module, the port's inline code
        before, after = d["flax_between"]
        gap = f"between {before or 'its start'} and {after or 'its end'}"
        where = f"{d['module']} <-> in {d['flax_module']}, {gap}: its own code"
    elif d.get("between") is not None:
        before, after = d["between"]
        gap = f"between {before or 'its start'} and {after or 'its end'}"
        held = d.get("unrecorded") or []
        where = f"in {where}, {gap}: " + (
            f"in its submodules that ran there without a record ({_few(held)}: traced inside a transform), "
            "or its own code"
            if held
            else "its own code"
        )
    seen = f"seen at {d['seen_at']}: " if d.get("seen_at", d["module"]) != d["module"] else ""
    return [
        f"first divergence: {where}  ({seen}output rel {out.relative_error:.2e}, "
        f"max |d| {out.max_abs_error:.2e} at {out.max_error_index}; inputs: {ins})"
    ]


def _no_first_divergence(d: Mapping[str, Any]) -> list[str]:
    if d.get("gradient_only"):  # parameter -> (torch module, flax module or None)
        return [
            f"seen only in the gradient of `{p}`: every module output agrees; its module {t} <-> {f or '(unpaired)'} "
            "holds a parameter whose value does not show in the forward pass (a zero bias left out of the port's code)"
            for p, (t, f) in d["gradient_only"].items()
        ]
    if d["failed_outputs"]:
        return [
            f"no submodule output diverges, yet {', '.join(d['failed_outputs'])} differ: the difference arises in "
            "the forward pass, in values no submodule's floating output holds (an integer output, or the model's "
            "own computation between submodules)"
        ]
    return ["no submodule output diverges: the difference arises in the backward pass or the loss"]


UNPAIRED_REASONS = ("no flax module holds", "no flax twin", "no flax module's output")  # not a failed isolation


def _few(names: Sequence[str]) -> str:
    return ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")


def _isolation(d: Mapping[str, Any]) -> list[str]:
    tried = [m for m, why in d["skipped"].items() if not why.startswith(UNPAIRED_REASONS)]
    skipped = (
        f"; not run alone: {', '.join(tried[:3])}{', ...' if len(tried) > 3 else ''} ({len(tried)}; the reasons "
        "are in isolation.skipped)"
        if tried
        else ""
    )
    unrecorded = list(d.get("unrecorded", {}))
    if unrecorded:
        skipped += (
            f"; not recorded: {_few(unrecorded)} (traced inside a scan, vmap or checkpoint; the reasons are in "
            "isolation.unrecorded)"
        )
    kept = d.get("kept", {})
    kept_line = (
        "; kept the port's own arguments: "
        + "; ".join(f"{m}: " + ", ".join(f"`{k}`" for k in names) for m, names in kept.items())
        if kept
        else ""
    )
    if not d["results"]:
        why = commonest(d["skipped"])
        return [f"isolated: no module could be run alone ({len(d['skipped'])} skipped{why}){skipped}"]
    if not d["culprits"]:
        every = "every module agrees" if not d["skipped"] else "every module run alone agrees"
        return [
            f"isolated: {every} on torch's inputs ({len(d['results'])} run alone, "
            f"{len(d['skipped'])} not){skipped}{kept_line}"
        ]
    by_name = {r.name: r for r in d["results"]}
    own = set(d.get("own_code", ()))
    ran = [r.name for r in d["results"]]

    def children(m: str) -> int:
        return sum(1 for p in ran if p != m and (m == WHOLE_MODEL or p.startswith(m + ".")))

    flax_of = dict(zip(d["culprits"], d.get("flax_culprits") or d["culprits"]))
    named = ", ".join(
        (
            f"{m} <-> the port's own code in {flax_of[m]} (torch's module, computed inline in the port"
            if m not in by_name  # not run alone: the port has no module of its own for it
            else f"{m} (own output rel {fmt(by_name[m].relative_error)}"
        )
        + (f"; in its own code: its {children(m)} paired children run alone agree" if m in own else "")
        + ")"
        for m in d["culprits"]
    )
    return [f"isolated: {named}{skipped}{kept_line}"]


def commonest(skipped: Mapping[str, str], n: int = 3) -> str:
    """``; commonest reasons: ... (k)`` of a ``{module: reason}`` table (reasons cut at their first colon)."""
    counts: dict[str, int] = {}
    for why in skipped.values():
        label, _, rest = why.partition(": ")
        if rest and label.split(" ")[0] in ("input", "output"):  # "output 0: shapes ...": the reason after it
            why = rest
        head = why.split(":")[0][:100]
        counts[head] = counts.get(head, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return "; commonest reasons: " + "; ".join(f"{why} ({k})" for why, k in top) if top else ""


def _islands(d: Mapping[str, Any]) -> list[str]:
    """One line per kind of island (side, what, lifted), its modules counted when it recurs (a T5's cast in every
    attention), those not lifted first: report.islands keeps one entry per module and kind."""
    kinds: dict[tuple[str, str, bool], list[Any]] = {}
    for island in d["islands"]:
        kinds.setdefault((island.side, island.what, island.lifted), []).append(island)
    lines = [f"float32 islands ({len(d['islands'])}; lifted: run in float64 by this comparison):"]
    for (side, what, lifted), found in sorted(kinds.items(), key=lambda kind: kind[0][2]):  # stable: unlifted first
        where = [i.module if i.module is not None else "(no module)" for i in found]
        times = sum(i.count for i in found)
        place = where[0] if len(where) == 1 else f"{len(where)} modules ({_few(where)})"
        many = (f", in {len(where)} modules" if len(where) > 1 else "") + (f", {times} times" if times > 1 else "")
        lines.append(f"  {side:<5} {place}: {what} ({'lifted' if lifted else 'NOT lifted'}{many})")
    return lines


def _float64_check(sections: Sequence[Section]) -> list[str]:
    """The float64 check, indented under its own line: a passing one by its summary and islands, a failing one
    whole."""
    by_kind = {s.kind: s for s in sections}
    if "could not run" in by_kind:
        return [
            "float64 check could not run:",
            *("  " + line for line in _could_not_run(by_kind["could not run"].data)),
        ]
    if by_kind["summary"].data["passed"]:
        lines = [f"{by_kind['title'].data['title']} {section_text(by_kind['summary'])}"]
        lines += _islands(by_kind["islands"].data) if "islands" in by_kind else []
    else:
        lines = format_sections(sections).split("\n")
    return ["float64 check (islands lifted):", *("  " + line for line in lines)]


_TEXT: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "title": _title,
    "tensors": _tensors,
    "summary": _summary,
    "train step": _train_step,
    "lm metrics": lambda d: [format_lm_metrics(d)],
    "attribution": _attribution,
    "nothing compared": lambda d: ["nothing compared: no tensor in this report, which is not a pass"],
    "no gradients": _no_gradients,
    "frozen": _frozen,
    "dropped parameters": _dropped_parameters,
    "dropped outputs": lambda d: [
        "dropped outputs (not arrays or numbers, not compared): "
        + ", ".join(f"{k} ({v})" for k, v in d["outputs"].items())
    ],
    "first divergence": _first_divergence,
    "no first divergence": _no_first_divergence,
    "isolation": _isolation,
    "localization note": lambda d: [d["note"]],
    "input casts": lambda d: [
        "inputs cast to the comparison's dtype: " + ", ".join(f"{k} ({v})" for k, v in d["casts"].items())
    ],
    "islands": _islands,
    "constants": lambda d: [
        "flax-only constants (the key map's constants=, no torch key, no gradient compared): "
        + ", ".join(f"{k} = {v}" for k, v in d["constants"].items())
    ],
    "discovery": lambda d: ["key map discovered from the port's loader:", *("  " + x for x in d["text"].splitlines())],
    "modules": lambda d: [],  # drawn by plot_errors, not printed
    "ties": _ties,
    "environment": lambda d: [],  # the CLI's header line (format_environment)
    "float64 check": lambda d: _float64_check(d["sections"]),
    "could not run": _could_not_run,
    "verdict": _verdict,
}


def section_text(section: Section) -> str:
    """One section as the report's text prints it (its lines joined)."""
    return "\n".join(_TEXT[section.kind](section.data))


def format_sections(sections: Iterable[Section], *, quiet: bool = False) -> str:
    """The report's text: a table of the worst tensors by distance to tolerance, a summary row, then the
    training, LM metrics, attribution and localisation lines.

    ``quiet`` keeps only the summary (after the title), training, LM metrics, attribution and
    localisation lines (:data:`QUIET_KINDS`).
    """
    title, lines = "", []
    for section in sections:
        if section.kind == "title":
            title = section.data["title"]
        if not quiet or section.kind in QUIET_KINDS:
            lines += _TEXT[section.kind](section.data)
    if quiet:
        lines[0] = f"{title} {lines[0]}"
    return "\n".join(lines)


def format_report(report: Sectioned, *, worst: int = 8, quiet: bool = False) -> str:
    """A report's text (:func:`format_sections` of its sections), at most ``worst`` rows besides the outputs."""
    return format_sections(report.sections(worst), quiet=quiet)


def format_environment(env: Mapping[str, Any]) -> str:
    """The header line of a run: backend, devices, versions, matmul precision, dtype and x64."""
    devices = ", ".join(env["devices"])
    return (
        f"flax-ln parity | backend {env['backend']} ({devices}) | jax {env['jax']}, flax {env['flax']}, "
        f"torch {env['torch']}, optax {env['optax']} | matmul precision {env['matmul_precision']}"
    )


# ---------------------------------------------------------------------------------------
# chart


def plot_errors(reports: Sequence[Sectioned], path: str) -> None:
    """Save a chart, one row per model: each submodule's output error, its own error run alone
    (isolated mode) and the worst gradient error of its parameters, in execution order, on a
    log scale with the tolerances; beside it, for language models, the KL divergence per position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib ships with the test extra
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from err

    charts = [{s.kind: s.data for s in report.sections()} for report in reports]
    lm = any("lm metrics" in chart for chart in charts)
    fig, axes = plt.subplots(
        len(reports),
        2 if lm else 1,
        figsize=(19 if lm else 14, 3.6 * len(reports)),
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if lm else None,
    )
    tiny = 1e-18  # exact zeros are drawn at the bottom of the log scale
    for row, chart in enumerate(charts):
        if lm:
            _plot_lm_metrics(axes[row, 1], chart.get("lm metrics"), tiny)
        ax = axes[row, 0]
        data = chart["modules"]
        modules = data["names"]
        x = np.arange(len(modules))
        ax.plot(x, [max(data["outputs"].get(m, np.nan), tiny) for m in modules], "o-", label="module output rel. error")
        ax.plot(
            x, [max(data["grads"].get(m, np.nan), tiny) for m in modules], "s--", label="param grad rel. error (worst)"
        )
        if data["isolated"] is not None:  # each module run alone on torch's inputs: its own error
            ax.plot(
                x,
                [max(data["isolated"].get(m, np.nan), tiny) for m in modules],
                "^",
                color="C3",
                ms=4,
                label="isolated: module's own output rel. error",
            )
        for color, tol, label in (
            ("C0", data["output_rtol"], "output tolerance"),
            ("C1", data["grad_rtol"], "gradient tolerance"),
        ):
            if tol is not None:
                ax.axhline(tol, color=color, lw=0.8, ls=":", label=label)
        ax.set_yscale("log")
        ax.set_title(f"{chart['title']['title']}: {'PASS' if chart['title']['passed'] else 'FAIL'}")
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
        f"KL(torch || flax) per position ({metrics['output']}): mean {fmt(metrics['kl_mean'])}\n"
        f"top-1 {metrics['top1_agreement']:.3f}, {top_k.split('_')[0]} {metrics[top_k]:.3f}, worst "
        f"{tuple(metrics['worst_position'])}",
        fontsize=8,
    )
    ax.set_xlabel("position (batch-major)", fontsize=7)

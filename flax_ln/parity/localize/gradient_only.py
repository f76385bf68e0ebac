"""A difference seen only in a gradient (:func:`gradient_only_modules`): every module output agrees, yet a parameter's
gradient differs (a bias the port leaves out of its computation, whose value is zero, changes no output but has
a gradient in torch). The module that holds the parameter is the one to look at. Imports no torch."""

from __future__ import annotations

from flax_ln.parity.records.capture import WHOLE_MODEL
from flax_ln.parity.report.data import ParityReport


def holder(parameter: str, modules: list[str]) -> str:
    """The innermost of torch's module paths ``modules`` that holds ``parameter`` (a state-dict key), else the whole
    model."""
    parts = parameter.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if (path := ".".join(parts[:i])) in modules:
            return path
    return WHOLE_MODEL


def gradient_only_modules(report: ParityReport) -> dict[str, str]:
    """Each failing parameter gradient -> torch's module that holds it, when no output, no recorded module output
    (``report.module_errors``) and no first divergence differs: the difference shows in the gradient alone. ``{}``
    otherwise (an output that differs is the place to start, and the first divergence names it)."""
    if report.passed or report.first_divergence is not None or not report.module_errors:
        return {}
    if any(not r.passed for r in report.results if r.kind == "output"):
        return {}
    if any(not r.passed for r in report.module_errors):
        return {}
    modules = list(report.module_pairs)
    return {r.name: holder(r.name, modules) for r in report.results if r.kind == "param grad" and not r.passed}

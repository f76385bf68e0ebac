"""The parity report as one self-contained HTML page: ``report.to_html()``, ``flax-ln parity --html``.

A renderer over the report's one walk, :meth:`flax_ln.parity.ParityReport.sections` (as the text and the
chart of :mod:`flax_ln.parity.report.text`): a header (verdict, dtype, the tolerances each kind of tensor was
judged by, the environment, timings); the module tree with torch's names and the paired flax paths, each
module shaded by its output, input, isolated and gradient error on a logarithmic scale against its
tolerance, the first divergence and the isolated culprits marked and opened (``<details open>``, so that
the page reads without JavaScript); every tensor in a table that sorts by a column and filters by name; and
every other section. A kind of section this module does not know is drawn generically, a heading and its
data as a definition list, so that a new section shows without changes here.

The page loads nothing: its style and script (``html_assets/``) are written into it. Every number is
written twice, readable and exact (``data-*`` attributes with Python's ``repr`` of the float), so that a
page can be checked against the ``--json`` it was rendered from.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

from flax_ln.parity.core.policy import TensorResult
from flax_ln.parity.report.text import Section, Sectioned, fmt, section_text, status

WHOLE_MODEL = "(whole model)"  # the path the root module's own call is recorded under (capture.WHOLE_MODEL)
ALL_ROWS = 1 << 30  # sections(worst=ALL_ROWS): every tensor in the "tensors" section
DRAWN = frozenset({"title", "tensors", "summary", "modules", "environment", "float64 check", "first divergence"})


def e(value: Any) -> str:
    """``value`` as text, escaped for HTML (attribute values included)."""
    return html.escape(str(value), quote=True)


def exact(value: float | None) -> str:
    """A float as a ``data-*`` attribute holds it: ``repr`` (round-trips exactly), ``inf``, ``nan``; ``""`` for none."""
    return "" if value is None else repr(float(value))


def shade(error: float | None, tolerance: float | None) -> str:
    """A background colour for ``error`` against ``tolerance`` on a log scale: green far below it, through
    yellow to orange at it, red past it (darker the further past), none without a value or a tolerance."""
    if error is None or tolerance is None:
        return "transparent"
    if not math.isfinite(error):
        return "hsl(0, 85%, 45%)"
    if not tolerance:
        return "hsl(0, 85%, 60%)" if error > 0 else "hsl(120, 45%, 85%)"
    if error <= 0:
        return "hsl(120, 45%, 85%)"
    decades = math.log10(error / tolerance)  # 0 at the tolerance, -8 eight decades below it
    if decades > 0:
        return f"hsl(0, 85%, {max(42.0, 68.0 - 6.0 * decades):.0f}%)"
    t = min(1.0, max(0.0, (decades + 8.0) / 8.0))
    return f"hsl({120.0 - 90.0 * t:.0f}, 70%, {86.0 - 14.0 * t:.0f}%)"


def error_cell(error: float | None, tolerance: float | None, what: str, tag: str = "td") -> str:
    """One error, shaded, with its exact value in ``data-v`` (for sorting and checks) and the tolerance in its title."""
    if error is None:
        return f'<{tag} class="err none" data-v="">&ndash;</{tag}>'
    title = f"{what}: {error!r}" + ("" if tolerance is None else f" against {tolerance:g}")
    return (
        f'<{tag} class="err" data-v="{exact(error)}" title="{e(title)}" '
        f'style="background:{shade(error, tolerance)}">{e(fmt(error))}</{tag}>'
    )


def generic(value: Any) -> str:
    """Any section's data as HTML: a mapping as a definition list, a list of mappings as a table, a list as a
    list, a dataclass (a :class:`TensorResult`, an island, a tie) by its fields, a number with its exact value."""
    if isinstance(value, TensorResult):
        value = value.to_json()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        if not value:
            return '<span class="empty">(none)</span>'
        items = "".join(f"<dt>{e(k)}</dt><dd>{generic(v)}</dd>" for k, v in value.items())
        return f'<dl class="generic">{items}</dl>'
    if isinstance(value, (list, tuple)):
        rows = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v for v in value]
        if rows and all(isinstance(r, Mapping) for r in rows):
            keys = list(dict.fromkeys(k for r in rows for k in r))
            head = "".join(f"<th>{e(k)}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{generic(r.get(k))}</td>" for k in keys) + "</tr>" for r in rows)
            return f'<table class="generic"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        if all(not isinstance(v, (Mapping, list, tuple)) for v in rows):
            return f'<span class="list">{", ".join(generic(v) for v in rows) or "(none)"}</span>'
        return "<ul>" + "".join(f"<li>{generic(v)}</li>" for v in rows) + "</ul>"
    if isinstance(value, float):
        return (
            f'<span class="num" data-v="{exact(value)}">{e(fmt(value) if abs(value) < 1e-3 else f"{value:.6g}")}</span>'
        )
    return e("none" if value is None else value)


# ---------------------------------------------------------------------------------------
# the module tree


def _parent(path: str, present: set[str]) -> str | None:
    """The nearest recorded ancestor of ``path`` (dotted prefixes), else the whole model, else ``None``."""
    if path == WHOLE_MODEL:
        return None
    parts = path.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if (prefix := ".".join(parts[:k])) in present:
            return prefix
    return WHOLE_MODEL if WHOLE_MODEL in present else None


@dataclasses.dataclass
class _Marks:
    """What the tree marks: the first divergence (and where it was seen), the culprits, and the modules open on load."""

    divergence: Mapping[str, Any] | None
    culprits: Sequence[str]
    own_code: Sequence[str]
    opened: set[str]


def _marks(by_kind: Mapping[str, Section], tree: Sequence[str]) -> _Marks:
    fd = by_kind["first divergence"].data if "first divergence" in by_kind else None
    iso = by_kind["isolation"].data if "isolation" in by_kind else {}
    culprits, own = list(iso.get("culprits", [])), list(iso.get("own_code", []))
    marked = set(culprits) | ({fd["module"], fd.get("seen_at") or fd["module"]} if fd else set())
    present, opened = set(tree), {WHOLE_MODEL}
    for path in marked:
        at: str | None = path
        while at is not None:
            opened.add(at)
            at = _parent(at, present)
    return _Marks(fd, culprits, own, opened)


def _badges(path: str, marks: _Marks) -> str:
    """The marks a module's summary carries: first divergence (with a gap in its own code), seen here, culprit."""
    out, fd = [], marks.divergence
    if fd is not None and path == fd["module"]:
        between = fd.get("between")
        gap = ""
        if between is not None:
            gap = f": in its own code, between {between[0] or 'its start'} and {between[1] or 'its end'}"
        out.append(f'<span class="badge divergence">first divergence{e(gap)}</span>')
    if fd is not None and path == fd.get("seen_at") and path != fd["module"]:
        out.append('<span class="badge seen">first seen here</span>')
    if path in marks.culprits:
        own = " (its own code: its paired children run alone agree)" if path in marks.own_code else ""
        out.append(f'<span class="badge culprit">isolated culprit{e(own)}</span>')
    return "".join(out)


def module_tree(data: Mapping[str, Any], marks: _Marks) -> str:
    """The ``"modules"`` section as a tree of ``<details>``, torch's path and flax's beside it, each error shaded."""
    tree = list(data.get("tree") or data["names"])
    tree += [n for n in data["names"] if n not in tree]
    if not tree:
        return (
            '<p class="empty">No module was recorded: localisation runs on a failure, or with --html/--plot '
            "(capture_modules=True).</p>"
        )
    present = set(tree)
    kids: dict[str | None, list[str]] = {}
    for path in tree:
        kids.setdefault(_parent(path, present), []).append(path)
    flax_paths, skipped = data.get("flax_paths") or {}, data.get("skipped") or {}
    out_tol, grad_tol = data["output_rtol"], data["grad_rtol"]
    isolated = data["isolated"] or {}

    def node(path: str, depth: int) -> Iterator[str]:
        flax = flax_paths.get(path, path) if flax_paths else path
        unpaired = bool(flax_paths) and flax is None
        marked = path in marks.culprits or (marks.divergence is not None and path == marks.divergence["module"])
        classes = ["node"] + (["unpaired"] if unpaired else ["skipped"] if path in skipped else [])
        classes += ["marked"] if marked else []
        classes += [] if kids.get(path) else ["leaf"]
        values = {
            "out": data["outputs"].get(path),
            "in": data.get("inputs", {}).get(path),
            "iso": isolated.get(path),
            "grad": data["grads"].get(path),
        }
        attrs = "".join(f' data-{k}="{exact(v)}"' for k, v in values.items())
        yield (
            f'<details class="{" ".join(classes)}" data-path="{e(path)}"{attrs}'
            + (' data-culprit="1"' if marked else "")
            + (" open" if path in marks.opened else "")
            + "><summary>"
        )
        yield f'<span class="torch" style="padding-left:{depth * 1.1:.1f}em">{e(path)}</span>'
        yield f'<span class="flax">{e("(unpaired)" if flax is None else flax)}</span>'
        yield error_cell(values["out"], out_tol, "output rel. error", "span")
        yield error_cell(values["in"], out_tol, "input rel. error", "span")
        yield error_cell(values["iso"], out_tol, "run alone: own output rel. error", "span")
        yield error_cell(values["grad"], grad_tol, "worst parameter gradient rel. error", "span")
        reason = f'<span class="reason">{e(skipped[path])}</span>' if path in skipped else ""
        yield f'<span class="marks">{_badges(path, marks)}{reason}</span></summary>'
        for child in kids.get(path, []):
            yield from node(child, depth + 1)
        yield "</details>"

    head = (
        '<div class="tree-head"><span class="torch">torch module</span><span class="flax">flax module</span>'
        '<span class="err">output</span><span class="err">input</span><span class="err">alone</span>'
        '<span class="err">param grads</span></div>'
    )
    body = "".join(part for root in kids.get(None, []) for part in node(root, 0))
    tolerances = f"outputs and inputs against rtol {out_tol:g}" if out_tol is not None else ""
    if grad_tol is not None:
        tolerances += f", gradients against rtol {grad_tol:g}"
    scale = "Shaded on a log scale: green far below the tolerance, orange at it, red past it"
    legend = f'<p class="legend">{scale} ({tolerances}).</p>'
    return f'<div class="tree">{legend}{head}{body}</div>'


# ---------------------------------------------------------------------------------------
# the tensors


def tensor_table(rows: Sequence[TensorResult], attributed: bool, table_id: str) -> str:
    """Every tensor: a row each, sortable by any column (click its header) and filterable by name."""
    cols = ["tensor", "kind", "shape", "max |d|", "at", "rel err", "rtol", "atol", "gtol", "status"]
    cols += ["torch vs float64", "flax vs float64"] if attributed else []
    numeric = {"max |d|", "rel err", "rtol", "atol", "gtol", "torch vs float64", "flax vs float64"}
    head = "".join(f'<th data-type="{"num" if c in numeric else "text"}" title="sort">{e(c)}</th>' for c in cols)
    body = []
    for r in rows:
        tol = r.tolerance
        cells = [
            f'<td class="name">{e(r.name)}</td><td>{e(r.kind)}</td><td>{e(list(r.shape))}</td>',
            error_cell(r.max_abs_error, tol.atol or None, "max |d|"),
            f"<td>{e('' if r.max_error_index is None else list(r.max_error_index))}</td>",
            error_cell(r.relative_error, tol.rtol, "rel. error"),
            "".join(f'<td data-v="{exact(v)}">{v:g}</td>' for v in (tol.rtol, tol.atol, tol.gtol)),
            f'<td class="status">{e(status(r))}'
            + "".join(f' <span class="reason">{e(note)}</span>' for note in (r.problem, r.nonfinite) if note)
            + "</td>",
        ]
        if attributed:
            cells += [error_cell(r.torch_vs_float64, tol.rtol, "torch vs float64")]
            cells += [error_cell(r.flax_vs_float64, tol.rtol, "flax vs float64")]
        body.append(
            f'<tr class="{"ok" if r.passed else "fail"}" data-name="{e(r.name)}" data-rel="{exact(r.relative_error)}" '
            f'data-abs="{exact(r.max_abs_error)}">{"".join(cells)}</tr>'
        )
    return (
        f'<div class="tensors"><input type="search" class="filter" data-table="{table_id}" '
        f'placeholder="filter tensors by name"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


# ---------------------------------------------------------------------------------------
# the page


def _header(by_kind: Mapping[str, Section]) -> str:
    title, summary = by_kind["title"].data, by_kind["summary"].data
    verdict = "PASS" if title["passed"] else "FAIL"
    policy: dict[str, set[str]] = {}
    for r in by_kind["tensors"].data["rows"]:
        t = r.tolerance
        policy.setdefault(r.kind, set()).add(
            f"rtol {t.rtol:g}" + (f", atol {t.atol:g}" if t.atol else "") + (f", gtol {t.gtol:g}" if t.gtol else "")
        )
    facts = {
        "verdict": f"{summary['within']}/{summary['compared']} tensors within tolerance",
        "time": f"{summary['seconds']:.2f} s"
        + (
            ""
            if summary.get("check_seconds") is None
            else f" (the float64 check's {summary['check_seconds']:.2f} s included)"
        ),
        "tolerances": "; ".join(f"{kind}: {' | '.join(sorted(t))}" for kind, t in policy.items()) or "none",
    }
    env = by_kind["environment"].data if "environment" in by_kind else None
    if env is not None:
        facts["environment"] = (
            f"backend {env.get('backend')} ({', '.join(env.get('devices', []))}); jax {env.get('jax')}, "
            f"flax {env.get('flax')}, torch {env.get('torch')}, optax {env.get('optax')}, numpy {env.get('numpy')}; "
            f"x64 {env.get('x64')}; matmul precision {env.get('matmul_precision')}"
        )
    kinds = generic(summary["kinds"])
    items = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts.items())
    return (
        f'<header><h2><span class="verdict {verdict.lower()}">{verdict}</span> {e(title["title"])}</h2>'
        f'<dl class="facts">{items}</dl>{kinds}</header>'
    )


def _other(section: Section, ids: Iterator[str]) -> str:
    """A section besides the header, the tree and the table: its text line and its data, or, for a kind this
    renderer does not know, a heading and its data."""
    kind = e(section.kind)
    if section.kind == "float64 check":
        inner = render_sections(section.data["sections"], ids)
        passed = "passed" if section.data["sections"][0].data["passed"] else "FAILED"
        summary = f"<summary>float64 check (islands lifted): {passed}</summary>"
        return f'<details class="float64" data-kind="{kind}">{summary}{inner}</details>'
    try:
        text = section_text(section)
    except KeyError:  # a kind the text renderer does not know either
        heading = f"<h3>{kind}</h3>"
        return f'<section class="section generic-section" data-kind="{kind}">{heading}{generic(section.data)}</section>'
    lines = "".join(f"<p>{e(line)}</p>" for line in text.split("\n") if line)
    details = f"<details><summary>data</summary>{generic(section.data)}</details>" if section.data else ""
    return f'<section class="section" data-kind="{kind}"><h3>{kind}</h3>{lines}{details}</section>'


def render_sections(sections: Sequence[Section], ids: Iterator[str]) -> str:
    """One report's sections as HTML: header, the first divergence, the tree, the other sections, the tensors."""
    by_kind = {s.kind: s for s in sections}
    parts = [_header(by_kind)]
    if "first divergence" in by_kind:
        fd = by_kind["first divergence"]
        parts.append(
            f'<section class="section divergence" data-kind="first divergence"><p>{e(section_text(fd))}</p></section>'
        )
    if "modules" in by_kind:
        tree = list(by_kind["modules"].data.get("tree") or by_kind["modules"].data["names"])
        parts.append(f"<h3>modules</h3>{module_tree(by_kind['modules'].data, _marks(by_kind, tree))}")
    parts += [_other(s, ids) for s in sections if s.kind not in DRAWN]
    rows = by_kind["tensors"].data["rows"]
    attributed = any(r.torch_vs_float64 is not None for r in rows)
    parts.append(f"<h3>tensors ({len(rows)})</h3>{tensor_table(rows, attributed, next(ids))}")
    parts += [_other(s, ids) for s in sections if s.kind == "float64 check"]
    return "".join(parts)


def _asset(name: str) -> str:
    return resources.files("flax_ln.parity.report").joinpath("html_assets", name).read_text(encoding="utf-8")


def render_html(reports: Sequence[Sectioned], title: str = "flax-ln parity report") -> str:
    """One self-contained page (style and script inline, nothing loaded) for ``reports``, each read through its
    sections with every tensor (:meth:`flax_ln.parity.ParityReport.sections`)."""
    ids = (f"tensors-{i}" for i in range(1 << 30))
    body, verdicts = [], []
    for report in reports:
        sections = report.sections(ALL_ROWS)
        verdicts.append(sections[0].data["passed"])
        kind = "pass" if verdicts[-1] else "fail"
        body.append(f'<section class="report {kind}">{render_sections(sections, ids)}</section>')
    verdict = "PASS" if all(verdicts) else "FAIL"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}: {verdict}</title><style>{_asset('report.css')}</style></head>"
        f"<body><h1>{e(title)}: {len(reports)} model{'s' if len(reports) != 1 else ''} &rarr; {verdict}</h1>"
        f"{''.join(body)}<script>{_asset('report.js')}</script></body></html>\n"
    )


def framed(page: str, height: int = 640) -> str:
    """``page`` inside an ``<iframe srcdoc>``: how a notebook shows it, the page's style and script kept apart
    from the notebook's own."""
    return f'<iframe srcdoc="{e(page)}" style="width: 100%; height: {height}px; border: 1px solid #ccc"></iframe>'

"""The HTML report (``report.to_html()``, ``flax-ln parity --html``, ``flax-ln report``), checked in a real browser,
and the pytest plugin's ``--parity-html``.

The browser is the system's Chromium driven by playwright (see CONTRIBUTING.md: ``apt-get install chromium``, and
never ``playwright install``). Without one these tests skip, except with ``CI=true``, where a missing browser fails
them (CI installs it). One browser serves the whole module and each report is built once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from flax_ln.book import cases
from flax_ln.cli import main
from flax_ln.parity import ParityReport, check_case, compare_modules
from flax_ln.parity.report.data import reports_from_json
from flax_ln.parity.report.html import render_html
from flax_ln.parity.report.text import Section
from flax_ln.pytest_plugin import safe_file_name

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the ports are imported from the checkout
    sys.path.insert(0, str(ROOT))
from examples.ports import llama  # noqa: E402

CHROMIUM = os.environ.get("FLAX_LN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_missing() -> str | None:
    """Why no browser can run these tests (``None`` when one can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'"
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM}: apt-get install chromium (or set FLAX_LN_CHROMIUM)"
    return None


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module; skip without one, except under CI=true (CI installs it)."""
    missing = browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, so the HTML report must be tested in a browser: {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Page:
    """A page of a report file opened in ``browser``: every request but the file's own refused and kept, every
    console error and uncaught exception kept."""

    def __init__(self, browser, path: Path, *, javascript: bool = True):
        self.url = path.resolve().as_uri()
        self.context = browser.new_context(java_script_enabled=javascript, viewport={"width": 1500, "height": 1000})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda err: self.problems.append(f"uncaught: {err}"))
        self.page.on("request", lambda request: self.requests.append(request.url))

        def route(r):
            if r.request.url == self.url:
                r.continue_()
            else:
                r.abort()

        self.page.route("**/*", route)
        self.page.goto(self.url)

    def node(self, torch_path: str):
        """The summary line of the module ``torch_path`` in the tree."""
        return self.page.locator(f'details.node[data-path="{torch_path}"] > summary').first

    def check_clean(self) -> None:
        """No console error, no uncaught exception, no request but the file itself."""
        assert self.problems == []
        assert [u for u in self.requests if u != self.url] == []

    def close(self) -> None:
        self.context.close()


def written(tmp_path_factory, name: str, html: str) -> Path:
    path = tmp_path_factory.mktemp("html") / f"{name}.html"
    path.write_text(html, encoding="utf-8")
    return path


def as_loaded(report: ParityReport) -> tuple[dict, ParityReport]:
    """The report's JSON as a file holds it, and the report read back from it (what ``flax-ln report`` renders)."""
    data = json.loads(json.dumps(report.to_json()))
    return data, ParityReport.from_json(data)


# ---- the failing comparisons -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_failure():
    """The book's small GPT (torch_ref.GPT against flax_ln's) with the LayerNorm eps of block 1's ln_2 planted on
    the flax side: (the report, its JSON, the report loaded back from that JSON)."""
    case = cases.gpt("float32", 2, 8, 0)
    case.flax_model.transformer.h[1].ln_2.eps = 1e-2  # torch keeps 1e-5
    report = check_case(case)
    return report, *as_loaded(report)


def hf_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norm scales away from 1, so that a planted eps shows at float32's tolerance
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    return model.eval()


@pytest.fixture(scope="module")
def llama_failure():
    """The Llama port of examples/ports against transformers' Llama, through the port's key map, with the RMSNorm
    eps before block 1's feed-forward planted on the port (1e-1 against the config's 1e-6). In float32 alone: the
    default's float64 check beside it would cost most of this module's time (the nested check is drawn by
    test_the_page_holds_every_error_the_json_holds)."""
    hf = hf_llama()
    config = llama.config_from_hf(hf.config)
    port = nnx.eval_shape(lambda: llama.Llama(config, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    port.blocks[1].norm2.eps = 1e-1
    ids = np.random.default_rng(1).integers(0, 64, (2, 7))
    logits = (lambda m, x: m(x).logits, None)  # transformers returns a ModelOutput; the port returns the logits
    report = compare_modules(hf, port, (ids,), weights=llama.KEY_MAP, forward=logits, dtype="float32")
    return report, *as_loaded(report)


def test_the_json_round_trip_keeps_every_field(gpt_failure, llama_failure):
    """What --json holds comes back whole: the loaded report writes the same JSON and the same text."""
    for report, data, loaded in (gpt_failure, llama_failure):
        assert loaded.to_json() == data
        assert str(loaded) == str(report)
        assert data["module_pairs"] and data["module_inputs"] and data["environment"]["backend"]


@pytest.mark.parametrize(
    "which, culprit, flax_culprit",
    [
        ("gpt", "transformer.h.1.ln_2", "transformer.h.1.ln_2"),
        ("llama", "model.layers.1.post_attention_layernorm", "blocks.1.norm2"),
    ],
)
def test_the_culprit_is_visible_on_load_and_marked(
    browser, tmp_path_factory, gpt_failure, llama_failure, which, culprit, flax_culprit
):
    report, _, loaded = {"gpt": gpt_failure, "llama": llama_failure}[which]
    assert report.isolation.culprits == [culprit]  # the engine names the planted module
    path = written(tmp_path_factory, which, loaded.to_html())
    page = Page(browser, path)
    try:
        row = page.node(culprit)
        assert row.is_visible()  # opened on load: every ancestor is <details open>
        assert "isolated culprit" in row.inner_text()
        assert flax_culprit in row.locator(".flax").inner_text()
        assert page.page.locator(".badge.divergence").first.is_visible()
        assert "FAIL" in page.page.locator("header .verdict").first.inner_text()
        if which == "gpt" and (shot := os.environ.get("FLAX_LN_SCREENSHOT")):
            page.page.screenshot(path=shot)  # the documentation's picture (docs/images/)
        page.check_clean()
    finally:
        page.close()


def test_a_node_collapses_and_expands(browser, tmp_path_factory, gpt_failure):
    page = Page(browser, written(tmp_path_factory, "collapse", gpt_failure[0].to_html()))
    try:
        parent, child = page.node("transformer.h.1"), page.node("transformer.h.1.ln_2")
        assert child.is_visible()
        parent.click()
        assert not child.is_visible()
        parent.click()
        assert child.is_visible()
        page.check_clean()
    finally:
        page.close()


def test_sorting_by_error_puts_the_worst_first_and_the_filter_keeps_matching_names(
    browser, tmp_path_factory, llama_failure
):
    report, data, _ = llama_failure
    page = Page(browser, written(tmp_path_factory, "sort", report.to_html()))
    try:
        table = page.page.locator("table.sortable").first
        table.locator("th", has_text="rel err").click()
        names = table.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.name)")
        errors = {t["name"]: float(t["relative_error"]) for t in data["tensors"]}
        assert sorted(names) == sorted(errors)  # every tensor, once
        assert errors[names[0]] == max(errors.values())
        assert all(errors[a] >= errors[b] for a, b in zip(names, names[1:]))  # the worst first, then down
        page.page.locator("input.filter").first.fill("layers.1.mlp")
        shown = table.locator("tbody tr:visible").evaluate_all("rows => rows.map(r => r.dataset.name)")
        assert shown and all("layers.1.mlp" in n for n in shown)
        assert len(shown) == sum("layers.1.mlp" in t["name"] for t in data["tensors"])
        page.check_clean()
    finally:
        page.close()


def test_without_javascript_the_page_is_a_static_tree_with_the_culprit_visible(browser, tmp_path_factory, gpt_failure):
    page = Page(browser, written(tmp_path_factory, "nojs", gpt_failure[2].to_html()), javascript=False)
    try:
        assert page.node("transformer.h.1.ln_2").is_visible()
        assert page.page.locator("details.node").count() == len(gpt_failure[1]["module_pairs"])
        assert page.page.locator("table.sortable tbody tr").count() == len(gpt_failure[1]["tensors"])
        page.check_clean()
    finally:
        page.close()


def page_numbers(page: Page, scope: str) -> tuple[dict, dict]:
    """The errors the page holds under ``scope`` (a CSS selector ending in ``>``): per tensor row its relative and
    largest absolute error, per module node its output, input and isolated error (the exact data attributes)."""
    rows = page.page.locator(f"{scope} div.tensors table tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.name, r.dataset.rel, r.dataset.abs])"
    )
    nodes = page.page.locator(f"{scope} div.tree details.node").evaluate_all(
        "nodes => nodes.map(n => [n.dataset.path, n.dataset.out, n.dataset.in, n.dataset.iso])"
    )
    return {n: (float(r), float(a)) for n, r, a in rows}, {p: (out, inp, iso) for p, out, inp, iso in nodes}


def check_numbers(tensors: dict, modules: dict, data: dict) -> None:
    assert tensors == {t["name"]: (float(t["relative_error"]), float(t["max_abs_error"])) for t in data["tensors"]}
    assert len(modules) == len(data["module_pairs"])
    isolated = data["isolated"]["modules"] if data["isolated"] else []
    for column, results in ((0, data["module_errors"]), (1, data["module_inputs"]), (2, isolated)):
        for r in results:
            assert float(modules[r["name"]][column]) == float(r["relative_error"]), (r["name"], column)


def test_the_page_holds_every_error_the_json_holds(browser, tmp_path_factory, gpt_failure, llama_failure):
    """Every tensor's relative and largest absolute error, every module's output, input and isolated error, in the
    comparison and in its float64 check: the same floats in the page (its data attributes) as in the JSON, read
    from the page in the browser. The float64 check drawn is the GPT's report set there (a real report: the
    page draws a float64 check as it draws any report's sections)."""
    nested = dataclasses.replace(llama_failure[2], float64_check=gpt_failure[2])
    data, loaded = as_loaded(nested)
    assert data["module_errors"] and data["module_inputs"] and data["isolated"]["modules"]
    assert data["float64_check"]["module_errors"]
    page = Page(browser, written(tmp_path_factory, "numbers", loaded.to_html()))
    try:
        check_numbers(*page_numbers(page, "section.report >"), data)
        check_numbers(*page_numbers(page, "section.report > details.float64 >"), data["float64_check"])
        page.check_clean()
    finally:
        page.close()


def test_a_notebook_shows_the_page_in_a_frame_of_its_own(browser, tmp_path_factory, gpt_failure):
    """``_repr_html_`` (what Jupyter shows) is the page in an ``<iframe srcdoc>``: inside it the culprit is visible,
    and the page's own style does not reach the notebook around it."""
    notebook = f"<!DOCTYPE html><html><body><p id=cell>a notebook cell</p>{gpt_failure[0]._repr_html_()}</body></html>"
    page = Page(browser, written(tmp_path_factory, "notebook", notebook))
    try:
        frame = page.page.frame_locator("iframe")
        assert frame.locator('details.node[data-path="transformer.h.1.ln_2"] > summary').is_visible()
        margin = page.page.locator("body").evaluate("b => getComputedStyle(b).margin")
        assert margin == "8px"  # the browser's default, not the report's 1.5em
        page.check_clean()
    finally:
        page.close()


def test_attribution_adds_torch_and_flax_error_against_float64_to_every_row(gpt_failure):
    """With attribution, each tensor's row also holds torch's and flax's error against float64 truth, exactly."""
    report = gpt_failure[2]
    attributed = dataclasses.replace(
        report,
        results=[
            dataclasses.replace(r, torch_vs_float64=1e-9 * (i + 1), flax_vs_float64=r.relative_error)
            for i, r in enumerate(report.results)
        ],
    )
    page = attributed.to_html()
    assert '<th data-type="num" title="sort">torch vs float64</th>' in page
    for i in range(len(report.results)):
        assert f'data-v="{1e-9 * (i + 1)!r}"' in page
    assert "torch vs float64" not in report.to_html()  # a report without attribution has no such columns


class WithNewSections:
    """A report with sections no renderer knows yet, as another engineer's new kind would arrive."""

    def __init__(self, report: ParityReport):
        self.report = report

    def sections(self, worst: int = 8) -> list[Section]:
        return self.report.sections(worst) + [
            Section("constants", {"eps": 1e-05, "names": ["ln_1", "ln_2"]}),
            Section("discovery", {"found": [{"module": "h.0", "what": "a LayerNorm"}]}),
        ]


def test_an_unknown_section_kind_renders_generically(browser, tmp_path_factory, gpt_failure):
    page = Page(browser, written(tmp_path_factory, "generic", render_html([WithNewSections(gpt_failure[0])])))
    try:
        constants = page.page.locator('section[data-kind="constants"]')
        assert constants.locator("h3").inner_text() == "constants"
        assert "eps" in constants.locator("dt").all_inner_texts()
        assert "ln_2" in constants.inner_text()
        discovery = page.page.locator('section[data-kind="discovery"]')
        assert "a LayerNorm" in discovery.locator("table").inner_text()
        page.check_clean()
    finally:
        page.close()


def test_cli_html_and_the_report_command_render_a_passing_run(browser, tmp_path, capsys):
    """``flax-ln parity --model gpt --html`` (passing) and ``flax-ln report`` of its --json: both pages pass the checks,
    every module recorded although nothing failed."""
    html, js, again = tmp_path / "out.html", tmp_path / "out.json", tmp_path / "again.html"
    args = [
        "parity",
        "--model",
        "gpt",
        "--batch",
        "1",
        "--seq-len",
        "4",
        "--quiet",
        "--html",
        str(html),
        "--json",
        str(js),
    ]
    assert main(args) == 0
    assert main(["report", str(js), "--html", str(again)]) == 0
    data = json.loads(js.read_text())
    (model,) = data["models"]
    assert model["module_errors"]  # recorded although everything passed, as for --plot
    assert [r.name for r in reports_from_json(js)] == ["gpt"]
    for path in (html, again):
        page = Page(browser, path)
        try:
            assert "PASS" in page.page.locator("header .verdict").first.inner_text()
            assert page.page.locator("details.node").count() == len(model["module_pairs"])
            assert page.page.locator(".badge").count() == 0  # nothing marked in a pass
            page.check_clean()
        finally:
            page.close()


def test_html_output_path_is_checked_before_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["parity", "--model", "gpt", "--html", str(tmp_path / "missing" / "out.html")])
    assert exit_info.value.code == 2
    assert "--html" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["parity", "--model", "gpt", "--html", str(tmp_path / "a"), "--json", str(tmp_path / "a")])
    assert "--html" in capsys.readouterr().err


# ---- the pytest plugin -----------------------------------------------------------------------------------------------


FAILING_TEST = """
import numpy as np
import torch
from flax import nnx

from flax_ln.parity import assert_parity


class WrongBias(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) + 1e-2  # the port's bias is off by 0.01


def test_linear_port():
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype("float32")
    assert_parity(torch.nn.Linear(3, 2), WrongBias(3, 2, rngs=nnx.Rngs(0)), (x,))
"""


def test_parity_html_writes_the_page_of_a_failing_assert_parity_and_names_it(pytester, plugin_arguments):
    pytester.makepyfile(test_port=FAILING_TEST)
    pages = pytester.path / "pages"
    result = pytester.runpytest_inprocess(*plugin_arguments, "--parity-html", str(pages), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    expected = pages / (safe_file_name("test_port.py::test_linear_port") + ".html")
    assert expected.is_file()
    assert re.search(rf"HTML report: {re.escape(str(expected))}$", result.stdout.str(), re.MULTILINE)
    page = expected.read_text()
    assert "FAIL" in page and 'data-name="bias"' in page
    assert "FLAX_LN_PARITY_HTML_DIR" not in os.environ  # the run's setting did not outlive it


def test_without_the_option_nothing_is_written_and_the_message_is_unchanged(pytester, plugin_arguments):
    pytester.makepyfile(test_port=FAILING_TEST)
    result = pytester.runpytest_inprocess(*plugin_arguments, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert not re.search(r"HTML report: \S+\.html", result.stdout.str())
    assert not list(pytester.path.glob("**/*.html"))


def test_safe_file_name():
    assert safe_file_name("parity_tests/test_x.py::test_y[float32-a/b]") == "parity_tests_test_x.py_test_y_float32-a_b"
    assert safe_file_name("::") == "test"

"""The engine's old flat module paths still import, warning where each now lives, and a built wheel holds the HTML
report's assets (the modules moved into rooms; nothing a user imports breaks until the next minor release)."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flax_ln.parity
from flax_ln._deprecated import MovedModules

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")  # the engine's own imports must not warn

# every old path a document or docstring named, and what it must still give: (old module, name, new module)
DOCUMENTED = [
    ("flax_ln.parity.report", "reports_from_json", "flax_ln.parity.report.data"),
    ("flax_ln.parity.report", "ParityReport", "flax_ln.parity.report.data"),
    ("flax_ln.parity.html", "render_html", "flax_ln.parity.report.html"),
    ("flax_ln.parity.progress", "Progress", "flax_ln.parity.core.progress"),
    ("flax_ln.parity.islands", "Island", "flax_ln.parity.islands.island"),
    ("flax_ln.parity.torch_side", "run_torch_side", "flax_ln.parity.sides.torch"),
    ("flax_ln.parity.localize", "localize", "flax_ln.parity.localize.locate"),
    ("flax_ln.parity.streamed", "compare_streamed", "flax_ln.parity.streamed.compare"),
    ("flax_ln.parity.stages", "Stages", "flax_ln.parity.streamed.stages"),
]

# In a fresh interpreter (an import warns once per process): each old module imported both ways, the warnings
# caught, and whether the name is the very object at its new home.
PROBE = """
import importlib, json, sys, warnings
old, name, new = sys.argv[1:]
out = {}
for how in ("import", "from"):
    for key in [k for k in sys.modules if k.startswith("flax_ln.parity")]:
        del sys.modules[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "import":
            exec(f"import {old} as module", globals())
        else:
            exec(f"from {old.rpartition('.')[0]} import {old.rpartition('.')[2]} as module", globals())
        value = getattr(module, name)
    out[how] = {
        "same": value is getattr(importlib.import_module(new), name),
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize(("old", "name", "new"), DOCUMENTED)
def test_a_documented_old_path_imports_with_a_warning_naming_its_new_home(old, name, new):
    done = subprocess.run([sys.executable, "-c", PROBE, old, name, new], capture_output=True, text=True, check=True)
    for how, found in json.loads(done.stdout).items():
        assert found["same"], (how, found)
        deprecations = [w for w in found["warnings"] if w[0] == "DeprecationWarning"]
        assert len(deprecations) == 1, (how, found["warnings"])
        assert new in deprecations[0][1], deprecations
        assert deprecations[0][2] == "<string>", deprecations  # pointed at the importing line, not the hook


def test_every_moved_module_is_the_module_at_its_new_home():
    hooks = [f for f in sys.meta_path if isinstance(f, MovedModules)]
    assert len(hooks) == 1 and "flax_ln.parity.torch_side" in hooks[0].moved
    for old, new in hooks[0].moved.items():
        with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
            sys.modules.pop(old, None)
            module = __import__(old, fromlist=["_"])
        assert module is sys.modules[new]


def test_a_name_the_old_module_never_had_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = flax_ln.parity.report.nothing_here  # type: ignore[attr-defined]


def test_a_built_wheel_holds_the_html_assets_and_renders_a_page(tmp_path):
    root = Path(flax_ln.parity.__file__).parents[2]
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    for part in ("flax_ln", "torch_ref"):
        shutil.copytree(root / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(root / part, source / part)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), source],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("flax_ln-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assets = sorted(n for n in names if "html_assets" in n)
    assert assets == ["flax_ln/parity/report/html_assets/report.css", "flax_ln/parity/report/html_assets/report.js"]
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    render = (
        "import flax_ln, pathlib; from flax_ln.parity import ParityReport; "
        "from flax_ln.parity.report.html import render_html; "
        "assert pathlib.Path(flax_ln.__file__).is_relative_to(pathlib.Path.cwd()), flax_ln.__file__; "
        "page = render_html([ParityReport('probe', 'float32', [])]); "
        "css = (pathlib.Path('flax_ln/parity/report/html_assets/report.css')).read_text(); "
        "assert css.strip()[:40] in page; print(len(page))"
    )
    done = subprocess.run([sys.executable, "-c", render], cwd=unpacked, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 1000

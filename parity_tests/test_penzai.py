"""penzai's own Llama (converted from transformers by penzai's converter) checked as a ``Function``:
``examples/ports/penzai_llama.py``, the recipe of docs/ports.md, "A penzai model".

The key map is discovered from penzai's converter used as a loader; float32 passes as converted; float64 passes
with ``flax_factory=`` (the conversion re-run under lifting) and fails without it, naming penzai's float32
constants. Tolerances are the engine's policy (docs/tolerances.md).
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("penzai", reason="penzai is not installed (the test extra installs it)")

import torch  # noqa: E402

from flax_ln.parity import compare_modules  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the ports are imported from the checkout
    sys.path.insert(0, str(ROOT))
from examples.ports import penzai_llama  # noqa: E402

LOGITS = (lambda m, ids: m(ids).logits, None)  # transformers returns a ModelOutput; the function returns logits


@pytest.fixture(scope="module")
def llama():
    """(the torch model, its discovered key map, token ids (2, 8))."""
    hf = penzai_llama.hf_llama()
    ids = torch.randint(0, penzai_llama.HF_CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    return hf, penzai_llama.key_map(hf), ids


def compare(llama, **options):
    hf, key_map, ids = llama
    port = penzai_llama.function(penzai_llama.convert(hf))
    return compare_modules(hf, port, (ids,), weights=key_map, forward=LOGITS, **options)


def test_the_key_map_is_discovered_from_penzais_converter(llama):
    hf, key_map, _ = llama
    discovery = key_map.discovery
    assert discovery is not None and not discovery.dropped and not discovery.unfilled and not discovery.ties
    assert len(key_map.rules) == 12  # the embedding, 9 per-layer rules folded over (\d+), the final norm, the head
    q = next(r for r in key_map.rules if "q_proj" in r.pattern)
    assert q.templates == (r"transformer.block_\1.attention.query.weights",)


def test_float32_passes_as_converted(llama):
    report = compare(llama, dtype="float32")
    assert report.passed, str(report)
    assert {r.name for r in report.results if r.kind == "param grad"} == {n for n, _ in llama[0].named_parameters()}


def test_float64_passes_with_the_conversion_rerun_under_lifting(llama):
    report = compare(llama, dtype="float64", flax_factory=penzai_llama.factory(llama[0]))
    assert report.passed, str(report)
    assert not [i for i in report.islands if i.side == "flax" and not i.lifted], report.islands
    assert [i for i in report.islands if i.side == "flax" and i.lifted]  # penzai's float32 requests, lifted


def test_float64_without_the_factory_fails_naming_penzais_float32_constants(llama):
    report = compare(llama, dtype="float64")
    assert not report.passed, str(report)
    constants = [i for i in report.islands if i.side == "flax" and not i.lifted]
    assert constants and all("float32 constant" in i.what for i in constants), report.islands
    # a Function has no modules: no first divergence, no isolation, and the report says why
    assert report.first_divergence is None and report.isolation is None
    assert report.localization_note is not None and "a Function has no submodules" in report.localization_note

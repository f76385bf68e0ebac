"""A long comparison's progress bar (flax_ln.parity.core.progress): shown on a terminal after its delay with the phase
that runs, cleared when closed (also on an error), and never made with ``quiet=True``, off a terminal (pytest's
capture, pipes) or with ``FLAX_LN_PROGRESS=0``. The terminal is a fake: a StringIO that says it is a tty."""

import io
import sys
import threading
import time

import numpy as np
import pytest
import torch
from flax import nnx

import flax_ln.parity.case as case
import flax_ln.parity.core.progress as progress
from flax_ln.cli import main
from flax_ln.parity import compare_modules
from flax_ln.parity.core.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def never_made(*args, **kwargs):
    raise AssertionError("a tqdm bar was made where progress is off")


def ticker_threads():
    return [t for t in threading.enumerate() if t.name == "flax-ln-progress" and t.is_alive()]


def cleared(text):
    """The last thing written blanks the bar's line (tqdm's leave=False): its final segment is whitespace."""
    return text.endswith("\r") and text.rstrip("\r").split("\r")[-1].strip() == ""


def on_terminal(monkeypatch):
    """sys.stderr a fake terminal, no FLAX_LN_PROGRESS, the bar drawn at once and redrawn often. Called in the
    test's body: pytest sets sys.stderr to its capture again between a fixture's setup and the test."""
    fake = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.01)
    return fake


def test_the_bar_appears_after_the_delay_with_the_phase_while_the_phase_runs(monkeypatch):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.05)
    with Progress(3, label="Block") as bar:
        bar.phase("torch forward and backward")
        deadline = time.monotonic() + 5  # generous: the ticker draws it about 0.05 s in, on a loaded machine later
        while "torch forward and backward" not in terminal.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        shown = terminal.getvalue()  # nothing advanced: the ticker drew it
        bar.advance()
        bar.phase("comparison")
    assert "Block" in shown and "0/3" in shown and "torch forward and backward" in shown, repr(shown)
    out = terminal.getvalue()
    assert "1/3" in out and "comparison" in out, repr(out)
    assert cleared(out), repr(out)
    assert not ticker_threads()


def test_a_run_shorter_than_the_delay_prints_nothing(monkeypatch):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 60.0)
    with Progress(2, label="Block") as bar:
        bar.phase("torch forward and backward")
        bar.advance()
        bar.phase("comparison")
        time.sleep(0.05)  # a few ticks pass, none past the delay
        bar.advance()
    assert terminal.getvalue() == ""
    assert not ticker_threads()


@pytest.mark.parametrize("why", ["quiet", "not a terminal", "FLAX_LN_PROGRESS=0"])
def test_progress_is_off_and_makes_no_bar(monkeypatch, why):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr(progress, "tqdm", never_made)
    stream = terminal
    if why == "not a terminal":
        stream = io.StringIO()  # as pytest's capture, a pipe or a CI log: isatty() is False
        monkeypatch.setattr(sys, "stderr", stream)
    if why == "FLAX_LN_PROGRESS=0":
        monkeypatch.setenv("FLAX_LN_PROGRESS", "0")
    with Progress(2, label="Block", quiet=why == "quiet") as bar:
        bar.phase("torch forward and backward")
        bar.advance(2)
    bar.close()  # closing again does nothing
    assert stream.getvalue() == ""
    assert not ticker_threads()


def test_an_error_inside_closes_the_bar(monkeypatch):
    terminal = on_terminal(monkeypatch)
    with pytest.raises(RuntimeError, match="inside"):
        with Progress(3, label="Block") as bar:
            bar.phase("torch forward and backward")
            raise RuntimeError("inside")
    out = terminal.getvalue()
    assert "torch forward and backward" in out and cleared(out), repr(out)
    assert not ticker_threads()


def linear_pair():
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    return torch.nn.Linear(4, 3), nnx.Linear(4, 3, rngs=nnx.Rngs(0)), x


def test_compare_modules_shows_its_phases_and_counts_them(monkeypatch):
    terminal = on_terminal(monkeypatch)
    torch_model, flax_model, x = linear_pair()
    report = compare_modules(torch_model, flax_model, x, dtype="float32")
    assert report.passed, str(report)
    out = terminal.getvalue()
    # one run: torch, flax, the comparison, and localisation (counted, passed over on a pass)
    for phase in ("torch forward and backward", "flax load, compile and run", "comparison"):
        assert f"{phase}]" in out, (phase, out)
    assert "Linear" in out and "0/4" in out and "4/4" in out and "localisation" not in out, repr(out)
    assert "float64 check" not in out  # an explicit dtype runs that dtype only
    assert cleared(out), repr(out)


def test_compare_modules_default_dtype_shows_the_float64_check_first(monkeypatch):
    terminal = on_terminal(monkeypatch)
    torch_model, flax_model, x = linear_pair()
    report = compare_modules(torch_model, flax_model, x, capture_modules=True, name="tiny")
    assert report.passed and report.float64_check is not None, str(report)
    out = terminal.getvalue()
    # two runs of four phases, localisation run in both (capture_modules); the check's phases come first
    check = out.index("float64 check: torch forward and backward")
    assert check < out.index("float64 check: localisation") < out.index(", torch forward and backward]"), repr(out)
    assert out.index(", localisation]") > out.index("float64 check: localisation")
    assert "tiny" in out and "8/8" in out and "9/8" not in out, repr(out)


def test_compare_modules_quiet_shows_nothing(monkeypatch):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr(progress, "tqdm", never_made)
    torch_model, flax_model, x = linear_pair()
    assert compare_modules(torch_model, flax_model, x, dtype="float32", quiet=True).passed
    assert "torch forward" not in terminal.getvalue()


def test_an_error_in_compare_modules_closes_the_bar(monkeypatch):
    terminal = on_terminal(monkeypatch)
    torch_model, flax_model, x = linear_pair()

    def broken(module, *inputs):
        raise RuntimeError("the port's forward is broken")

    with pytest.raises(RuntimeError, match="broken"):
        compare_modules(torch_model, flax_model, x, dtype="float32", forward=(None, broken))
    out = terminal.getvalue()
    assert "flax load, compile and run" in out and cleared(out), repr(out)
    assert not ticker_threads()


@pytest.mark.parametrize("quiet", [True, False])
def test_the_cli_passes_quiet_to_the_comparison(monkeypatch, capsys, quiet):
    seen = []

    def spy(*args, **options):
        seen.append(options.get("quiet"))
        return compare_modules(*args, **options)

    monkeypatch.setattr(case, "compare_modules", spy)
    code = main(["parity", "--model", "layernorm", *(["--quiet"] if quiet else [])])
    out = capsys.readouterr()
    assert code == 0 and seen == [quiet], (seen, out.out, out.err)
    assert "[1/1] layernorm: building" in out.err  # the CLI's own line stays on stderr, --quiet or not

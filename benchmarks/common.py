"""Shared pieces of the benchmarks: the registry, interleaved timing and the report tables.

A benchmark is a function ``fn(cfg: Config) -> list[Table]`` registered under a name
with :func:`register`. ``run.py`` imports every ``benchmarks/bench_*.py`` module, so a
new workload (the GPT training step, compile time, remat memory) is a new module
with its own ``@register(...)`` function and touches nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Config:
    """What every benchmark is told: ``quick`` asks for small sizes and few repeats."""

    quick: bool
    repeats: int
    warmup: int
    torch_compile: bool


@dataclasses.dataclass
class Timing:
    """Seconds of one candidate over interleaved rounds."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> tuple[float, float]:
        """The 25th and 75th percentiles, to show how noisy the shared machine was."""
        q = statistics.quantiles(self.samples, n=4) if len(self.samples) > 1 else [self.samples[0]] * 3
        return q[0], q[2]


@dataclasses.dataclass
class Table:
    """One printed table: a title, column names, rows of cells, and free-text notes."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = dataclasses.field(default_factory=list)

    def markdown(self) -> str:
        def cell(v):
            if isinstance(v, float):
                return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
            return str(v)

        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)


BENCHMARKS: dict[str, Callable[[Config], list[Table]]] = {}


def register(name: str):
    """Decorator: add ``fn(cfg) -> list[Table]`` to the registry under ``name``."""

    def deco(fn):
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice; pick another name")
        BENCHMARKS[name] = fn
        return fn

    return deco


# Untimed calls of a candidate before each of its timed calls, in seconds: see interleaved().
LEAD_IN_S = 0.05


def interleaved(
    candidates: dict[str, Callable[[], Any]], repeats: int, warmup: int, lead_in: float = LEAD_IN_S
) -> dict[str, Timing]:
    """Time each zero-argument callable ``repeats`` times, round-robin after ``warmup`` calls.

    Each callable must finish its work before returning (``block_until_ready`` for
    JAX). Interleaving puts every candidate under the same background load, so the
    ratios of medians stay meaningful on a shared machine even when absolute times drift.

    Before each timed call the same candidate runs untimed for at least ``lead_in``
    seconds (at least one call), so each is timed as in a loop of its own. Without the
    lead-in, whatever ran after torch paid for torch's idle threads: libgomp keeps its
    workers spinning for milliseconds after a parallel region, and on 2 cores they take
    a core from XLA's pool. Measured here, XLA's first 8000x1024 copy after a torch
    LayerNorm took 4.6 ms against 1.4 ms in a run of its own (torch's first call after
    XLA: 1.6 against 1.2 ms). ``lead_in=0`` times single calls back to back.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            if lead_in > 0:
                deadline = time.perf_counter() + lead_in
                fn()
                while time.perf_counter() < deadline:
                    fn()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing(s) for name, s in samples.items()}


def timing_rows(timings: dict[str, Timing], reference: str | None = None) -> list[list[Any]]:
    """Rows ``[name, median ms, p25-p75 ms, ratio to reference]`` for a raw-timings table."""
    ref = timings[reference].median if reference else None
    rows = []
    for name, t in timings.items():
        lo, hi = t.spread
        rows.append([name, t.median * 1e3, f"{lo * 1e3:.3g}-{hi * 1e3:.3g}", t.median / ref if ref else ""])
    return rows


def ratio_row(workload: str, ours: str, ours_t: Timing, ref: str, ref_t: Timing, target: float | None) -> list[Any]:
    """Row ``[workload, ours vs ref, ratio, target, met]`` for the summary table."""
    ratio = ours_t.median / ref_t.median
    met = "" if target is None else ("yes" if ratio <= target else "no")
    return [workload, f"{ours} vs {ref}", ratio, "" if target is None else f"<= {target:g}x", met]


def torch_device() -> str:
    """``"cuda"`` when JAX runs on a GPU and torch sees one, else ``"cpu"``: both frameworks on the same device.

    On a GPU both sides get TF32 matmuls for float32 (JAX's default precision there;
    torch is set to ``"high"``), so they do the same arithmetic.
    """
    import torch

    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        return "cuda"
    return "cpu"


def one_thread(run: Callable[[], Any]) -> Callable[[], Any]:
    """``run`` with torch limited to one thread: on a loaded 2-core machine torch's spinning
    OpenMP threads can lose to one thread, so eager targets are taken against the faster."""

    def wrapped():
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)

    return wrapped


def add_torch_compile(candidates: dict, notes: list[str], label: str, run: Callable[[], Any]) -> None:
    """Run the ``torch.compile`` step ``run`` once (it compiles) and add it to ``candidates`` as
    ``"torch.compile(torch_ref)"``, noting the first step's time, or note why it failed."""
    try:
        t0 = time.perf_counter()
        run()
        notes.append(f"{label}: first step {time.perf_counter() - t0:.1f} s")
        candidates["torch.compile(torch_ref)"] = run
    except Exception as e:  # noqa: BLE001 - reported, not raised
        notes.append(f"{label} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


@contextlib.contextmanager
def plain_linear_products():
    """Build models whose ``nnx.Linear`` layers use plain ``lax.dot_general`` (the code before
    :func:`flax_ln.models.dense.linear_dot_general`): a side-by-side before/after column.
    Same values; only the kernel gradient's form in reverse mode differs."""
    import flax_ln.models.encoder_decoder.layers as encoder_decoder
    import flax_ln.models.gpt as gpt

    modules = (gpt, encoder_decoder)
    saved = [module.linear_dot_general for module in modules]
    for module in modules:
        module.linear_dot_general = jax.lax.dot_general
    try:
        yield
    finally:
        for module, product in zip(modules, saved):
            module.linear_dot_general = product


class PeakAnonymous(threading.Thread):
    """The peak of this process's anonymous memory (``RssAnon``), sampled every 20 ms while it runs (``start()``,
    then ``done.set()``). ``ru_maxrss`` also counts file pages mapped in (a checkpoint being read, gradients kept
    in files), which the kernel can drop."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib, self.done = 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))  # "RssAnon:  123 kB"


class PhaseClock:
    """Times the engine's phases, each given as ``(name, module, attribute)`` and wrapped where the engine looks it
    up (``"Class.method"``: the class's and every subclass's own definition, so each side kind's override; a name in
    ``entries`` is a context manager, timed to its entry), per run of ``Comparison.run`` (``"float64"``,
    ``"float32"``): ``seconds[run][phase]``, with ``"whole run"``; and ``compiles[run][phase]``, XLA's compiles
    counted to the innermost phase running. A phase that calls itself (an override calling its base) counts once."""

    def __init__(self, phases: list[tuple[str, str, str]], entries: frozenset[str] = frozenset()) -> None:
        import functools
        import importlib

        self.seconds: dict[str, dict[str, float]] = {}
        self.compiles: dict[str, dict[str, int]] = {}
        self.run, self.stack = "outside a run", ["outside a phase"]

        @contextlib.contextmanager
        def phase_of(phase: str):
            started = time.perf_counter()
            self.stack.append(phase)
            try:
                yield
            finally:
                self.stack.pop()
                run = self.seconds.setdefault(self.run, {})
                run[phase] = run.get(phase, 0.0) + time.perf_counter() - started

        def timed(phase: str, fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                if self.stack[-1] == phase:
                    return fn(*args, **kwargs)
                with phase_of(phase):
                    return fn(*args, **kwargs)

            return call

        def timed_entry(phase: str, fn):
            @contextlib.contextmanager
            def scope(*args, **kwargs):
                with contextlib.ExitStack() as held:
                    with phase_of(phase):
                        value = held.enter_context(fn(*args, **kwargs))
                    yield value

            return scope

        def compiling(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                counts = self.compiles.setdefault(self.run, {})
                counts[self.stack[-1]] = counts.get(self.stack[-1], 0) + 1
                return fn(*args, **kwargs)

            return call

        def per_run(fn):
            @functools.wraps(fn)
            def call(comparison, dtype, *args, **kwargs):
                self.run = dtype
                try:
                    return timed("whole run", fn)(comparison, dtype, *args, **kwargs)
                finally:
                    self.run = "outside a run"

            return call

        def wrap(owner: Any, name: str, phase: str) -> None:
            raw = owner.__dict__[name]
            if isinstance(raw, classmethod):
                setattr(owner, name, classmethod(timed(phase, raw.__func__)))
            else:
                setattr(owner, name, (timed_entry if name in entries else timed)(phase, raw))

        compare = importlib.import_module("flax_ln.parity.compare")
        compare.Comparison.run = per_run(compare.Comparison.run)
        compiler = importlib.import_module("jax._src.compiler")
        compiler.backend_compile_and_load = compiling(compiler.backend_compile_and_load)
        for phase, module_name, attribute in phases:
            owner = importlib.import_module(module_name)
            if "." not in attribute:
                wrap(owner, attribute, phase)
                continue
            class_name, name = attribute.split(".")
            for cls in _with_subclasses(getattr(owner, class_name)):
                if name in cls.__dict__:
                    wrap(cls, name, phase)


def _with_subclasses(cls: type) -> list[type]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _with_subclasses(sub))]

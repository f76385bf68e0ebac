"""Print the benchmark ratios, all measured in this one run.

Usage: python benchmarks/run.py [--quick] [--only NAME ...] [--no-torch-compile] [--repeats N]
                                [--quiet-load L] [--max-wait S]

Every ``benchmarks/bench_*.py`` module is imported and registers its benchmarks in
``common.BENCHMARKS``; each returns tables that are printed as Markdown, ready to
paste into RESULTS.md. ``--quick`` uses small sizes and few repeats (a smoke test for
CI, a few seconds). Timings are interleaved medians; only their ratios mean anything
on a shared machine, and nothing here asserts a speed. Each timed call follows 50 ms of
untimed calls of the same candidate (``common.interleaved``), so it is timed as in a loop
of its own, not in the wake of the other framework's spinning threads.

Load favours XLA: under contention torch's OpenMP threads stall far more than XLA's
pool, so a ratio taken while other jobs run measures neither framework. Before each
benchmark the runner waits (cools down) until the 1-minute load average falls below
``--quiet-load`` (default 1.0 on this 2-core machine), for at most ``--max-wait``
seconds, and prints the load before and after every benchmark. A benchmark that starts
at or above the threshold (the load never fell: something else is running) is marked
INVALID: rerun it on a quiet machine. The load after a benchmark includes its own
threads (about 2 here), so it is recorded, not judged. ``--quick`` (the CI smoke run)
only marks, never waits.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


def environment() -> str:
    import flax
    import jax
    import numpy
    import torch

    import flax_ln

    cpu = (
        next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        if os.path.exists("/proc/cpuinfo")
        else platform.processor()
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (
        f"date {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"{cpu}, {os.cpu_count()} logical CPUs, load average {load[0]:.2f} at start; "
        f"python {platform.python_version()}, "
        f"jax {jax.__version__} ({jax.default_backend()}), flax {flax.__version__}, torch {torch.__version__}, "
        f"numpy {numpy.__version__}; flax_ln from {pathlib.Path(flax_ln.__file__).parent}"
    )


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def cool_down(threshold: float, max_wait: float) -> float | None:
    """Wait until the 1-minute load average is below ``threshold`` (at most ``max_wait`` s); return it."""
    deadline = time.monotonic() + max_wait
    load = load_average()
    while load is not None and load >= threshold and time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        load = load_average()
    return load


def load_note(before: float | None, after: float | None, threshold: float) -> str:
    """The per-benchmark load line, with INVALID when the benchmark started at or above ``threshold``.

    ``after`` includes the benchmark's own threads, so it is reported but not judged.
    """
    if before is None or after is None:
        return "Load average: unknown on this platform."
    verdict = (
        "quiet start"
        if before < threshold
        else f"INVALID: load >= {threshold:g} at the start; ratios under load favour XLA, rerun on a quiet machine"
    )
    return f"Load average (1 min): {before:.2f} before, {after:.2f} after (includes its own threads) -> {verdict}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke test")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these registered benchmarks")
    parser.add_argument("--repeats", type=int, help="timed rounds per candidate (default 30, or 3 with --quick)")
    parser.add_argument(
        "--no-torch-compile", action="store_true", help="skip torch.compile (skipped anyway with --quick)"
    )
    parser.add_argument(
        "--quiet-load",
        type=float,
        default=1.0,
        metavar="L",
        help="a benchmark is valid only if the 1-minute load average is below L before and after it",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for the load to fall below --quiet-load before each benchmark",
    )
    args = parser.parse_args(argv)

    for path in sorted(HERE.glob("bench_*.py")):
        importlib.import_module(path.stem)
    names = args.only or list(common.BENCHMARKS)
    unknown = [n for n in names if n not in common.BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; registered: {sorted(common.BENCHMARKS)}")

    cfg = common.Config(
        quick=args.quick,
        repeats=args.repeats or (3 if args.quick else 30),
        warmup=1 if args.quick else 3,
        torch_compile=not (args.quick or args.no_torch_compile),
    )
    print(f"# flax-ln benchmarks{' (--quick)' if args.quick else ''}\n")
    print(f"Command: python benchmarks/run.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"\nEnvironment: {environment()}\n")
    for name in names:
        before = load_average() if args.quick else cool_down(args.quiet_load, args.max_wait)
        for table in common.BENCHMARKS[name](cfg):
            print(table.markdown(), end="\n\n", flush=True)
        print(f"{name}: {load_note(before, load_average(), args.quiet_load)}\n", flush=True)
    if hasattr(os, "getloadavg"):
        print(f"Load average at end: {os.getloadavg()[0]:.2f} (the machine is shared; compare ratios, not times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

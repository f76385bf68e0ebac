"""What the first answer costs: the default ``compare_modules`` call (the float32 run and the float64 check, islands
lifted) on a port that passes, against the same port with one planted mistake, which the engine then localises.

Every case runs in a fresh process per measurement (imports, model building and the call; no compilation cache, so
each process compiles what it needs, as a user's first call does), passing and failing, ``--repeats`` times each
(default 2, the best kept). Only the ``compare_modules`` call is timed. For each case the script prints the best
times, the ratio failing / passing, and each failing report's first-divergence and isolation lines (of the float32
run and of the float64 check): they must not change when the engine gets faster.

The cases:

* ``gpt``: the project's own 2-layer GPT (width 64, 4 heads, vocab 50; two sequences of 32 tokens), ``ln_2``'s eps
  planted in layer 1 of the flax side (1e-2 against torch's 1e-5);
* ``gpt2-eps`` and ``gpt2-gelu``: GPT-2 124M (``torch_ref.GPT`` against ``flax_ln.GPT``, one sequence of 128 tokens,
  torch's initialisation): ``ln_2``'s eps planted in the last block (1e-2), or block 0's GELU made erf on the torch
  side where the port keeps tanh (at the default initialisation only the float64 check sees it);
* one planted port per side kind, from the tests: the NNX conv net of ``test_localization.py`` (block 1's norm eps),
  the Linen stack of ``test_isolation_replay.py`` (block 1's norm eps, inside ``nn.remat``), the Equinox stack of
  ``test_localize_batched_and_scanned.py`` (``lax.scan`` over four layers, layer 2's norm eps on the torch side) and
  ``test_keras.py``'s ``keras_net(eps=0.1)``.

    python benchmarks/first_answer.py                         # every case, best of two fresh processes each
    python benchmarks/first_answer.py --case gpt --case keras # some of them
    python benchmarks/first_answer.py --profile               # and where a failing call's time goes, by phase

``--profile`` runs each failing call once more (another fresh process) with the engine's phases timed: per run (the
float64 check, the float32 run) the torch side, the flax side's load/trace/compile/run, and localisation split into
its steps, with the XLA compiles made in each. Run it alone on the machine: the times mean nothing under load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import PhaseClock
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "parity_tests"


# --- the cases: each builds (torch model, flax side, inputs, options) for compare_modules, planted or not -------------


def _book_gpt(planted: bool):
    from flax_ln.book import cases

    case = cases.gpt("float32", 2, 32, 0)
    if planted:
        case.flax_model.transformer.h[1].ln_2.eps = 1e-2  # torch keeps 1e-5
    options = dict(input_names=case.input_names, forward=case.forward, kwargs=case.kwargs, lm_logits=case.lm_logits)
    return case.torch_model, case.flax_model, tuple(case.inputs), options


def _gpt2(plant: str | None):
    import numpy as np
    import torch
    from flax import nnx

    import flax_ln
    import torch_ref

    config = flax_ln.GPTConfig.gpt2()
    torch.manual_seed(0)
    torch_model = torch_ref.GPT(config).eval()  # torch's initialisation (std 0.02), as a user's fresh model
    flax_model = nnx.eval_shape(lambda: flax_ln.GPT(config, rngs=nnx.Rngs(0)))  # weights come from torch's
    if plant == "eps":
        flax_model.transformer.h[config.n_layer - 1].ln_2.eps = 1e-2  # torch keeps 1e-5
    elif plant == "gelu":
        torch_model.transformer.h[0].mlp.act = torch.nn.GELU()  # erf; the port keeps the book's tanh form
    idx = np.random.default_rng(0).integers(0, config.vocab_size, (1, 128))
    return torch_model, flax_model, (idx,), {}


def _conv(planted: bool):
    import test_localization as t

    x = np.random.default_rng(2).standard_normal((t.BATCH, 3, t.IMAGE, t.IMAGE)).astype("float32")  # NCHW
    port = nnx.eval_shape(lambda: t.ConvNet("float32"))
    if planted:
        port.blocks[1].norm.epsilon = 1e-1
    options = dict(flax_inputs=(x.transpose(0, 2, 3, 1),), weights=t.NNX_CONV_MAP)
    return t.randomized(t.TorchConvNet(), "float32"), port, (x,), options


def _linen(planted: bool):
    import test_isolation_replay as t

    from flax_ln.parity import Linen

    x = np.random.default_rng(3).standard_normal((t.BATCH, t.SEQ, t.WIDTH)).astype("float32")
    module = t.LinenStack(jnp.float32, (1e-5, 1e-1 if planted else 1e-5))
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, t.SEQ, t.WIDTH), jnp.float32))
    torch_model = t.randomized(t.TorchStack(), "float32")
    return torch_model, Linen(module, variables), (x,), dict(weights=t.STACK_MAP)


def _equinox(planted: bool):
    import test_localize_batched_and_scanned as t

    x = np.random.default_rng(4).standard_normal((t.BATCH, t.SEQ, t.WIDTH)).astype("float32")
    torch_model = t.TorchStack("float32")  # layer 2's norm eps planted (0.5) by its constructor
    if not planted:
        torch_model.layers[2].norm.eps = 1e-5
    weights = t._stacked_map("weight", "weight", None)
    return torch_model, t.EqxScanned(jnp.float32), (x,), dict(weights=weights, forward=(None, t._per_example))


def _keras(planted: bool):
    import keras
    import test_keras as t

    return t.torch_net(), t.keras_net(keras, eps=0.1 if planted else 1e-3), (t.X,), dict(weights=t.KEY_MAP)


CASES = {
    "gpt": (_book_gpt, "the project's 2-layer GPT, ln_2 eps in layer 1"),
    "gpt2-eps": (lambda planted: _gpt2("eps" if planted else None), "GPT-2 124M B1 T128, ln_2 eps in block 11"),
    "gpt2-gelu": (lambda planted: _gpt2("gelu" if planted else None), "GPT-2 124M B1 T128, erf GELU in block 0"),
    "conv": (_conv, "NNX conv net (test_localization), block 1's norm eps"),
    "linen": (_linen, "Linen stack in nn.remat (test_isolation_replay), block 1's norm eps"),
    "equinox": (_equinox, "Equinox lax.scan stack (test_localize_batched_and_scanned), layer 2's norm eps"),
    "keras": (_keras, "Keras keras_net(eps=0.1) (test_keras)"),
}


# --- one measurement, in this (fresh) process ----------------------------------------------------------------------


def _answer_lines(report) -> list[str]:
    """The lines of the report that say where the difference is: the first divergence and isolation's culprits, of
    the run and of its float64 check, as plain facts (paths), so that two versions of the engine compare."""
    lines = []
    for label, r in (("run", report), ("float64 check", report.float64_check)):
        if r is None:
            continue
        fd = r.first_divergence
        where = None if fd is None else (fd.module, fd.flax_module, fd.between, fd.flax_between, fd.seen_at)
        lines.append(f"{label}: passed={r.passed} first divergence={where}")
        iso = r.isolation
        if iso is not None:
            lines.append(f"{label}: isolated culprits={iso.culprits} flax={iso.flax_culprits} own code={iso.own_code}")
        else:
            lines.append(f"{label}: isolation=None")
    return lines


def measure(case: str, planted: bool, profile: bool) -> dict:
    from flax_ln.parity import compare_modules

    jax.config.update("jax_enable_compilation_cache", False)  # a first call compiles everything it needs
    torch_model, flax_side, inputs, options = CASES[case][0](planted)
    clock = PhaseClock(PHASES) if profile else None
    started = time.perf_counter()
    report = compare_modules(torch_model, flax_side, inputs, quiet=True, **options)
    seconds = time.perf_counter() - started
    return dict(
        seconds=seconds,
        passed=report.passed,
        check_passed=None if report.float64_check is None else report.float64_check.passed,
        lines=_answer_lines(report),
        phases=None if clock is None else clock.seconds,
        compiles=None if clock is None else clock.compiles,
    )


# The phases: (name, module, attribute), each timed where the engine looks it up. Localisation's steps nest in
# "localisation"; XLA's compiles are counted and timed apart, by the phase they happen in.
PHASES = [
    ("torch side", "flax_ln.parity.compare", "run_torch_side"),
    ("flax side (load, trace, compile, run, judge)", "flax_ln.parity.compare", "load_and_judge"),
    ("torch records", "flax_ln.parity.compare", "record_torch_side"),
    ("localisation", "flax_ln.parity.compare", "localize"),
    ("  eager flax forward, recorded", "flax_ln.parity.sides.flax", "FlaxSide.record"),
    ("  pairing", "flax_ln.parity.localize.locate", "pair_modules"),
    ("  nudged run", "flax_ln.parity.sides.flax", "FlaxSide.record_nudged"),
    ("  first divergence", "flax_ln.parity.localize.locate", "first_divergence"),
    ("  isolation", "flax_ln.parity.localize.locate", "isolate"),
    ("  activations inside layers", "flax_ln.parity.localize.locate", "activations_in_own_code"),
]


# --- the driver: fresh processes, best of the repeats, the ratio ----------------------------------------------------


def _in_subprocess(case: str, planted: bool, profile: bool) -> dict:
    command = [sys.executable, __file__, "--measure", case] + (["--planted"] if planted else [])
    command += ["--profile"] if profile else []
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "KERAS_BACKEND": "jax"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"{case} ({'failing' if planted else 'passing'}) exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=list(CASES), help="a case to run (repeatable; default all)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per call; the best is kept")
    parser.add_argument("--profile", action="store_true", help="also one failing call per case with phases timed")
    parser.add_argument("--measure", choices=list(CASES), help=argparse.SUPPRESS)  # inside the fresh process
    parser.add_argument("--planted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.planted, args.profile)))
        return

    import platform

    print(f"python {platform.python_version()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at start")
    rows = []
    for case in args.case or list(CASES):
        runs = {
            planted: [_in_subprocess(case, planted, False) for _ in range(args.repeats)] for planted in (False, True)
        }
        best = {planted: min(r["seconds"] for r in found) for planted, found in runs.items()}
        passing, failing = runs[False][0], runs[True][0]
        if not passing["passed"] or failing["passed"]:
            raise SystemExit(
                f"{case}: expected the clean port to pass and the planted one to fail: {passing} {failing}"
            )
        ratio = best[True] / best[False]
        rows.append((case, best[False], best[True], ratio))
        print(f"\n{case}: {CASES[case][1]}")
        each = {planted: ", ".join(f"{r['seconds']:.2f}" for r in found) for planted, found in runs.items()}
        print(f"  passing {best[False]:.2f} s, failing {best[True]:.2f} s, ratio {ratio:.2f}")
        print(f"  (each process: passing {each[False]}; failing {each[True]})")
        for line in failing["lines"]:
            print(f"  | {line}")
        if args.profile:
            profiled = _in_subprocess(case, True, True)
            print(f"  profiled failing call: {profiled['seconds']:.2f} s")
            for run, phases in profiled["phases"].items():
                compiles = profiled["compiles"].get(run, {})
                for phase, seconds in phases.items():
                    count = compiles.get(phase, 0)
                    print(f"    {run:8} {phase:46} {seconds:7.2f} s  {count:4d} compiles")
                rest = {p: n for p, n in compiles.items() if p not in {q for q in phases}}
                if rest:
                    print(f"    {run:8} compiles outside the timed phases: {rest}")
    print(f"\nload {os.getloadavg()[0]:.2f} at the end")
    print("\n| case | passing (s) | failing (s) | failing / passing |\n|---|---|---|---|")
    for case, p, f, r in rows:
        print(f"| {case} | {p:.2f} | {f:.2f} | {r:.2f} |")


if __name__ == "__main__":
    main()

"""The parity engine's own cost: ``compare_modules`` on a whole GPT-2 against the floor it cannot go under.

The floor is what any comparison of outputs and every parameter gradient must do: one torch forward and backward,
one XLA compile of the flax forward and backward, and one run of it. This script measures, for one model and
dtype, in ONE command:

* the floor's three parts, in a fresh subprocess (torch forward+backward, flax compile, flax forward+backward);
* ``compare_modules`` with an explicit ``dtype`` (float64: islands lifted, the default), in another fresh
  subprocess; with ``--dtype default``, ``compare_modules`` with no ``dtype`` on float32 models (the float32 run and
  the float64 check, islands lifted), against the sum of the float32 and float64 floors, each in its own subprocess;
* with ``--profile``, the engine's call again with its phases timed (:data:`PHASES`, in a third fresh subprocess,
  so the timed call above is untouched): per run (the float64 check, the float32 run) the float64 copy of the
  torch model, torch's forward and backward, the flax load, the flax side's trace, compile and run (of it XLA's
  compile), the judging of the results, and the rest;

then prints each time, the ratio of ``compare_modules`` to the floor (and to the floor compiled with the cotangent an
argument of the program, as the engine passes it, instead of a constant in it), and each subprocess's peak RSS
(``ru_maxrss``: a fresh process per measurement, so the peak is that measurement's), next to the size of both
sides' weights and gradients. Weights are random (torch's own initialisation, B=1, no downloads); the torch
model ``torch_ref.GPT``, the flax model ``flax_ln.GPT`` with ``scan_layers=True``.

    python benchmarks/engine_floor.py --model gpt2 --dtype float32
    python benchmarks/engine_floor.py --model gpt2 --dtype float64
    python benchmarks/engine_floor.py --model gpt2 --dtype default         # no dtype: float32 and the float64 check
    python benchmarks/engine_floor.py --model gpt2 --dtype default --profile  # and where the engine's time goes
    python benchmarks/engine_floor.py --model gpt2-xl --dtype float32       # T=64 by default; needs ~24 GiB

Run it alone on the machine: the peak RSS and the times are only meaningful on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import PeakAnonymous, PhaseClock

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"gpt2": "gpt2", "gpt2-medium": None, "gpt2-xl": "gpt2_xl"}
DEFAULT_SEQ = {"gpt2": 128, "gpt2-medium": 128, "gpt2-xl": 64}


def _config(model: str):
    from flax_ln import GPTConfig

    if model == "gpt2-medium":
        return GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024)
    return getattr(GPTConfig, MODELS[model])()


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB


def _models(model: str, dtype: str, seq: int):
    """The torch model (random weights, eval mode, in ``dtype``), the flax twin built abstractly (no random init:
    the weights come from torch's), the token ids and the config."""
    import numpy as np
    import torch
    from flax import nnx

    import flax_ln
    import torch_ref

    config = _config(model)
    torch.manual_seed(0)
    torch_model = torch_ref.GPT(config).to(getattr(torch, dtype)).eval()
    param_dtype = np.dtype(dtype)
    flax_model = nnx.eval_shape(
        lambda: flax_ln.GPT(config, scan_layers=True, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    idx = np.random.default_rng(0).integers(0, config.vocab_size, (1, seq))
    return torch_model, flax_model, idx, config


def measure_floor(model: str, dtype: str, seq: int) -> dict:
    """The floor's three parts, each timed once (cold, as a comparison runs them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    import flax_ln

    with jax.enable_x64(dtype == "float64"), jax.default_matmul_precision("highest"):
        torch_model, flax_model, idx, _ = _models(model, dtype, seq)
        flax_ln.load_torch_state_dict(flax_model, torch_model.state_dict())
        flax_model.eval()
        n_params = sum(p.numel() for p in torch_model.parameters())

        t0 = time.perf_counter()
        logits, _ = torch_model(torch.from_numpy(idx))
        cotangent = torch.from_numpy(np.random.default_rng(0).standard_normal(logits.shape).astype(dtype))
        (logits * cotangent).sum().backward()
        torch_s = time.perf_counter() - t0
        torch_model.zero_grad(set_to_none=True)

        graphdef, params, rest = nnx.split(flax_model, nnx.Param, ...)
        c = jnp.asarray(cotangent.numpy())

        def objective(params, rest, idx):
            return jnp.sum(nnx.merge(graphdef, params, rest)(idx)[0] * c)

        step = jax.jit(jax.value_and_grad(objective))
        t1 = time.perf_counter()
        compiled = step.lower(params, rest, jnp.asarray(idx)).compile()
        compile_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(params, rest, jnp.asarray(idx)))
        flax_s = time.perf_counter() - t2

        # the same program with the cotangent an argument (as the engine passes it) instead of a constant in it
        def objective_of_c(params, rest, idx, c):
            return jnp.sum(nnx.merge(graphdef, params, rest)(idx)[0] * c)

        t3 = time.perf_counter()
        jax.jit(jax.value_and_grad(objective_of_c)).lower(params, rest, jnp.asarray(idx), c).compile()
        compile_argument_s = time.perf_counter() - t3
    return dict(
        torch_s=torch_s,
        compile_s=compile_s,
        flax_s=flax_s,
        compile_argument_s=compile_argument_s,
        n_params=n_params,
        peak_gib=_peak_gib(),
    )


def measure_engine(model: str, dtype: str, seq: int, profile: bool = False) -> dict:
    """``compare_modules`` with an explicit ``dtype``, or none for ``"default"`` (on float32 models); the verdict
    is printed, so a failing run is seen. ``profile``: with :data:`PHASES` timed (:class:`PhaseClock`)."""
    import jax

    from flax_ln.parity import compare_modules

    with jax.enable_x64(dtype == "float64"):
        torch_model, flax_model, idx, _ = _models(model, "float32" if dtype == "default" else dtype, seq)
    # torch imports torch._dynamo (1-2 s) the first time a process enters a dispatch mode, which float64's island
    # lifting uses: a once-per-process import like `import torch`, timed apart and not counted as the engine's
    t_import = time.perf_counter()
    import torch._dynamo  # noqa: F401

    import_s = time.perf_counter() - t_import
    clock = PhaseClock(PHASES, entries=frozenset({"torch_model_for"})) if profile else None
    before = _peak_gib()
    sampler = PeakAnonymous()
    sampler.start()
    options = {} if dtype == "default" else {"dtype": dtype}
    t0 = time.perf_counter()
    report = compare_modules(torch_model, flax_model, idx, **options)
    engine_s = time.perf_counter() - t0
    sampler.done.set()
    worst = max(report.results, key=lambda r: r.relative_error)
    check = report.float64_check
    return dict(
        engine_s=engine_s,
        import_s=import_s,
        passed=report.passed,
        worst=f"{worst.name} rel {worst.relative_error:.2e}",
        check=None if check is None else f"float64 check passed={check.passed}, {check.seconds:.1f} s",
        peak_before_gib=before,
        peak_gib=_peak_gib(),
        peak_anonymous_gib=sampler.peak_kib / 2**20,
        grad_left=any(p.grad is not None for p in torch_model.parameters()),
        phases=None if clock is None else clock.seconds,
    )


# The engine's phases, each timed where the engine calls the function that does it: (phase, module, attribute).
# XLA's compile is part of the flax side's values; what the phases leave out of a run is its "rest".
PHASES = [
    ("torch model in float64 (copy)", "flax_ln.parity.compare", "torch_model_for"),
    ("torch forward and backward", "flax_ln.parity.compare", "run_torch_side"),
    ("flax load", "flax_ln.parity.sides.nnx", "NNXSide.load"),
    ("flax trace, compile and run", "flax_ln.parity.sides.flax", "FlaxSide.values"),
    ("  of it XLA's compile", "jax._src.compiler", "backend_compile_and_load"),
    ("judging the results", "flax_ln.parity.compare", "judge"),
]


def _in_subprocess(part: str, args: argparse.Namespace, dtype: str | None = None, profile: bool = False) -> dict:
    command = [sys.executable, __file__, "--part", part, "--model", args.model, "--dtype", dtype or args.dtype]
    command += ["--seq-len", str(args.seq_len)] + (["--profile"] if profile else [])
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}  # no accelerator probing
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:  # -9: killed, most likely by the kernel for memory
        why = "killed (out of memory?)" if done.returncode == -9 else f"exit status {done.returncode}"
        return {"failed": f"{part} {why}, peak RSS unknown:\n{done.stderr[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _floor(args: argparse.Namespace, dtype: str) -> tuple[dict, float, float]:
    """The floor in ``dtype``: its parts, its total, and its total with the cotangent an argument of the program."""
    floor = _in_subprocess("floor", args, dtype)
    if "failed" in floor:
        raise SystemExit(floor["failed"])
    total = floor["torch_s"] + floor["compile_s"] + floor["flax_s"]
    print(
        f"floor, {dtype}: torch fwd+bwd {floor['torch_s']:.1f} s + flax compile {floor['compile_s']:.1f} s + "
        f"flax fwd+bwd {floor['flax_s']:.1f} s = {total:.1f} s (peak RSS {floor['peak_gib']:.2f} GiB); "
        f"compiled with the cotangent an argument: {floor['compile_argument_s']:.1f} s"
    )
    return floor, total, total - floor["compile_s"] + floor["compile_argument_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="gpt2")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64", "default"],
        default="float32",
        help="default: no dtype argument (float32 models; the float32 run and the float64 check)",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128 (gpt2, gpt2-medium), 64 (gpt2-xl)")
    parser.add_argument("--profile", action="store_true", help="also the engine's call with its phases timed")
    parser.add_argument("--part", choices=["floor", "engine"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq_len = args.seq_len or DEFAULT_SEQ[args.model]
    if args.part is not None:  # one measurement, in its own process
        if args.part == "floor":
            print(json.dumps(measure_floor(args.model, args.dtype, args.seq_len)))
        else:
            print(json.dumps(measure_engine(args.model, args.dtype, args.seq_len, args.profile)))
        return
    floor_dtypes = ["float32", "float64"] if args.dtype == "default" else [args.dtype]
    floors = [_floor(args, d) for d in floor_dtypes]
    total, strict = sum(f[1] for f in floors), sum(f[2] for f in floors)
    n_params = floors[0][0]["n_params"]
    engine = _in_subprocess("engine", args)
    weights_gib = n_params * (4 if args.dtype == "float32" else 8) * 4 / 2**30
    print(f"{args.model}, {args.dtype}, B=1, T={args.seq_len}, {n_params / 1e6:.0f}M parameters")
    if "failed" in engine:
        raise SystemExit(f"compare_modules: {engine['failed']}")
    print(
        f"compare_modules: {engine['engine_s']:.1f} s = {engine['engine_s'] / total:.2f}x the floor "
        f"({total:.1f} s); passed={engine['passed']} (worst: {engine['worst']}); "
        f".grad left on the torch module: {engine['grad_left']}"
    )
    print(
        f"  against the floor with the cotangent an argument of the program, as the engine passes it ({strict:.1f} s): "
        f"{engine['engine_s'] / strict:.2f}x"
    )
    if engine["check"] is not None:
        print(f"  of it the {engine['check']}")
    print(f"not counted: torch's one-time import of torch._dynamo, {engine['import_s']:.1f} s")
    print(
        f"peak RSS: {engine['peak_gib']:.2f} GiB, of it anonymous {engine['peak_anonymous_gib']:.2f} GiB "
        f"({engine['peak_before_gib']:.2f} GiB with both models built); "
        f"both sides' weights and gradients: {weights_gib:.2f} GiB"
        + (" (float64's: the check's copies)" if args.dtype == "default" else "")
    )
    if args.profile:
        profiled = _in_subprocess("engine", args, profile=True)
        if "failed" in profiled:
            raise SystemExit(f"compare_modules with its phases timed: {profiled['failed']}")
        print(f"with its phases timed (another fresh process): {profiled['engine_s']:.1f} s; seconds by phase:")
        for run, phases in profiled["phases"].items():
            whole = phases.pop("whole run", 0.0)
            rest = whole - sum(t for p, t in phases.items() if not p.startswith(" "))
            cells = ", ".join(f"{p.strip()} {t:.2f}" for p, t in phases.items())
            print(f"  {run} run, {whole:.2f} s: {cells}, rest {rest:.2f}")


if __name__ == "__main__":
    main()

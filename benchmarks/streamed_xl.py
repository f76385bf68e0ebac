"""The book's GPT-2 XL (1.5B parameters) checked whole, every output and parameter gradient, stage by stage
from a checkpoint on disk (``compare_streamed``), on a machine that could not hold both sides' weights and
gradients at once (4x the model: 25 GB in float32, 50 GB in float64).

One command does, each measurement in a fresh subprocess (so that its peak RSS is its own):

1. writes a torch-keyed safetensors checkpoint of random weights (once; kept in ``--dir``), a tensor at a time;
2. times torch alone going through the same stages from the same checkpoint (each stage's forward, then each
   stage's backward with its recomputed forward): the torch half of the work, the reference for the ratio;
3. runs ``compare_streamed`` (torch ``meta`` model, abstract ``nnx.eval_shape`` port, explicit ``--dtype``),
   optionally with a mistake planted in one block of the port (``--plant K``: that block's first LayerNorm eps
   1e-3 instead of 1e-5), and prints its time, the ratio, its peak RSS and peak anonymous memory, the verdict and
   where the report localises a failure.

    python benchmarks/streamed_xl.py --dtype float32
    python benchmarks/streamed_xl.py --dtype float64
    python benchmarks/streamed_xl.py --dtype float64 --plant 30

Run it alone on the machine. Not run in CI (about 6.5 GB of checkpoint and minutes of compute).
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

from common import PeakAnonymous

ROOT = Path(__file__).resolve().parent.parent
SEQ = 64


def _config(model: str):
    from flax_ln import GPTConfig

    return GPTConfig.gpt2_xl() if model == "gpt2-xl" else GPTConfig.gpt2()


def _meta_torch(config):
    import torch

    import torch_ref

    with torch.device("meta"):
        model = torch_ref.GPT(config)
    return model.eval()


def write_checkpoint(model: str, folder: Path) -> Path:
    """Random weights for every key of torch_ref's GPT, written a tensor at a time: matrices normal(0, 0.02),
    biases normal(0, 0.02), LayerNorm scales 1 + normal(0, 0.1), the causal-mask buffers as torch builds them."""
    import numpy as np

    from flax_ln.convert.tensor_files import write_streamed

    file = folder / f"{model}.safetensors"
    if file.is_file():
        return file
    folder.mkdir(parents=True, exist_ok=True)
    state = _meta_torch(_config(model)).state_dict()
    rng = np.random.default_rng(0)

    def values(key: str, shape: tuple[int, ...]):
        def blocks():
            if key.endswith(".attn.bias"):  # the causal mask buffer, (1, 1, S, S)
                yield np.tril(np.ones(shape[-2:], np.float32)).reshape(shape)
            elif ".ln_" in key and key.endswith("weight") or key == "transformer.ln_f.weight":
                yield 1 + 0.1 * rng.standard_normal(shape, np.float32)
            else:
                yield 0.02 * rng.standard_normal(shape, np.float32)

        return blocks

    tmp = file.with_suffix(".partial")
    write_streamed(tmp, [(k, tuple(t.shape), np.float32, values(k, tuple(t.shape))) for k, t in state.items()])
    tmp.rename(file)
    return file


def _inputs(config):
    import numpy as np

    return np.random.default_rng(1).integers(0, config.vocab_size, (1, SEQ))


def measure_torch(model: str, dtype: str, file: Path) -> dict:
    """Torch alone through the stages from the checkpoint: forward stage by stage, then backward from the last."""
    import numpy as np
    import torch
    from flax import nnx

    import flax_ln
    from flax_ln.parity.streamed.sides import Checkpoint, torch_stage
    from flax_ln.parity.streamed.stages import gpt_stages

    config = _config(model)
    skeleton = _meta_torch(config)
    stages = gpt_stages(skeleton, nnx.eval_shape(lambda: flax_ln.GPT(config, rngs=nnx.Rngs(0)))).bound()
    t0 = time.perf_counter()
    checkpoint = Checkpoint(file, skeleton, dtype)
    acts = [(torch.from_numpy(_inputs(config)),)]
    for b in stages:
        acts.append(torch_stage(skeleton, b, checkpoint, dtype)[0].forward(acts[-1], {}))
    out = acts.pop()
    cot = {"output[0]": np.random.default_rng(0).standard_normal(tuple(out[0].shape)).astype(dtype)}
    for k in reversed(range(len(stages))):
        _, x_grad = torch_stage(skeleton, stages[k], checkpoint, dtype)[0].gradients(acts[k], {}, cot)
        cot = {"output": x_grad.numpy()} if k else cot
    return dict(torch_s=time.perf_counter() - t0, peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def measure_streamed(model: str, dtype: str, file: Path, plant: int | None) -> dict:
    import jax
    from flax import nnx

    import flax_ln
    from flax_ln.parity import compare_streamed

    config = _config(model)
    with jax.enable_x64(dtype == "float64"):
        port = nnx.eval_shape(lambda: flax_ln.GPT(config, rngs=nnx.Rngs(0)))
    if plant is not None:
        port.transformer.h[plant].ln_1.eps = 1e-3
    import torch._dynamo  # noqa: F401  # a once-per-process import float64's lifting triggers, not the engine's

    torch_model, ids = _meta_torch(config), _inputs(config)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    sampler = PeakAnonymous()
    sampler.start()
    t0 = time.perf_counter()
    report = compare_streamed(torch_model, port, ids, checkpoint=file, dtype=dtype, quiet=True)
    seconds = time.perf_counter() - t0
    sampler.done.set()
    worst = max(report.results, key=lambda r: r.relative_error)
    return dict(
        streamed_s=seconds,
        passed=report.passed,
        compared=len(report.results),
        failed=sum(not r.passed for r in report.results),
        worst=f"{worst.name} rel {worst.relative_error:.2e}",
        first_divergence=None if report.first_divergence is None else report.first_divergence.describe(),
        culprits=None if report.isolation is None else report.isolation.culprits,
        note=report.localization_note,
        peak_before_gib=before,
        peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        peak_anonymous_gib=sampler.peak_kib / 2**20,
    )


def _stage_gib(model: str, dtype: str) -> tuple[float, float]:
    """The weights of the largest block stage and of the embedding stage, in ``dtype``."""
    config = _config(model)
    c, size = config.n_embd, 4 if dtype == "float32" else 8
    block = 12 * c * c + 13 * c
    embedding = (config.vocab_size + config.block_size) * c
    return block * size / 2**30, embedding * size / 2**30


def _in_subprocess(args: argparse.Namespace, part: str) -> dict:
    command = [sys.executable, __file__, "--part", part, "--model", args.model, "--dtype", args.dtype]
    command += ["--dir", str(args.dir)] + ([] if args.plant is None else ["--plant", str(args.plant)])
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        why = "killed (out of memory?)" if done.returncode == -9 else f"exit status {done.returncode}"
        raise SystemExit(f"{part}: {why}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt2-xl", "gpt2"], default="gpt2-xl")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--plant", type=int, default=None, help="plant a LayerNorm eps of 1e-3 in this block")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/flax-ln-streamed"), help="where the checkpoint is kept")
    parser.add_argument("--part", choices=["write", "torch", "streamed"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    file = args.dir / f"{args.model}.safetensors"
    if args.part == "write":
        t0 = time.perf_counter()
        write_checkpoint(args.model, args.dir)
        print(json.dumps({"write_s": time.perf_counter() - t0}))
        return
    if args.part is not None:
        measure = measure_torch(args.model, args.dtype, file) if args.part == "torch" else None
        print(json.dumps(measure or measure_streamed(args.model, args.dtype, file, args.plant)))
        return
    written = _in_subprocess(args, "write")
    torch_alone = _in_subprocess(args, "torch")
    streamed = _in_subprocess(args, "streamed")
    block_gib, embedding_gib = _stage_gib(args.model, args.dtype)
    print(f"{args.model}, {args.dtype}, B=1, T={SEQ}, checkpoint {file.stat().st_size / 2**30:.2f} GiB float32")
    print(f"checkpoint written in {written['write_s']:.1f} s (0 if it was there)")
    alone = torch_alone["torch_s"]
    print(f"torch alone through the stages: {alone:.1f} s (peak RSS {torch_alone['peak_gib']:.2f} GiB)")
    print(
        f"compare_streamed: {streamed['streamed_s']:.1f} s = {streamed['streamed_s'] / torch_alone['torch_s']:.2f}x "
        f"torch alone; passed={streamed['passed']}, {streamed['failed']}/{streamed['compared']} tensors failed "
        f"(worst: {streamed['worst']})"
    )
    print(
        f"peak RSS {streamed['peak_gib']:.2f} GiB (the process before it: {streamed['peak_before_gib']:.2f} GiB), "
        f"peak anonymous {streamed['peak_anonymous_gib']:.2f} GiB; one block's "
        f"weights {block_gib:.2f} GiB, the embedding stage's {embedding_gib:.2f} GiB ({args.dtype})"
    )
    if not streamed["passed"]:
        print(f"first divergence: {streamed['first_divergence']}; isolated culprits: {streamed['culprits']}")
        print(f"note: {streamed['note']}")


if __name__ == "__main__":
    main()

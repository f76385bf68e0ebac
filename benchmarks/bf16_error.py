"""Error of ``--dtype bfloat16`` (float32 parameters, bfloat16 compute) against float32, for docs/examples.md.

Two measurements, correctness only (no timing):

* generate_gpt2's random-weights model (2 layers, width 64, byte vocabulary): the
  relative Frobenius error of the logits on random prompts, and how many greedy tokens
  agree (``generate`` with temperature 0) before the first difference;
* train_music's tiny config: the per-step loss of ``examples/train_music.py`` run twice
  with the same seed, data and dropout keys, once per dtype (``--out-dir`` holds both runs).

Run: python benchmarks/bf16_error.py [--midi DIR] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from generate_gpt2 import random_model  # noqa: E402

import flax_ln  # noqa: E402


def relative_error(actual, expected) -> float:
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def generation_error(seeds=(0, 1, 2), batch: int = 4, prompt_len: int = 32, new_tokens: int = 64) -> dict:
    """Logits error and greedy agreement of the random-weights model, bf16 compute against float32."""
    rows = []
    for seed in seeds:
        f32, bf16 = (random_model(seed, dtype=d) for d in (jnp.float32, jnp.bfloat16))
        prompt = jax.random.randint(jax.random.key(100 + seed), (batch, prompt_len), 0, 256)  # (B, T)
        logits32, _ = f32(prompt)
        logits16, _ = bf16(prompt)
        out32, out16 = (
            np.asarray(flax_ln.generate(m, prompt, new_tokens, temperature=0.0, rng=jax.random.key(0)))[:, prompt_len:]
            for m in (f32, bf16)
        )  # greedy: the key is unused
        differs = out32 != out16  # (B, new_tokens)
        first = np.where(differs.any(1), differs.argmax(1), new_tokens)  # tokens equal before the first difference
        rows.append(
            {
                "seed": seed,
                "logits_rel_error": relative_error(logits16, logits32),
                "greedy_agreement": float((~differs).mean()),
                "equal_prefix": first.tolist(),
                "argmax_agreement": float((np.argmax(logits16, -1) == np.argmax(logits32, -1)).mean()),
            }
        )
    return {
        "model": "generate_gpt2 random weights (2 layers, width 64, vocab 256)",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "runs": rows,
    }


def training_error(midi: Path, steps: int, out_dir: Path) -> dict:
    """Per-step losses of train_music.py --config tiny in float32 and in bfloat16 compute."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = out_dir / f"music-tiny-{dtype}"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "train_music.py"),
                "--config",
                "tiny",
                "--steps",
                str(steps),
                "--batch-size",
                "8",
                "--seq-len",
                "64",
                "--max-files",
                "4",
                "--seed",
                "3",
                "--generate-tokens",
                "0",
                "--data",
                str(midi),
                "--out",
                str(out),
                "--dtype",
                dtype,
            ],
            check=True,
            capture_output=True,
            env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )
        losses[dtype] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    rel = np.abs(bf16 - f32) / np.abs(f32)
    return {
        "model": "train_music --config tiny, batch 8, seq 64, 4 chorales, seed 3",
        "steps": steps,
        "loss_float32": f32.round(5).tolist(),
        "loss_bfloat16": bf16.round(5).tolist(),
        "max_rel_loss_diff": float(rel.max()),
        "last_rel_loss_diff": float(rel[-1]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--midi", type=Path, help="folder of MIDI files for the training run (omit to skip it)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=Path("out/bf16-error"))
    args = p.parse_args()
    with jax.default_matmul_precision("highest"):  # float32 at full precision: the error is bf16's alone
        result = {"generation": generation_error()}
    if args.midi is not None:
        result["training"] = training_error(args.midi, args.steps, args.out_dir)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

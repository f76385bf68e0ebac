"""Float32 LayerNorm error against float64 truth on rows whose mean is large against their spread.

Prints a Markdown table: the median per-row relative error (``||y - truth|| / ||truth||``)
of the book's norm (flax_ln.LayerNorm vs torch_ref.LayerNorm) and of the torch twin
(flax_ln.TorchLayerNorm vs torch.nn.LayerNorm), 64 rows of width 1024 per line, unit
scale and zero offset. Rows at mean 1e6 with spread 1e-2 round to constants in float32
(their truth is 0/0), so that line uses spread 1 only.

    python benchmarks/accuracy_table.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import flax_ln
import torch_ref

WIDTH, ROWS = 1024, 64
CASES = [(1e2, 1e-2), (1e2, 1.0), (1e4, 1e-2), (1e4, 1.0), (1e6, 1.0)]


def truth(x: np.ndarray, eps: float, ddof: int) -> np.ndarray:
    x = x.astype(np.float64)
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered * centered).sum(-1, keepdims=True) / (x.shape[-1] - ddof) + eps)


def median_error(y, expected: np.ndarray) -> float:
    diff = np.linalg.norm(np.asarray(y, np.float64) - expected, axis=-1)
    return float(np.median(diff / np.linalg.norm(expected, axis=-1)))


def main() -> None:
    rng = np.random.default_rng(0)
    norms = [  # (flax module, torch module, ddof, eps)
        (flax_ln.LayerNorm(WIDTH), torch_ref.LayerNorm(WIDTH, 1e-6), 1, 1e-6),
        (flax_ln.TorchLayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH, 1e-5), 0, 1e-5),
    ]
    print("| mean | spread | book norm: flax_ln | book norm: torch_ref | torch twin: flax_ln | nn.LayerNorm |")
    print("|---|---|---|---|---|---|")
    for mean, spread in CASES:
        x = (mean + spread * rng.normal(size=(ROWS, WIDTH))).astype(np.float32)
        cells = []
        for flax_module, torch_module, ddof, eps in norms:
            expected = truth(x, eps, ddof)
            cells.append(median_error(jax.jit(lambda v, m=flax_module: m(v))(jnp.asarray(x)), expected))
            with torch.no_grad():
                cells.append(median_error(torch_module(torch.from_numpy(x)).numpy(), expected))
        print(f"| {mean:g} | {spread:g} | " + " | ".join(f"{e:.1e}" for e in cells) + " |")


if __name__ == "__main__":
    main()

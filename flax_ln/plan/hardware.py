"""The TPU chips the planner has figures for, and the analytic half of a plan: parameter counts, FLOPs, the roofline.

The roofline (:func:`roofline`):

- FLOPs are analytic, for the whole step on all chips (:func:`gpt_flops`,
  :func:`encoder_decoder_flops`): ``6 * N * tokens`` for the matmul weights (``N``
  counts every parameter except the embedding tables, which are looked up, not
  multiplied) plus ``12 * n_layer * d_model * T`` per token for attention's two
  ``T x T`` products (forward 4, backward 8). ``cost_analysis()`` is not used: it counts a
  ``scan`` body once, not once per layer.
- compute time = hardware FLOPs / (chips * peak bf16 FLOP/s); with remat the hardware
  also recomputes the forward pass (``8 N`` and ``16 L d T`` instead of ``6 N`` and ``12 L d T``).
- memory time = bytes per chip / the chip's HBM bandwidth, the bytes counted as: the
  step's arguments read once and outputs written once (state and batch), every
  temporary written once and read once (``2 * temp_bytes``: a lower bound, since the
  peak live size reuses buffers), and every weight read gathered in the compute dtype
  once per pass (forward, backward, and the remat recompute): ``passes * N_all * itemsize``,
  counted over all layers (a scanned model's body counts once per layer).
- step time = the larger of the two; ``bound`` names it; ``mfu_ceiling`` = model FLOPs /
  (chips * peak * step time), the best MFU the chip allows for this step.

Decoding (``--generate``): one step of :func:`flax_ln.models.sampling.decode_step` (one token
per sequence against a KV cache of ``seq_len`` positions), FLOPs ``B * (2 * N + 4 * L * d * S)``,
weights read once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

GIB = 2**30


class Chip(NamedTuple):
    """A TPU chip's published figures.

    Attributes:
      device_kind: JAX's ``device_kind`` of the chip.
      peak_bf16_flops: peak bfloat16 FLOP/s per chip.
      hbm_bytes: HBM per chip.
      hbm_bandwidth: HBM bytes per second per chip.
    """

    device_kind: str
    peak_bf16_flops: float
    hbm_bytes: int
    hbm_bandwidth: float


# Google Cloud TPU's published per-chip specifications (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e;
# "System architecture" pages): peak bf16 compute, HBM capacity (GiB) and HBM bandwidth (GB/s).

# Google Cloud TPU's published per-chip specifications (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e;
# "System architecture" pages): peak bf16 compute, HBM capacity (GiB) and HBM bandwidth (GB/s).
CHIPS = {
    "v4": Chip("TPU v4", 275e12, 32 * GIB, 1200e9),
    "v5e": Chip("TPU v5 lite", 197e12, 16 * GIB, 819e9),
    "v5p": Chip("TPU v5", 459e12, 95 * GIB, 2765e9),
    "v6e": Chip("TPU v6 lite", 918e12, 32 * GIB, 1640e9),
}

MEGACORE = ("v4", "v5p")


def param_counts(params) -> dict:
    """Parameter counts of an abstract ``params`` state by top-level name (``transformer``, ``encoder``, ...)."""
    import jax

    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = ".".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)
        counts[key] = counts.get(key, 0) + math.prod(leaf.shape)
    return counts


def gpt_flops(config: dict, n_params: int, batch: int, seq_len: int, *, remat: bool = False) -> tuple[float, float]:
    """``(model FLOPs, hardware FLOPs)`` of one GPT training step on ``batch`` sequences of ``seq_len`` tokens.

    Model FLOPs: ``tokens * (6 N + 12 L d T)``, ``N`` the parameters without the two
    embedding tables; hardware FLOPs add the remat recompute (``8 N`` and ``16 L d T``).
    """
    n = n_params - config["vocab_size"] * config["n_embd"] - config["block_size"] * config["n_embd"]
    tokens = batch * seq_len
    attention = config["n_layer"] * config["n_embd"] * seq_len
    model = tokens * (6 * n + 12 * attention)
    hardware = tokens * ((8 if remat else 6) * n + (16 if remat else 12) * attention)
    return float(model), float(hardware)


def decode_flops(config: dict, n_params: int, batch: int, cache_len: int) -> float:
    """FLOPs of one KV-cache decoding step: ``B * (2 N + 4 L d S)``, the attention over all ``S`` cached slots."""
    n = n_params - config["vocab_size"] * config["n_embd"] - config["block_size"] * config["n_embd"]
    return float(batch * (2 * n + 4 * config["n_layer"] * config["n_embd"] * cache_len))


def encoder_decoder_flops(counts: dict, setup: dict, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one encoder-decoder training step: ``6 (N_enc S + (N_dec + N_gen) T)`` per sequence plus attention
    ``12 L d (S^2 + T^2 + S T)`` (encoder self, decoder self, cross), embeddings excluded."""

    def total(prefix: str) -> int:
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    n_enc, n_dec, n_gen = total("encoder"), total("decoder"), total("generator")
    s, t = src_len, tgt_len
    per_sequence = 6 * (n_enc * s + (n_dec + n_gen) * t) + 12 * setup["layers"] * setup["d_model"] * (
        s * s + t * t + s * t
    )
    return float(batch * per_sequence)


def roofline(
    chip: Chip, chips: int, memory: dict, model_flops: float, hardware_flops: float, weight_bytes: float, tokens: int
) -> dict:
    """The roofline bound of one step (see the module docstring for how bytes are counted)."""
    compute = hardware_flops / (chips * chip.peak_bf16_flops)
    moved = memory["argument_bytes"] + memory["output_bytes"] + 2 * memory["temp_bytes"] + weight_bytes
    memory_seconds = moved / chip.hbm_bandwidth
    step = max(compute, memory_seconds)
    return {
        "step_seconds": step,
        "tokens_per_second": tokens / step,
        "mfu_ceiling": model_flops / (chips * chip.peak_bf16_flops * step),
        "bound": "compute" if compute >= memory_seconds else "memory",
        "compute_seconds": compute,
        "memory_seconds": memory_seconds,
        "bytes_per_chip": moved,
    }

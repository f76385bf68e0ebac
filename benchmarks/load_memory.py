"""Peak host memory of ``flax_ln.load_hf_gpt2`` for a GPT-2XL-shaped checkpoint, onto a mesh or one device.

Writes a Hugging Face GPT-2XL folder with random weights once (``config.json``, sharded
``model-0000i-of-0000n.safetensors`` of at most ~1 GB each and the index, so that writing
needs ~2 GB rather than the whole model twice), then loads it in a fresh subprocess per
configuration, on simulated CPU devices (``--xla_force_host_platform_device_count``).

On simulated devices every shard lives in the same process, so the loaded parameters
themselves count in the process's RSS. Each row therefore reports:

- baseline: VmHWM after importing JAX and building the mesh, before loading;
- peak: VmHWM after loading (the kernel's high-water mark of resident memory, anonymous
  and file-backed pages together);
- on devices: the bytes of every parameter shard on every device (``addressable_shards``);
- host overhead: peak - baseline - on devices, i.e. what the loader held beyond the
  shards at its worst moment (read blocks, casts, mapped file pages, the abstract model,
  XLA's compilation of the RNG-state initialiser).

The checkpoint and its folder are deleted at the end unless ``--keep``.

    python benchmarks/load_memory.py [--folder /tmp/gpt2xl-random] [--dtype float32] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MEASURE = r"""
import json, sys, time
import jax, numpy as np
from flax import nnx
import flax_ln
from flax_ln.sharding import make_mesh

def vm(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

folder, fsdp, scan = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
mesh = make_mesh(fsdp) if fsdp else None
baseline = vm("VmHWM")
t0 = time.perf_counter()
model = flax_ln.load_hf_gpt2(folder, mesh=mesh, scan_layers=scan)
jax.block_until_ready(nnx.state(model))
seconds = time.perf_counter() - t0
peak = vm("VmHWM")
params = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
on_devices = sum(s.data.nbytes for p in params for s in p.addressable_shards)
wte = model.transformer.wte.embedding.get_value()
print(json.dumps({
    "devices": jax.device_count(), "fsdp": fsdp, "scan_layers": scan, "baseline": baseline, "peak": peak,
    "on_devices": on_devices, "n_params": sum(p.size for p in params), "seconds": seconds,
    "wte_spec": str(wte.sharding.spec) if mesh else "one device",
    "wte_shard_shape": list(wte.addressable_shards[0].data.shape),
}))
"""

GPT2_XL = dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, n_positions=1024)


def write_checkpoint(folder: Path, dtype: str, shard_bytes: int = 1 << 30) -> int:
    """A random GPT-2XL in Hugging Face's sharded layout (tied lm_head, Conv1D (in, out) weights); returns its bytes."""
    import ml_dtypes  # noqa: F401  (bfloat16 for NumPy)
    import numpy as np
    from safetensors.numpy import save_file

    c, d = GPT2_XL["n_embd"], np.dtype(dtype)
    shapes = {
        "transformer.wte.weight": (GPT2_XL["vocab_size"], c),
        "transformer.wpe.weight": (GPT2_XL["n_positions"], c),
    }
    for i in range(GPT2_XL["n_layer"]):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (c,),
                p + "ln_1.bias": (c,),
                p + "attn.c_attn.weight": (c, 3 * c),
                p + "attn.c_attn.bias": (3 * c,),
                p + "attn.c_proj.weight": (c, c),
                p + "attn.c_proj.bias": (c,),
                p + "ln_2.weight": (c,),
                p + "ln_2.bias": (c,),
                p + "mlp.c_fc.weight": (c, 4 * c),
                p + "mlp.c_fc.bias": (4 * c,),
                p + "mlp.c_proj.weight": (4 * c, c),
                p + "mlp.c_proj.bias": (c,),
            }
        )
    shapes.update({"transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)})
    groups, current, size = [], [], 0
    for key, shape in shapes.items():
        nbytes = int(np.prod(shape)) * d.itemsize
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    groups.append(current)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for n, keys in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (0.02 * rng.standard_normal(shapes[k], dtype=np.float32)).astype(d) for k in keys}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "activation_function": "gelu_new", "tie_word_embeddings": True, **GPT2_XL})
    )
    return total


def measure(folder: Path, devices: int, fsdp: int, scan: bool) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder), str(fsdp), "1" if scan else "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, default=Path("/tmp/gpt2xl-random"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    args = parser.parse_args()

    gib = 2**30
    try:
        size = write_checkpoint(args.folder, args.dtype)
        print(f"checkpoint: {args.folder}, GPT-2XL shaped, {args.dtype}, tied lm_head, {size / gib:.2f} GiB of tensors")
        print(
            "| devices | mesh (data, fsdp) | scan_layers | baseline | peak | on devices | host overhead | "
            "overhead / checkpoint | load (s) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for devices, fsdp, scan in ((8, 8, False), (8, 8, True), (1, 0, False)):
            r = measure(args.folder, devices, fsdp, scan)
            overhead = r["peak"] - r["baseline"] - r["on_devices"]
            mesh = f"({devices // fsdp}, {fsdp})" if fsdp else "none"
            print(
                f"| {devices} | {mesh} | {scan} | {r['baseline'] / gib:.2f} GiB | {r['peak'] / gib:.2f} GiB | "
                f"{r['on_devices'] / gib:.2f} GiB | {overhead / gib:.2f} GiB | {overhead / size:.1%} | "
                f"{r['seconds']:.0f} |",
                flush=True,
            )
            print(
                f"  wte {r['wte_spec']}, one shard {r['wte_shard_shape']}, {r['n_params'] / 1e9:.3f}B parameters",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()

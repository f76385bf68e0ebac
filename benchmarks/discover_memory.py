"""Extra host memory of ``KeyMap.discover`` on GPT-2 124M, beside what one call of the loader costs by itself.

The torch side is torch_ref's GPT at GPT-2 124M's sizes with random weights and ``lm_head`` tied to
``wte`` (as GPT-2 ships it), so nothing is downloaded. The loader is written as a port author writes
one: ``safetensors.numpy.load_file`` on ``model.safetensors``, a regex table from torch keys to
flax_ln's GPT variables, transposes, a cast to the variable's dtype, the tie copied, the causal-mask
buffers skipped; the model is built abstract (``nnx.eval_shape``) and every parameter then set.

Each measurement runs in a fresh subprocess, after building the torch model (and, for the plain
load, writing its checkpoint):

- ``loader``: one plain call of the loader on the real checkpoint, the cost discovery cannot avoid;
- ``discover``: ``KeyMap.discover(loader, like, takes="folder")``.

With ``--takes state_dict`` the same loader takes the state dict instead (the plain call gets the
torch model's own tensors as NumPy views, discovery its probe state dicts).

Resident memory is sampled every ~20 ms by a background thread reading ``VmRSS`` from
``/proc/self/status``; the loader marks phases (which load is running, and the decoding between
loads), and at each mark the kernel's high-water mark ``VmHWM`` is read and reset (``clear_refs``),
so each phase's peak includes spikes shorter than the sampling interval, and the peak is printed
with the phase it fell in. ``ru_maxrss`` reads the same kernel counter as ``VmHWM``, so after those
resets it is the last phase's peak only; it is printed as that. Extra = peak during the call -
resident just before it.

    python benchmarks/discover_memory.py [--layers 12] [--width 768] [--takes folder|state_dict]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GIB = 2**30


def status(field: str = "VmRSS") -> int:
    """A memory line of ``/proc/self/status`` in bytes: ``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss() -> int:
    return status("VmRSS")


def reset_high_water_mark() -> None:
    """Set ``VmHWM`` back to the resident memory now (``clear_refs`` 5), so it holds the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Sampler:
    """A thread that records resident memory every ``interval`` seconds, with the phase named at that moment."""

    def __init__(self, interval: float = 0.02):
        import threading

        self.interval, self.phase = interval, "start"
        self.peak, self.peak_phase = 0, "start"
        self.peaks: dict[str, int] = {}  # phase -> its highest sample
        self.begins: dict[str, int] = {}  # phase -> resident memory when it began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        now, phase = rss(), self.phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), now)
        if now > self.peak:
            self.peak, self.peak_phase = now, phase

    def mark(self, phase: str) -> None:
        """End the current phase (its peak: the kernel's high-water mark since it began, which sees even a spike
        shorter than the sampling interval) and begin ``phase``."""
        self.sample()
        hwm = status("VmHWM")
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), hwm)
        if hwm > self.peak:
            self.peak, self.peak_phase = hwm, self.phase
        reset_high_water_mark()
        self.phase = phase
        self.begins.setdefault(phase, rss())

    def __enter__(self) -> Sampler:
        reset_high_water_mark()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.mark("done")


def torch_gpt2(layers: int, width: int):
    """torch_ref's GPT at GPT-2 124M's sizes (or ``layers``/``width``), random weights, ``lm_head`` tied to ``wte``."""
    import torch

    from torch_ref.gpt import GPT

    torch.manual_seed(0)
    config = dict(n_layer=layers, n_head=width // 64, n_embd=width, vocab_size=50257, block_size=1024)
    with torch.no_grad():
        model = GPT(config).eval()
    model.lm_head.weight = model.transformer.wte.weight  # one Parameter, as GPT-2 ties them
    return model, config


# torch key -> (flax path template, transposed): the port author's table.
TABLE = [
    (r"transformer\.wte\.weight", "transformer.wte.embedding", False),
    (r"transformer\.wpe\.weight", "transformer.wpe.embedding", False),
    (r"transformer\.h\.(\d+)\.ln_(1|2)\.weight", r"transformer.h.\1.ln_\2.scale", False),
    (r"transformer\.h\.(\d+)\.ln_(1|2)\.bias", r"transformer.h.\1.ln_\2.bias", False),
    (r"transformer\.h\.(\d+)\.(attn|mlp)\.(c_attn|c_proj|c_fc)\.weight", r"transformer.h.\1.\2.\3.kernel", True),
    (r"transformer\.h\.(\d+)\.(attn|mlp)\.(c_attn|c_proj|c_fc)\.bias", r"transformer.h.\1.\2.\3.bias", False),
    (r"transformer\.ln_f\.weight", "transformer.ln_f.scale", False),
    (r"transformer\.ln_f\.bias", "transformer.ln_f.bias", False),
]


def make_loader(config: dict, marks=None):
    """The port's loader over a folder; ``marks(phase)`` (optional) is told when each load starts and ends."""
    import re

    import jax.numpy as jnp
    import safetensors.numpy
    from flax import nnx

    from flax_ln import GPT

    calls = [0]

    def put(model, path: str, value) -> None:
        *head, last = path.split(".")
        node = model
        for step in head:
            node = node[int(step)] if step.isdigit() else getattr(node, step)
        var = getattr(node, last)
        var.set_value(jnp.asarray(value, var.get_value().dtype))

    def load(source):
        calls[0] += 1
        if marks:
            marks(f"load {calls[0]} (the loader)")
        # a folder (takes="folder") or the state dict itself (takes="state_dict"), whose entries are not the loader's
        tensors = (
            dict(source) if isinstance(source, dict) else safetensors.numpy.load_file(f"{source}/model.safetensors")
        )
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
        for key in list(tensors):
            w = tensors.pop(key)  # each tensor dropped once placed, as a careful port does
            if key == "transformer.wte.weight":
                put(model, "lm_head.kernel", w.T)  # the tie, copied
            for pattern, template, transposed in TABLE:
                if m := re.fullmatch(pattern, key):
                    put(model, m.expand(template), w.T if transposed else w)
                    break
            # anything else (lm_head.weight, the attn.bias mask buffers) is skipped
        if marks:
            marks(f"after load {calls[0]} (decoding)")
        return model

    return load, calls


def child(mode: str, layers: int, width: int, takes: str) -> dict:
    import resource
    import tempfile
    import time

    import safetensors.torch

    from flax_ln.convert import KeyMap
    from flax_ln.convert.assign import as_numpy

    like, config = torch_gpt2(layers, width)
    names = {id(p): p for p in like.parameters()}
    float32_bytes = 4 * sum(p.numel() for p in names.values())
    sampler = Sampler()
    loader, calls = make_loader(config, sampler.mark)
    with tempfile.TemporaryDirectory() as folder:
        if mode == "loader" and takes == "folder":
            # every key the probes hold, the tie too (its own copy: safetensors stores no shared tensors)
            state = {k: v.contiguous().clone() if k == "lm_head.weight" else v for k, v in like.state_dict().items()}
            safetensors.torch.save_file(state, f"{folder}/model.safetensors")
            del state
        baseline = rss()
        with sampler:
            t0 = time.perf_counter()
            if mode == "loader":
                result = loader(folder if takes == "folder" else {k: as_numpy(v) for k, v in like.state_dict().items()})
            else:
                result = KeyMap.discover(loader, like, takes=takes)
            seconds = time.perf_counter() - t0
    out = {
        "mode": mode,
        "float32_bytes": float32_bytes,
        "baseline": baseline,
        "peak": sampler.peak,
        "peak_phase": sampler.peak_phase,
        "phases": sampler.peaks,
        "begins": sampler.begins,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": seconds,
        "loads": calls[0],
    }
    if mode == "discover":
        out["rules"] = len(result.rules)
        out["dropped"] = sorted(result.discovery.dropped)
        out["ties"] = result.discovery.ties
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--takes", choices=("folder", "state_dict"), default="folder")
    parser.add_argument("--child", choices=("loader", "discover"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.takes)))
        return
    root = Path(__file__).resolve().parent.parent
    results = {}
    for mode in ("loader", "discover"):
        command = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--takes",
            args.takes,
        ]
        done = subprocess.run(command, capture_output=True, text=True, cwd=root)
        if done.returncode:
            sys.exit(f"{mode}: the subprocess failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    size = results["loader"]["float32_bytes"]
    print(
        f"model: {args.layers} layers, width {args.width}, {size / 4 / 1e6:.1f}M parameters, "
        f"float32 {size / GIB:.2f} GiB"
    )
    for mode, r in results.items():
        extra = r["peak"] - r["baseline"]
        print(
            f"{mode:9s} baseline {r['baseline'] / GIB:.2f} GiB, peak {r['peak'] / GIB:.2f} GiB "
            f"(in {r['peak_phase']!r}), extra {extra / GIB:.2f} GiB = {extra / size:.2f}x float32; "
            f"ru_maxrss (last phase) {r['ru_maxrss'] / GIB:.2f} GiB; {r['seconds']:.1f} s, {r['loads']} load(s)"
        )
    d = results["discover"]
    for phase, peak in d["phases"].items():
        begin = d["begins"].get(phase, d["baseline"])
        print(
            f"  discover phase {phase!r}: begins at {(begin - d['baseline']) / GIB:.2f} GiB, "
            f"peak {(peak - d['baseline']) / GIB:.2f} GiB above baseline"
        )
    extra = {m: r["peak"] - r["baseline"] for m, r in results.items()}
    beyond = extra["discover"] - extra["loader"]
    print(
        f"discover beyond one plain load: {beyond / GIB:.2f} GiB = {beyond / size:.2f}x the model's float32 size "
        f"({results['discover']['rules']} rules, ties {results['discover']['ties']})"
    )


if __name__ == "__main__":
    main()

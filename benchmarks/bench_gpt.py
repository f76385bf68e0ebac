"""GPT benchmarks: the training step against PyTorch, compile time, and rematerialisation memory.

Rows (float32, this CPU; ``--quick`` shrinks every model to a 64-wide toy):

* ``gpt-train-step``: one training step (forward, backward, clip to norm 1, Adam 1e-4) of
  the music-width GPT (n_embd 512, 8 heads, vocab 390), 2 layers, B=8, T=256, **dropout
  on (0.1 everywhere) in both frameworks**, as in real training. flax_ln is
  ``make_train_step(gpt_loss, gpt_adam())`` (jitted on the functional split, state
  donated); torch is ``torch_ref.GPT`` with ``torch.optim.Adam(lr=1e-4)`` and
  ``clip_grad_norm_(params, 1)``, eager and with ``torch.compile(model)`` (the
  optimizer step stays eager, as in the book's loop). Targets: <= 0.9x eager, <= 1.0x compile.
* ``gpt2-train-step``: the same step for GPT-2 124M at B=4/8 x T=128/1024
  (``FLAX_LN_GPT2_CASES`` picks a subset). Where a case runs is decided by the flax step's
  memory (:func:`placement`): in this process, interleaved with torch, when it fits twice
  over; each candidate alone in a fresh process, one after another, when it fits once
  (B=4, T=1024 on a 23 GiB machine); else it is skipped with a note (B=8, T=1024 needs
  19.9 GiB for the flax step alone). ``bench_gpt.py --gpt2-step CANDIDATE`` is that process.
* ``gpt-compile-time``: XLA compile time of a GPT-2XL forward+backward, 48 scanned
  layers vs 1 (``compile_time.run_case``, a fresh process each). Target: <= 3x.
* ``gpt-remat``: a GPT-2 124M training step (``GPTConfig.gpt2()``, B=4, T=1024, dropout
  on) with and without per-block rematerialisation (``GPT(remat=True)``), for both layer
  layouts: XLA's ``memory_analysis()`` temporary bytes of the compiled step and the peak
  RSS growth during a step (a fresh process per case; peak VmHWM minus the RSS with the
  parameters, the Adam state and the compiled step in memory), and the step-time ratio
  measured round-robin in one process. Target: activation memory (the XLA temporaries)
  cut >= 3x at <= 1.35x the step time.

Run one case of the memory row by hand with
``python benchmarks/bench_gpt.py --memory-case full unrolled [--batch 4 --seq-len 1024] [--tiny]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    Config,
    Table,
    Timing,
    add_torch_compile,
    interleaved,
    one_thread,
    plain_linear_products,
    ratio_row,
    register,
    timing_rows,
    torch_device,
)
from flax import nnx

import flax_ln
from flax_ln import GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REMAT = {"off": False, "full": True}


def tiny_config(n_layer: int = 2, block_size: int = 64, **overrides) -> GPTConfig:
    """The 64-wide toy every GPT row falls back to under ``--quick``."""
    return GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, vocab_size=256, block_size=block_size, **overrides)


def token_batch(config: GPTConfig, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, config.vocab_size, (batch, seq_len)), rng.integers(0, config.vocab_size, (batch, seq_len)))


class FlaxStep:
    """A flax_ln training step with its state threaded through donated calls: ``run()`` does one step."""

    def __init__(self, model: flax_ln.GPT, idx: np.ndarray, targets: np.ndarray, state=None):
        tx = flax_ln.gpt_adam()
        self.step = flax_ln.make_train_step(flax_ln.gpt_loss, tx)
        self.graphdef, state0 = flax_ln.init_train_state(model, tx)
        self.state = state0 if state is None else state
        self.batch = {"idx": jnp.asarray(idx, jnp.int32), "targets": jnp.asarray(targets, jnp.int32)}

    def run(self) -> float:
        self.state, loss = self.step(self.graphdef, self.state, self.batch)
        return float(loss)  # waits for the step

    def compile(self):
        """The compiled step for this state and batch; a later :meth:`run` reuses the compilation."""
        return self.step.lower(self.graphdef, self.state, self.batch).compile()


# ---- (a) training step vs PyTorch ---------------------------------------------------------------


@contextlib.contextmanager
def nnx_dropout_masks():
    """Build GPTs with plain ``nnx.Dropout`` instead of flax_ln's: a side-by-side before/after column.

    Same masks (``flax_ln.models.dropout`` is bit-identical), only JAX's own mask kernel.
    """
    import flax_ln.models.gpt as gpt_module

    fused = gpt_module.Dropout
    gpt_module.Dropout = nnx.Dropout
    try:
        yield
    finally:
        gpt_module.Dropout = fused


def torch_step(model, idx, targets):
    """The book's training step: Adam(1e-4) after clipping the gradient norm to 1."""
    import torch

    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    device = params[0].device
    idx_t, targets_t = torch.as_tensor(idx, device=device), torch.as_tensor(targets, device=device)

    def run(forward=model):
        opt.zero_grad(set_to_none=True)
        _, loss = forward(idx_t, targets_t)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    return run


@register("gpt-train-step")
def gpt_train_step(cfg: Config) -> list[Table]:
    import torch

    import torch_ref

    if cfg.quick:
        config, batch, seq_len = tiny_config(block_size=32), 2, 32
    else:
        config, batch, seq_len = GPTConfig.music(n_layer=2, block_size=256), 8, 256
    idx, targets = token_batch(config, batch, seq_len)
    torch.manual_seed(0)
    reference = torch_ref.GPT(config).train()

    def torch_twin():
        model = torch_ref.GPT(config).train()
        model.load_state_dict(reference.state_dict())
        return model

    def flax_twin(**kwargs):
        model = flax_ln.GPT(config, rngs=nnx.Rngs(0), **kwargs)
        flax_ln.load_torch_state_dict(model, reference.state_dict())
        return FlaxStep(model, idx, targets)

    ours, scanned = flax_twin(), flax_twin(scan_layers=True)
    with nnx_dropout_masks():
        before = flax_twin()
    t0 = time.perf_counter()
    ours.run()
    notes = [f"flax_ln first step (trace + XLA compile + run): {time.perf_counter() - t0:.1f} s"]
    scanned.run()
    before.run()
    eager = torch_step(torch_twin(), idx, targets)
    candidates = {
        "flax_ln (jit, unrolled layers)": ours.run,
        "flax_ln (jit, scan_layers)": scanned.run,
        "flax_ln with nnx.Dropout masks (before)": before.run,
        "torch_ref eager": eager,
        "torch_ref eager, 1 thread": one_thread(eager),
    }
    if cfg.torch_compile:
        compiled_model = torch_twin()
        compiled, forward = torch_step(compiled_model, idx, targets), torch.compile(compiled_model)
        add_torch_compile(candidates, notes, "torch.compile(model)", lambda: compiled(forward))
    else:
        notes.append("torch.compile skipped (--quick or --no-torch-compile)")
    t = interleaved(candidates, cfg.repeats, cfg.warmup)
    notes.insert(
        0,
        (
            f"{config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads, vocab {config.vocab_size}, "
            f"B={batch}, T={seq_len}, float32, dropout {config.attn_pdrop} on in both frameworks; median of "
            f"{cfg.repeats} interleaved steps after {cfg.warmup} warm-up; torch threads {torch.get_num_threads()}"
        ),
    )
    name = "flax_ln (jit, unrolled layers)"
    best_eager = min(("torch_ref eager", "torch_ref eager, 1 thread"), key=lambda k: t[k].median)
    notes.append("the eager target is taken against the faster of torch's default thread count and 1 thread")
    rows = [ratio_row("GPT train step", name, t[name], best_eager, t[best_eager], 0.9)]
    if "torch.compile(torch_ref)" in t:
        rows.append(
            ratio_row("GPT train step", name, t[name], "torch.compile(torch_ref)", t["torch.compile(torch_ref)"], 1.0)
        )
    rows.append(
        ratio_row(
            "GPT train step",
            "flax_ln (jit, scan_layers)",
            t["flax_ln (jit, scan_layers)"],
            best_eager,
            t[best_eager],
            None,
        )
    )
    before_name = "flax_ln with nnx.Dropout masks (before)"
    rows.append(ratio_row("GPT train step (before)", before_name, t[before_name], best_eager, t[best_eager], None))
    if "torch.compile(torch_ref)" in t:
        rows.append(
            ratio_row(
                "GPT train step (before)",
                before_name,
                t[before_name],
                "torch.compile(torch_ref)",
                t["torch.compile(torch_ref)"],
                None,
            )
        )
    rows.append(ratio_row("GPT train step", name, t[name], before_name, t[before_name], None))
    return [
        Table(
            "GPT training step (fwd+bwd+clip+Adam): ratios (lower is better)",
            ["workload", "comparison", "ratio", "target", "met"],
            rows,
            notes,
        ),
        Table(
            "GPT training step: raw timings",
            ["candidate", "median ms", "p25-p75 ms", "ratio to flax_ln"],
            timing_rows(t, name),
        ),
    ]


# ---- (a2) GPT-2 124M training step vs PyTorch ----------------------------------------------------

GPT2_CASES = [(4, 128), (8, 128), (4, 1024), (8, 1024)]  # (B, T)


def gpt2_cases() -> list[tuple[int, int]]:
    """``GPT2_CASES``, or the ``BxT`` list in ``FLAX_LN_GPT2_CASES`` (e.g. ``4x128,8x1024``) to run a subset."""
    spec = os.environ.get("FLAX_LN_GPT2_CASES")
    if not spec:
        return GPT2_CASES
    try:
        return [tuple(int(v) for v in case.split("x")) for case in spec.split(",")]
    except ValueError:
        raise SystemExit(f"FLAX_LN_GPT2_CASES: expected e.g. '4x128,8x1024', got {spec!r}") from None


def step_memory(step: FlaxStep) -> tuple[int, int] | None:
    """``(need, available)`` in bytes on the CPU, else None: the flax step's own need (XLA's memory
    analysis of the compiled step) and the memory this machine has available (``MemAvailable``)."""
    if jax.default_backend() != "cpu":
        return None  # device memory: left to the device
    analysis = step.compile().memory_analysis()
    if analysis is None:
        return None
    need = (
        analysis.temp_size_in_bytes
        + analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return need, available


# What a process running one candidate alone holds besides the flax step's own buffers: the
# Python, JAX and torch runtimes and torch_ref's reference model (0.5 GiB) that the weights
# come from, about 1.5 GiB measured as VmRSS before the first step; rounded up.
PROCESS_OVERHEAD = 2 * 2**30


def placement(memory: tuple[int, int] | None) -> tuple[str, str]:
    """Where a case runs: ``("together", "")`` in this process, interleaved with torch, when the
    flax step fits twice over (as much again for torch's model and activations); ``("alone",
    why)`` each candidate in a fresh process of its own, one after another, when it fits once;
    else ``("skip", why)``."""
    if memory is None:
        return "together", ""
    need, available = memory
    sizes = (
        f"the flax_ln step needs {need / 2**30:.1f} GiB (XLA memory analysis), {available / 2**30:.1f} GiB available"
    )
    if 2 * need <= available:
        return "together", ""
    if need + PROCESS_OVERHEAD <= available:
        return "alone", (
            f"{sizes}: not twice over, so each candidate ran alone in a fresh process, one after "
            "another (not interleaved)"
        )
    return "skip", f"not run: {sizes}, not enough for the step and a process around it"


GPT2_CANDIDATES = ("flax_ln", "torch_ref eager", "torch.compile(torch_ref)")


def gpt2_step_alone(candidate: str, batch: int, seq_len: int, repeats: int, tiny: bool = False) -> dict:
    """One candidate of a ``gpt2-train-step`` case alone in this (fresh) process: its first step,
    one warm-up step, then ``repeats`` timed steps, on the same weights and batch as the other
    candidates' processes (torch seed 0, :func:`token_batch`); with the process's peak RSS.
    ``tiny``: the 64-wide toy (smoke test)."""
    import torch

    import torch_ref

    config = tiny_config(block_size=64) if tiny else GPTConfig.gpt2()
    torch.manual_seed(0)
    reference = torch_ref.GPT(config).train()
    idx, targets = token_batch(config, batch, seq_len)
    if candidate == "flax_ln":
        model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
        flax_ln.load_torch_state_dict(model, reference.state_dict())
        del reference
        run = FlaxStep(model, idx, targets).run
        del model
    else:
        reference.to(torch_device())
        eager = torch_step(reference, idx, targets)
        if candidate == "torch_ref eager":
            run = eager
        else:
            compiled = torch.compile(reference)

            def run():
                return eager(compiled)

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    samples = interleaved({candidate: run}, repeats, 1, lead_in=0)[
        candidate
    ].samples  # alone: no other framework to wait out
    return dict(candidate=candidate, samples=samples, first_s=first, peak_rss_gib=_rss_gib("VmHWM"))


def run_alone(*args: str) -> dict:
    """``bench_gpt.py *args`` in a fresh Python process; its last stdout line, parsed as JSON.
    A process that fails (killed for memory, say) gives ``{"error": ...}`` instead."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "bench_gpt.py"), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        killed = " (killed: out of memory?)" if proc.returncode == -9 else ""
        return {"error": f"exit {proc.returncode}{killed}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gpt2_case_alone(
    batch: int, seq_len: int, repeats: int, torch_compile: bool, notes: list[str], tiny: bool = False
) -> dict[str, Timing]:
    """Each candidate of a case in a fresh process of its own (:func:`gpt2_step_alone`)."""
    timings = {}
    for candidate in GPT2_CANDIDATES if torch_compile else GPT2_CANDIDATES[:2]:
        result = run_alone(
            "--gpt2-step",
            candidate,
            "--batch",
            str(batch),
            "--seq-len",
            str(seq_len),
            "--repeats",
            str(repeats),
            *(["--tiny"] if tiny else []),
        )
        if "error" in result:
            notes.append(f"B={batch} T={seq_len}: {candidate} FAILED alone: {result['error']}")
            continue
        notes.append(
            f"B={batch} T={seq_len}: {candidate} alone: first step {result['first_s']:.0f} s, "
            f"peak RSS {result['peak_rss_gib']:.1f} GiB"
        )
        timings[candidate] = Timing(result["samples"])
    return timings


BEFORE = "flax_ln, plain lax.dot_general in nnx.Linear (before)"


@register("gpt2-train-step")
def gpt2_train_step(cfg: Config) -> list[Table]:
    """GPT-2 124M training steps (dropout on, clip + Adam 1e-4) against torch_ref eager and ``torch.compile``."""
    import torch

    import torch_ref

    config = tiny_config(block_size=64) if cfg.quick else GPTConfig.gpt2()
    cases = [(2, 32)] if cfg.quick else gpt2_cases()
    torch.manual_seed(0)
    reference = torch_ref.GPT(config).train()
    state_dict = reference.state_dict()  # copied into flax before the torch model moves to the device
    device = torch_device()
    rows, raw, notes = [], [], []
    for batch, seq_len in cases:
        # T=1024 steps take tens of seconds on 2 cores: fewer rounds there.
        repeats = cfg.repeats if cfg.quick else min(cfg.repeats, 5 if seq_len <= 128 else 2)
        idx, targets = token_batch(config, batch, seq_len)
        model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
        flax_ln.load_torch_state_dict(model, state_dict)
        ours = FlaxStep(model, idx, targets)
        del model
        t0 = time.perf_counter()
        where, why = placement(step_memory(ours))  # compiles the step; the first run reuses it
        if where != "together":
            del ours
            notes.append(f"B={batch} T={seq_len}: {why}")
            if where == "skip":
                continue
            t = gpt2_case_alone(batch, seq_len, repeats, cfg.torch_compile, notes, tiny=cfg.quick)
            if "flax_ln" not in t:
                continue
        else:
            reference.to(device)
            ours.run()
            first = time.perf_counter() - t0
            eager = torch_step(reference, idx, targets)
            candidates = {"flax_ln": ours.run, "torch_ref eager": eager}
            if seq_len <= 128:  # the before column; at T=1024 a second step does not fit beside the rest
                with plain_linear_products():
                    model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
                flax_ln.load_torch_state_dict(model, state_dict)
                before = FlaxStep(model, idx, targets)
                del model
                before.run()
                candidates[BEFORE] = before.run
            if cfg.torch_compile:
                forward = torch.compile(reference)
                add_torch_compile(
                    candidates,
                    notes,
                    f"B={batch} T={seq_len}: torch.compile(model)",
                    lambda eager=eager, forward=forward: eager(forward),
                )
            t = interleaved(candidates, repeats, 1)
            del ours, candidates
            notes.append(
                f"B={batch} T={seq_len}: flax_ln first step (trace + compile + run) {first:.0f} s; "
                f"median of {repeats} interleaved steps after 1 warm-up"
            )
        workload = f"B={batch}, T={seq_len}"
        if "torch_ref eager" in t:
            rows.append(ratio_row(workload, "flax_ln", t["flax_ln"], "torch_ref eager", t["torch_ref eager"], 1.0))
        if "torch.compile(torch_ref)" in t:
            rows.append(
                ratio_row(
                    workload, "flax_ln", t["flax_ln"], "torch.compile(torch_ref)", t["torch.compile(torch_ref)"], 1.1
                )
            )
        if BEFORE in t:
            rows.append(ratio_row(workload, "flax_ln", t["flax_ln"], BEFORE, t[BEFORE], None))
        raw += [[workload, *r] for r in timing_rows(t, "flax_ln")]
        del t
    model_name = "64-wide toy (--quick)" if cfg.quick else "GPT-2 124M"
    notes.insert(
        0,
        (
            f"{model_name}: {config.n_layer} layers, width {config.n_embd}, vocab {config.vocab_size}, "
            f"float32, dropout {config.attn_pdrop} on in both; flax_ln unrolled layers, jitted step with the "
            f"state donated; torch_ref ({device}) with torch.optim.Adam(1e-4) after clip_grad_norm_(1), "
            f"{torch.get_num_threads()} threads; torch.compile compiles the model, the optimizer stays eager"
        ),
    )
    return [
        Table(
            f"{model_name} training step (fwd+bwd+clip+Adam): ratios (lower is better)",
            ["workload", "comparison", "ratio", "target", "met"],
            rows,
            notes,
        ),
        Table(
            f"{model_name} training step: raw timings",
            ["case", "candidate", "median ms", "p25-p75 ms", "ratio to flax_ln"],
            raw,
        ),
    ]


# ---- (b) compile time ----------------------------------------------------------------------------


@register("gpt-compile-time")
def gpt_compile_time(cfg: Config) -> list[Table]:
    import compile_time

    deep = 4 if cfg.quick else 48
    kwargs = dict(batch=1, seq_len=32 if cfg.quick else 1024, tiny=cfg.quick)
    if cfg.quick:  # smoke test: in this process (fresh jit functions, so no cache hits), no subprocess start-up
        one, many = (compile_time.measure("scan", n, kwargs["batch"], kwargs["seq_len"], tiny=True) for n in (1, deep))
    else:
        one, many = compile_time.run_case("scan", 1, **kwargs), compile_time.run_case("scan", deep, **kwargs)
    total = {k: r["lower_s"] + r["compile_s"] for k, r in (("one", one), ("many", many))}
    ratio = total["many"] / total["one"]
    model = "64-wide toy (--quick)" if cfg.quick else "GPT-2XL"
    return [
        Table(
            f"{model} forward+backward compile time, scan_layers, {deep} layers vs 1",
            ["layers", "params", "lower s", "XLA compile s", "total s", "ratio to 1 layer", "target", "met"],
            [
                [1, one["params"], one["lower_s"], one["compile_s"], total["one"], 1.0, "", ""],
                [
                    deep,
                    many["params"],
                    many["lower_s"],
                    many["compile_s"],
                    total["many"],
                    ratio,
                    "<= 3x",
                    "yes" if ratio <= 3 else "no",
                ],
            ],
            [
                "batch 1, loss + gradients w.r.t. every parameter, dropout on, lowered from abstract inputs; "
                "a fresh Python process per row (benchmarks/compile_time.py)"
                if not cfg.quick
                else "--quick: both rows in this process"
            ],
        )
    ]


# ---- (c) rematerialisation: memory and time ------------------------------------------------------


def _rss_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    raise KeyError(field)


def remat_config(tiny: bool) -> GPTConfig:
    return tiny_config(block_size=128) if tiny else GPTConfig.gpt2()


def memory_case(remat: str, layout: str, batch: int, seq_len: int, tiny: bool) -> dict:
    """One GPT training step in this (fresh) process: XLA's temporary bytes and the peak RSS growth."""
    config = remat_config(tiny)
    model = flax_ln.GPT(config, scan_layers=layout == "scan", remat=REMAT[remat], rngs=nnx.Rngs(0))
    runner = FlaxStep(model, *token_batch(config, batch, seq_len))
    del model
    jax.block_until_ready(runner.state)
    rss_state = _rss_gib("VmRSS")
    compiled = runner.compile()
    memory = compiled.memory_analysis()
    rss_before = _rss_gib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS: the peak below is the step's own
        hwm_reset = True
    except OSError:
        hwm_reset = False
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2):
        t0 = time.perf_counter()
        runner.state, loss = compiled(runner.state, runner.batch)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 2
    rss_peak = _rss_gib("VmHWM")
    return dict(
        remat=remat,
        layout=layout,
        temp_gib=memory.temp_size_in_bytes / 2**30,
        args_gib=memory.argument_size_in_bytes / 2**30,
        rss_state_gib=rss_state,
        rss_before_gib=rss_before,
        rss_peak_gib=rss_peak,
        rss_growth_gib=rss_peak - rss_before if hwm_reset else float("nan"),
        step_s=min(times),
        minor_faults_per_step=faults,
        loss=loss,
    )


def run_memory_case(remat: str, layout: str, batch: int, seq_len: int, tiny: bool) -> dict:
    """:func:`memory_case` in a fresh Python process, so each peak RSS is its own."""
    result = run_alone(
        "--memory-case", remat, layout, "--batch", str(batch), "--seq-len", str(seq_len), *(["--tiny"] if tiny else [])
    )
    if "error" in result:
        raise RuntimeError(f"gpt-remat memory case {remat} {layout}: {result['error']}")
    return result


@register("gpt-remat")
def gpt_remat(cfg: Config) -> list[Table]:
    tiny = cfg.quick
    batch, seq_len = (2, 128) if tiny else (4, 1024)
    config = remat_config(tiny)
    layouts = ("unrolled",) if tiny else ("unrolled", "scan")  # --quick: one layout keeps the smoke test short
    mem = {(r, lay): run_memory_case(r, lay, batch, seq_len, tiny) for lay in layouts for r in REMAT}

    repeats = cfg.repeats if cfg.quick else max(3, min(cfg.repeats, 5))
    timings = {}
    for layout in layouts:
        # One parameter/Adam state, stepped alternately by both variants (remat does not change
        # the state's structure), so both run on the same numbers and memory holds one state.
        idx, targets = token_batch(config, batch, seq_len)
        off = FlaxStep(flax_ln.GPT(config, scan_layers=layout == "scan", rngs=nnx.Rngs(0)), idx, targets)
        on = FlaxStep(
            flax_ln.GPT(config, scan_layers=layout == "scan", remat=True, rngs=nnx.Rngs(0)),
            idx,
            targets,
            state=off.state,
        )

        def step_off(off=off, on=on):
            off.state = on.state
            off.run()
            on.state = off.state

        def step_on(off=off, on=on):
            on.state = off.state
            on.run()
            off.state = on.state

        timings[layout] = interleaved({"off": step_off, "remat": step_on}, repeats, 1, lead_in=0)  # both JAX
        del off, on

    model = "64-wide toy (--quick)" if tiny else "GPT-2 124M"
    rows, raw = [], []
    for layout in layouts:
        m_off, m_on = mem[("off", layout)], mem[("full", layout)]
        t = timings[layout]
        mem_ratio = m_off["temp_gib"] / m_on["temp_gib"]
        rss_ratio = m_off["rss_growth_gib"] / m_on["rss_growth_gib"]
        time_ratio = t["remat"].median / t["off"].median
        met = "yes" if mem_ratio >= 3 and time_ratio <= 1.35 else "no"
        rows.append([f"{model} train step, {layout}", mem_ratio, rss_ratio, time_ratio, ">= 3x, <= 1.35x", met])
        for r, m in (("off", m_off), ("remat=True", m_on)):
            key = "off" if r == "off" else "remat"
            raw.append(
                [
                    layout,
                    r,
                    m["temp_gib"],
                    m["rss_growth_gib"],
                    m["rss_state_gib"],
                    m["rss_peak_gib"],
                    m["minor_faults_per_step"],
                    t[key].median,
                    f"{t[key].spread[0]:.3g}-{t[key].spread[1]:.3g}",
                ]
            )
    notes = [
        (
            f"{model}, B={batch}, T={seq_len}, float32, dropout 0.1 on, clip + Adam; remat=True wraps each block in "
            "jax.checkpoint(policy=nothing_saveable) (flax_ln.models.remat.remat_in_backward when unrolled)"
        ),
        (
            "memory ratios are 'off / remat': XLA temp = compiled.memory_analysis().temp_size_in_bytes (the target's "
            "measure: every buffer of the step besides its donated parameters/optimizer state, batch and outputs); "
            "RSS growth = peak VmHWM during two steps minus VmRSS before them, with state and executable resident, "
            "one fresh process per case"
        ),
        f"time ratio: median of {repeats} interleaved steps per variant in one process, 1 warm-up each",
    ]
    return [
        Table(
            f"{model} training step: per-block rematerialisation",
            ["workload", "XLA temp off/remat", "RSS growth off/remat", "step time remat/off", "target", "met"],
            rows,
            notes,
        ),
        Table(
            f"{model} rematerialisation: raw numbers",
            [
                "layout",
                "remat",
                "XLA temp GiB",
                "RSS growth GiB",
                "RSS with state GiB",
                "peak RSS GiB",
                "minor page faults per step",
                "step s (median)",
                "p25-p75 s",
            ],
            raw,
        ),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="one case of the gpt-remat memory row, or one candidate of a gpt2-train-step case, as JSON"
    )
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument(
        "--memory-case",
        nargs=2,
        metavar=("REMAT", "LAYOUT"),
        help=f"remat in {sorted(REMAT)}, layout in ['scan', 'unrolled']",
    )
    job.add_argument(
        "--gpt2-step",
        choices=GPT2_CANDIDATES,
        metavar="CANDIDATE",
        help=f"time one GPT-2 124M training step candidate alone, one of {list(GPT2_CANDIDATES)}",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed steps after the first and a warm-up (--gpt2-step)"
    )
    parser.add_argument("--tiny", action="store_true", help="the 64-wide toy model (smoke test)")
    args = parser.parse_args(argv)
    if args.gpt2_step:
        print(json.dumps(gpt2_step_alone(args.gpt2_step, args.batch, args.seq_len, args.repeats, args.tiny)))
        return 0
    remat, layout = args.memory_case
    if remat not in REMAT or layout not in ("scan", "unrolled"):
        parser.error(
            f"--memory-case: expected REMAT in {sorted(REMAT)} and LAYOUT in scan/unrolled, got {remat} {layout}"
        )
    print(json.dumps(memory_case(remat, layout, args.batch, args.seq_len, args.tiny)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

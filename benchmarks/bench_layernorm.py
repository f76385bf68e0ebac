"""LayerNorm forward and forward+backward, flax_ln under jit against PyTorch, flax and a copy.

Rows (float32, 8192x1024 by default):

* forward: flax_ln.LayerNorm under ``jax.jit`` vs the best of ``F.layer_norm``,
  ``torch_ref.LayerNorm`` eager and ``torch.compile(torch_ref.LayerNorm)``;
* forward vs the copy floor, a NumPy copy of the same bytes;
* forward+backward (output and the gradients of input, scale and bias) vs torch's best.

``nnx.LayerNorm`` and the naive formula under autodiff are extra reference columns.
The book's norm (unbiased variance) and ``F.layer_norm`` (biased) differ by one
divisor, which costs nothing; both are timed as "a LayerNorm of this shape".
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from common import Config, Table, interleaved, ratio_row, register, timing_rows
from flax import nnx
from naive import naive_normalize

import flax_ln
import torch_ref

EPS = 1e-6


def jax_module_fns(module):
    """(forward, forward+backward) jitted on the functional split of an NNX norm module."""
    graphdef, state = nnx.split(module)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    def forward_backward(state, x, g):
        y, vjp = jax.vjp(forward, state, x)
        return y, vjp(g)

    return state, jax.jit(forward), jax.jit(forward_backward)


def torch_compiled(module, x, grad: bool):
    """``torch.compile(module)`` warmed up once, its compile time, or the reason it failed."""
    try:
        compiled = torch.compile(module)
        t0 = time.perf_counter()
        if grad:
            compiled(x).backward(torch.ones_like(x))
        else:
            with torch.no_grad():
                compiled(x)
        return compiled, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 - any failure is reported, not raised
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@register("layernorm")
def layernorm(cfg: Config) -> list[Table]:
    n, d = (256, 128) if cfg.quick else (8192, 1024)
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(n, d)).astype(np.float32) * 2 + 1
    g_np = rng.normal(size=(n, d)).astype(np.float32)
    scale_np = rng.normal(size=d).astype(np.float32)
    offset_np = rng.normal(size=d).astype(np.float32)
    x, g, scale, offset = map(jnp.asarray, (x_np, g_np, scale_np, offset_np))

    ours = flax_ln.LayerNorm(d, EPS)
    ours.a_2[...] = scale
    ours.b_2[...] = offset
    ours_state, ours_fwd, ours_fb = jax_module_fns(ours)
    flax_state, flax_fwd, flax_fb = jax_module_fns(nnx.LayerNorm(d, epsilon=EPS, rngs=nnx.Rngs(0)))
    naive_fwd = jax.jit(naive_normalize)

    def naive_forward_backward(x, s, o, g):
        y, vjp = jax.vjp(naive_normalize, x, s, o)
        return y, vjp(g)

    naive_fb = jax.jit(naive_forward_backward)
    ours_graphdef = nnx.graphdef(ours)
    ours_inplace = jax.jit(lambda state, x: nnx.merge(ours_graphdef, state)(x), donate_argnums=1)
    negate = jax.jit(jnp.negative)
    negate_inplace = jax.jit(jnp.negative, donate_argnums=0)

    x_t = torch.from_numpy(x_np.copy())
    g_t = torch.from_numpy(g_np.copy())
    weight_t = torch.from_numpy(scale_np.copy()).requires_grad_()
    bias_t = torch.from_numpy(offset_np.copy()).requires_grad_()
    ref = torch_ref.LayerNorm(d, EPS)
    with torch.no_grad():
        ref.a_2.copy_(weight_t)
        ref.b_2.copy_(bias_t)
    x_grad_t = x_t.clone().requires_grad_()
    torch_params = [weight_t, bias_t, *ref.parameters(), x_grad_t]

    def torch_fb(fn):
        def run():
            for p in torch_params:
                p.grad = None
            y = fn(x_grad_t)
            y.backward(g_t)
            return y

        return run

    def torch_fwd(fn):
        def run():
            with torch.no_grad():
                return fn(x_t)

        return run

    def f_layer_norm(v):
        return torch.nn.functional.layer_norm(v, (d,), weight_t, bias_t, EPS)

    notes = [
        f"shape {n}x{d} float32; median of {cfg.repeats} interleaved rounds after {cfg.warmup} warm-up calls; "
        f"torch threads {torch.get_num_threads()}, JAX devices {jax.devices()}",
    ]
    compiled_fwd = compiled_fb = None
    if cfg.torch_compile:
        compiled_fwd, secs, err = torch_compiled(ref, x_t, grad=False)
        notes.append(f"torch.compile forward: {'compiled in %.1f s' % secs if err is None else 'FAILED, ' + err}")
        ref_fb = torch_ref.LayerNorm(d, EPS)
        ref_fb.load_state_dict(ref.state_dict())
        torch_params.extend(ref_fb.parameters())
        compiled_fb, secs, err = torch_compiled(ref_fb, x_grad_t, grad=True)
        notes.append(f"torch.compile fwd+bwd: {'compiled in %.1f s' % secs if err is None else 'FAILED, ' + err}")
    else:
        notes.append("torch.compile skipped (--quick or --no-torch-compile)")

    # ---- forward ------------------------------------------------------------------
    copy_dst = np.empty_like(x_np)
    chain = {"ours": x + 0, "negate": x + 0}  # fresh buffers, consumed by the donated calls

    def step(key, fn, *args):
        def run():
            chain[key] = fn(*args, chain[key])
            chain[key].block_until_ready()

        return run

    fwd = {
        "flax_ln.LayerNorm (jit)": lambda: ours_fwd(ours_state, x).block_until_ready(),
        "naive formula (jit)": lambda: naive_fwd(x, scale, offset).block_until_ready(),
        "nnx.LayerNorm (jit)": lambda: flax_fwd(flax_state, x).block_until_ready(),
        "torch F.layer_norm": torch_fwd(f_layer_norm),
        "torch_ref.LayerNorm eager": torch_fwd(ref),
    }
    if compiled_fwd is not None:
        fwd["torch.compile(torch_ref)"] = torch_fwd(compiled_fwd)
    fwd |= {
        "numpy copy (np.copy)": lambda: np.copy(x_np),
        "numpy copy into a preallocated array": lambda: np.copyto(copy_dst, x_np),
        "XLA copy (jit negate)": lambda: negate(x).block_until_ready(),
        "flax_ln.LayerNorm in place (donated input)": step("ours", ours_inplace, ours_state),
        "XLA copy in place (donated negate)": step("negate", negate_inplace),
    }
    t_fwd = interleaved(fwd, cfg.repeats, cfg.warmup)

    # ---- forward + backward -------------------------------------------------------------
    fb = {
        "flax_ln.LayerNorm (jit)": lambda: jax.block_until_ready(ours_fb(ours_state, x, g)),
        "naive formula (jit, autodiff)": lambda: jax.block_until_ready(naive_fb(x, scale, offset, g)),
        "nnx.LayerNorm (jit)": lambda: jax.block_until_ready(flax_fb(flax_state, x, g)),
        "torch F.layer_norm": torch_fb(f_layer_norm),
        "torch_ref.LayerNorm eager": torch_fb(ref),
    }
    if compiled_fb is not None:
        fb["torch.compile(torch_ref)"] = torch_fb(compiled_fb)
    t_fb = interleaved(fb, cfg.repeats, cfg.warmup)

    torch_names = [k for k in fwd if k.startswith("torch")]
    best_fwd = min(torch_names, key=lambda k: t_fwd[k].median)
    best_fb = min(torch_names, key=lambda k: t_fb[k].median)
    ours_name = "flax_ln.LayerNorm (jit)"
    summary = Table(
        f"LayerNorm {n}x{d} float32: ratios (lower is better)",
        ["workload", "comparison", "ratio", "target", "met"],
        [
            ratio_row("LN forward", ours_name, t_fwd[ours_name], best_fwd, t_fwd[best_fwd], 1.0),
            ratio_row(
                "LN forward", ours_name, t_fwd[ours_name], "numpy copy (np.copy)", t_fwd["numpy copy (np.copy)"], 3.0
            ),
            ratio_row("LN forward+backward", ours_name, t_fb[ours_name], best_fb, t_fb[best_fb], 1.0),
            ratio_row(
                "LN forward", ours_name, t_fwd[ours_name], "nnx.LayerNorm (jit)", t_fwd["nnx.LayerNorm (jit)"], None
            ),
            ratio_row(
                "LN forward+backward",
                ours_name,
                t_fb[ours_name],
                "nnx.LayerNorm (jit)",
                t_fb["nnx.LayerNorm (jit)"],
                None,
            ),
            ratio_row(
                "LN forward+backward",
                ours_name,
                t_fb[ours_name],
                "naive formula (jit, autodiff)",
                t_fb["naive formula (jit, autodiff)"],
                None,
            ),
            ratio_row(
                "LN forward, in place",
                "flax_ln (donated)",
                t_fwd["flax_ln.LayerNorm in place (donated input)"],
                "numpy copy into a preallocated array",
                t_fwd["numpy copy into a preallocated array"],
                None,
            ),
        ],
        notes,
    )
    columns = ["candidate", "median ms", "p25-p75 ms", "ratio to flax_ln"]
    return [
        summary,
        Table(f"LayerNorm forward {n}x{d}: raw timings", columns, timing_rows(t_fwd, ours_name)),
        Table(f"LayerNorm forward+backward {n}x{d}: raw timings", columns, timing_rows(t_fb, ours_name)),
    ]


@register("layernorm-shapes")
def layernorm_shapes(cfg: Config) -> list[Table]:
    """Forward+backward at the widths this project's models use, where the arrays fit in cache."""
    shapes = [(64, 32), (256, 128)] if cfg.quick else [(256, 128), (1024, 256), (2048, 512), (4096, 1600)]
    rows = []
    for n, d in shapes:
        rng = np.random.default_rng(1)
        x_np, g_np = (rng.normal(size=(n, d)).astype(np.float32) for _ in range(2))
        x, g = jnp.asarray(x_np), jnp.asarray(g_np)
        module = flax_ln.LayerNorm(d, EPS)
        state, _, ours_fb = jax_module_fns(module)
        scale, offset = module.a_2[...], module.b_2[...]

        def naive_forward_backward(x, s, o, g):
            y, vjp = jax.vjp(naive_normalize, x, s, o)
            return y, vjp(g)

        naive_fb = jax.jit(naive_forward_backward)
        x_t = torch.from_numpy(x_np).requires_grad_()
        g_t = torch.from_numpy(g_np)
        w_t, b_t = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)

        def torch_fb():
            x_t.grad = w_t.grad = b_t.grad = None
            torch.nn.functional.layer_norm(x_t, (d,), w_t, b_t, EPS).backward(g_t)

        t = interleaved(
            {
                "flax_ln": lambda: jax.block_until_ready(ours_fb(state, x, g)),
                "naive": lambda: jax.block_until_ready(naive_fb(x, scale, offset, g)),
                "torch": torch_fb,
            },
            cfg.repeats * (1 if cfg.quick else 3),
            cfg.warmup,
        )
        ours, naive, torch_ms = (t[k].median * 1e3 for k in ("flax_ln", "naive", "torch"))
        rows.append([f"{n}x{d}", ours, naive, torch_ms, ours / naive, ours / torch_ms])
    return [
        Table(
            "LayerNorm forward+backward at other shapes (float32)",
            ["shape", "flax_ln ms", "naive autodiff ms", "torch F.layer_norm ms", "flax_ln / naive", "flax_ln / torch"],
            rows,
            [f"median of {cfg.repeats * (1 if cfg.quick else 3)} interleaved rounds per shape"],
        )
    ]

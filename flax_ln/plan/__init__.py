"""Plan a TPU run on a machine without a TPU: compile the real step for a TPU topology and read its memory.

``jax.experimental.topologies`` with libtpu installed (``pip install "jax[tpu]"``) gives
abstract devices of any TPU topology (``v5e:2x4``, ``v4:2x2x1``, ...). The planner builds
the examples' own training step (:mod:`flax_ln.recipes`: the same model, optimizer, loss
and shardings that ``examples/train_music.py`` and ``examples/train_translation.py`` train
with) on a mesh of those devices, with an abstract state (``jax.eval_shape``: no weight is
allocated), compiles it with the TPU compiler and reads the bytes per chip from
``memory_analysis()``. Nothing runs on a TPU; the numbers are compiled-for-TPU figures.

The compile runs in a child process (``python -m flax_ln.plan``) whose stack limit is
raised: libtpu's compiler threads take their stack size from the process's limit and
overflow the usual 8 MiB on real models (a SIGSEGV). The child runs JAX with
``JAX_PLATFORMS=cpu`` and ``TPU_SKIP_MDS_QUERY=1``: it never opens a real TPU and never
waits on the TPU metadata server.

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

import dataclasses
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

INSTALL = 'pip install "jax[tpu]==JAX_VERSION"'  # JAX_VERSION: the installed jax's version (filled in at use)
MODELS = ("gpt2", "gpt2-xl", "chapter12", "music", "encoder-decoder")
GPT_MODELS = ("gpt2", "gpt2-xl", "chapter12", "music")
DEFAULT_VOCAB = 10000  # chapter12 and the encoder-decoder: the vocabulary is the user's data's; a round default
DEFAULT_ENC_DEC_LEN = 64  # the encoder-decoder's source and target length (train_translation.py's --max-len)
BATCH_PER_CHIP = 2  # default --batch: 2 sequences per chip
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2
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
CHIPS = {
    "v4": Chip("TPU v4", 275e12, 32 * GIB, 1200e9),
    "v5e": Chip("TPU v5 lite", 197e12, 16 * GIB, 819e9),
    "v5p": Chip("TPU v5", 459e12, 95 * GIB, 2765e9),
    "v6e": Chip("TPU v6 lite", 918e12, 32 * GIB, 1640e9),
}


MEGACORE = ("v4", "v5p")


class PlanError(Exception):
    """A plan that cannot be made; ``exit_code`` is 2 (usage, libtpu missing, not lowerable for TPU)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------- requests (plain data)


def _gpt_config(model: str, vocab_size: int | None) -> dict:
    """The preset's :class:`~flax_ln.GPTConfig` fields as a dict (imports only the torch-free config)."""
    from flax_ln.models.gpt import GPTConfig

    presets = {
        "gpt2": GPTConfig.gpt2,
        "gpt2-xl": GPTConfig.gpt2_xl,
        "music": GPTConfig.music,
    }
    if model == "chapter12":
        config = GPTConfig.chapter12(vocab_size or DEFAULT_VOCAB)
    else:
        config = presets[model](**({} if vocab_size is None else {"vocab_size": vocab_size}))
    return dataclasses.asdict(config)


def make_request(
    model: str,
    topology: str,
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    dtype: str = "bfloat16",
    fsdp: int | None = None,
    remat: bool = False,
    vocab_size: int | None = None,
    generate: bool = False,
    search: str | None = None,
    config: dict | None = None,
    encoder_decoder: dict | None = None,
) -> dict:
    """A validated plan request (plain JSON data), as ``flax-ln plan``'s arguments describe it.

    ``config`` replaces a GPT preset's fields (any :class:`~flax_ln.GPTConfig` as a dict);
    ``encoder_decoder`` gives :func:`flax_ln.recipes.encoder_decoder_setup`'s keyword
    arguments (default chapter 10's sizes). ``--batch`` defaults to 2 per chip once the
    chip count is known (in the child). Raises :class:`PlanError` on a usage error.
    """
    if model not in MODELS:
        raise PlanError(f"--model: expected one of {', '.join(MODELS)}, got {model!r}")
    chip, _, shape = topology.partition(":")
    if chip not in CHIPS or not re.fullmatch(r"\d+(x\d+)*", shape):
        raise PlanError(
            f"--topology: expected CHIP:SHAPE with CHIP one of {', '.join(CHIPS)} (the chips whose figures the "
            f"planner has) and SHAPE like 2x4 or 2x2x1, got {topology!r}"
        )
    if dtype not in ("bfloat16", "float32"):
        raise PlanError(f"--dtype: expected bfloat16 or float32, got {dtype!r}")
    for name, value in (("--batch", batch), ("--seq-len", seq_len), ("--fsdp", fsdp), ("--vocab-size", vocab_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise PlanError(f"{name}: expected a positive integer, got {value!r}")
    if search not in (None, "batch", "fsdp"):
        raise PlanError(f"--search: expected batch or fsdp, got {search!r}")
    if model == "encoder-decoder":
        if generate:
            raise PlanError("--generate: only the GPT models (gpt2, gpt2-xl, chapter12, music) have a KV-cache decoder")
        if remat:
            raise PlanError("--remat: the encoder-decoder has no remat option; drop --remat")
        kwargs = {"layers": 6, "d_model": 256, "d_ff": 1024, "heads": 8, **(encoder_decoder or {})}
        vocab = vocab_size or DEFAULT_VOCAB
        kwargs.setdefault("src_vocab", vocab)
        kwargs.setdefault("tgt_vocab", vocab)
        seq_len = seq_len or DEFAULT_ENC_DEC_LEN
        spec: dict[str, Any] = {"kind": "encoder-decoder", "setup": kwargs}
    else:
        fields = {**_gpt_config(model, vocab_size), **(config or {})}
        block = fields["block_size"]
        seq_len = seq_len or block
        if seq_len > block:
            raise PlanError(f"--seq-len: at most the model's block size {block} for --model {model}, got {seq_len}")
        spec = {"kind": "decode" if generate else "gpt", "config": fields, "scan_layers": True}
    return {
        **spec,
        "model": model,
        "topology": topology,
        "batch": batch,
        "seq_len": seq_len,
        "dtype": dtype,
        "fsdp": fsdp,
        "remat": bool(remat),
        "search": search,
    }


def libtpu_missing() -> str | None:
    """``None`` when libtpu is installed, else the message saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return None
    try:
        from importlib.metadata import version

        jax_version = version("jax")
    except Exception:  # noqa: BLE001 - jax's metadata missing: still say what to install
        jax_version = "<your jax version>"
    return (
        "libtpu is not installed: it compiles for TPU topologies on any machine. Install it at your jax's version: "
        + INSTALL.replace("JAX_VERSION", jax_version)
    )


# ----------------------------------------------------------------------------- the parent: run the child


def _raised_stack() -> None:
    """``preexec_fn`` of the child: the stack limit raised as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))


def child_env() -> dict:
    """The child's environment: JAX on the CPU only (no real TPU opened), no TPU metadata lookup."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def run(request: dict, *, timeout: float | None = None) -> dict:
    """Make the plan of ``request`` (from :func:`make_request`) in a child process; returns the result dict.

    The result has the pinned JSON keys of ``flax-ln plan``, and ``"exit_code"`` and
    ``"error"`` (``None`` when the plan was made; a message otherwise).
    """
    return run_many([request], timeout=timeout)[0]


def run_many(requests: list[dict], *, timeout: float | None = None) -> list[dict]:
    """:func:`run` for several requests in one child process (JAX and libtpu start once); results in order."""
    missing = libtpu_missing()
    if missing:
        return [failed(request, missing, EXIT_USAGE) for request in requests]
    with tempfile.TemporaryDirectory(prefix="flax-ln-plan-") as tmp:
        request_file, result_file = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(request_file, "w") as f:
            json.dump(requests, f)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "flax_ln.plan", request_file, result_file],
                env=child_env(),
                preexec_fn=_raised_stack,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return [failed(r, f"the TPU compile took longer than {timeout} s", EXIT_USAGE) for r in requests]
        if proc.returncode == 0 and os.path.exists(result_file):
            with open(result_file) as f:
                return json.load(f)
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    if proc.returncode < 0:
        why = f"the TPU compiler process was killed by signal {-proc.returncode}"
    else:
        why = f"the TPU compiler process failed (exit status {proc.returncode})"
    return [failed(r, f"{why}; its last messages:\n{tail}", EXIT_USAGE) for r in requests]


def failed(request: dict, message: str, exit_code: int, **known) -> dict:
    """The pinned JSON of a plan that was not made (``fits`` false, numbers null) with the error message."""
    chip = CHIPS.get(str(request.get("topology", "")).partition(":")[0])
    result: dict[str, Any] = {
        "fits": False,
        "topology": request.get("topology"),
        "chips": None,
        "device_kind": chip.device_kind if chip else None,
        "model": request.get("model"),
        "batch": request.get("batch"),
        "seq_len": request.get("seq_len"),
        "dtype": request.get("dtype"),
        "fsdp": request.get("fsdp"),
        "remat": request.get("remat"),
        "per_chip": {
            "argument_bytes": None,
            "output_bytes": None,
            "temp_bytes": None,
            "alias_bytes": None,
            "total_bytes": None,
            "capacity_bytes": chip.hbm_bytes if chip else None,
        },
        "flops_per_step": None,
        "compile_seconds": None,
        "roofline": None,
    }
    result.update(known)
    return {**result, "exit_code": exit_code, "error": message}


# ----------------------------------------------------------------------------- the child: compile


class Compiled(NamedTuple):
    """One compile's figures."""

    memory: dict
    seconds: float
    oom: bool


def _find_not_lowerable(jaxpr) -> str | None:
    """The first op of ``jaxpr`` (and its sub-jaxprs) that a TPU cannot run as asked: float64 values or a host
    callback; ``None`` if there is none. The message names the op and the code that created it."""
    callbacks = {"pure_callback", "io_callback", "debug_callback", "callback"}

    def where(eqn) -> str:
        frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or []
        library = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/contextlib.py", "/functools.py")
        frame = next((fr for fr in frames if not any(part in fr.file_name for part in library)), None)
        stack = str(getattr(eqn.source_info, "name_stack", "") or "")
        at = f"{frame.file_name}:{frame.line_num} ({frame.function_name})" if frame else "an unknown place"
        return at + (f", inside {stack}" if stack else "")

    def walk(jx) -> str | None:
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name in callbacks:
                return (
                    f"a host callback ({name}) at {where(eqn)}: the compiled TPU step cannot call back into "
                    "Python on the host; remove it (jax.debug.print/callback) from the step"
                )
            for var in eqn.outvars:
                dtype = getattr(getattr(var, "aval", None), "dtype", None)
                if dtype is not None and str(dtype) in ("float64", "complex128"):
                    return (
                        f"{name} produces {dtype} at {where(eqn)}: TPUs have no float64 arithmetic; "
                        "run with jax_enable_x64 off or cast to float32"
                    )
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        found = walk(inner)
                        if found:
                            return found
        return None

    return walk(getattr(jaxpr, "jaxpr", jaxpr))


_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory|exceeds? .*memory|Exceeded hbm capacity")
_USED = re.compile(r"Used ([0-9.]+)([KMGT]?)i?B? of ([0-9.]+)([KMGT]?)i?B? hbm")


def _compiler_bytes(message: str) -> int | None:
    """The compiler's own figure for the memory it needed, from its out-of-memory message (``Used 20.1G of ...``)."""
    found = _USED.search(message)
    if not found:
        return None
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return int(float(found.group(1)) * scale[found.group(2)])


def compile_traced(traced) -> Compiled:
    """Lower and compile a ``jax.jit(...).trace(...)`` for its TPU devices; the memory per chip, or the compiler's
    out-of-memory figure. Raises :class:`PlanError` for what cannot lower for TPU."""
    bad = _find_not_lowerable(traced.jaxpr)
    if bad:
        raise PlanError(f"cannot compile for TPU: {bad}")
    start = time.perf_counter()
    try:
        compiled = traced.lower().compile()
    except Exception as e:  # noqa: BLE001 - XLA raises its runtime error type; it is classified by its message
        message = str(e)
        if _OOM.search(message):
            total = _compiler_bytes(message)
            return Compiled(
                {"total_bytes": total, "compiler_message": message[:2000]}, time.perf_counter() - start, True
            )
        custom = re.search(r"[Cc]ustom (?:emitter|call target|call) (?:for )?['\"]?([\w.:-]+)", message)
        if custom or "NotImplemented" in type(e).__name__ or "translation rule" in message:
            what = f"the custom call {custom.group(1)!r} has no TPU implementation" if custom else message[:800]
            location = re.search(r"Suspected Python Code Location:\s*\n\s*(\S.*)", message)
            raise PlanError(
                f"cannot compile for TPU: {what}" + (f" (at {location.group(1).strip()})" if location else "")
            ) from None
        raise PlanError(f"the TPU compiler refused the step: {type(e).__name__}: {message[:2000]}") from None
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }
    memory["total_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"] - memory["alias_bytes"]
    )
    return Compiled(memory, seconds, False)


def topology_devices(topology: str):
    """The abstract devices of a libtpu topology (``v5e:2x4``); :class:`PlanError` naming it when libtpu refuses."""
    from jax.experimental import topologies

    try:
        # v4 and v5p chips have two TensorCores that JAX drives as one device ("megacore"), as on a TPU VM
        options = {"chip_config_name": "megacore"} if topology.partition(":")[0] in MEGACORE else {}
        return topologies.get_topology_desc(topology_name=topology, platform="tpu", **options).devices
    except Exception as e:  # noqa: BLE001 - libtpu reports an unknown topology with a runtime error
        raise PlanError(
            f"--topology {topology!r}: libtpu does not know this topology ({str(e).splitlines()[0][:300]}); "
            "give CHIP:SHAPE as Cloud TPU names it, e.g. v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4"
        ) from None


def _param_counts(params) -> dict:
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


def _plan_once(request: dict, devices, batch: int, fsdp: int) -> dict:
    """Compile ``request`` at one (batch, fsdp) on ``devices``; the pinned result dict (with ``exit_code``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flax_ln import recipes
    from flax_ln.models.gpt import GPTConfig
    from flax_ln.models.sampling import decode_step
    from flax_ln.sharding import DATA, FSDP, make_mesh, replicated, state_shardings

    chips = len(devices)
    chip = CHIPS[request["topology"].partition(":")[0]]
    seq_len = request["seq_len"]
    base = {**request, "batch": batch, "fsdp": fsdp}
    known = {"chips": chips, "device_kind": devices[0].device_kind, "batch": batch, "fsdp": fsdp}
    if chips % fsdp:
        raise PlanError(f"--fsdp: expected a divisor of the chip count {chips} of {request['topology']}, got {fsdp}")
    mesh = make_mesh(fsdp, devices=devices)
    kind = request["kind"]
    itemsize = 2 if request["dtype"] == "bfloat16" else 4
    extra: dict[str, Any] = {}
    if kind == "decode":
        config = GPTConfig(**request["config"])
        model = nnx.eval_shape(
            lambda: recipes.gpt_model(config, dtype=request["dtype"], scan_layers=request["scan_layers"])
        )
        model.eval()
        graphdef, state = nnx.split(model)
        state_sh = state_shardings(state, mesh)
        cache = jax.eval_shape(lambda: model.init_cache(batch, length=seq_len))
        split = batch % chips == 0
        batch_spec = jax.sharding.PartitionSpec(None, (DATA, FSDP)) if split else jax.sharding.PartitionSpec()
        cache_sh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, batch_spec), cache)
        token_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec((DATA, FSDP)) if split else batch_spec)

        def placed(tree, sh):
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)

        step = jax.jit(
            decode_step,
            static_argnums=0,
            donate_argnums=(3,),
            in_shardings=(state_sh, token_sh, cache_sh, replicated(mesh)),
            out_shardings=(None, cache_sh),
        )
        traced = step.trace(
            graphdef,
            placed(state, state_sh),
            jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=token_sh),
            placed(cache, cache_sh),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh)),
        )
        params = nnx.state(model, nnx.Param)
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
        model_flops = hardware_flops = decode_flops(request["config"], n_params, batch, seq_len)
        weight_bytes = n_params * itemsize
        tokens = batch
        cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
        extra["kv_cache_bytes"] = cache_bytes // (chips if split else 1)
    else:
        if batch % chips:
            raise PlanError(
                f"--batch: expected a multiple of the chip count {chips}: the batch is split over every chip "
                f"(mesh data {chips // fsdp} x fsdp {fsdp}), got {batch}"
            )
        if kind == "gpt":
            config = GPTConfig(**request["config"])
            setup = recipes.gpt_setup(
                config,
                batch=batch,
                seq_len=seq_len,
                dtype=request["dtype"],
                remat=request["remat"],
                scan_layers=request["scan_layers"],
            )
        else:
            kw = dict(request["setup"])
            src_vocab, tgt_vocab = kw.pop("src_vocab"), kw.pop("tgt_vocab")
            kw.pop("batch", None)
            src_len = kw.pop("src_len", seq_len)
            tgt_len = kw.pop("tgt_len", seq_len + 1)
            setup = recipes.encoder_decoder_setup(
                src_vocab,
                tgt_vocab,
                batch=batch,
                src_len=src_len,
                tgt_len=tgt_len,
                dtype=request["dtype"],
                **kw,
            )
        # batch_axes ["data"]: the batch replicated over fsdp, for before/after comparisons only (not on the CLI)
        sharded = recipes.sharded_step(setup, mesh, batch_axes=tuple(request.get("batch_axes") or (DATA, FSDP)))
        traced = sharded.step.trace(sharded.graphdef, sharded.abstract_state, sharded.abstract_batch)
        counts = _param_counts(sharded.abstract_state.params)
        n_params = sum(counts.values())
        if kind == "gpt":
            model_flops, hardware_flops = gpt_flops(request["config"], n_params, batch, seq_len, remat=request["remat"])
            tokens = batch * seq_len
        else:
            full = {**request["setup"], "layers": request["setup"].get("layers", 6)}
            model_flops = hardware_flops = encoder_decoder_flops(counts, full, batch, src_len, tgt_len - 1)
            tokens = batch * (tgt_len - 1)
        weight_bytes = (3 if request["remat"] else 2) * n_params * itemsize
    compiled = compile_traced(traced)
    per_chip = {**compiled.memory, "capacity_bytes": chip.hbm_bytes, **extra}
    if compiled.oom:
        per_chip.pop("compiler_message", None)
        result = failed(base, "does not fit: the TPU compiler ran out of memory", EXIT_DOES_NOT_FIT, **known)
        result["per_chip"].update({**{k: None for k in ("argument_bytes", "output_bytes")}, **per_chip})
        result.update(flops_per_step=model_flops, compile_seconds=round(compiled.seconds, 2))
        result["compiler_message"] = compiled.memory.get("compiler_message")
        return result
    fits = per_chip["total_bytes"] <= chip.hbm_bytes
    return {
        "fits": fits,
        "topology": request["topology"],
        "chips": chips,
        "device_kind": devices[0].device_kind,
        "model": request["model"],
        "batch": batch,
        "seq_len": seq_len,
        "dtype": request["dtype"],
        "fsdp": fsdp,
        "remat": request["remat"],
        "per_chip": per_chip,
        "flops_per_step": model_flops,
        "compile_seconds": round(compiled.seconds, 2),
        "roofline": roofline(chip, chips, compiled.memory, model_flops, hardware_flops, weight_bytes, tokens),
        "exit_code": EXIT_FITS if fits else EXIT_DOES_NOT_FIT,
        "error": None if fits else "does not fit",
    }


def _search_batch(request: dict, devices, fsdp: int) -> tuple[dict, dict]:
    """The largest batch (a multiple of the chip count) that fits, in few compiles.

    Memory per chip grows about linearly with the batch, so each candidate is predicted
    from the compiles so far: after the first (one sequence per chip), assuming every
    temporary scales with the batch (an over-estimate of the slope, so the guess fits);
    after two, by the secant through the last two; once a batch fails, the search
    bisects between the largest that fits and the smallest that does not, starting from
    the secant's guess, until they are adjacent. ``request["max_compiles"]`` (not on the
    command line) stops it early; ``smallest_failing`` then shows how tight the answer is.
    """
    chips = len(devices)
    step = 1 if request["kind"] == "decode" else chips
    budget = request.get("max_compiles") or 10**9
    tried: list[dict] = []
    results: dict[int, dict] = {}

    def attempt(k: int) -> bool:
        result = _plan_once(request, devices, k * step, fsdp)
        results[k] = result
        tried.append({"batch": k * step, "fits": result["fits"], "total_bytes": result["per_chip"]["total_bytes"]})
        return result["fits"]

    def total(k: int) -> float:  # only for compiles that gave a figure (see ``known``)
        return float(results[k]["per_chip"]["total_bytes"])

    capacity = CHIPS[request["topology"].partition(":")[0]].hbm_bytes
    lo, hi = 0, None
    k = 1
    while len(tried) < budget:
        if attempt(k):
            lo = k
        else:
            hi = k if hi is None else min(hi, k)
        if hi == 1 or (hi is not None and hi - lo <= 1):
            break
        known = sorted(j for j in results if results[j]["per_chip"]["total_bytes"] is not None)
        guess = None
        if len(known) >= 2:
            a, b = known[-2], known[-1]
            slope = (total(b) - total(a)) / (b - a)
            if slope > 0:
                guess = a + int((capacity - total(a)) // slope)
        elif len(known) == 1 and results[known[0]]["per_chip"].get("temp_bytes"):
            a = known[0]
            slope = results[a]["per_chip"]["temp_bytes"] / a
            guess = a + int((capacity - total(a)) // slope)
        if hi is None:
            k = max(lo + 1, min(guess if guess is not None else 2 * lo, 64 * lo))
        else:
            k = guess if guess is not None and lo < guess < hi else (lo + hi) // 2
            k = min(max(k, lo + 1), hi - 1)
    best = results[lo] if lo else results[hi or 1]
    search = {"axis": "batch", "best": lo * step if lo else None, "tried": tried}
    search["smallest_failing"] = hi * step if hi is not None else None
    return best, search


def _search_fsdp(request: dict, devices, batch: int) -> tuple[dict, dict]:
    """The smallest fsdp (a divisor of the chip count) that fits, by bisection over the divisors."""
    chips = len(devices)
    divisors = [d for d in range(1, chips + 1) if chips % d == 0]
    tried: list[dict] = []
    results: dict[int, dict] = {}
    lo, hi = -1, len(divisors) - 1  # divisors[hi] fits (checked first), divisors[lo] does not

    def attempt(i: int) -> bool:
        result = _plan_once(request, devices, batch, divisors[i])
        results[i] = result
        tried.append({"fsdp": divisors[i], "fits": result["fits"], "total_bytes": result["per_chip"]["total_bytes"]})
        return result["fits"]

    if not attempt(hi):
        return results[hi], {"axis": "fsdp", "best": None, "tried": tried}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    return results[hi], {"axis": "fsdp", "best": divisors[hi], "tried": tried}


def plan_request(request: dict) -> dict:
    """The plan of one request, in this process (the child's work; its stack limit must be raised for libtpu)."""
    devices = None
    try:
        devices = topology_devices(request["topology"])
        if request.get("devices"):  # a script that runs on fewer chips than the topology has (generate_gpt2.py: 1)
            devices = devices[: request["devices"]]
        chips = len(devices)
        fsdp = request["fsdp"] or chips
        batch = request["batch"] or (BATCH_PER_CHIP * chips if request["kind"] != "decode" else chips)
        if request["search"] == "batch":
            result, search = _search_batch(request, devices, fsdp)
            return {**result, "search": search}
        if request["search"] == "fsdp":
            result, search = _search_fsdp(request, devices, batch)
            return {**result, "search": search}
        return _plan_once(request, devices, batch, fsdp)
    except PlanError as e:
        return failed(request, str(e), e.exit_code, **({"chips": len(devices)} if devices is not None else {}))


def child_main(request_file: str, result_file: str) -> int:
    """The child process: plan each request listed in ``request_file``; the results, in order, to ``result_file``."""
    with open(request_file) as f:
        requests = json.load(f)
    results = [plan_request(request) for request in requests]
    with open(result_file, "w") as f:
        json.dump(results, f)
    return 0

"""The child's work: the plan of one request, compiled at one (batch, fsdp) or searched for the largest batch
or the smallest fsdp that fits (:func:`plan_request`), and the child process's entry point (:func:`child_main`)."""

from __future__ import annotations

import json
import math
from typing import Any

from flax_ln.plan.compiling import compile_traced, topology_devices
from flax_ln.plan.hardware import CHIPS, decode_flops, encoder_decoder_flops, gpt_flops, param_counts, roofline
from flax_ln.plan.request import BATCH_PER_CHIP, EXIT_DOES_NOT_FIT, EXIT_FITS, PlanError, failed


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
        counts = param_counts(sharded.abstract_state.params)
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

"""``flax-ln plan``: its arguments, the terminal summary and the ``--json`` file; the planner is :mod:`flax_ln.plan`."""

from __future__ import annotations

import json
import math
import sys

from flax_ln.cli.paths import output_file_problem
from flax_ln.plan import (
    BATCH_PER_CHIP,
    CHIPS,
    DEFAULT_ENC_DEC_LEN,
    DEFAULT_TIMEOUT,
    DEFAULT_VOCAB,
    EXIT_DOES_NOT_FIT,
    EXIT_USAGE,
    GIB,
    MODELS,
    PlanError,
    failed,
    make_request,
    run,
)


def add_arguments(parser) -> None:
    """``flax-ln plan``'s arguments (pinned: other code and independent checks read them)."""
    # choices are checked by make_request, not argparse, so that a wrong value still writes the --json file
    parser.add_argument(
        "--model", required=True, metavar="{" + ",".join(MODELS) + "}", help="which model's training step to compile"
    )
    parser.add_argument(
        "--topology",
        required=True,
        metavar="CHIP:SHAPE",
        help=f"a TPU topology as libtpu names it: v4:2x2x1, v5e:2x4, v5p:2x2x1, v6e:2x4, v5e:16x16, ... "
        f"(chips with published figures here: {', '.join(CHIPS)})",
    )
    parser.add_argument(
        "--batch",
        type=int,
        help=f"global batch, a multiple of the chip count (default {BATCH_PER_CHIP} per chip; with --generate, "
        "one sequence per chip, any batch allowed)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default: the model's block size; encoder-decoder: {DEFAULT_ENC_DEC_LEN}); "
        "with --generate, the KV cache's length",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", metavar="{bfloat16,float32}", help="compute dtype (default bfloat16)"
    )
    parser.add_argument("--fsdp", type=int, help="chips that share each parameter (default: the chip count)")
    parser.add_argument("--remat", action="store_true", help="rematerialise each block in the backward pass")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=f"vocabulary size (default {DEFAULT_VOCAB} for chapter12 and encoder-decoder; a preset's own otherwise)",
    )
    parser.add_argument("--generate", action="store_true", help="compile the GPT's KV-cache decode step instead")
    parser.add_argument(
        "--search",
        metavar="{batch,fsdp}",
        help="batch: the largest batch that fits; fsdp: the smallest fsdp that fits",
    )
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON (also when it fails)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"stop the TPU compile after this long and exit 2 (default {DEFAULT_TIMEOUT}; a --search compiles "
        "several times within it)",
    )


def _gib(n) -> str:
    """Bytes as GiB (MiB below 1 GiB), for the terminal."""
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def summary(result: dict) -> str:
    """The plan in a few lines, for the terminal."""
    pc = result["per_chip"]
    lines = [
        f"plan: {result['model']} on {result['topology']} ({result['chips']} x {result['device_kind']}), "
        f"batch {result['batch']}, seq {result['seq_len']}, {result['dtype']}, fsdp {result['fsdp']}, "
        f"remat {'on' if result['remat'] else 'off'} (compiled for TPU on this machine, not run on a TPU)",
        f"per chip: arguments {_gib(pc['argument_bytes'])}, outputs {_gib(pc['output_bytes'])}, temporaries "
        f"{_gib(pc['temp_bytes'])}, aliased {_gib(pc['alias_bytes'])}: total {_gib(pc['total_bytes'])} of "
        f"{_gib(pc['capacity_bytes'])}"
        + (f"; KV cache {_gib(pc['kv_cache_bytes'])}" if "kv_cache_bytes" in pc else ""),
    ]
    r = result.get("roofline")
    if r:
        lines.append(
            f"roofline: {r['step_seconds'] * 1e3:.1f} ms/step, {r['tokens_per_second']:,.0f} tokens/s, "
            f"mfu ceiling {r['mfu_ceiling']:.2f}, {r['bound']}-bound; {result['flops_per_step']:.3g} FLOPs/step; "
            f"compiled in {result['compile_seconds']} s"
        )
    if "search" in result:
        s = result["search"]
        tried = ", ".join(f"{t[s['axis']]}{'' if t['fits'] else ' (no)'}" for t in s["tried"])
        lines.append(f"search {s['axis']}: best {s['best']}; tried {tried}")
    lines.append("fits" if result["fits"] else "does not fit")
    return "\n".join(lines)


def finish(result: dict, json_path: str | None, prog: str) -> int:
    """Write ``json_path`` (the pinned keys), print the summary or the error; returns the exit code."""
    code = result.pop("exit_code")
    error = result.pop("error")
    result.pop("compiler_message", None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if code == EXIT_USAGE:
        print(f"{prog}: error: {error}", file=sys.stderr)
    else:
        print(summary(result))
        if code == EXIT_DOES_NOT_FIT and error and error != "does not fit":
            print(error)
    return code


def main_args(args, prog: str = "flax-ln plan") -> int:
    """Run ``flax-ln plan`` for parsed ``args`` (from :func:`add_arguments`); returns the exit code."""
    problem = output_file_problem("--json", args.json) if args.json else None
    if problem:  # checked before anything compiles; there is no file to write the failure to
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    try:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise PlanError(
                f"--timeout: expected a positive number of seconds (default {DEFAULT_TIMEOUT}), got {timeout}"
            )
        request = make_request(
            args.model,
            args.topology,
            batch=args.batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            fsdp=args.fsdp,
            remat=args.remat,
            vocab_size=args.vocab_size,
            generate=args.generate,
            search=args.search,
        )
    except PlanError as e:
        request = {k: getattr(args, k, None) for k in ("model", "topology", "batch", "seq_len", "dtype", "fsdp")}
        return finish(failed({**request, "remat": args.remat}, str(e), e.exit_code), args.json, prog)
    return finish(run(request, timeout=timeout), args.json, prog)


def plan_or_exit(request: dict, json_path: str | None, prog: str) -> int:
    """For the examples' ``--compile-only``: run ``request`` and finish as ``flax-ln plan`` does."""
    return finish(run(request), json_path, prog)

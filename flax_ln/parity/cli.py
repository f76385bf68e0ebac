"""The ``flax-ln`` command line: ``flax-ln parity``."""

from __future__ import annotations

import argparse
import json
import sys
import time

import flax_ln

MODEL_CHOICES = ["layernorm", "torch-layernorm", "encoder-decoder", "gpt", "gpt2-xl-block", "music"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flax-ln",
        description="flax-ln: the book's LayerNorm and Transformer blocks in Flax NNX, "
        "with a PyTorch reference and cross-framework parity checks.",
    )
    parser.add_argument("--version", action="version", version=f"flax-ln {flax_ln.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    parity = commands.add_parser(
        "parity",
        help="load the same weights into torch_ref and flax_ln and compare outputs and gradients",
        description="Load the same weights into the PyTorch reference and the Flax port, then compare "
        "every output and the gradient of every input and parameter. Exit code 0 only if all are "
        "within tolerance; on failure, name the first submodule whose output diverges.",
    )
    parity.add_argument("--model", choices=[*MODEL_CHOICES, "all"], default="all",
                        help="which model to check (default: all, on small configs; gpt2-xl-block is full width)")
    parity.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parity.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parity.add_argument("--seq-len", type=int, default=None, help="sequence length (default: per model)")
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--train-steps", type=int, default=0, metavar="K",
                        help="also run K optimizer steps in both frameworks and compare loss and parameters")
    parity.add_argument("--rtol", type=float, default=None, help="override the relative tolerance of every tensor")
    parity.add_argument("--atol", type=float, default=None, help="override the absolute tolerance of every tensor")
    parity.add_argument("--json", metavar="PATH", help="write a machine-readable report with every number")
    parity.add_argument("--plot", metavar="PATH", help="save a chart of per-module output and gradient errors")
    parity.add_argument("--quiet", action="store_true", help="print only the summary lines")
    parity.add_argument("--worst", type=int, default=8, help="rows per table (default 8)")
    parity.add_argument("--attribute", action="store_true",
                        help="also run both models in float64 and give, for every failing tensor, torch's and "
                        "flax's error against that float64 truth: which side is wrong")
    ref = parity.add_argument_group("parity without torch on the machine")
    ref.add_argument("--save-reference", metavar="FILE",
                     help="write the torch side of every selected model (inputs, weights, cotangents, outputs, "
                     "gradients, per-submodule records; float64 values with --attribute) to one safetensors file")
    ref.add_argument("--reference", metavar="FILE",
                     help="check the flax side against a file written by --save-reference; needs no torch "
                     "(replaces --model/--checkpoint; dtype and sizes come from the file)")
    ckpt = parity.add_argument_group("checking a checkpoint of your own")
    ckpt.add_argument("--checkpoint", metavar="PATH",
                      help="a torch_ref GPT, encoder-decoder or LayerNorm state dict (.safetensors, or .pt/.pth/.bin "
                      "read with weights_only=True) or a Hugging Face GPT-2 folder; replaces --model")
    ckpt.add_argument("--preset", choices=["gpt2", "gpt2-xl", "chapter12", "music"],
                      help="GPT preset for what tensor shapes cannot tell (head count, ignore_index)")
    ckpt.add_argument("--n-head", type=int, help="attention heads (not visible in the weights)")
    ckpt.add_argument("--ffn-activation", choices=["none", "relu"], default="none",
                      help="encoder-decoder feed-forward activation (default none, as the book)")
    return parser


def _positive(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("batch", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.train_steps < 0:
        parser.error(f"--train-steps must be at least 0, got {args.train_steps}")
    if args.n_head is not None and args.n_head < 1:
        parser.error(f"--n-head must be at least 1, got {args.n_head}")
    if args.checkpoint and args.model != "all":
        parser.error("--checkpoint replaces --model; give one of them")
    if args.reference and (args.checkpoint or args.model != "all" or args.save_reference or args.train_steps):
        parser.error("--reference replaces --model, --checkpoint, --save-reference and --train-steps; "
                     "the file says what to check")


def _tolerances(args: argparse.Namespace, dtype: str) -> dict:
    """The policy's tolerances for ``dtype``, with --rtol/--atol applied."""
    import dataclasses

    from flax_ln.parity import engine as parity

    return {kind: dataclasses.replace(tol, rtol=tol.rtol if args.rtol is None else args.rtol,
                                      atol=tol.atol if args.atol is None else args.atol)
            for kind, tol in parity.TOLERANCES[dtype].items()}


def _finish(args: argparse.Namespace, env: dict, dtype: str, reports: list) -> int:
    """The overall line, --json and --plot; the exit code."""
    from flax_ln.parity import report as parity_report

    passed = all(r.passed for r in reports)
    print(f"overall: {sum(r.passed for r in reports)}/{len(reports)} models within tolerance -> "
          f"{'PASS' if passed else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "dtype": dtype, "passed": passed,
                       "models": [r.to_json() for r in reports]}, f, indent=1)
    if args.plot:
        parity_report.plot_errors(reports, args.plot)
    return 0 if passed else 1


def run_reference(args: argparse.Namespace) -> int:
    """``--reference FILE``: the flax side of every model in the file against its stored torch side; no torch."""
    from flax_ln.parity import engine as parity
    from flax_ln.parity import reference
    from flax_ln.parity import report as parity_report

    try:
        settings, models = reference.load_reference(args.reference)
    except reference.ReferenceError as err:
        print(f"flax-ln parity: error: {err}", file=sys.stderr)
        return 2
    dtype = settings["dtype"]
    reports = []
    with parity.numerics(dtype):
        env = parity_report.environment()
        print(parity_report.format_environment(env) + f" | dtype {dtype} | reference {args.reference}", flush=True)
        for index, model in enumerate(models, 1):
            print(f"[{index}/{len(models)}] {model.side.name}: building, compiling and comparing ...",
                  file=sys.stderr, flush=True)
            report = reference.check_reference(model, _tolerances(args, dtype), capture_modules=bool(args.plot))
            reports.append(report)
            print(parity_report.format_report(report, worst=args.worst, quiet=args.quiet), flush=True)
    return _finish(args, env, dtype, reports)


def run_parity(args: argparse.Namespace) -> int:
    if args.reference:
        return run_reference(args)

    from flax_ln.parity import cases as parity_cases
    from flax_ln.parity import engine as parity
    from flax_ln.parity import report as parity_report

    names = [args.checkpoint] if args.checkpoint else MODEL_CHOICES if args.model == "all" else [args.model]
    from flax_ln.parity import reference as parity_reference

    progress = sys.stderr
    reports, saved = [], []
    with parity.numerics(args.dtype):
        env = parity_report.environment()
        print(parity_report.format_environment(env) + f" | dtype {args.dtype} | x64 {env['x64']}", flush=True)
        for index, name in enumerate(names, 1):
            start = time.perf_counter()
            print(f"[{index}/{len(names)}] {name}: building, compiling and comparing ...", file=progress, flush=True)
            try:
                if args.checkpoint:
                    case = parity_cases.checkpoint_case(
                        args.checkpoint, args.dtype, args.batch, args.seq_len, args.seed, preset=args.preset,
                        n_head=args.n_head, ffn_activation=None if args.ffn_activation == "none" else "relu")
                else:
                    case = parity_cases.BUILDERS[name](args.dtype, args.batch, args.seq_len, args.seed)
            except ValueError as err:  # CheckpointError, or sizes the model cannot take
                print(f"flax-ln parity: error: {err}", file=sys.stderr)
                return 2
            tolerances = _tolerances(args, args.dtype)
            if args.save_reference:
                side = parity.torch_side_of_case(case, attribute=args.attribute, record=True)
                saved.append(parity_reference.ReferenceModel(side, dict(case.spec), parity_reference.forward_name(
                    case.forward), case.lm_logits))
                report = parity.compare_side(side, case.flax_model, forward=case.forward, tolerances=tolerances,
                                             capture_modules=bool(args.plot), lm_logits=case.lm_logits)
            else:
                report = parity.check_case(case, tolerances, capture_modules=bool(args.plot),
                                           attribute=args.attribute)
            if args.train_steps and case.train is not None:
                report.train_steps = parity.check_training(case, args.train_steps, tolerances)
            report.seconds = time.perf_counter() - start
            reports.append(report)
            print(parity_report.format_report(report, worst=args.worst, quiet=args.quiet), flush=True)
    if args.save_reference:
        settings = {key: getattr(args, key) for key in ("model", "checkpoint", "dtype", "batch", "seq_len", "seed",
                                                        "attribute")}
        parity_reference.save_reference(args.save_reference, saved, settings)
        print(f"reference: {len(saved)} model(s) written to {args.save_reference}")
    return _finish(args, env, args.dtype, reports)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _positive(parser, args)
    return run_parity(args)


if __name__ == "__main__":
    sys.exit(main())

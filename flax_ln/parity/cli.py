"""The ``flax-ln`` command line: ``flax-ln parity`` and ``flax-ln plan`` (:mod:`flax_ln.plan`, imported lazily)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import flax_ln
from flax_ln.book.catalog import GPT_PRESETS, MODEL_NAMES, check_seq_len


def build_parser() -> argparse.ArgumentParser:
    """The ``flax-ln`` argument parser, with its subcommands."""
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
        "every output and the gradient of every input and parameter. Exit code 0 if all are within "
        "tolerance, 1 if any is not (the first submodule whose output diverges is named) or if a --reference "
        "file was altered since it was written, 2 for a usage error, a refused checkpoint or a reference file "
        "that breaks its schema; every argument is checked before anything runs.",
    )
    parity.add_argument(
        "--model",
        choices=[*MODEL_NAMES, "all"],
        default="all",
        help="which model to check (default: all, on small configs; gpt2-xl-block is full width)",
    )
    parity.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="compute dtype of both sides (default float32; with --reference the file decides)",
    )
    parity.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parity.add_argument("--seq-len", type=int, default=None, help="sequence length (default: per model)")
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument(
        "--train-steps",
        type=int,
        default=0,
        metavar="K",
        help="also run K optimizer steps in both frameworks and compare loss and parameters",
    )
    parity.add_argument("--rtol", type=float, default=None, help="override the relative tolerance of every tensor")
    parity.add_argument("--atol", type=float, default=None, help="override the absolute tolerance of every tensor")
    parity.add_argument("--json", metavar="PATH", help="write a machine-readable report with every number")
    parity.add_argument(
        "--plot", metavar="PATH", help="save a chart of per-module output and gradient errors (.png, .pdf, .svg, ...)"
    )
    parity.add_argument("--quiet", action="store_true", help="print only the summary lines")
    parity.add_argument("--worst", type=int, default=8, help="rows per table (default 8)")
    parity.add_argument(
        "--attribute",
        action="store_true",
        help="also run both models in float64 and give, for every failing tensor, torch's and "
        "flax's error against that float64 truth: which side is wrong",
    )
    ref = parity.add_argument_group("parity without torch on the machine")
    ref.add_argument(
        "--save-reference",
        metavar="FILE",
        help="write the torch side of every selected model (inputs, weights, cotangents, outputs, "
        "gradients, per-submodule records; float64 values with --attribute) to one safetensors file",
    )
    ref.add_argument(
        "--reference",
        metavar="FILE",
        help="check the flax side against a file written by --save-reference; needs no torch "
        "(replaces --model/--checkpoint; dtype and sizes come from the file; --devices/--fsdp apply)",
    )
    mesh = parity.add_argument_group("running the flax side sharded")
    mesh.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="run the flax side on a (data, fsdp) mesh of the first N devices; on CPU, N devices are "
        "simulated (XLA's host device count, set before JAX starts)",
    )
    mesh.add_argument(
        "--fsdp",
        type=int,
        metavar="K",
        help="FSDP size of the mesh (default 1; with --fsdp alone, the mesh spans every device): "
        "parameters are split K ways by the training rules, the batch over N // K",
    )
    ckpt = parity.add_argument_group("checking a checkpoint of your own")
    ckpt.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a torch_ref GPT, encoder-decoder or LayerNorm state dict (.safetensors, or .pt/.pth/.bin "
        "read with weights_only=True) or a Hugging Face GPT-2 folder; replaces --model",
    )
    ckpt.add_argument(
        "--preset",
        choices=list(GPT_PRESETS),
        help="GPT preset for what tensor shapes cannot tell (head count, ignore_index)",
    )
    ckpt.add_argument("--n-head", type=int, help="attention heads (not visible in the weights)")
    ckpt.add_argument(
        "--ffn-activation",
        choices=["none", "relu"],
        default="none",
        help="encoder-decoder feed-forward activation (default none, as the book)",
    )
    plan = commands.add_parser(
        "plan",
        help="compile a model's training step for a TPU topology on this machine: per-chip memory, fit, roofline",
        description="Compile the examples' training step (or, with --generate, the GPT's KV-cache decode step) "
        "for a TPU topology with libtpu, on any machine and without a TPU, and report the memory per chip, "
        "whether it fits and a roofline bound. Exit code 0 if it fits, 1 if it does not (also when the TPU "
        "compiler refuses it for lack of memory), 2 for a usage error (also: libtpu missing, an op that cannot "
        "run on TPU). The numbers are compiled-for-TPU figures, not measurements on a TPU.",
    )
    from flax_ln.plan import add_arguments as add_plan_arguments  # torch-free; imports JAX only to compile

    add_plan_arguments(plan)
    return parser


def _check_output_file(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Fail now, not after the run, when ``path`` cannot be written: a folder, a missing folder, no permission."""
    if os.path.isdir(path):
        parser.error(f"{option} {path!r} is a directory; give a file name inside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path!r}: the folder {folder!r} does not exist; create it first")
    try:
        if os.path.exists(path):
            open(path, "a").close()  # opening to append changes nothing
        else:
            open(path, "x").close()
            os.remove(path)
    except OSError as err:
        parser.error(f"{option} {path!r} cannot be written: {err.strerror or err}")


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: ``os.path.samefile`` where both exist, resolved paths otherwise."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _checkpoint_files(path: str) -> list[str]:
    """The files a ``--checkpoint`` path reads: the file itself, or every file directly inside the folder."""
    if os.path.isdir(path):
        return [entry.path for entry in os.scandir(path) if entry.is_file()]
    return [path]


def _check_distinct_files(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Outputs never overwrite inputs or each other: refuse (exit 2) before anything runs."""
    outputs = [(f"--{name.replace('_', '-')}", getattr(args, name)) for name in ("json", "plot", "save_reference")]
    outputs = [(option, path) for option, path in outputs if path]
    inputs = [("--reference", args.reference)] if args.reference else []
    if args.checkpoint and os.path.exists(args.checkpoint):
        inputs += [("--checkpoint", path) for path in _checkpoint_files(args.checkpoint)]
    for i, (option, path) in enumerate(outputs):
        for other, other_path in outputs[:i] + inputs:
            if _same_file(path, other_path):
                what = "an input" if (other, other_path) in inputs else "another output"
                parser.error(
                    f"{option} {path!r} is the same file as {other} {other_path!r} ({what}): writing it would "
                    f"overwrite that; give {option} a different file"
                )


def _plot_formats() -> dict[str, str]:
    """File extensions matplotlib can save to (extension -> description)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every usage error, before anything slow runs; ``parser.error`` exits with code 2."""
    for name in ("batch", "seq_len", "n_head", "devices", "fsdp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.train_steps < 0:
        parser.error(f"--train-steps must be at least 0, got {args.train_steps}")
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(f"--{name} must be a finite number >= 0, got {value}")
    if args.checkpoint and args.model != "all":
        parser.error("--checkpoint replaces --model; give one of them")
    if args.reference and args.dtype is not None:
        parser.error(
            f"--reference takes its dtype from the file; drop --dtype {args.dtype} (write the file with "
            "--save-reference --dtype to check another dtype)"
        )
    if args.dtype is None:
        args.dtype = "float32"
    if args.reference:
        if args.checkpoint or args.model != "all" or args.save_reference or args.train_steps or args.seq_len:
            parser.error(
                "--reference replaces --model, --checkpoint, --save-reference, --train-steps and --seq-len; "
                "the file says what to check"
            )
        if args.attribute:
            parser.error(
                "--reference takes attribution from the file: write it with --save-reference FILE "
                "--attribute (on the machine with torch)"
            )
        if not os.path.isfile(args.reference):
            parser.error(f"--reference {args.reference!r}: no such file")
    _check_distinct_files(parser, args)
    if args.save_reference:
        _check_output_file(parser, "--save-reference", args.save_reference)
    if args.json:
        _check_output_file(parser, "--json", args.json)
    if args.plot:
        try:
            formats = _plot_formats()
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
        extension = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if extension not in formats:
            what = f"extension .{extension}" if extension else "no file extension"
            parser.error(f"--plot {args.plot!r} has {what}; matplotlib saves {', '.join('.' + f for f in formats)}")
        _check_output_file(parser, "--plot", args.plot)
    if args.seq_len is not None and not args.checkpoint:  # a checkpoint's limit is its block_size, checked on reading
        for name in _model_names(args):
            try:
                check_seq_len(name, args.seq_len)
            except ValueError as err:
                parser.error(str(err))
    if (args.devices or args.fsdp) and args.train_steps:
        parser.error("--train-steps runs unsharded; drop --devices/--fsdp to compare training steps")


def _model_names(args: argparse.Namespace) -> list[str]:
    return [args.checkpoint] if args.checkpoint else MODEL_NAMES if args.model == "all" else [args.model]


def _make_mesh(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The ``(data, fsdp)`` mesh of ``--devices``/``--fsdp``, or ``None`` without them.

    On CPU, ``--devices N`` needs N simulated host devices, a setting JAX reads once when
    it starts its backends: it is set here if JAX has not started yet (as when run from
    the command line), and otherwise the error says how to set it.
    """
    if args.devices is None and args.fsdp is None:
        return None
    import jax

    from flax_ln.sharding import DATA, make_mesh

    if args.devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", args.devices)
        except RuntimeError:  # JAX's backends already started: the CPU device count is fixed
            pass
    devices = jax.devices()
    wanted = len(devices) if args.devices is None else args.devices
    if wanted > len(devices):
        parser.error(
            f"--devices {wanted}: JAX sees {len(devices)} {jax.default_backend()} device(s). On CPU, start with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted} in the environment (JAX reads it when it "
            "starts, so it cannot be changed in a running process); on an accelerator, use at most the devices it has"
        )
    fsdp = args.fsdp or 1
    if wanted % fsdp:
        parser.error(
            f"--fsdp {fsdp} must divide --devices {wanted}: the mesh is (data, fsdp) = ({wanted} // fsdp, fsdp)"
        )
    mesh = make_mesh(fsdp, devices=devices[:wanted])
    if not args.reference and args.batch % mesh.shape[DATA]:  # a reference's batch is checked on reading it
        parser.error(
            f"--batch {args.batch} must be a multiple of the mesh's data axis ({mesh.shape[DATA]} = "
            f"devices {wanted} // fsdp {fsdp}): the batch is split over it"
        )
    return mesh


def _tolerances(args: argparse.Namespace, dtype: str) -> dict:
    """The policy's tolerances for ``dtype``, with --rtol/--atol applied."""
    import dataclasses

    from flax_ln.parity import engine as parity

    return {
        kind: dataclasses.replace(
            tol, rtol=tol.rtol if args.rtol is None else args.rtol, atol=tol.atol if args.atol is None else args.atol
        )
        for kind, tol in parity.TOLERANCES[dtype].items()
    }


def _finish(args: argparse.Namespace, env: dict, dtype: str, reports: list) -> int:
    """The overall line, --json and --plot; the exit code."""
    from flax_ln.parity import render

    passed = all(r.passed for r in reports)
    print(
        f"overall: {sum(r.passed for r in reports)}/{len(reports)} models within tolerance -> "
        f"{'PASS' if passed else 'FAIL'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "dtype": dtype, "passed": passed, "models": [r.to_json() for r in reports]},
                f,
                indent=1,
            )
    if args.plot:
        render.plot_errors(reports, args.plot)
    return 0 if passed else 1


def _reference_error(args: argparse.Namespace, message: str) -> int:
    """One line on stderr for an error on the reference path; exit code 2 (no comparison was made)."""
    print(f"flax-ln parity: error: {message}", file=sys.stderr)
    return 2


def run_reference(args: argparse.Namespace, mesh=None) -> int:
    """``--reference FILE``: the flax side of every model in the file against its stored torch side; no torch.

    On ``mesh`` (``--devices``/``--fsdp``), the flax side runs sharded as in a live run.
    Exit code 1 only for a comparison that failed or a file altered since it was written
    (its digest); every other error, from reading the file to the verdict, is a one-line
    error and exit code 2.
    """
    from flax_ln.book import reference
    from flax_ln.parity import engine as parity
    from flax_ln.parity import render
    from flax_ln.parity import report as parity_report

    notes: list[str] = []
    try:
        settings, models = reference.load_reference(args.reference, notes)
    except reference.ReferenceFileError as err:
        return _reference_error(args, str(err))
    except reference.ReferenceAlteredError as err:
        print(f"flax-ln parity: {err}", file=sys.stderr)
        print(f"overall: --reference {args.reference} ALTERED (its digest does not match) -> FAIL")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "reference": args.reference,
                        "passed": False,
                        "verdict": "altered",
                        "digest": {"expected": err.expected, "actual": err.actual},
                    },
                    f,
                    indent=1,
                )
        return 1
    except Exception as err:  # noqa: BLE001 - any other failure to read the file is a usage error, never a FAIL
        return _reference_error(args, f"--reference {args.reference!r} cannot be read ({type(err).__name__}: {err})")
    for note in notes:
        print(f"flax-ln parity: {note}", file=sys.stderr)
    if mesh is not None:
        from flax_ln.sharding import DATA

        if settings["batch"] % mesh.shape[DATA]:
            return _reference_error(
                args,
                f"--reference {args.reference!r} holds batch {settings['batch']}, not a multiple of the mesh's "
                f"data axis ({mesh.shape[DATA]}): the batch is split over it; choose --devices/--fsdp to fit, or "
                "write the reference with a --batch that divides",
            )
    dtype = settings["dtype"]  # float32 or float64: the schema allows nothing else
    reports = []
    with parity.numerics(dtype):
        env = parity_report.environment()
        print(render.format_environment(env) + f" | dtype {dtype} | reference {args.reference}", flush=True)
        for index, model in enumerate(models, 1):
            print(
                f"[{index}/{len(models)}] {model.side.name}: building, compiling and comparing ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                report = reference.check_reference(
                    model, _tolerances(args, dtype), capture_modules=bool(args.plot), mesh=mesh
                )
            except Exception as err:  # noqa: BLE001 - a model the file describes but flax cannot run is exit 2, not a FAIL
                return _reference_error(
                    args,
                    f"--reference {args.reference!r}: model {index} ({model.side.name!r}) could not be checked "
                    f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); the file does not "
                    "describe a model flax-ln can run: write it again with --save-reference",
                )
            if not report.results:
                return _reference_error(
                    args, f"--reference {args.reference!r}: model {index} ({model.side.name!r}) compared nothing"
                )
            reports.append(report)
            print(render.format_report(report, worst=args.worst, quiet=args.quiet), flush=True)
    return _finish(args, env, dtype, reports)


def run_parity(args: argparse.Namespace, mesh=None) -> int:
    """Run ``flax-ln parity`` on parsed arguments; returns the exit code (0 pass, 1 FAIL, 2 usage error)."""
    if args.reference:
        return run_reference(args, mesh)

    from flax_ln.book import reference as parity_reference
    from flax_ln.book.cases import BUILDERS
    from flax_ln.book.torch_checkpoint import torch_checkpoint_case
    from flax_ln.parity import engine as parity
    from flax_ln.parity import render
    from flax_ln.parity import report as parity_report

    names = _model_names(args)
    progress = sys.stderr
    reports, saved = [], []
    with parity.numerics(args.dtype):
        env = parity_report.environment()
        print(render.format_environment(env) + f" | dtype {args.dtype} | x64 {env['x64']}", flush=True)
        for index, name in enumerate(names, 1):
            start = time.perf_counter()
            print(f"[{index}/{len(names)}] {name}: building, compiling and comparing ...", file=progress, flush=True)
            try:
                if args.checkpoint:
                    case = torch_checkpoint_case(
                        args.checkpoint,
                        args.dtype,
                        args.batch,
                        args.seq_len,
                        args.seed,
                        preset=args.preset,
                        n_head=args.n_head,
                        ffn_activation=None if args.ffn_activation == "none" else "relu",
                    )
                else:
                    case = BUILDERS[name](args.dtype, args.batch, args.seq_len, args.seed)
            except ValueError as err:  # TorchCheckpointError, or sizes the model cannot take
                print(f"flax-ln parity: error: {err}", file=sys.stderr)
                return 2
            tolerances = _tolerances(args, args.dtype)
            if args.save_reference:
                if case.spec is None:  # every case flax_ln.book builds carries the spec that rebuilds its flax side
                    raise RuntimeError(f"{case.name}: no spec to rebuild its flax side from a reference file")
                side = parity.torch_side_of_case(case, attribute=args.attribute, record=True)
                saved.append(
                    parity_reference.ReferenceModel(
                        side,
                        dict(case.spec),
                        parity_reference.forward_name(case.forward),
                        case.lm_logits,
                        case.stored_dtype,
                    )
                )
                report = parity.compare_side(
                    side,
                    case.flax_model,
                    forward=case.forward,
                    tolerances=tolerances,
                    capture_modules=bool(args.plot),
                    lm_logits=case.lm_logits,
                    mesh=mesh,
                )
                report.stored_dtype = case.stored_dtype
            else:
                report = parity.check_case(
                    case, tolerances, capture_modules=bool(args.plot), attribute=args.attribute, mesh=mesh
                )
            if args.train_steps and case.train is not None:
                report.train_steps = parity.check_training(case, args.train_steps, tolerances)
            report.seconds = time.perf_counter() - start
            reports.append(report)
            print(render.format_report(report, worst=args.worst, quiet=args.quiet), flush=True)
    if args.save_reference:
        settings = {
            key: getattr(args, key) for key in ("model", "checkpoint", "dtype", "batch", "seq_len", "seed", "attribute")
        }
        parity_reference.save_reference(args.save_reference, saved, settings)
        print(f"reference: {len(saved)} model(s) written to {args.save_reference}")
    return _finish(args, env, args.dtype, reports)


def main(argv: list[str] | None = None) -> int:
    """The ``flax-ln`` command: parse ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "plan":
        from flax_ln.plan import main_args  # torch-free: never imports the parity engine

        return main_args(args)
    _validate(parser, args)
    return run_parity(args, _make_mesh(parser, args))


if __name__ == "__main__":
    sys.exit(main())

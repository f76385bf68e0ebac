"""``flax-ln parity``'s arguments and their checks: every usage error, before anything runs.

:func:`add_arguments` fills the subcommand's parser and :func:`validate` refuses (exit code 2)
what cannot run; both read only :mod:`flax_ln.book.catalog`, so that building the command line
imports neither torch nor the parity engine. The run itself is :mod:`flax_ln.cli.parity_run`.
"""

from __future__ import annotations

import argparse
import math
import os

import jax

from flax_ln import sharding
from flax_ln.book.catalog import GPT_PRESETS, MODEL_NAMES, check_seq_len
from flax_ln.cli.paths import output_file_problem, same_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``flax-ln parity``'s arguments."""
    parser.add_argument(
        "--model",
        choices=[*MODEL_NAMES, "all"],
        default="all",
        help="which model to check (default: all, on small configs; gpt2-xl-block is full width)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="compute dtype of both sides (default float32; with --reference the file decides)",
    )
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: per model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        metavar="K",
        help="also run K optimizer steps in both frameworks and compare loss and parameters",
    )
    parser.add_argument("--rtol", type=float, default=None, help="override the relative tolerance of every tensor")
    parser.add_argument("--atol", type=float, default=None, help="override the absolute tolerance of every tensor")
    parser.add_argument("--json", metavar="PATH", help="write a machine-readable report with every number")
    parser.add_argument(
        "--plot", metavar="PATH", help="save a chart of per-module output and gradient errors (.png, .pdf, .svg, ...)"
    )
    parser.add_argument(
        "--html",
        metavar="PATH",
        help="write one self-contained HTML page of every model checked: the module trees side by side, shaded "
        "by error, the first divergence and culprits marked, every tensor in a sortable table",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary lines, and no progress bar")
    parser.add_argument("--worst", type=int, default=8, help="rows per table (default 8)")
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="also run both models in float64 and give, for every failing tensor, torch's and "
        "flax's error against that float64 truth: which side is wrong",
    )
    ref = parser.add_argument_group("parity without torch on the machine")
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
    mesh = parser.add_argument_group("running the flax side sharded")
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
    ckpt = parser.add_argument_group("checking a checkpoint of your own")
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


def _check_output_file(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Fail now, not after the run, when ``path`` cannot be written: a folder, a missing folder, no permission."""
    problem = output_file_problem(option, path)
    if problem:
        parser.error(problem)


def _checkpoint_files(path: str) -> list[str]:
    """The files a ``--checkpoint`` path reads: the file itself, or every file directly inside the folder."""
    if os.path.isdir(path):
        return [entry.path for entry in os.scandir(path) if entry.is_file()]
    return [path]


def _check_distinct_files(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Outputs never overwrite inputs or each other: refuse (exit 2) before anything runs."""
    outputs = [
        (f"--{name.replace('_', '-')}", getattr(args, name)) for name in ("json", "plot", "html", "save_reference")
    ]
    outputs = [(option, path) for option, path in outputs if path]
    inputs = [("--reference", args.reference)] if args.reference else []
    if args.checkpoint and os.path.exists(args.checkpoint):
        inputs += [("--checkpoint", path) for path in _checkpoint_files(args.checkpoint)]
    for i, (option, path) in enumerate(outputs):
        for other, other_path in outputs[:i] + inputs:
            if same_file(path, other_path):
                what = "an input" if (other, other_path) in inputs else "another output"
                parser.error(
                    f"{option} {path!r} is the same file as {other} {other_path!r} ({what}): writing it would "
                    f"overwrite that; give {option} a different file"
                )


def _plot_formats() -> dict[str, str]:
    """File extensions matplotlib can save to (extension -> description)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
    if args.html:
        _check_output_file(parser, "--html", args.html)
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
        for name in model_names(args):
            try:
                check_seq_len(name, args.seq_len)
            except ValueError as err:
                parser.error(str(err))
    if (args.devices or args.fsdp) and args.train_steps:
        parser.error("--train-steps runs unsharded; drop --devices/--fsdp to compare training steps")


def capture_modules(args: argparse.Namespace) -> bool:
    """Whether every module's error is recorded even when everything passes: ``--plot`` and ``--html`` show them."""
    return bool(args.plot or args.html)


def model_names(args: argparse.Namespace) -> list[str]:
    """What ``flax-ln parity`` checks, in order: the ``--checkpoint``, every book model, or the one ``--model``."""
    return [args.checkpoint] if args.checkpoint else MODEL_NAMES if args.model == "all" else [args.model]


def make_mesh(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The ``(data, fsdp)`` mesh of ``--devices``/``--fsdp``, or ``None`` without them.

    On CPU, ``--devices N`` needs N simulated host devices, a setting JAX reads once when
    it starts its backends: it is set here if JAX has not started yet (as when run from
    the command line), and otherwise the error says how to set it.
    """
    if args.devices is None and args.fsdp is None:
        return None
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
    mesh = sharding.make_mesh(fsdp, devices=devices[:wanted])
    if not args.reference and args.batch % mesh.shape[sharding.DATA]:  # a reference's batch is checked on reading it
        parser.error(
            f"--batch {args.batch} must be a multiple of the mesh's data axis ({mesh.shape[sharding.DATA]} = "
            f"devices {wanted} // fsdp {fsdp}): the batch is split over it"
        )
    return mesh

"""Running ``flax-ln parity`` on checked arguments: the book's models, a torch checkpoint or a reference file.

Imported by :func:`flax_ln.cli.main` only when the parity subcommand runs, after its
arguments are checked (:mod:`flax_ln.cli.parity`): this module imports the parity engine.
torch is imported for a live run only, so that ``--reference`` runs where torch is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import flax_ln.parity.report.text as render
from flax_ln.book import reference
from flax_ln.cli.parity import capture_modules, model_names
from flax_ln.parity import TOLERANCES, check_case, check_training
from flax_ln.parity.case import torch_side_of_case
from flax_ln.parity.core.policy import numerics
from flax_ln.parity.report.data import environment
from flax_ln.parity.report.html import render_html
from flax_ln.parity.stored import compare_side
from flax_ln.sharding import DATA


def _tolerances(args: argparse.Namespace, dtype: str) -> dict:
    """The policy's tolerances for ``dtype``, with --rtol/--atol applied."""
    return {
        kind: dataclasses.replace(
            tol, rtol=tol.rtol if args.rtol is None else args.rtol, atol=tol.atol if args.atol is None else args.atol
        )
        for kind, tol in TOLERANCES[dtype].items()
    }


def _finish(args: argparse.Namespace, env: dict, dtype: str, reports: list) -> int:
    """The overall line, --json, --plot and --html; the exit code."""
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
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(reports))
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
    try:
        settings, models = reference.load_reference(args.reference)
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
    if mesh is not None and settings["batch"] % mesh.shape[DATA]:
        return _reference_error(
            args,
            f"--reference {args.reference!r} holds batch {settings['batch']}, not a multiple of the mesh's "
            f"data axis ({mesh.shape[DATA]}): the batch is split over it; choose --devices/--fsdp to fit, or "
            "write the reference with a --batch that divides",
        )
    dtype = settings["dtype"]  # float32 or float64: the schema allows nothing else
    reports = []
    with numerics(dtype):
        env = environment()
        print(render.format_environment(env) + f" | dtype {dtype} | reference {args.reference}", flush=True)
        for index, model in enumerate(models, 1):
            print(
                f"[{index}/{len(models)}] {model.side.name}: building, compiling and comparing ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                report = reference.check_reference(
                    model, _tolerances(args, dtype), capture_modules=capture_modules(args), mesh=mesh
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
    # torch only here, for a live run: --reference checks a file where torch is not installed
    from flax_ln.book.cases import BUILDERS
    from flax_ln.book.torch_checkpoint import torch_checkpoint_case

    names = model_names(args)
    progress = sys.stderr
    reports, saved = [], []
    with numerics(args.dtype):
        env = environment()
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
                side = torch_side_of_case(case, attribute=args.attribute, record=True)
                saved.append(
                    reference.ReferenceModel(
                        side,
                        dict(case.spec),
                        reference.forward_name(case.forward),
                        case.lm_logits,
                        case.stored_dtype,
                    )
                )
                report = compare_side(
                    side,
                    case.flax_model,
                    forward=case.forward,
                    tolerances=tolerances,
                    capture_modules=capture_modules(args),
                    lm_logits=case.lm_logits,
                    mesh=mesh,
                )
                report.stored_dtype = case.stored_dtype
            else:
                report = check_case(
                    case,
                    tolerances,
                    capture_modules=capture_modules(args),
                    attribute=args.attribute,
                    mesh=mesh,
                    quiet=args.quiet,
                )
            if args.train_steps and case.train is not None:
                report.train_steps = check_training(case, args.train_steps, tolerances)
            report.seconds = time.perf_counter() - start
            reports.append(report)
            print(render.format_report(report, worst=args.worst, quiet=args.quiet), flush=True)
    if args.save_reference:
        settings = {
            key: getattr(args, key) for key in ("model", "checkpoint", "dtype", "batch", "seq_len", "seed", "attribute")
        }
        reference.save_reference(args.save_reference, saved, settings)
        print(f"reference: {len(saved)} model(s) written to {args.save_reference}")
    return _finish(args, env, args.dtype, reports)

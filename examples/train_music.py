"""Train chapter 14's music Transformer (``flax_ln.GPT``) on MIDI files, then sample a new piece.

Run (CPU, seconds):     python examples/train_music.py --config tiny --steps 500 --out out/music-tiny
The book's model:       python examples/train_music.py --config music --steps 20000 --out out/music \
                            --data PATH/TO/maestro-v2.0.0
Continue a run:         add --resume (same --out); it continues exactly where the last checkpoint left off.
                        If the newest checkpoint cannot be read (damaged files), a one-line warning says
                        why, the run resumes from the newest one that reads, and the damaged folder is
                        renamed to STEP.unreadable (kept for inspection; orbax ignores it).
Sample only:            python examples/train_music.py --config music --sample-only book_music.pt \
                            --data PATH/TO/maestro-v2.0.0 --out out/book-sample
Several devices:        --fsdp K shards parameters and optimizer state over K devices and the batch over
                        every device (--batch-size a multiple of the device count).
Several hosts:          run the same command on every host with --distributed (a TPU pod slice: JAX finds
                        its peers) or with --coordinator HOST:PORT --num-processes N --process-id I (any
                        cluster, or N processes on one machine), and a --ckpt-dir every host can reach
                        (e.g. gs://BUCKET/run). Each process reads only its share of every batch; process
                        0 writes the metrics, plot and sample; the checkpoints are written by all together
                        and resume on any number of processes. N processes x M devices train on the same
                        batches, data order and dropout as 1 process x N*M devices (equal up to the order in
                        which the cross-process all-reduce sums float32 values). See docs/tpu.md, "Multi-host".
Check a TPU run first:  add --compile-only v5e:2x4 (any CHIP:SHAPE): compiles this exact training step for
                        that TPU topology on this machine (libtpu, no TPU needed) and prints the memory
                        per chip and a roofline bound instead of training; exit 0 fits, 1 does not, 2 error.

Data: the Bach chorales of music21's corpus, rendered to MIDI once into OUT/bach_chorales
(no download; about two minutes; reuse them with ``--data OUT/bach_chorales``), or
``--data DIR`` with .mid/.midi files (searched recursively). The book's own data is a
MAESTRO v2 folder (``maestro-v2.0.0``, with ``maestro-v2.0.0.csv`` beside the year
folders): then the csv's split column decides, as in the book: the ``train`` pieces are
trained on and the first ``test`` piece gives the prompt. Any other folder (and the
chorales) holds out its last file (sorted by path) for the prompt and trains on the rest.
Tokenised by ``flax_ln.music`` exactly as the book's processor.
Training as the book: one example per piece, ``x`` its first ``block`` ids (padded with
389), ``y`` shifted by one with 388 after the last id; Adam 1e-4 after clipping the
gradient norm to 1, cross-entropy that ignores the padding id 389, dropout 0.1.
Sampling as the book: the prompt is the first 250 ids of the held-out piece (at most a
quarter of a shorter block), and each new id is drawn from softmax(logits / temperature)
over the 388 event ids only (never 388 = end or 389 = padding).

``--sample-only CHECKPOINT`` skips training and samples OUT/sample.mid from a model trained
elsewhere: a ``.pt``/``.pth``/``.bin`` (read with ``torch.load(weights_only=True)``) or
``.safetensors`` state dict of the book's music model (``torch_ref`` layout, the keys the
book's ``model.state_dict()`` saves), or an orbax checkpoint folder of this example (its
``OUT/checkpoints``: the latest step). ``--config`` must describe that model.

Outputs in OUT: metrics.jsonl (one JSON object per step), checkpoints/ (orbax: parameters,
optimizer state, dropout RNG state, step, data position), loss.png and sample.mid (sampled
with the KV-cache generator, continuing a prompt taken from the data).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from flax_ln import GPT, ConversionError, GPTConfig, generate, load_torch_state_dict, music, recipes
from flax_ln.checkpoint import (
    Checkpointer,
    CheckpointError,
    FolderNotWritableError,
    MetricsLog,
    check_writable_folder,
    plot_loss,
    read_metrics,
)
from flax_ln.sharding import (
    batch_sharding,
    local_copy,
    make_mesh,
    process_rows,
    replicated,
    shard_process_batch,
)
from flax_ln.train import gpt_adam, init_train_state

CONFIGS = {
    "music": GPTConfig.music(),  # the book's 6 layers, 8 heads, width 512, vocab 390, block 2048
    "tiny": GPTConfig.music(n_layer=2, n_head=4, n_embd=64, block_size=128),  # seconds on a CPU
}
DTYPES = recipes.DTYPES  # compute dtype; parameters stay float32
KILL_ENV = "FLAX_LN_TEST_SIGKILL_AFTER_STEP"  # tests only: SIGKILL this process once this step is logged


class UsageError(Exception):
    """A problem with the command line, the data or the output folder, reported without a traceback."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config",
        choices=list(CONFIGS),
        default="tiny",
        help="tiny: 2 layers, width 64, block 128; music: the book's 6/8/512, block 2048 (default tiny)",
    )
    p.add_argument("--steps", type=int, default=500, help="train until this many steps in total (default 500)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per example (default: the block size)")
    p.add_argument("--out", default=None, help="output folder (default out/music-CONFIG)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest readable checkpoint in the checkpoint folder"
    )
    p.add_argument(
        "--ckpt-dir",
        default=None,
        help="checkpoint folder (default OUT/checkpoints); on several hosts a shared one, e.g. gs://...",
    )
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps and at the end")
    p.add_argument(
        "--generate-tokens", type=int, default=256, help="ids to sample after the prompt into sample.mid (0: none)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--sample-only",
        type=Path,
        default=None,
        metavar="CHECKPOINT",
        help="no training: sample from this .pt/.safetensors state dict or orbax checkpoint folder",
    )
    p.add_argument(
        "--prompt-midi",
        type=Path,
        default=None,
        help="take the prompt from this MIDI file instead of the held-out piece of the data",
    )
    p.add_argument("--fsdp", type=int, default=1, help="devices that share each parameter (mesh: devices//K x K)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, dropout, data order and sampling seed")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="compute dtype (default float32); parameters, optimizer state, norm statistics, the "
        "attention softmax and the loss stay float32",
    )
    p.add_argument("--data", default=None, help="folder of .mid/.midi files (default: music21's Bach chorales)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N MIDI files (quick runs)")
    p.add_argument("--remat", action="store_true", help="rematerialise each block in the backward pass (less memory)")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the blocks and scan over them (faster compiles; checkpoints then hold the stacked layout)",
    )
    recipes.add_distributed_arguments(p)
    recipes.add_compile_only_arguments(p, "this training step")
    args = p.parse_args(argv)
    recipes.check_distributed_arguments(p, args)
    config = CONFIGS[args.config]
    args.seq_len = args.seq_len or config.block_size
    checks = [
        (args.steps >= 1, "--steps must be >= 1"),
        (args.batch_size >= 1, "--batch-size must be >= 1"),
        (
            1 <= args.seq_len <= config.block_size,
            f"--seq-len must be in [1, {config.block_size}] for --config {args.config}",
        ),
        (args.ckpt_every >= 1, "--ckpt-every must be >= 1"),
        (args.generate_tokens >= 0, "--generate-tokens must be >= 0"),
        (args.sample_only is None or args.generate_tokens >= 1, "--sample-only needs --generate-tokens >= 1"),
        (args.sample_only is None or not args.resume, "--sample-only trains nothing, so --resume does not apply"),
        (args.temperature >= 0, "--temperature must be >= 0"),
        (args.max_files is None or args.max_files >= 1, "--max-files must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            p.error(message)
    args.out = Path(args.out or f"out/music-{args.config}")
    if args.compile_only:
        return args  # nothing is written
    try:  # before any slow work: a run that cannot write its outputs fails now, not at its first save
        check_writable_folder(args.out, "--out")
        check_writable_folder(args.ckpt_dir or args.out / "checkpoints", "--ckpt-dir" if args.ckpt_dir else "--out")
    except FolderNotWritableError as e:
        p.error(str(e))
    return args


def split_files(args) -> tuple[list[Path], Path]:
    """``(training files, held-out piece for the prompt)`` of the data (see the module docstring)."""
    try:
        if args.data is None:
            if jax.process_index() == 0:
                print(f"data: music21's Bach chorales, rendered to MIDI once into {args.out / 'bach_chorales'}")
            files = music.render_bach_chorales(args.out / "bach_chorales", limit=args.max_files)
        else:
            maestro = music.maestro_split(args.data)
            if maestro is not None:
                return maestro["train"][: args.max_files], maestro["test"][0]
            files = music.midi_files(args.data, limit=args.max_files)
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"{'--data' if args.data else 'data'}: {e}") from None
    if len(files) < 2:
        raise UsageError(
            f"{'--data' if args.data else 'data'}: {len(files)} MIDI file(s); need at least 2, "
            "one to train on and one held out for the sampling prompt (raise --max-files)"
        )
    return files[:-1], files[-1]


def load_data(args, files: list[Path]) -> music.MusicDataset:
    try:
        dataset = music.MusicDataset.from_files(files, args.seq_len, args.seed)
    except (OSError, ValueError) as e:
        raise UsageError(f"{'--data' if args.data else 'data'}: {e}") from None
    if jax.process_index() == 0:
        print(f"data: {len(files)} training pieces, {len(dataset)} examples of {args.seq_len} tokens")
    return dataset


def open_checkpoints(args, expect: dict) -> Checkpointer:
    """The checkpoint folder, checked before any slow work so that a wrong --out or --resume fails fast."""
    ckpt_dir = args.ckpt_dir or str(args.out / "checkpoints")
    if args.resume:
        ckpt = Checkpointer(ckpt_dir, create=False)
        try:
            ckpt.check(ckpt.newest_readable_meta(), expect)  # config, seq_len, seed; the data is checked on restore
        except CheckpointError:
            ckpt.close()
            raise
        return ckpt
    ckpt = Checkpointer(ckpt_dir)
    latest = ckpt.latest_step()
    if latest is not None:
        ckpt.close()
        raise UsageError(
            f"{ckpt.directory} already holds checkpoints (latest step {latest}); "
            "pass --resume to continue that run or choose another --out"
        )
    return ckpt


def new_model(config: GPTConfig, seed: int, dtype: str = "float32", remat: bool = False, scan: bool = False) -> GPT:
    return recipes.gpt_model(config, seed=seed, dtype=dtype, remat=remat, scan_layers=scan)


def training_setup(args, config: GPTConfig) -> recipes.TrainingSetup:
    """This script's training step; ``--compile-only`` compiles the same one (``flax_ln.plan``)."""
    return recipes.gpt_setup(
        config,
        batch=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        dtype=args.dtype,
        remat=args.remat,
        scan_layers=args.scan_layers,
    )


def fit(args, config: GPTConfig, mesh, ckpt: Checkpointer, expect: dict, files: list[Path]):
    """Train to ``args.steps`` (from the latest checkpoint with --resume); returns (graphdef, state)."""
    is_main = jax.process_index() == 0
    dataset = load_data(args, files)
    expect = {**expect, "data": dataset.fingerprint}
    setup = training_setup(args, config)  # clip the global norm to 1 as torch does, then Adam(1e-4)
    sharded = recipes.sharded_step(setup, mesh)
    graphdef = sharded.graphdef
    if args.resume:
        state, meta, skipped = ckpt.restore_newest_readable(sharded.abstract_state, expect=expect)
        for error in skipped:
            moved = ckpt.set_aside(error.step)  # every process: process 0 renames, all reload
            if is_main:
                print(
                    f"warning: {error}; resuming from checkpoint {meta['step']} instead, and moved the unreadable "
                    f"one to {moved}",
                    file=sys.stderr,
                )
        start, position = meta["step"], meta["data_position"]
    else:
        state = recipes.init_state(setup, sharded)
        start, position = 0, 0
    rows = process_rows(batch_sharding(mesh), args.batch_size)  # this process's share of every batch: data x fsdp
    train_step = sharded.step

    metrics = MetricsLog(args.out / "metrics.jsonl", keep_through=start, enabled=is_main)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(total=args.steps, initial=start, unit="step", disable=not is_main, dynamic_ncols=True)
    t0 = time.perf_counter()
    first = None  # (step, time) of the first logged step: tokens/s is averaged from there (compilation excluded)
    pending = None  # (step, loss array) not yet logged

    def log_pending():
        # Reading a loss waits for that step only; the next step is already queued behind it.
        nonlocal pending, first
        if pending is None:
            return
        step, loss_array = pending
        pending = None
        loss, now = float(loss_array), time.perf_counter()
        metrics.write({"step": step, "loss": loss, "time": round(now - t0, 4)})
        first = first or (step, now)
        rate = tokens_per_step * (step - first[0]) / (now - first[1]) if step > first[0] else 0.0
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
        bar.update(step - bar.n)
        if os.environ.get(KILL_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)

    for step in range(start + 1, args.steps + 1):
        x, y, position = dataset.batch(position, args.batch_size, rows)  # (B / processes, T) each
        batch = shard_process_batch({"idx": x, "targets": y}, sharded.batch_shardings, args.batch_size)  # (B, T)
        state, loss = train_step(graphdef, state, batch)
        log_pending()
        pending = (step, loss)
        if step % args.ckpt_every == 0 or step == args.steps:
            log_pending()  # the log never lags behind a checkpoint
            ckpt.save(
                step,
                state,
                {**expect, "data_position": position, "batch_size": args.batch_size, "n_examples": len(dataset)},
            )
    log_pending()
    bar.close()
    metrics.close()
    return graphdef, state


def sample(args, model: GPT, prompt_file: Path) -> np.ndarray:
    """Write OUT/sample.mid as the book samples: the opening of ``prompt_file`` continued by ``generate``.

    The prompt is the first ``music.prompt_length(block_size)`` ids (250 for the book's
    model); each new id is drawn from softmax(logits / temperature) over the 388 event ids.
    Returns the ids (prompt included).
    """
    try:
        ids = music.encode_midi(prompt_file)
    except (OSError, ValueError) as e:
        raise UsageError(f"prompt piece: {e}") from None
    prompt = ids[: music.prompt_length(model.config.block_size)]  # (P,)
    if prompt.size == 0:
        raise UsageError(f"prompt piece {prompt_file} has no notes; pass --prompt-midi with another file")
    out = generate(
        model,
        prompt[None],
        args.generate_tokens,
        temperature=args.temperature,
        vocab_limit=music.N_EVENTS,
        rng=jax.random.fold_in(jax.random.key(args.seed), 1),
    )  # (1, P + new)
    out = np.asarray(out)[0]
    if jax.process_index() == 0:
        notes = music.decode_midi(out, args.out / "sample.mid")
        print(
            f"sample.mid: {prompt.size} prompt ids from {prompt_file} + {args.generate_tokens} sampled, "
            f"{len(notes)} notes"
        )
    return out


def load_for_sampling(args, config: GPTConfig) -> GPT:
    """The model of ``--sample-only``: a torch state dict file or an orbax checkpoint folder of this example."""
    path = args.sample_only
    model = new_model(config, args.seed, args.dtype, args.remat, args.scan_layers)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        ckpt = Checkpointer(folder, create=False)
        try:
            graphdef, abstract = jax.eval_shape(
                lambda: init_train_state(
                    new_model(config, args.seed, args.dtype, args.remat, args.scan_layers), gpt_adam()
                )
            )
            state, _ = ckpt.restore(abstract, expect={"config": dataclasses.asdict(config)})
        finally:
            ckpt.close()
        return nnx.merge(graphdef, state.params, state.rest)
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.numpy import load_file

            state_dict = load_file(str(path))
        elif suffix in (".pt", ".pth", ".bin"):
            import torch  # only for this path: reading the book's torch.save output

            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise UsageError(
                f"--sample-only {path}: expected a .pt/.pth/.bin or .safetensors state dict, or a "
                "checkpoint folder of this example"
            )
    except (OSError, RuntimeError, ValueError) as e:
        raise UsageError(f"--sample-only {path}: cannot read it ({type(e).__name__}: {e})") from None
    if not isinstance(state_dict, dict):
        raise UsageError(
            f"--sample-only {path}: expected a state dict (name -> tensor), got "
            f"{type(state_dict).__name__}; save the book's model with torch.save(model.state_dict(), PATH)"
        )
    try:
        load_torch_state_dict(model, state_dict)
    except ConversionError as e:
        raise UsageError(f"--sample-only {path} does not fit --config {args.config}:\n{e}") from None
    return model


def train(args, mesh) -> None:
    config = CONFIGS[args.config]
    if args.sample_only is not None:
        _, prompt_file = split_files(args) if args.prompt_midi is None else (None, args.prompt_midi)
        args.out.mkdir(parents=True, exist_ok=True)
        sample(args, load_for_sampling(args, config), prompt_file)
        return
    expect = {"config": dataclasses.asdict(config), "seq_len": args.seq_len, "seed": args.seed}
    if args.scan_layers:  # the stacked layout; absent from default runs' checkpoints, as before the option existed
        expect["scan_layers"] = True
    ckpt = open_checkpoints(args, expect)
    try:
        train_files, heldout = split_files(args)
        graphdef, state = fit(args, config, mesh, ckpt, expect, train_files)
    finally:
        ckpt.close()  # waits for the last save

    records = read_metrics(args.out / "metrics.jsonl") if jax.process_index() == 0 else []
    if records:
        plot_loss(records, args.out / "loss.png", title=f"music Transformer ({args.config}), seed {args.seed}")
    if args.generate_tokens and jax.process_count() == 1:
        params, rest = jax.device_put((state.params, state.rest), replicated(mesh))
        sample(args, nnx.merge(graphdef, params, rest), args.prompt_midi or heldout)
    elif args.generate_tokens:  # several processes: process 0 samples alone, from a whole copy of the state
        params, rest = local_copy((state.params, state.rest), mesh)
        if jax.process_index() == 0:
            sample(args, nnx.merge(graphdef, params, rest), args.prompt_midi or heldout)
    if records:
        print(
            f"steps {records[0]['step']}..{records[-1]['step']}: loss {records[0]['loss']:.4f} -> "
            f"{records[-1]['loss']:.4f}; outputs in {args.out}"
        )


def compile_only(args) -> int:
    """``--compile-only TOPOLOGY``: the plan of this script's own step for a TPU topology (``flax_ln.plan``)."""
    from flax_ln import plan
    from flax_ln.cli.plan import plan_or_exit

    config = CONFIGS[args.config]
    try:
        request = plan.make_request(
            "music",
            args.compile_only,
            batch=args.batch_size,
            seq_len=args.seq_len,
            dtype=args.dtype,
            fsdp=args.fsdp,
            remat=args.remat,
            config=dataclasses.asdict(config),
        )
    except plan.PlanError as e:
        print(f"train_music.py: error: {str(e).replace('--topology', '--compile-only')}", file=sys.stderr)
        return 2
    request["scan_layers"] = args.scan_layers  # this script's own layout (the planner's default is scanned)
    return plan_or_exit(request, args.plan_json, "train_music.py")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    recipes.join_distributed(args, "train_music.py")
    try:
        mesh = make_mesh(args.fsdp)
    except ValueError as e:
        print(f"train_music.py: error: {e}", file=sys.stderr)
        return 2
    n = jax.device_count()
    if args.batch_size % n:
        print(
            f"train_music.py: error: --batch-size {args.batch_size} must be a multiple of the device count "
            f"{n}: the batch is split over every device (mesh data {mesh.shape['data']} x fsdp {args.fsdp}); "
            f"pick a --batch-size like {n * max(1, args.batch_size // n)}",
            file=sys.stderr,
        )
        return 2
    try:
        train(args, mesh)
    except (CheckpointError, UsageError) as e:
        print(f"train_music.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train chapter 14's music Transformer (``flax_ln.GPT``) on MIDI files, then sample a new piece.

Run (CPU, seconds):     python examples/train_music.py --config tiny --steps 500 --out out/music-tiny
The book's model:       python examples/train_music.py --config music --steps 20000 --out out/music
Continue a run:         add --resume (same --out); it continues exactly where the last checkpoint left off.
                        If the newest checkpoint cannot be read (damaged files), a one-line warning says
                        why, the run resumes from the newest one that reads, and the damaged folder is
                        renamed to STEP.unreadable (kept for inspection; orbax ignores it).
Several devices:        --fsdp K shards parameters and optimizer state over K devices and the batch over
                        the other devices // K; on a multi-host slice run the same command on every
                        host with --distributed and a shared --ckpt-dir (e.g. gs://BUCKET/run).

Data: the Bach chorales of music21's corpus, rendered to MIDI once into OUT/bach_chorales
(no download; about two minutes; reuse them with ``--data OUT/bach_chorales``), or
``--data DIR`` with .mid/.midi files; tokenised by ``flax_ln.music``.
Training as the book: Adam 1e-4 after clipping the gradient norm to 1, cross-entropy that
ignores the padding id 389, dropout 0.1.

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

from flax_ln import GPT, GPTConfig, generate, music
from flax_ln.checkpoint import Checkpointer, CheckpointError, MetricsLog, plot_loss, read_metrics
from flax_ln.checkpoint import FolderNotWritableError, check_writable_folder
from flax_ln.sharding import batch_sharding, initialize_distributed, make_mesh, replicated, shard_batch, state_shardings
from flax_ln.train import gpt_adam, gpt_loss, init_train_state, make_train_step

CONFIGS = {
    "music": GPTConfig.music(),  # the book's 6 layers, 8 heads, width 512, vocab 390, block 2048
    "tiny": GPTConfig.music(n_layer=2, n_head=4, n_embd=64, block_size=128),  # seconds on a CPU
}
KILL_ENV = "FLAX_LN_TEST_SIGKILL_AFTER_STEP"  # tests only: SIGKILL this process once this step is logged


class UsageError(Exception):
    """A problem with the command line, the data or the output folder, reported without a traceback."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=list(CONFIGS), default="tiny",
                   help="tiny: 2 layers, width 64, block 128; music: the book's 6/8/512, block 2048 (default tiny)")
    p.add_argument("--steps", type=int, default=500, help="train until this many steps in total (default 500)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per example (default: the block size)")
    p.add_argument("--out", default=None, help="output folder (default out/music-CONFIG)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest readable checkpoint in the checkpoint folder")
    p.add_argument("--ckpt-dir", default=None,
                   help="checkpoint folder (default OUT/checkpoints); on several hosts a shared one, e.g. gs://...")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps and at the end")
    p.add_argument("--generate-tokens", type=int, default=256, help="tokens to sample into sample.mid (0: none)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--fsdp", type=int, default=1, help="devices that share each parameter (mesh: devices//K x K)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, dropout, data order and sampling seed")
    p.add_argument("--data", default=None, help="folder of .mid/.midi files (default: music21's Bach chorales)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N MIDI files (quick runs)")
    p.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() (multi-host)")
    args = p.parse_args(argv)
    config = CONFIGS[args.config]
    args.seq_len = args.seq_len or config.block_size
    checks = [
        (args.steps >= 1, "--steps must be >= 1"),
        (args.batch_size >= 1, "--batch-size must be >= 1"),
        (1 <= args.seq_len <= config.block_size, f"--seq-len must be in [1, {config.block_size}] for --config "
                                                 f"{args.config}"),
        (args.ckpt_every >= 1, "--ckpt-every must be >= 1"),
        (args.generate_tokens >= 0, "--generate-tokens must be >= 0"),
        (args.temperature >= 0, "--temperature must be >= 0"),
        (args.max_files is None or args.max_files >= 1, "--max-files must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            p.error(message)
    args.out = Path(args.out or f"out/music-{args.config}")
    try:  # before any slow work: a run that cannot write its outputs fails now, not at its first save
        check_writable_folder(args.out, "--out")
        check_writable_folder(args.ckpt_dir or args.out / "checkpoints", "--ckpt-dir" if args.ckpt_dir else "--out")
    except FolderNotWritableError as e:
        p.error(str(e))
    return args


def load_data(args) -> music.MusicDataset:
    try:
        if args.data is None:
            if jax.process_index() == 0:
                print(f"data: music21's Bach chorales, rendered to MIDI once into {args.out / 'bach_chorales'}")
            files = music.render_bach_chorales(args.out / "bach_chorales", limit=args.max_files)
        else:
            files = music.midi_files(args.data, limit=args.max_files)
        dataset = music.MusicDataset.from_files(files, args.seq_len, args.seed)
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"{'--data' if args.data else 'data'}: {e}") from None
    if jax.process_index() == 0:
        print(f"data: {len(files)} MIDI files, {len(dataset)} examples of {args.seq_len + 1} tokens")
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
        raise UsageError(f"{ckpt.directory} already holds checkpoints (latest step {latest}); "
                         "pass --resume to continue that run or choose another --out")
    return ckpt


def fit(args, config: GPTConfig, mesh, ckpt: Checkpointer, expect: dict):
    """Train to ``args.steps`` (from the latest checkpoint with --resume); returns (graphdef, state, dataset)."""
    is_main = jax.process_index() == 0
    dataset = load_data(args)
    expect = {**expect, "data": dataset.fingerprint}
    tx = gpt_adam()  # clip the global norm to 1 as torch does, then Adam(1e-4)

    def make_model() -> GPT:
        model = GPT(config, rngs=nnx.Rngs(args.seed))
        model.train()  # dropout on; its RNG state is split into state.rest and checkpointed with it
        return model

    graphdef, abstract = jax.eval_shape(lambda: init_train_state(make_model(), tx))
    shardings = state_shardings(abstract, mesh)
    if args.resume:
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
        state, meta, skipped = ckpt.restore_newest_readable(target, expect=expect)
        for error in skipped if is_main else ():
            print(f"warning: {error}; resuming from checkpoint {meta['step']} instead, and moved the unreadable "
                  f"one to {ckpt.set_aside(error.step)}", file=sys.stderr)
        start, position = meta["step"], meta["data_position"]
    else:
        state = jax.jit(lambda: init_train_state(make_model(), tx)[1], out_shardings=shardings)()
        start, position = 0, 0
    data_sharding = batch_sharding(mesh)
    train_step = make_train_step(gpt_loss, tx, state_sharding=shardings, batch_sharding=data_sharding)

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
        x, y, position = dataset.batch(position, args.batch_size)  # (B, T) each
        state, loss = train_step(graphdef, state, shard_batch({"idx": x, "targets": y}, data_sharding))
        log_pending()
        pending = (step, loss)
        if step % args.ckpt_every == 0 or step == args.steps:
            log_pending()  # the log never lags behind a checkpoint
            ckpt.save(step, state, {**expect, "data_position": position, "batch_size": args.batch_size,
                                    "n_examples": len(dataset)})
    log_pending()
    bar.close()
    metrics.close()
    return graphdef, state, dataset


def sample(args, config: GPTConfig, mesh, graphdef, state, dataset) -> None:
    """Write OUT/sample.mid: the opening of the first piece (in file order) continued by ``generate``."""
    opening = dataset.examples[0]  # (T + 1,)
    n = int(np.argmax(opening >= music.EOS)) if (opening >= music.EOS).any() else opening.size
    prompt = opening[:max(1, min(n, config.block_size // 4))]  # at most a quarter of the context
    params, rest = jax.device_put((state.params, state.rest), replicated(mesh))
    model = nnx.merge(graphdef, params, rest)
    ids = generate(model, prompt[None], args.generate_tokens, temperature=args.temperature,
                   rng=jax.random.fold_in(jax.random.key(args.seed), 1))  # (1, prompt + new), KV cache
    if jax.process_index() == 0:
        notes = music.decode_midi(np.asarray(ids)[0], args.out / "sample.mid")
        print(f"sample.mid: {len(prompt)} prompt tokens + {args.generate_tokens} sampled, {len(notes)} notes")


def train(args) -> None:
    config = CONFIGS[args.config]
    try:
        mesh = make_mesh(args.fsdp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.batch_size % mesh.shape["data"]:
        raise UsageError(f"--batch-size {args.batch_size} must be a multiple of the mesh's data axis "
                         f"({mesh.shape['data']} = {jax.device_count()} devices // --fsdp {args.fsdp})")
    expect = {"config": dataclasses.asdict(config), "seq_len": args.seq_len, "seed": args.seed}
    ckpt = open_checkpoints(args, expect)
    try:
        graphdef, state, dataset = fit(args, config, mesh, ckpt, expect)
    finally:
        ckpt.close()  # waits for the last save

    records = read_metrics(args.out / "metrics.jsonl") if jax.process_index() == 0 else []
    if records:
        plot_loss(records, args.out / "loss.png", title=f"music Transformer ({args.config}), seed {args.seed}")
    if args.generate_tokens:
        sample(args, config, mesh, graphdef, state, dataset)
    if records:
        print(f"steps {records[0]['step']}..{records[-1]['step']}: loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}; outputs in {args.out}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.distributed:
        initialize_distributed()
    try:
        train(args)
    except (CheckpointError, UsageError) as e:
        print(f"train_music.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

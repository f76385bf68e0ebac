"""Chapter 10: train the book's encoder-decoder Transformer, then translate with greedy decoding.

Trains ``flax_ln.make_model`` with chapter 10's recipe (Adam 0.9/0.98/1e-9 under the Noam
schedule, label smoothing 0.1 through a summed KL divergence with a padding index) using
the jitted train step of ``flax_ln.train``, on CPU, GPU or TPU, whatever JAX sees. Then
it decodes held-out sources greedily (``flax_ln.greedy_decode``) and prints the
exact-match rate and a few examples.

Data, ``--data FILE``: a UTF-8 text file with one sentence pair per line,
``source<TAB>target``, for example ``ich bin müde<TAB>i am tired``. Each side is split
on whitespace into word tokens (tokenise and lower-case beforehand if you want that);
blank lines are skipped; a line without exactly one tab is an error. Pairs longer than
``--max-len`` tokens on either side are dropped. Each side gets its own word-level
vocabulary, built from the training pairs, with ``<pad>`` = 0, ``<s>`` = 1 (begin),
``</s>`` = 2 (end) and ``<unk>`` = 3; sources are ``words </s>``, targets ``<s> words </s>``.
``--holdout`` pairs (at most a tenth of the file, chosen at random with ``--seed``) are
kept out of training and used for the exact-match evaluation.

Without ``--data`` it runs the book's copy task, needing no download: random sequences
of ``--copy-len`` symbols out of ``--copy-symbols`` that the model must reproduce, with
held-out sequences that never occur in training.

Outputs in ``--out`` (default ``out/translation``): ``metrics.jsonl`` (one JSON object
per step: ``step``, ``loss`` per target token, ``lr``), ``loss.png`` and ``eval.json``
(exact-match rate and examples).

Several devices: the batch is split over every device (``--batch-size`` a multiple of the
device count) and ``--fsdp K`` shards parameters and optimizer state over K of them
(``flax_ln.sharding``). ``--compile-only TOPOLOGY`` (e.g. ``v5e:2x4``) compiles this exact
training step for that TPU topology on this machine (libtpu, no TPU needed) and prints the
memory per chip and a roofline bound instead of training (exit 0 fits, 1 does not, 2 error).

Several hosts: run the same command on every host with ``--distributed`` (a TPU pod slice:
JAX finds its peers) or ``--coordinator HOST:PORT --num-processes N --process-id I`` (any
cluster, or N processes rehearsing on one machine). Each process reads only its share of
every global batch; process 0 prints and writes the outputs and runs the evaluation.

Run: python examples/train_translation.py                       # copy task, ~30 s on 2 CPU cores
     python examples/train_translation.py --data pairs.tsv --layers 6 --d-model 256 --steps 20000
     python examples/train_translation.py --data pairs.tsv --layers 6 --d-model 256 --compile-only v5e:2x4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import flax_ln
from flax_ln import recipes
from flax_ln.sharding import batch_sharding, local_copy, make_mesh, process_rows, shard_process_batch
from flax_ln.train import make_batch, noam_schedule

PAD, BOS, EOS, UNK = recipes.PAD, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


class Vocab:
    """A word-level vocabulary: the four specials, then words by decreasing frequency (ties alphabetical)."""

    def __init__(self, sentences: list[list[str]]):
        counts = collections.Counter(word for words in sentences for word in words)
        self.itos = list(SPECIALS) + sorted((w for w in counts if w not in SPECIALS), key=lambda w: (-counts[w], w))
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: list[str]) -> list[int]:
        return [self.stoi.get(w, UNK) for w in words]

    def decode(self, ids) -> list[str]:
        """Words of ``ids`` after the leading ``<s>`` (if any) up to the first ``</s>``."""
        ids = list(ids)
        if ids and ids[0] == BOS:
            ids = ids[1:]
        if EOS in ids:
            ids = ids[: ids.index(EOS)]
        return [self.itos[i] for i in ids]


def read_pairs(path: Path) -> list[tuple[list[str], list[str]]]:
    """``(source words, target words)`` for every non-blank ``source<TAB>target`` line of ``path``."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2 or not fields[0].split() or not fields[1].split():
                raise SystemExit(
                    f"{path}:{lineno}: expected 'source<TAB>target' with words on both sides, got {line[:80]!r}"
                )
            pairs.append((fields[0].split(), fields[1].split()))
    if not pairs:
        raise SystemExit(f"{path}: no sentence pairs found; expected lines 'source<TAB>target'")
    return pairs


def copy_task(n_train: int, n_holdout: int, length: int, symbols: int, rng: np.random.Generator):
    """The book's copy task as pairs of word lists: held-out sequences never occur in training."""
    seqs = rng.integers(1, symbols + 1, size=(n_train + n_holdout, length))
    holdout = {tuple(s) for s in seqs[:n_holdout]}
    train = [s for s in seqs[n_holdout:] if tuple(s) not in holdout]

    def as_pair(seq):
        words = [str(x) for x in seq]
        return words, list(words)

    return [as_pair(s) for s in train], [as_pair(s) for s in seqs[:n_holdout]]


def to_arrays(pairs, src_vocab: Vocab, tgt_vocab: Vocab, src_len: int, tgt_len: int):
    """(src, tgt) int32 arrays padded with ``<pad>``: ``words </s>`` and ``<s> words </s>``."""
    src = np.full((len(pairs), src_len), PAD, np.int32)
    tgt = np.full((len(pairs), tgt_len), PAD, np.int32)
    for i, (s, t) in enumerate(pairs):
        s_ids = src_vocab.encode(s) + [EOS]
        t_ids = [BOS] + tgt_vocab.encode(t) + [EOS]
        src[i, : len(s_ids)] = s_ids
        tgt[i, : len(t_ids)] = t_ids
    return src, tgt


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """Endless index batches: a fresh permutation every epoch; a last partial batch is dropped."""
    if n < batch_size:
        raise SystemExit(f"only {n} training pairs for --batch-size {batch_size}; lower --batch-size")
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def evaluate(model, src, refs, tgt_vocab: Vocab, max_len: int, chunk: int = 256):
    """Greedy-decode ``src`` in fixed-size chunks; returns the decoded word lists and the exact-match rate."""
    hyps = []
    for start in range(0, len(src), chunk):
        part = src[start : start + chunk]
        n = len(part)
        if n < chunk and len(src) > chunk:  # pad the last chunk to the same shape: one compilation
            part = np.concatenate([part, np.repeat(part[-1:], chunk - n, 0)])
        part = jnp.asarray(part)
        ys = flax_ln.greedy_decode(model, part, flax_ln.make_src_mask(part, PAD), max_len, BOS)
        hyps += [tgt_vocab.decode(row) for row in np.asarray(ys)[:n]]
    exact = float(np.mean([h == r for h, r in zip(hyps, refs)]))
    return hyps, exact


def save_plot(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("label-smoothed loss per token")
    ax.set_yscale("log")
    ax.set_title("encoder-decoder training (chapter 10)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, help="tab-separated 'source<TAB>target' file; default: the copy task")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, help="N, layers in the encoder and in the decoder (book: 6)")
    p.add_argument("--d-model", type=int, default=64, help="model width (book: 256)")
    p.add_argument("--d-ff", type=int, help="feed-forward width (default 4 * d-model; book: 1024)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (book: 8)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--ffn-activation",
        choices=["none", "relu"],
        default="none",
        help="none: the book's feed-forward network; relu: the Annotated Transformer's",
    )
    p.add_argument("--factor", type=float, default=1.0, help="Noam schedule factor")
    p.add_argument("--warmup", type=int, default=200, help="Noam warm-up steps (book: 2000)")
    p.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    p.add_argument("--max-len", type=int, default=64, help="drop pairs with more words than this on either side")
    p.add_argument("--holdout", type=int, default=200, help="pairs held out for the exact-match evaluation")
    p.add_argument("--copy-len", type=int, default=10, help="copy task: symbols per sequence")
    p.add_argument("--copy-symbols", type=int, default=10, help="copy task: distinct symbols")
    p.add_argument("--copy-pairs", type=int, default=20000, help="copy task: training sequences")
    p.add_argument("--examples", type=int, default=5, help="held-out examples to print")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/translation"), help="output folder")
    p.add_argument("--dtype", choices=list(recipes.DTYPES), default="float32", help="compute dtype (default float32)")
    p.add_argument("--fsdp", type=int, default=1, help="devices that share each parameter (mesh: devices//K x K)")
    recipes.add_distributed_arguments(p)
    recipes.add_compile_only_arguments(p, "this training step")
    args = p.parse_args(argv)
    recipes.check_distributed_arguments(p, args)
    for name in (
        "steps",
        "batch_size",
        "layers",
        "d_model",
        "heads",
        "warmup",
        "max_len",
        "copy_len",
        "copy_symbols",
        "copy_pairs",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.holdout < 0:
        p.error(f"--holdout must be >= 0, got {args.holdout}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    return args


def compile_only(args, setup_kwargs: dict) -> int:
    """``--compile-only TOPOLOGY``: the plan of this script's own step for a TPU topology (``flax_ln.plan``)."""
    from flax_ln import plan
    from flax_ln.cli.plan import plan_or_exit

    kwargs = {k: v for k, v in setup_kwargs.items() if k not in ("batch", "seed")}
    try:
        request = plan.make_request(
            "encoder-decoder",
            args.compile_only,
            batch=args.batch_size,
            seq_len=kwargs["src_len"],
            dtype=args.dtype,
            fsdp=args.fsdp,
            encoder_decoder=kwargs,
        )
    except plan.PlanError as e:
        print(f"train_translation.py: error: {str(e).replace('--topology', '--compile-only')}", file=sys.stderr)
        return 2
    return plan_or_exit(request, args.plan_json, "train_translation.py")


def main(argv=None) -> dict | int:
    args = parse_args(argv)
    if not args.compile_only:
        recipes.join_distributed(
            args, "train_translation.py"
        )  # before anything touches JAX; with no distributed flag, nothing
    is_main = True if args.compile_only else jax.process_index() == 0  # process 0 prints and writes the outputs
    say = print if is_main else lambda *a, **k: None
    rng = np.random.default_rng(args.seed)

    if args.data is None:
        train_pairs, test_pairs = copy_task(args.copy_pairs, args.holdout, args.copy_len, args.copy_symbols, rng)
        say(
            f"copy task: {len(train_pairs)} training and {len(test_pairs)} held-out sequences of "
            f"{args.copy_len} symbols out of {args.copy_symbols}"
        )
    else:
        pairs = read_pairs(args.data)
        kept = [p for p in pairs if len(p[0]) <= args.max_len and len(p[1]) <= args.max_len]
        if len(kept) < len(pairs):
            say(f"dropped {len(pairs) - len(kept)} pairs longer than --max-len {args.max_len}")
        order = rng.permutation(len(kept))
        n_test = min(args.holdout, len(kept) // 10)
        test_pairs = [kept[i] for i in order[:n_test]]
        train_pairs = [kept[i] for i in order[n_test:]]
        say(f"{args.data}: {len(train_pairs)} training and {len(test_pairs)} held-out pairs")

    src_vocab = Vocab([s for s, _ in train_pairs])
    tgt_vocab = Vocab([t for _, t in train_pairs])
    src_len = max(len(s) for s, _ in train_pairs + test_pairs) + 1  # + </s>
    tgt_len = max(len(t) for _, t in train_pairs + test_pairs) + 2  # + <s> ... </s>
    src_train, tgt_train = to_arrays(train_pairs, src_vocab, tgt_vocab, src_len, tgt_len)
    src_test, _ = to_arrays(test_pairs, src_vocab, tgt_vocab, src_len, tgt_len)
    say(f"vocabularies: source {len(src_vocab)}, target {len(tgt_vocab)} words (specials included)")

    d_ff = args.d_ff or 4 * args.d_model
    setup_kwargs = dict(  # this script's training step; --compile-only compiles the same one (flax_ln.plan)
        src_vocab=len(src_vocab),
        tgt_vocab=len(tgt_vocab),
        batch=args.batch_size,
        src_len=src_len,
        tgt_len=tgt_len,
        layers=args.layers,
        d_model=args.d_model,
        d_ff=d_ff,
        heads=args.heads,
        dropout=args.dropout,
        ffn_activation=None if args.ffn_activation == "none" else "relu",
        factor=args.factor,
        warmup=args.warmup,
        smoothing=args.smoothing,
        seed=args.seed,
    )
    if args.compile_only:
        return compile_only(args, setup_kwargs)
    try:
        mesh = make_mesh(args.fsdp)
    except ValueError as e:
        raise SystemExit(f"train_translation.py: error: {e}") from None
    if args.batch_size % jax.device_count():
        n = jax.device_count()
        print(
            f"train_translation.py: error: --batch-size {args.batch_size} must be a multiple of the device count "
            f"{n}: the batch is split over every device (mesh data {mesh.shape['data']} x fsdp {args.fsdp}); "
            f"pick a --batch-size like {n * max(1, args.batch_size // n)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    setup = recipes.encoder_decoder_setup(dtype=args.dtype, **setup_kwargs)
    sharded = recipes.sharded_step(setup, mesh)
    lr_at = noam_schedule(args.d_model, factor=args.factor, warmup=args.warmup)
    step_fn, graphdef = sharded.step, sharded.graphdef
    state = recipes.init_state(setup, sharded)  # created with its shardings, which may span several processes
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    say(
        f"model: N={args.layers} d_model={args.d_model} d_ff={d_ff} h={args.heads}, {n_params:,} parameters, "
        f"on {jax.devices()[0].platform}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    losses: list[float] = []
    start = time.perf_counter()
    index_batches = batches(len(src_train), args.batch_size, rng)  # global batches: the same on every process
    rows = process_rows(batch_sharding(mesh), args.batch_size)  # this process's share of each: all rows on one
    target_tokens = np.sum(tgt_train[:, 1:] != PAD, axis=1)  # per pair: a batch's ntokens counts the whole batch
    with (
        open(args.out / "metrics.jsonl", "w") if is_main else open(os.devnull, "w") as metrics,
        tqdm(range(1, args.steps + 1), desc="train", mininterval=0.5, disable=not is_main) as bar,
    ):
        for step in bar:
            global_idx = next(index_batches)
            idx = global_idx[rows]
            batch = make_batch(src_train[idx], tgt_train[idx], PAD)
            batch["ntokens"] = np.int32(target_tokens[global_idx].sum())  # the global batch's, on every process
            state, loss = step_fn(graphdef, state, shard_process_batch(batch, sharded.batch_shardings, args.batch_size))
            loss = float(loss)
            if not np.isfinite(loss):
                raise SystemExit(f"step {step}: the loss is {loss}; lower --factor or raise --warmup")
            losses.append(loss)
            metrics.write(json.dumps({"step": step, "loss": loss, "lr": float(lr_at(step - 1))}) + "\n")
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    train_seconds = time.perf_counter() - start
    if is_main:
        save_plot(losses, args.out / "loss.png")

    model = setup.make_model()
    if jax.process_count() == 1:
        nnx.update(model, state.params, state.rest)
    else:  # process 0 evaluates alone, on a whole copy of the state
        nnx.update(model, *local_copy((state.params, state.rest), mesh))
        if not is_main:
            return {"steps": args.steps, "final_loss": losses[-1]}
    refs = [t for _, t in test_pairs]
    result = {
        "steps": args.steps,
        "train_seconds": round(train_seconds, 2),
        "final_loss": losses[-1],
        "heldout": len(test_pairs),
    }
    if test_pairs:
        hyps, exact = evaluate(model, src_test, refs, tgt_vocab, tgt_len)
        result["exact_match"] = exact
        result["examples"] = [
            {"source": " ".join(s), "reference": " ".join(t), "greedy": " ".join(h)}
            for (s, t), h in zip(test_pairs[: args.examples], hyps)
        ]
        say(
            f"trained {args.steps} steps in {train_seconds:.1f} s, final loss {losses[-1]:.4f}; "
            f"greedy exact match on {len(test_pairs)} held-out pairs: {exact:.1%}"
        )
        for ex in result["examples"]:
            mark = "ok" if ex["greedy"] == ex["reference"] else "xx"
            say(
                f"  [{mark}] source:    {ex['source']}\n       reference: {ex['reference']}\n"
                f"       greedy:    {ex['greedy']}"
            )
    else:
        say(f"trained {args.steps} steps in {train_seconds:.1f} s, final loss {losses[-1]:.4f}; no held-out pairs")
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {args.out / 'metrics.jsonl'}, {args.out / 'loss.png'}, {args.out / 'eval.json'}")
    return result


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)

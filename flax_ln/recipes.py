"""The examples' training setups as functions: the scripts and the planner (:mod:`flax_ln.plan`) build one step.

A :class:`TrainingSetup` is everything that decides a training step's program: how the
model is built, the optax transformation, the loss, and the shapes of one batch.
:func:`sharded_step` turns it into the jitted step on a ``(data, fsdp)`` mesh with the
shardings of :mod:`flax_ln.sharding`. ``examples/train_music.py`` and
``examples/train_translation.py`` train with exactly this step; the planner compiles it
for a TPU topology instead. Nothing here allocates parameters: the state's shapes come
from ``jax.eval_shape``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from flax_ln.models.encoder_decoder import EncoderDecoderConfig, Transformer
from flax_ln.models.gpt import GPT, GPTConfig
from flax_ln.sharding import DATA, FSDP, batch_shardings, initialize_distributed, state_shardings
from flax_ln.train import (
    LossFn,
    TrainState,
    encoder_decoder_loss,
    gpt_adam,
    gpt_loss,
    init_train_state,
    make_batch,
    make_train_step,
    noam_adam,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # compute dtypes; parameters stay float32
PAD = 0  # the encoder-decoder examples' padding id


class TrainingSetup(NamedTuple):
    """What a training step is made of.

    Attributes:
      make_model: builds the model in training mode (dropout on); called under ``jax.eval_shape`` or ``jax.jit``.
      tx: the optax transformation.
      loss_fn: ``(model, batch) -> scalar loss``.
      batch: one global batch as a pytree of ``jax.ShapeDtypeStruct``.
    """

    make_model: Callable[[], nnx.Module]
    tx: optax.GradientTransformation
    loss_fn: LossFn
    batch: Any


class ShardedStep(NamedTuple):
    """A :class:`TrainingSetup`'s jitted step on a mesh, with the shardings it takes and returns.

    Attributes:
      graphdef: the model's static graph (the step's first, static argument).
      abstract_state: the :class:`~flax_ln.train.TrainState` as ``ShapeDtypeStruct`` s, each carrying its sharding.
      state_shardings: the state's shardings (parameters and optimizer state split over ``fsdp``).
      batch_shardings: the batch's shardings (split over ``data`` and ``fsdp``).
      abstract_batch: the batch as ``ShapeDtypeStruct`` s carrying their shardings.
      step: ``step(graphdef, state, batch) -> (state, loss)``, from :func:`flax_ln.train.make_train_step`.
    """

    graphdef: nnx.GraphDef
    abstract_state: TrainState
    state_shardings: Any
    batch_shardings: Any
    abstract_batch: Any
    step: Any  # the jitted function (``jax.jit``'s wrapper: call it, or ``.trace``/``.lower`` it)


def gpt_model(
    config: GPTConfig, *, seed: int = 0, dtype: str = "float32", remat: bool = False, scan_layers: bool = False
) -> GPT:
    """A :class:`~flax_ln.GPT` for training: ``dtype`` compute (float32 parameters), dropout on."""
    model = GPT(config, dtype=DTYPES[dtype], remat=remat, scan_layers=scan_layers, rngs=nnx.Rngs(seed))
    model.train()  # dropout on; its RNG state is split into state.rest and checkpointed with it
    return model


def gpt_setup(
    config: GPTConfig,
    *,
    batch: int,
    seq_len: int,
    seed: int = 0,
    dtype: str = "float32",
    remat: bool = False,
    scan_layers: bool = False,
) -> TrainingSetup:
    """Chapters 11-14's step: :func:`gpt_model`, clip-to-1 + Adam 1e-4 (:func:`~flax_ln.gpt_adam`), ``gpt_loss``."""
    ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)  # (B, T)
    return TrainingSetup(
        lambda: gpt_model(config, seed=seed, dtype=dtype, remat=remat, scan_layers=scan_layers),
        gpt_adam(),
        gpt_loss,
        {"idx": ids, "targets": ids},
    )


def encoder_decoder_model(config: EncoderDecoderConfig, *, seed: int = 0, dtype: str = "float32") -> Transformer:
    """The encoder-decoder of ``config`` for training: ``dtype`` compute (float32 parameters), dropout on."""
    model = Transformer.from_config(config, dtype=DTYPES[dtype], rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    model.train()
    return model


def encoder_decoder_setup(
    src_vocab: int,
    tgt_vocab: int,
    *,
    batch: int,
    src_len: int,
    tgt_len: int,
    layers: int = 6,
    d_model: int = 256,
    d_ff: int = 1024,
    heads: int = 8,
    dropout: float = 0.1,
    ffn_activation: str | None = None,
    factor: float = 1.0,
    warmup: int = 2000,
    smoothing: float = 0.1,
    seed: int = 0,
    dtype: str = "float32",
) -> TrainingSetup:
    """Chapter 10's step: the encoder-decoder under Noam Adam with label smoothing (``examples/train_translation.py``).

    The model is :func:`encoder_decoder_model` of ``EncoderDecoderConfig(src_vocab, tgt_vocab,
    N=layers, d_model, d_ff, h=heads, dropout, ffn_activation)``, whose checks apply; the
    sizes' defaults are :meth:`~flax_ln.EncoderDecoderConfig.chapter10`'s. The keywords are the
    examples' command-line names, which ``flax-ln plan`` requests carry. ``tgt_len`` counts the
    target with its ``<s>``: the decoder reads ``tgt_len - 1`` ids (:func:`~flax_ln.make_batch`).
    """
    config = EncoderDecoderConfig(
        src_vocab,
        tgt_vocab,
        N=layers,
        d_model=d_model,
        d_ff=d_ff,
        h=heads,
        dropout=dropout,
        ffn_activation=ffn_activation,
    )
    src = jax.ShapeDtypeStruct((batch, src_len), jnp.int32)  # (B, S)
    tgt = jax.ShapeDtypeStruct((batch, tgt_len), jnp.int32)  # (B, T + 1)
    return TrainingSetup(
        lambda: encoder_decoder_model(config, seed=seed, dtype=dtype),
        noam_adam(config.d_model, factor=factor, warmup=warmup),
        encoder_decoder_loss(padding_idx=PAD, smoothing=smoothing),
        jax.eval_shape(lambda s, t: make_batch(s, t, PAD), src, tgt),
    )


def sharded_step(
    setup: TrainingSetup, mesh: Mesh, *, donate: bool = True, batch_axes: Sequence[str] = (DATA, FSDP)
) -> ShardedStep:
    """``setup``'s train step on ``mesh``: the state split by :func:`~flax_ln.sharding.state_shardings`, the batch
    by :func:`~flax_ln.sharding.batch_shardings` over ``batch_axes`` (default ``data`` and ``fsdp``: every device);
    no parameter allocated."""
    graphdef, abstract = jax.eval_shape(lambda: init_train_state(setup.make_model(), setup.tx))
    shardings = state_shardings(abstract, mesh)
    batch_sh = batch_shardings(setup.batch, mesh, batch_axes)

    def placed(tree, sh):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)

    step = make_train_step(setup.loss_fn, setup.tx, donate=donate, state_sharding=shardings, batch_sharding=batch_sh)
    return ShardedStep(graphdef, placed(abstract, shardings), shardings, batch_sh, placed(setup.batch, batch_sh), step)


def init_state(setup: TrainingSetup, sharded: ShardedStep) -> TrainState:
    """The initial train state, created directly with its shardings (one jitted initialisation)."""
    return jax.jit(lambda: init_train_state(setup.make_model(), setup.tx)[1], out_shardings=sharded.state_shardings)()


def add_compile_only_arguments(parser, step: str) -> None:
    """An example's ``--compile-only TOPOLOGY`` and ``--plan-json PATH`` (see :mod:`flax_ln.plan`).

    Args:
      parser: the example's ``argparse.ArgumentParser``.
      step: what is compiled instead of run, for the help text (e.g. ``"this training step"``).
    """
    parser.add_argument(
        "--compile-only",
        metavar="TOPOLOGY",
        help=f"compile {step} for a TPU topology (e.g. v5e:2x4) and print the plan; nothing runs",
    )
    parser.add_argument("--plan-json", metavar="PATH", help="with --compile-only: also write the plan as JSON")


DISTRIBUTED_ADDRESS = ("coordinator", "num_processes", "process_id")  # the flags given together


def add_distributed_arguments(parser) -> None:
    """An example's multi-host flags: ``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id``,
    ``--distributed-timeout``.

    Check them after parsing with :func:`check_distributed_arguments`, join with
    :func:`join_distributed`.

    Args:
      parser: the example's ``argparse.ArgumentParser``.
    """
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-host run; alone: JAX detects the cluster (Cloud TPU, SLURM, ...); "
        "implied by --coordinator/--num-processes/--process-id",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (all processes pass the same)")
    parser.add_argument("--num-processes", type=int, metavar="N", help="how many processes the run has")
    parser.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1")
    parser.add_argument(
        "--distributed-timeout",
        type=int,
        default=300,
        metavar="SECONDS",
        help="exit with an error if the processes have not all joined within this time, or a peer "
        "stops answering for this long (default 300)",
    )


def check_distributed_arguments(parser, args) -> None:
    """``parser.error`` (exit 2) unless the distributed flags fit together; sets ``args.distributed`` if implied."""
    flags = {name: f"--{name.replace('_', '-')}" for name in DISTRIBUTED_ADDRESS}
    given = [name for name in DISTRIBUTED_ADDRESS if getattr(args, name) is not None]
    if given and len(given) < len(DISTRIBUTED_ADDRESS):
        missing = [flags[name] for name in DISTRIBUTED_ADDRESS if name not in given]
        parser.error(
            f"--coordinator, --num-processes and --process-id are given together; missing {' and '.join(missing)}"
        )
    if args.distributed_timeout < 1:
        parser.error(f"--distributed-timeout must be >= 1 second, got {args.distributed_timeout}")
    if given:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--coordinator must be HOST:PORT (e.g. 10.0.0.2:1234), got {args.coordinator!r}")
        if args.num_processes < 1:
            parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(
                f"--process-id must be in 0 .. {args.num_processes - 1} (--num-processes), got {args.process_id}"
            )
        args.distributed = True


def join_distributed(args, prog: str) -> None:
    """:func:`~flax_ln.sharding.initialize_distributed` with an example's checked flags, if ``--distributed``.

    A run JAX refuses to join (``--distributed`` alone where it detects no cluster) exits 2 with
    one line, ``PROG: error: ...``.

    Args:
      args: the parsed flags (:func:`add_distributed_arguments`, :func:`check_distributed_arguments`).
      prog: the script's name, for the message.
    """
    if not args.distributed:
        return
    try:
        initialize_distributed(
            args.coordinator, args.num_processes, args.process_id, timeout_s=args.distributed_timeout
        )
    except (ValueError, RuntimeError) as e:
        hint = (
            ""
            if args.coordinator
            else "; outside a cluster JAX detects, give --coordinator, --num-processes and --process-id"
        )
        print(f"{prog}: error: --distributed: cannot join the run ({e}){hint}", file=sys.stderr)
        raise SystemExit(2) from None

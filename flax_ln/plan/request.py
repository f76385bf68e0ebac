"""A plan request as plain JSON data: the models, the defaults, the exit codes, the validation of
``flax-ln plan``'s arguments (:func:`make_request`) and the pinned result of a plan that was not made
(:func:`failed`). Imports no JAX."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from flax_ln.plan.hardware import CHIPS
from flax_ln.plan.limits import int_problem, topology_problem

MODELS = ("gpt2", "gpt2-xl", "chapter12", "music", "encoder-decoder")
GPT_MODELS = ("gpt2", "gpt2-xl", "chapter12", "music")
DEFAULT_VOCAB = 10000  # chapter12 and the encoder-decoder: the vocabulary is the user's data's; a round default
DEFAULT_ENC_DEC_LEN = 64  # the encoder-decoder's source and target length (train_translation.py's --max-len)
BATCH_PER_CHIP = 2  # default --batch: 2 sequences per chip
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2
DEFAULT_TIMEOUT = 600  # seconds the compiler's child process may take (--timeout), all of a --search's compiles


class PlanError(Exception):
    """A plan that cannot be made; ``exit_code`` is 2 (usage, libtpu missing, not lowerable for TPU)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def _gpt_config(model: str, vocab_size: int | None) -> dict:
    """The preset's :class:`~flax_ln.GPTConfig` fields as a dict (imports only the torch-free config)."""
    from flax_ln.models.gpt import GPTConfig

    presets = {
        "gpt2": GPTConfig.gpt2,
        "gpt2-xl": GPTConfig.gpt2_xl,
        "music": GPTConfig.music,
    }
    if model == "chapter12":
        config = GPTConfig.chapter12(vocab_size or DEFAULT_VOCAB)
    else:
        config = presets[model](**({} if vocab_size is None else {"vocab_size": vocab_size}))
    return dataclasses.asdict(config)


def _positions() -> int:
    """The encoder-decoder's ``max_len``: the positions its sinusoid tables cover (the config's default)."""
    from flax_ln.models.encoder_decoder.config import EncoderDecoderConfig

    return next(f.default for f in dataclasses.fields(EncoderDecoderConfig) if f.name == "max_len")  # type: ignore[return-value]


def make_request(
    model: str,
    topology: str,
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    dtype: str = "bfloat16",
    fsdp: int | None = None,
    remat: bool = False,
    vocab_size: int | None = None,
    generate: bool = False,
    search: str | None = None,
    config: dict | None = None,
    encoder_decoder: dict | None = None,
) -> dict:
    """A validated plan request (plain JSON data), as ``flax-ln plan``'s arguments describe it.

    ``config`` replaces a GPT preset's fields (any :class:`~flax_ln.GPTConfig` as a dict);
    ``encoder_decoder`` gives :func:`flax_ln.recipes.encoder_decoder_setup`'s keyword
    arguments (default chapter 10's sizes). ``--batch`` defaults to 2 per chip once the
    chip count is known (in the child). Raises :class:`PlanError` on a usage error.
    """
    if model not in MODELS:
        raise PlanError(f"--model: expected one of {', '.join(MODELS)}, got {model!r}")
    chip, _, shape = topology.partition(":")
    if chip not in CHIPS or not re.fullmatch(r"\d+(x\d+)*", shape):
        raise PlanError(
            f"--topology: expected CHIP:SHAPE with CHIP one of {', '.join(CHIPS)} (the chips whose figures the "
            f"planner has) and SHAPE like 2x4 or 2x2x1, got {topology!r}"
        )
    problem = topology_problem(topology)
    if problem:
        raise PlanError(problem)
    if dtype not in ("bfloat16", "float32"):
        raise PlanError(f"--dtype: expected bfloat16 or float32, got {dtype!r}")
    for name, value in (("--batch", batch), ("--seq-len", seq_len), ("--fsdp", fsdp), ("--vocab-size", vocab_size)):
        problem = int_problem(name, value)
        if problem:
            raise PlanError(problem)
    if search not in (None, "batch", "fsdp"):
        raise PlanError(f"--search: expected batch or fsdp, got {search!r}")
    if model == "encoder-decoder":
        if generate:
            raise PlanError("--generate: only the GPT models (gpt2, gpt2-xl, chapter12, music) have a KV-cache decoder")
        if remat:
            raise PlanError("--remat: the encoder-decoder has no remat option; drop --remat")
        kwargs = {"layers": 6, "d_model": 256, "d_ff": 1024, "heads": 8, **(encoder_decoder or {})}
        vocab = vocab_size or DEFAULT_VOCAB
        kwargs.setdefault("src_vocab", vocab)
        kwargs.setdefault("tgt_vocab", vocab)
        seq_len = seq_len or DEFAULT_ENC_DEC_LEN
        limit = _positions()
        if seq_len > limit:
            raise PlanError(
                f"--seq-len: at most {limit} for --model encoder-decoder (its positional tables cover max_len "
                f"{limit} positions), got {seq_len}; give --seq-len {limit} or less"
            )
        spec: dict[str, Any] = {"kind": "encoder-decoder", "setup": kwargs}
    else:
        fields = {**_gpt_config(model, vocab_size), **(config or {})}
        block = fields["block_size"]
        seq_len = seq_len or block
        if seq_len > block:
            raise PlanError(
                f"--seq-len: at most the model's block size {block} for --model {model} (its positional table"
                f"{' and the KV cache' if generate else ''}), got {seq_len}; give --seq-len {block} or less"
            )
        spec = {"kind": "decode" if generate else "gpt", "config": fields, "scan_layers": True}
    return {
        **spec,
        "model": model,
        "topology": topology,
        "batch": batch,
        "seq_len": seq_len,
        "dtype": dtype,
        "fsdp": fsdp,
        "remat": bool(remat),
        "search": search,
    }


def failed(request: dict, message: str, exit_code: int, **known) -> dict:
    """The pinned JSON of a plan that was not made (``fits`` false, numbers null) with the error message."""
    chip = CHIPS.get(str(request.get("topology", "")).partition(":")[0])
    result: dict[str, Any] = {
        "fits": False,
        "topology": request.get("topology"),
        "chips": None,
        "device_kind": chip.device_kind if chip else None,
        "model": request.get("model"),
        "batch": request.get("batch"),
        "seq_len": request.get("seq_len"),
        "dtype": request.get("dtype"),
        "fsdp": request.get("fsdp"),
        "remat": request.get("remat"),
        "per_chip": {
            "argument_bytes": None,
            "output_bytes": None,
            "temp_bytes": None,
            "alias_bytes": None,
            "total_bytes": None,
            "capacity_bytes": chip.hbm_bytes if chip else None,
        },
        "flops_per_step": None,
        "compile_seconds": None,
        "roofline": None,
    }
    result.update(known)
    return {**result, "exit_code": exit_code, "error": message}

"""Chapter 11: sample text from a Hugging Face GPT-2 checkpoint with flax_ln's GPT and KV-cache generator.

``--checkpoint`` is a Hugging Face GPT-2 model folder as ``save_pretrained`` writes it:
``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``);
only safetensors are read. It is loaded with ``flax_ln.load_hf_gpt2`` and sampled with
``flax_ln.generate`` (temperature, top-k; ``--temperature 0`` is greedy).

The prompt is ``--prompt TEXT``, tokenised by Hugging Face's ``tokenizers`` package
(``pip install tokenizers``) from the folder's files: ``tokenizer.json``, or GPT-2's
original ``vocab.json`` + ``merges.txt`` (byte-level BPE, with ``<|endoftext|>`` kept
whole as GPT-2 does); or ``--prompt-ids 464,2068,7586`` (comma-separated token ids),
which needs no tokenizer. A folder without tokenizer files needs ``--prompt-ids``.

With no ``--checkpoint`` it runs a small GPT with random weights (2 layers, width 64,
one token per byte, so text prompts work) and says so: the output is noise, but every
step of the pipeline runs.

``--compile-only TOPOLOGY`` (e.g. ``v5e:2x4``) compiles this script's decode step (one token
per sample against the KV cache, :func:`flax_ln.models.sampling.decode_step`) for that TPU
topology on this machine (libtpu, no TPU needed; only ``config.json`` and the tokenizer
are read, no weights) and prints the plan instead of generating: the script runs on one
device, so the plan is for one chip of the topology (exit 0 fits, 1 does not, 2 error).

Run: python examples/generate_gpt2.py                                   # random weights, a notice
     python examples/generate_gpt2.py --checkpoint ~/models/gpt2-xl --prompt "I went to the kitchen and" \\
         --max-new-tokens 50 --temperature 0.8 --top-k 40
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_ln
from flax_ln import recipes

DEFAULT_PROMPT = "Once upon a time"
ENDOFTEXT = "<|endoftext|>"  # GPT-2's only special token
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ByteTokenizer:
    """One token per UTF-8 byte (vocab 256), for the random-weights demo."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the examples' ``encode(text) -> ids`` / ``decode(ids) -> text``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(folder: Path) -> tuple[HFTokenizer | None, str]:
    """``(tokenizer, where it came from)`` for a Hugging Face model folder; ``(None, why)`` without tokenizer files.

    ``tokenizer.json`` is read as it is; ``vocab.json`` + ``merges.txt`` as a byte-level
    BPE without a prefix space (GPT-2's settings), ``<|endoftext|>`` a special token when
    the vocabulary has it.
    """
    json_file, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
    if not json_file.is_file() and not (vocab.is_file() and merges.is_file()):
        return None, f"{folder} has no tokenizer.json or vocab.json + merges.txt"
    try:
        import tokenizers
    except ImportError:
        raise SystemExit(
            "text prompts are tokenised with Hugging Face's tokenizers: pip install tokenizers (or pass --prompt-ids)"
        ) from None
    try:
        if json_file.is_file():
            return HFTokenizer(tokenizers.Tokenizer.from_file(str(json_file))), f"{json_file} (tokenizers)"
        bpe = tokenizers.ByteLevelBPETokenizer(str(vocab), str(merges), add_prefix_space=False)
        if bpe.token_to_id(ENDOFTEXT) is not None:
            bpe.add_special_tokens([ENDOFTEXT])
        return HFTokenizer(bpe), f"{vocab} + {merges.name} (tokenizers, byte-level BPE)"
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception on malformed files
        raise SystemExit(f"{folder}: tokenizers cannot read its tokenizer files: {e}") from None


RANDOM_CONFIG = flax_ln.GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=128)


def random_model(seed: int, **kwargs) -> flax_ln.GPT:
    """A small GPT with random weights whose vocabulary is the 256 byte values; ``kwargs`` go to ``flax_ln.GPT``."""
    model = flax_ln.GPT(RANDOM_CONFIG, rngs=nnx.Rngs(seed), **kwargs)
    model.eval()
    return model


def parse_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"--prompt-ids: expected comma-separated integers like 464,2068,7586, got {text!r}") from None
    if not ids:
        raise SystemExit("--prompt-ids: give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise SystemExit(f"--prompt-ids: ids {bad} are outside the vocabulary [0, {vocab_size})")
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="Hugging Face GPT-2 folder (config.json + model.safetensors)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help=f"prompt text (needs tokenizer files; default {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 464,2068,7586")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    p.add_argument("--num-samples", type=int, default=1, help="independent continuations of the prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="compute dtype (parameters stay float32)")
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stack the blocks and scan over them: one compiled block, fast compiles for deep models",
    )
    recipes.add_compile_only_arguments(p, "this script's decode step")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.num_samples < 1:
        p.error(f"--num-samples must be >= 1, got {args.num_samples}")
    return args


def prompt_ids(args, tokenizer, source: str, vocab_size: int) -> list[int]:
    """The prompt's token ids, from --prompt-ids or the tokenised --prompt (default text)."""
    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids, vocab_size)
    if tokenizer is None:
        raise SystemExit(f"{source}, so a text prompt cannot be tokenised; pass --prompt-ids 464,2068,7586 instead")
    ids = tokenizer.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    if not ids:
        raise SystemExit("--prompt: the prompt is empty; give some text")
    if max(ids) >= vocab_size:
        raise SystemExit(f"the tokenizer gave id {max(ids)}, outside the model's vocabulary [0, {vocab_size})")
    return ids


def compile_only(args) -> int:
    """``--compile-only TOPOLOGY``: the plan of this script's decode step on one chip of a TPU topology."""
    import dataclasses
    import json
    import sys

    from flax_ln import plan
    from flax_ln.cli.plan import plan_or_exit
    from flax_ln.convert.hf import gpt_config_from_hf

    if args.checkpoint is None:
        config, tokenizer, source = RANDOM_CONFIG, ByteTokenizer(), "one token per byte (random-weights demo)"
    else:
        try:
            config = gpt_config_from_hf(json.loads((args.checkpoint / "config.json").read_text()))[0]
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"--checkpoint {args.checkpoint}: cannot read config.json ({e})") from None
        tokenizer, source = load_tokenizer(args.checkpoint)
    ids = prompt_ids(args, tokenizer, source, config.vocab_size)
    cache = max(1, min(config.block_size, len(ids) + args.max_new_tokens - 1))  # as generate() sizes its cache
    try:
        request = plan.make_request(
            "gpt2",
            args.compile_only,
            batch=args.num_samples,
            seq_len=cache,
            dtype=args.dtype,
            fsdp=1,
            generate=True,
            config=dataclasses.asdict(config),
        )
    except plan.PlanError as e:
        print(f"generate_gpt2.py: error: {str(e).replace('--topology', '--compile-only')}", file=sys.stderr)
        return 2
    request["scan_layers"] = args.scan_layers
    request["devices"] = 1  # generate() runs on one device
    return plan_or_exit(request, args.plan_json, "generate_gpt2.py")


def main(argv=None) -> list[list[int]] | int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    model_kwargs = dict(scan_layers=args.scan_layers, dtype=DTYPES[args.dtype])
    if args.checkpoint is None:
        print(
            "NOTICE: no --checkpoint given, so this runs a small GPT (2 layers, width 64, byte vocabulary) with "
            "RANDOM weights: the output is noise. Pass --checkpoint FOLDER (a Hugging Face GPT-2 folder with "
            "config.json and model.safetensors) for real text.\n"
        )
        model, tokenizer = random_model(args.seed, **model_kwargs), ByteTokenizer()
        source = "one token per byte (random-weights demo)"
    else:
        if not args.checkpoint.is_dir():
            raise SystemExit(f"--checkpoint {args.checkpoint}: not a folder; expected a Hugging Face GPT-2 folder")
        start = time.perf_counter()
        model = flax_ln.load_hf_gpt2(args.checkpoint, **model_kwargs)
        c = model.config
        print(
            f"loaded {args.checkpoint}: {c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, "
            f"vocab {c.vocab_size}, context {c.block_size} ({time.perf_counter() - start:.1f} s)"
        )
        tokenizer, source = load_tokenizer(args.checkpoint)
    print(f"tokenizer: {source}")

    vocab_size = model.config.vocab_size
    ids = prompt_ids(args, tokenizer, source, vocab_size)
    if args.top_k is not None and not 1 <= args.top_k <= vocab_size:
        raise SystemExit(f"--top-k must be in [1, {vocab_size}], got {args.top_k}")

    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (args.num_samples, 1)))  # (num_samples, T)
    start = time.perf_counter()
    out = flax_ln.generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        rng=jax.random.key(args.seed),
    )
    out = np.asarray(out).tolist()
    seconds = time.perf_counter() - start
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-k {args.top_k}"
    print(
        f"prompt ids: {ids}\ngenerated {args.max_new_tokens} tokens x {args.num_samples} ({mode}) in "
        f"{seconds:.1f} s, compilation included"
    )
    for n, row in enumerate(out):
        print(f"\n--- sample {n + 1} ---")
        print(f"ids: {row}")
        if tokenizer is not None:
            print(f"prompt:       {tokenizer.decode(row[: len(ids)])!r}")
            print(f"continuation: {tokenizer.decode(row[len(ids) :])!r}")
    return out


if __name__ == "__main__":
    import sys

    result = main()
    sys.exit(result if isinstance(result, int) else 0)

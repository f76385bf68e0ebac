"""The book's models by name, without torch: what ``flax-ln parity`` reads before it builds anything.

:data:`SEQ_LEN_LIMITS` is the one list of the models ``flax-ln parity --model`` checks, in
the order ``--model all`` runs them (:data:`MODEL_NAMES`); :data:`flax_ln.book.cases.BUILDERS`
has a builder for each. The command line parses and validates its arguments from this
module alone, so that ``flax-ln --help`` and ``flax-ln plan`` never import torch.
"""

from __future__ import annotations

import flax_ln

GPT_CONFIG = flax_ln.GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=50, block_size=32)
MUSIC_CONFIG = flax_ln.GPTConfig.music(n_layer=2)
ENCODER_DECODER_POSITIONS = 5000  # the book's positional table (max_len) on both sides
ENCODER_DECODER_LIMIT = (ENCODER_DECODER_POSITIONS, "positions in the positional-encoding table")

# Every book model, in the order `--model all` checks them: the longest sequence it takes
# (None: any), and what sets the limit.
SEQ_LEN_LIMITS: dict[str, tuple[int, str] | None] = {
    "layernorm": None,
    "torch-layernorm": None,
    "encoder-decoder": ENCODER_DECODER_LIMIT,
    "gpt": (GPT_CONFIG.block_size, "positions (its block_size)"),
    "gpt2-xl-block": (flax_ln.GPTConfig.gpt2_xl().block_size, "positions (GPT-2XL's block_size, its causal mask)"),
    "music": (MUSIC_CONFIG.block_size, "positions (its block_size)"),
}
MODEL_NAMES: list[str] = list(SEQ_LEN_LIMITS)

# What `--preset` names, for the sizes a GPT torch checkpoint's tensor shapes cannot tell.
GPT_PRESETS = {
    "gpt2": flax_ln.GPTConfig.gpt2,
    "gpt2-xl": flax_ln.GPTConfig.gpt2_xl,
    "chapter12": lambda **kw: flax_ln.GPTConfig.chapter12(**kw),
    "music": flax_ln.GPTConfig.music,
}


def check_seq_len(model: str, seq_len: int, limit: int | None = None, what: str | None = None) -> None:
    """Raise ``ValueError`` naming the limit when ``seq_len`` exceeds what ``model`` takes.

    ``limit`` and ``what`` default to the book model's entry in :data:`SEQ_LEN_LIMITS`;
    a torch checkpoint passes its own (its ``block_size``). Called before any model is built.
    """
    if limit is None:
        entry = SEQ_LEN_LIMITS.get(model)
        if entry is None:
            return
        limit, what = entry
    if seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is too long for {model}: it takes at most {limit} {what}; "
            f"pass --seq-len {limit} or less"
        )

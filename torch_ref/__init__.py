"""PyTorch reference implementations of the book's modules, with the book's state-dict keys.

Standalone: nothing here imports ``flax_ln``, JAX or flax, so a mistake in the port can
never hide in a piece the two share. Configs cross between the packages as plain data.
"""

from torch_ref.encoder_decoder import (
    EncoderDecoderConfig,
    LabelSmoothing,
    Transformer,
    make_model,
    make_std_mask,
    noam_rate,
    subsequent_mask,
)
from torch_ref.gpt import GPT, GPTConfig
from torch_ref.hf_gpt2 import HFCheckpointError, load_hf_gpt2, read_hf_gpt2
from torch_ref.layernorm import LayerNorm

__all__ = [
    "EncoderDecoderConfig",
    "LabelSmoothing",
    "LayerNorm",
    "GPT",
    "GPTConfig",
    "HFCheckpointError",
    "load_hf_gpt2",
    "read_hf_gpt2",
    "Transformer",
    "make_model",
    "make_std_mask",
    "noam_rate",
    "subsequent_mask",
]

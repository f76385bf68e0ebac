"""flax-ln: the layer normalisation and Transformer blocks of *Learn Generative AI with PyTorch* in Flax NNX.

``import flax_ln`` never imports torch; only :mod:`torch_ref`, the converter's torch
inputs and the parity harness need it.
"""

from flax_ln.convert import (
    ConversionError,
    KeyMap,
    load_hf_gpt2,
    load_torch_state_dict,
    save_hf_gpt2,
    to_torch_state_dict,
)
from flax_ln.models.encoder_decoder import (
    EncoderDecoderConfig,
    Transformer,
    greedy_decode,
    make_model,
    make_src_mask,
    make_std_mask,
    subsequent_mask,
)
from flax_ln.models.gpt import GPT, GPTConfig, KVCache
from flax_ln.models.layernorm import LayerNorm, TorchLayerNorm, normalize
from flax_ln.models.losses import head_cross_entropy, head_logits_and_cross_entropy
from flax_ln.models.sampling import generate
from flax_ln.train import (
    TrainState,
    encoder_decoder_loss,
    gpt_adam,
    gpt_loss,
    init_train_state,
    label_smoothing_loss,
    make_batch,
    make_train_step,
    noam_adam,
    noam_schedule,
)

__version__ = "0.1.0"

__all__ = [
    "ConversionError",
    "encoder_decoder_loss",
    "EncoderDecoderConfig",
    "generate",
    "greedy_decode",
    "head_cross_entropy",
    "head_logits_and_cross_entropy",
    "GPT",
    "gpt_adam",
    "gpt_loss",
    "GPTConfig",
    "init_train_state",
    "KeyMap",
    "KVCache",
    "label_smoothing_loss",
    "LayerNorm",
    "load_hf_gpt2",
    "load_torch_state_dict",
    "make_batch",
    "make_model",
    "make_src_mask",
    "make_std_mask",
    "make_train_step",
    "noam_adam",
    "noam_schedule",
    "normalize",
    "save_hf_gpt2",
    "subsequent_mask",
    "to_torch_state_dict",
    "TorchLayerNorm",
    "TrainState",
    "Transformer",
]

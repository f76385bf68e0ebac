"""flax-ln: the layer normalisation and Transformer blocks of *Learn Generative AI with PyTorch* in Flax NNX.

``import flax_ln`` never imports torch; only :mod:`torch_ref`, the converter's torch
inputs and the parity harness need it.
"""

from flax_ln.convert import ConversionError, load_torch_state_dict, to_torch_state_dict
from flax_ln.layernorm import LayerNorm, TorchLayerNorm, normalize

__version__ = "0.1.0"

__all__ = [
    "ConversionError",
    "LayerNorm",
    "TorchLayerNorm",
    "load_torch_state_dict",
    "normalize",
    "to_torch_state_dict",
]

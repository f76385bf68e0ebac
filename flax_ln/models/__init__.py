"""The Flax NNX twins of :mod:`torch_ref`, file for file: layernorm, attention, encoder_decoder, gpt."""

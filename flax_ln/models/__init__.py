"""The Flax NNX twins of :mod:`torch_ref`'s models, and the pieces they share.

The twins, file for file with ``torch_ref``: ``layernorm``, ``encoder_decoder`` and ``gpt``.
What they are built from: ``attention`` (scaled dot-product attention), ``dense`` (the product
inside every ``nnx.Linear``), ``dropout`` (its mask) and ``checks`` (token-id validation).
What the GPT uses beside its module tree: ``losses`` (its loss, head included), ``remat``
(rematerialisation and the scan over layers) and ``sampling`` (:func:`flax_ln.generate`).
"""

"""Ports of three ``transformers`` models, written from the torch modules' math, each with its own key map.

They do not mirror the torch module trees: their own names and nesting, fused
``(d_model, heads, head_dim)`` attention kernels, channels-last convolutions, tied
embeddings kept as two variables. Each module's ``KEY_MAP`` (a
:class:`flax_ln.convert.KeyMap`) loads the transformers checkpoint and exports it back:

* :mod:`.llama`: ``LlamaForCausalLM`` (GQA, RoPE, RMSNorm, SwiGLU, tied embeddings);
* :mod:`.resnet`: ``ResNetForImageClassification`` (bottleneck blocks, BatchNorm statistics, NHWC);
* :mod:`.vit`: ``ViTForImageClassification`` (patch embedding, erf GELU, fused q/k/v kernel).

Two more show the other kinds of flax side: :mod:`.vit_linen`, the ViT in Linen
(``flax_ln.parity.Linen``), and :mod:`.mlp_function`, a ``jax.numpy`` MLP over a dict of arrays
(``flax_ln.parity.Function``).

None of them imports torch or transformers; ``config_from_hf`` reads a transformers
config's attributes only.
"""

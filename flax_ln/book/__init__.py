"""The book's models on the parity engine: what ``flax-ln parity`` checks, beside the engine.

The engine (:mod:`flax_ln.parity`) compares any torch module with its flax twin and knows
nothing of the book; this package holds what it is run on:

* :mod:`.catalog`: the book's models by name, their small configs and sequence limits (no torch);
* :mod:`.cases`: a builder per name, each returning a :class:`flax_ln.parity.Case` (torch);
* :mod:`.torch_checkpoint`: a torch checkpoint of the user's own, recognised and turned into a case (torch);
* :mod:`.reference`: reference files (``--save-reference``/``--reference``), the book's forwards and
  the flax models rebuilt from a file's ``spec`` (no torch); :mod:`.reference_schema`, their schema.

Nothing is imported here, so that the torch-free modules import without torch.
"""

"""The two sides of a comparison. The torch run (:mod:`.torch`); the flax side's interface, written once (:mod:`.flax`:
``FlaxSide``, ``Linen``, ``Function``), with one file per kind of flax side (:mod:`.nnx`, :mod:`.linen`,
:mod:`.equinox`, :mod:`.keras`, :mod:`.function`, the pytree kinds over :mod:`.tree`) and the kind registry
(:mod:`.kinds`); torch tensors split across flax variables (:mod:`.split`) and distinct torch tensors that fill
one variable (:mod:`.shared`). A new kind of side is one file here, one line in :mod:`.kinds`, and its variable
tree in ``flax_ln.convert.trees``. It imports ``islands``, ``records`` and ``core``.
"""

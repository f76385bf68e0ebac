"""Float32 islands of a float64 run: the plain record both sides and the report share (:mod:`.island`), the JAX side's
discovery and lifting in the traced computation (:mod:`.jax`, over the JAX internals it needs in
:mod:`.jax_internals`), the torch side's at dispatch and at construction, with the torch model in float64 for a
scope (:mod:`.torch`), and both sides lifted together for one run (:mod:`.lifting`). It imports ``records`` and
``core``.

The names the old module ``flax_ln.parity.islands`` defined are served from here with a ``DeprecationWarning``
naming their new home, until the next minor release.
"""

from flax_ln._deprecated import module_getattr

_OLD_NAMES = (  # what the old module flax_ln.parity.islands defined (0.1.0): see CHANGELOG.md
    "Island",
    "float32_rounded",
)
__getattr__ = module_getattr(
    __name__, {name: f"flax_ln.parity.islands.island.{name}" for name in _OLD_NAMES}, globals()
)

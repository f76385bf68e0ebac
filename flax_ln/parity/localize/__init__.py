"""Naming the layer that differs, for every kind of side: modules paired through their parameters, the first divergence
along the flax run, and isolated mode, each paired module run alone on torch's values (:mod:`.locate`). It imports
``sides``, ``report``, ``islands``, ``records`` and ``core``.

The names the old module ``flax_ln.parity.localize`` defined are served from here with a ``DeprecationWarning``
naming their new home, until the next minor release.
"""

from flax_ln._deprecated import module_getattr

_OLD_NAMES = (  # what the old module flax_ln.parity.localize defined (0.1.0): see CHANGELOG.md
    "pair_modules",
    "first_divergence",
    "isolate",
    "localize",
    "check_torch_paths",
)
__getattr__ = module_getattr(
    __name__, {name: f"flax_ln.parity.localize.locate.{name}" for name in _OLD_NAMES}, globals()
)

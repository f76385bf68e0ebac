"""The comparison of models larger than memory, stage by stage from a checkpoint: a model as a chain of stages
(:mod:`.stages`), each side holding one stage's weights at a time (:mod:`.sides`), and ``compare_streamed``
(:mod:`.compare`). The top room: it imports the comparison (``flax_ln.parity.compare``) and every room below it.

The names the old module ``flax_ln.parity.streamed`` defined are served from here with a ``DeprecationWarning``
naming their new home, until the next minor release.
"""

from flax_ln._deprecated import module_getattr

_OLD_NAMES = (  # what the old module flax_ln.parity.streamed defined (0.1.0): see CHANGELOG.md
    "compare_streamed",
    "torch_skeleton",
    "Gradients",
    "Streamed",
)
__getattr__ = module_getattr(
    __name__, {name: f"flax_ln.parity.streamed.compare.{name}" for name in _OLD_NAMES}, globals()
)

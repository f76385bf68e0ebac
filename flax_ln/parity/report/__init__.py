"""What a comparison found, and how it is shown: the report's data (:mod:`.data`: ``ParityReport``,
``FirstDivergence``, ``Isolation``, JSON in and out), the JSON's schema (:mod:`.schema`), the text table and chart
(:mod:`.text`) and the self-contained HTML page (:mod:`.html`, its style and script in ``html_assets/``). It imports
``islands`` and ``core``.

The names the old module ``flax_ln.parity.report`` defined are served from here with a ``DeprecationWarning``
naming their new home, until the next minor release.
"""

from flax_ln._deprecated import module_getattr

_OLD_NAMES = (  # what the old module flax_ln.parity.report defined (0.1.0): see CHANGELOG.md
    "FirstDivergence",
    "Isolation",
    "ParityReport",
    "environment",
    "result_from_json",
    "report_from_dict",
    "reports_from_json",
)
__getattr__ = module_getattr(__name__, {name: f"flax_ln.parity.report.data.{name}" for name in _OLD_NAMES}, globals())

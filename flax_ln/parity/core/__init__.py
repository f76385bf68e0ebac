"""The comparison's basics, below every other room: what both sides run and the outputs as named leaves (:mod:`.call`),
the metrics and the tolerance policy (:mod:`.policy`, with float64 statistics read block by block in
:mod:`.tensor_stats`), an exception's description and notes (:mod:`.failure`), the progress bar (:mod:`.progress`)
and gradients spilled to disk (:mod:`.spill`). It imports no other room of ``flax_ln.parity`` (only
``flax_ln.convert``).
"""

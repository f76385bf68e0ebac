"""What localisation records and replays, kind by kind, below the sides that record: each side's submodule calls
(:mod:`.capture`), which torch and flax modules are the same layer (:mod:`.pairing`), and one recorded call replayed
alone on torch's values (:mod:`.replay`). It imports ``core`` only.
"""

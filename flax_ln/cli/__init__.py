"""The ``flax-ln`` command line."""

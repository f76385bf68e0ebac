"""``python -m flax_ln``: the same as the ``flax-ln`` command."""

import sys

from flax_ln.cli import main

sys.exit(main())

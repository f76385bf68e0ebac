import sys

from flax_ln.parity.cli import main

sys.exit(main())

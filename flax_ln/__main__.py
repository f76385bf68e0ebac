import sys

from flax_ln.cli import main

sys.exit(main())

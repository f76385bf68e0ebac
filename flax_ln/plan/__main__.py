"""``python -m flax_ln.plan REQUEST_FILE RESULT_FILE``: the child process that :func:`flax_ln.plan.run_many` starts."""

import sys

from flax_ln.plan.search import child_main

sys.exit(child_main(sys.argv[1], sys.argv[2]))

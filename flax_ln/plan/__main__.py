"""``python -m flax_ln.plan REQUEST_FILE RESULT_FILE``: the planner's child process (started by :func:`run_many`)."""

import sys

from flax_ln.plan import child_main

sys.exit(child_main(sys.argv[1], sys.argv[2]))

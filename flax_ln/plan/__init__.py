"""Plan a TPU run on a machine without a TPU: compile the real step for a TPU topology and read its memory.

``jax.experimental.topologies`` with libtpu installed (``pip install "jax[tpu]"``) gives
abstract devices of any TPU topology (``v5e:2x4``, ``v4:2x2x1``, ...). The planner builds
the examples' own training step (:mod:`flax_ln.recipes`: the same model, optimizer, loss
and shardings that ``examples/train_music.py`` and ``examples/train_translation.py`` train
with) on a mesh of those devices, with an abstract state (``jax.eval_shape``: no weight is
allocated), compiles it with the TPU compiler and reads the bytes per chip from
``memory_analysis()``. Nothing runs on a TPU; the numbers are compiled-for-TPU figures.

The compile runs in a child process (``python -m flax_ln.plan``) whose stack limit is raised, with
JAX on the CPU only (:mod:`flax_ln.plan.compiling` says why).

The package, by concept: :mod:`flax_ln.plan.hardware` (the chips, FLOPs and the roofline),
:mod:`flax_ln.plan.request` (a request as plain data, its validation, a failed plan's result),
:mod:`flax_ln.plan.limits` (the hard limits and the lower bound on memory checked before any compile),
:mod:`flax_ln.plan.compiling` (libtpu, the child process, the compile of one step) and
:mod:`flax_ln.plan.search` (the child's work: one plan, or the search for the batch or fsdp that
fits). The ``flax-ln plan`` command line is :mod:`flax_ln.cli.plan`.
"""

from flax_ln.plan.compiling import (
    INSTALL,
    Compiled,
    child_env,
    child_failure,
    compile_traced,
    find_not_lowerable,
    libtpu_missing,
    raised_stack,
    run,
    run_many,
    topology_devices,
)
from flax_ln.plan.hardware import (
    CHIPS,
    GIB,
    MEGACORE,
    Chip,
    decode_flops,
    encoder_decoder_flops,
    gpt_flops,
    param_counts,
    roofline,
)
from flax_ln.plan.limits import (
    INT32_MAX,
    TOPOLOGY_LIMITS,
    host_bounds,
    lower_bound_bytes,
    too_big,
    topology_problem,
)
from flax_ln.plan.request import (
    BATCH_PER_CHIP,
    DEFAULT_ENC_DEC_LEN,
    DEFAULT_TIMEOUT,
    DEFAULT_VOCAB,
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    EXIT_USAGE,
    GPT_MODELS,
    MODELS,
    PlanError,
    failed,
    make_request,
)
from flax_ln.plan.search import child_main, plan_request

__all__ = [
    "BATCH_PER_CHIP",
    "CHIPS",
    "DEFAULT_ENC_DEC_LEN",
    "DEFAULT_TIMEOUT",
    "DEFAULT_VOCAB",
    "EXIT_DOES_NOT_FIT",
    "EXIT_FITS",
    "EXIT_USAGE",
    "GIB",
    "GPT_MODELS",
    "INSTALL",
    "INT32_MAX",
    "MEGACORE",
    "MODELS",
    "Chip",
    "Compiled",
    "PlanError",
    "TOPOLOGY_LIMITS",
    "child_env",
    "child_failure",
    "child_main",
    "compile_traced",
    "decode_flops",
    "encoder_decoder_flops",
    "failed",
    "find_not_lowerable",
    "gpt_flops",
    "host_bounds",
    "libtpu_missing",
    "lower_bound_bytes",
    "make_request",
    "param_counts",
    "plan_request",
    "raised_stack",
    "roofline",
    "run",
    "run_many",
    "too_big",
    "topology_devices",
    "topology_problem",
]

import importlib.util
import json
import os

# With libtpu installed (jax[tpu], for the TPU planner), a JAX start would look for TPU chips and query the
# TPU metadata server first: then the tests run on the CPU unless JAX_PLATFORMS says otherwise (flax_ln.plan's
# child process compiles for TPU topologies all the same). Without libtpu (a GPU machine) nothing changes.
if importlib.util.find_spec("libtpu") is not None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

# Keras 3 runs its models on JAX only here (flax_ln.parity.Keras): its backend is read once, when keras is imported.
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402 - after the environment above
import pytest
from hypothesis import HealthCheck, settings

# Parity is defined at full float32 matmul precision (XLA's GPU/TPU default is lower).
jax.config.update("jax_default_matmul_precision", "highest")

# CI runs every property at least 200 times; a local run may ask for fewer.
settings.register_profile(
    "parity",
    max_examples=int(os.environ.get("FLAX_LN_HYPOTHESIS_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("parity")


# The tests .ci/ceiling.sh runs on CPython 3.13 with the newest releases (the `ceiling` marker, pyproject.toml): the
# lower-bounds core, plus whole files for the code that reaches into JAX's internals or the other module systems.
CEILING_FILES = {
    "test_jax_islands.py",  # float32 lifting patches JAX internals (flax_ln.parity.islands.jax_internals)
    "test_jax_lifting_fallback.py",
    "test_verdict.py",  # the verdict's rules, every kind of tensor
    "test_linen.py",  # Linen's interception and lifted transforms
    "test_equinox.py",  # Equinox's filtered transforms and pytrees
    "test_localize_batched_and_scanned.py",  # scanned and checkpointed stacks, recorded through JAX's traces
    "test_localize_remat.py",  # checkpoints run eagerly while localising (flax_ln.parity.islands.jax_remat)
    "test_localize_pytrees.py",  # pytrees of arrays through records, nudges and replays
    "test_keras.py",  # Keras 3 on the JAX backend
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in CEILING_FILES or item.get_closest_marker("lower_bounds") is not None:
            item.add_marker(pytest.mark.ceiling)


if os.environ.get("CI") == "true":
    # CI installs every optional package the tests use, in each of its venvs: there a module-level
    # pytest.importorskip that would skip a whole file fails it instead, as optional_package below does
    _importorskip = pytest.importorskip

    def _importorskip_or_fail(modname, *args, **kwargs):
        try:
            return _importorskip(modname, *args, **kwargs)
        except pytest.skip.Exception as skipped:
            pytest.fail(f"CI=true, so {modname} must be tested: {skipped}", pytrace=False)

    pytest.importorskip = _importorskip_or_fail


def optional_package(name: str, why: str):
    """The optional package ``name``, imported; skipped with the reason where it is missing or unimportable, except
    under ``CI=true`` (CI installs it), where the test fails instead."""
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - an unimportable package is as missing as an absent one
        missing = f"{name} is not installed or not importable ({type(err).__name__}: {err}); {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, so {name} must be tested: {missing}")
        pytest.skip(missing)


@pytest.fixture(scope="module")
def keras():
    """keras 3 (on JAX: KERAS_BACKEND above); skipped without it, failed under CI=true."""
    return optional_package("keras", "pip install 'flax-ln[keras]'")


@pytest.fixture(scope="module")
def keras_hub(keras):
    """keras-hub (installed with --no-deps, see .ci/run); skipped without it, failed under CI=true."""
    return optional_package(
        "keras_hub",
        "pip install --no-deps keras-hub==0.32.0; pip install sentencepiece 'kagglehub!=1.0.1' kagglesdk==0.1.28",
    )


@pytest.fixture
def x64():
    """Enable float64 in JAX for one test only."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="session")
def built_once(tmp_path_factory, worker_id):
    """``built_once(name, build)``: ``build()``'s JSON-able result, built by one pytest-xdist worker for all.

    A module-scoped fixture is built once per worker that runs one of its tests, and the
    parallel scheduler may give a module's tests to both workers. For the expensive ones (a
    set of TPU compiles, an 8-device subprocess) the first worker to ask builds the value,
    under a file lock in the run's shared temporary folder, and the others read its JSON.
    A build that raises leaves nothing behind: the next worker to ask builds it again.
    """
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    shared = root if worker_id == "master" else root.parent

    def once(name: str, build):
        path = shared / f"built-once-{name}.json"
        with FileLock(f"{path}.lock"):
            if path.is_file():
                return json.loads(path.read_text())
            value = build()
            path.write_text(json.dumps(value))
            return json.loads(path.read_text())  # the same JSON round trip as the workers that read it

    return once


@pytest.fixture
def plugin_arguments() -> list[str]:
    """The pytest arguments that load flax-ln's plugin in a pytester run: ``-p flax_ln.pytest_plugin`` unless the
    installed entry point already loads it (twice is an error)."""
    import importlib.metadata

    installed = any(ep.value == "flax_ln.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "flax_ln.pytest_plugin"]

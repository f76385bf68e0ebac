"""Multi-host through JAX's own distributed runtime, rehearsed on one machine: two processes of two CPU devices each,
joined through a coordinator on 127.0.0.1 with gloo collectives, train the music and the translation examples as one
process of four devices does; a two-process checkpoint resumes in one process; a process that cannot join exits."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flax_ln import music, recipes
from flax_ln.checkpoint import read_metrics
from flax_ln.sharding import batch_sharding, initialize_distributed, make_mesh, process_rows

ROOT = Path(__file__).resolve().parents[1]
MUSIC = ROOT / "examples" / "train_music.py"
TRANSLATION = ROOT / "examples" / "train_translation.py"
MUSIC_ARGS = ["--config", "tiny", "--max-files", "4", "--batch-size", "8", "--seq-len", "64", "--seed", "3"]
TRANSLATION_ARGS = [
    *("--steps", "3", "--batch-size", "8", "--layers", "1", "--d-model", "16", "--heads", "2"),
    *("--copy-pairs", "200", "--holdout", "8", "--examples", "2"),
]
# Two processes x two devices run the same partitioned program on the same global batches, parameters and dropout
# keys as one process x four devices; only the cross-device all-reduces differ: gloo sums the four devices' partial
# gradients and losses in another order than the in-process CPU collectives. Measured: the losses differ in the
# last float32 bit at some steps (max relative difference: music 8e-8 over 4 steps, translation 1.1e-7 over 3).
# Process 1 reading process 0's rows instead of its own moved the music losses by 5e-4 (tried by breaking
# process_rows): 50 times this bound.
RTOL_PROCESSES = 1e-5
TIMEOUT_S = 300  # every launched process is killed (its whole process group) past this


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices: int, cache: Path | None = None) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if cache is not None:  # single-process runs only: the multi-process ones compile other programs anyway
        env |= {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return env


def launch(commands: list[list[str]], env: dict, logs: Path, timeout: float = TIMEOUT_S) -> list[tuple[int, str, str]]:
    """Start every command at once, each in its own process group; ``(returncode, stdout, stderr)`` of each.

    Every process is waited for; any still running at ``timeout`` is killed with its whole group and the test fails.
    """
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    try:
        for i, command in enumerate(commands):
            out, err = open(logs / f"p{i}.out", "w"), open(logs / f"p{i}.err", "w")
            files += [out, err]
            procs.append(
                subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True, text=True)
            )
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process ran past {timeout} s; killed: {commands}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in files:
            f.close()
    return [
        (proc.returncode, (logs / f"p{i}.out").read_text(), (logs / f"p{i}.err").read_text())
        for i, proc in enumerate(procs)
    ]


def two_processes(script: Path, args: list, logs: Path) -> list[tuple[int, str, str]]:
    """``script args`` as processes 0 and 1 of a run, two CPU devices each, joined on 127.0.0.1."""
    address = f"127.0.0.1:{free_port()}"
    commands = [
        [sys.executable, str(script), *map(str, args)]
        + ["--coordinator", address, "--num-processes", "2", "--process-id", str(i), "--distributed-timeout", "120"]
        for i in range(2)
    ]
    results = launch(commands, environment(2), logs)
    for i, (code, _, err) in enumerate(results):
        assert code == 0, f"process {i} exited with {code}:\n{err[-4000:]}"
    return results


def one_process(script: Path, args: list, logs: Path, cache: Path) -> tuple[str, str]:
    """``script args`` as one process of four CPU devices."""
    [(code, out, err)] = launch([[sys.executable, str(script), *map(str, args)]], environment(4, cache), logs)
    assert code == 0, f"exited with {code}:\n{err[-4000:]}"
    return out, err


def losses(out: Path) -> tuple[list[int], np.ndarray]:
    records = read_metrics(out / "metrics.jsonl")
    return [r["step"] for r in records], np.array([r["loss"] for r in records])


def assert_same_losses(got: Path, reference: Path, steps: list[int]) -> float:
    got_steps, got_loss = losses(got)
    ref_steps, ref_loss = losses(reference)
    assert got_steps == ref_steps == steps
    np.testing.assert_allclose(got_loss, ref_loss, rtol=RTOL_PROCESSES, atol=0)
    return float(np.max(np.abs(got_loss / ref_loss - 1)))


@pytest.mark.slow
def test_music_two_processes_train_as_one_and_their_checkpoint_resumes_in_one_process(tmp_path):
    chorales = tmp_path / "chorales"
    music.render_bach_chorales(chorales, limit=4)
    cache = tmp_path / "jax-cache"
    run = [*MUSIC_ARGS, "--data", chorales, "--steps", "4", "--ckpt-every", "2", "--generate-tokens", "8"]

    two = tmp_path / "two"
    (_, out0, _), (_, out1, err1) = two_processes(MUSIC, [*run, "--out", two], tmp_path / "logs-two")
    one = tmp_path / "one"
    one_process(MUSIC, [*run, "--out", one], tmp_path / "logs-one", cache)
    worst = assert_same_losses(two, one, [1, 2, 3, 4])
    print(f"music, 2 processes x 2 devices vs 1 x 4: max relative loss difference {worst:.2e}")

    # Written once, by process 0, where one process writes them; the checkpoints by both together.
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["2", "4"]
    assert "sample.mid: 32 prompt ids" in out0 and "steps 1..4" in out0
    assert "sample.mid" not in out1 and "data:" not in out1 and "loss=" not in err1  # no output, no progress bar

    # The two-process checkpoint of step 2 resumes in one process and continues as the uninterrupted run.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    one_process(MUSIC, [*run, "--out", resumed, "--resume", "--generate-tokens", "0"], tmp_path / "logs-resumed", cache)
    worst = assert_same_losses(resumed, one, [1, 2, 3, 4])
    print(f"music, resumed in 1 process from the 2-process checkpoint: max relative loss difference {worst:.2e}")


@pytest.mark.slow
def test_a_process_that_cannot_reach_its_coordinator_exits_within_its_timeout(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    timeout = 4
    command = [sys.executable, str(MUSIC), *MUSIC_ARGS, "--out", str(tmp_path / "out"), "--coordinator", address]
    command += ["--num-processes", "2", "--process-id", "1", "--distributed-timeout", str(timeout)]
    start = time.monotonic()
    [(code, _, err)] = launch([command], environment(2), tmp_path / "logs", timeout=120)
    elapsed = time.monotonic() - start
    assert code == 1, err[-4000:]
    assert f"process 1 of 2: could not join the distributed run through the coordinator {address} within 4 s" in err
    assert "--distributed-timeout" in err and "Traceback" not in err
    assert elapsed < timeout + 60, elapsed  # the timeout plus starting Python and importing JAX on a loaded machine


@pytest.mark.slow
def test_distributed_alone_where_jax_detects_no_cluster_is_a_usage_error(tmp_path):
    clusters = ("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR")  # what JAX detects by
    env = {k: v for k, v in environment(1).items() if not k.startswith(clusters)}  # nothing here may reach a network
    command = [sys.executable, str(TRANSLATION), "--distributed", "--steps", "1", "--out", str(tmp_path / "out")]
    [(code, _, err)] = launch([command], env, tmp_path / "logs", timeout=120)
    assert code == 2 and "Traceback" not in err, err[-4000:]
    assert err.startswith("train_translation.py: error: --distributed: cannot join the run") and "--coordinator" in err


def test_the_shares_of_a_global_batch_are_its_rows_and_one_process_reads_all():
    mesh = make_mesh()
    assert process_rows(batch_sharding(mesh), 8).tolist() == list(range(8))  # one process: every row
    rng = np.random.default_rng(0)
    dataset = music.MusicDataset([rng.integers(0, 388, size=50) for _ in range(5)], seq_len=16, seed=1)
    x, y, end = dataset.batch(3, 8)  # 5 examples: examples 3 .. 10 of the stream span epochs 0, 1 and 2
    for part in ([0, 1, 2, 3], [4, 5, 6, 7], [1, 6]):  # what processes of a 2- or 4-way split read
        px, py, pend = dataset.batch(3, 8, part)
        np.testing.assert_array_equal(px, x[part])
        np.testing.assert_array_equal(py, y[part])
        assert pend == end == 11


@pytest.mark.parametrize("script", [MUSIC, TRANSLATION], ids=["music", "translation"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "127.0.0.1:1234"], "together; missing --num-processes and --process-id"),
        (["--num-processes", "2", "--process-id", "0"], "together; missing --coordinator"),
        (
            ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
            "--coordinator must be HOST:PORT",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id must be in 0 .. 1",
        ),
        (["--distributed-timeout", "0"], "--distributed-timeout must be >= 1"),
    ],
)
def test_distributed_flags_are_checked_together(script, flags, message, capsys, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args([*flags, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_address_flags_imply_distributed_and_none_keep_one_process():
    import argparse

    parser = argparse.ArgumentParser()
    recipes.add_distributed_arguments(parser)
    args = parser.parse_args(["--coordinator", "127.0.0.1:5", "--num-processes", "1", "--process-id", "0"])
    recipes.check_distributed_arguments(parser, args)
    assert args.distributed and args.distributed_timeout == 300
    args = parser.parse_args([])
    recipes.check_distributed_arguments(parser, args)
    assert not args.distributed  # join_distributed then does nothing: one process, as before


def test_initialize_distributed_wants_the_three_address_arguments_together():
    with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
        initialize_distributed("127.0.0.1:1234", 2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        initialize_distributed("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        initialize_distributed("127.0.0.1:1234", 2, 0, timeout_s=0)


# Last in the file: pytest-xdist hands each worker a contiguous half of the tests, so the two long ones run side by
# side (the music test comes first).
@pytest.mark.slow
def test_translation_two_processes_train_as_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    (_, out0, _), (_, out1, _) = two_processes(TRANSLATION, [*TRANSLATION_ARGS, "--out", two], tmp_path / "logs-two")
    one_process(TRANSLATION, [*TRANSLATION_ARGS, "--out", one], tmp_path / "logs-one", tmp_path / "jax-cache")
    worst = assert_same_losses(two, one, [1, 2, 3])
    print(f"translation, 2 processes x 2 devices vs 1 x 4: max relative loss difference {worst:.2e}")
    assert sorted(p.name for p in two.iterdir()) == ["eval.json", "loss.png", "metrics.jsonl"]
    assert json.loads((two / "eval.json").read_text())["heldout"] == 8
    assert "exact match on 8 held-out pairs" in out0  # process 0 evaluates and prints, alone
    assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == []  # gloo's own connection lines

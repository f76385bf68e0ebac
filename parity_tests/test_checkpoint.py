"""Checkpoints, metrics log and loss plot of resumable training (flax_ln.checkpoint)."""

import importlib.util
import io
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_ln.checkpoint as fc
from flax_ln import GPT, GPTConfig, music
from flax_ln.checkpoint import (
    Checkpointer,
    CheckpointError,
    MetricsLog,
    UnreadableCheckpointError,
    check_writable_folder,
    plot_loss,
    read_metrics,
)
from flax_ln.train import gpt_adam, init_train_state  # noqa: E402

TINY = GPTConfig.music(n_layer=1, n_head=2, n_embd=16, block_size=8)


def train_state(seed=0, config=TINY):
    model = GPT(config, rngs=nnx.Rngs(seed))
    model.train()
    return init_train_state(model, gpt_adam())


def test_train_state_round_trip_is_bitwise_with_prng_keys(tmp_path):
    _, state = train_state()
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(7, state, {"data_position": 56, "config": {"n_layer": 1}})
    ckpt.close()
    _, template = train_state(seed=1)  # different values, same structure
    restored, meta = Checkpointer(tmp_path / "ck", create=False).restore(template, expect={"config": {"n_layer": 1}})
    assert meta["step"] == 7 and meta["data_position"] == 56
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # dropout keys come back as typed keys
            assert b.dtype == a.dtype
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_restore_lists_every_incompatibility(tmp_path):
    _, state = train_state()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, {"seq_len": 8})
    ckpt.close()
    _, other = train_state(config=GPTConfig.music(n_layer=1, n_head=2, n_embd=32, block_size=8))
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, create=False).restore(other, expect={"seq_len": 16})
    message = str(err.value)
    assert str(tmp_path / "1") in message and "incompatible" in message
    assert "seq_len: checkpoint has 8, this run has 16" in message
    assert "params.lm_head.kernel.value: checkpoint has shape/dtype [[16, 390], 'float32']" in message


def test_missing_or_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        Checkpointer(tmp_path / "nope", create=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Checkpointer(tmp_path / "empty", create=False).read_meta()


@pytest.mark.slow
def test_kill_during_a_write_leaves_the_previous_checkpoint_usable(tmp_path):
    # Step 2 is 64 MB, so the process is killed (SIGKILL, no cleanup) while orbax is still writing it.
    script = textwrap.dedent(f"""
        import os, signal
        import jax.numpy as jnp
        from flax_ln.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(1, {{"a": jnp.ones(4), "b": jnp.zeros(16_000_000)}}, {{"tag": "one"}})
        ckpt.wait()
        ckpt.save(2, {{"a": jnp.full(4, 2.0), "b": jnp.ones(16_000_000)}}, {{"tag": "two"}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    ckpt = Checkpointer(tmp_path, create=False)
    template = {"a": jax.ShapeDtypeStruct((4,), jnp.float32), "b": jax.ShapeDtypeStruct((16_000_000,), jnp.float32)}
    state, meta = ckpt.restore(template)  # the latest *complete* checkpoint
    expected = {1: ("one", 1.0), 2: ("two", 2.0)}[meta["step"]]  # 2 only if the write had finished
    assert (meta["tag"], float(state["a"][0])) == expected


def test_metrics_log_resume_drops_redone_steps_and_partial_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # a writer killed mid-line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    log = MetricsLog(path, keep_through=3)  # resumed from the step-3 checkpoint: 4 and 5 will be redone
    log.write({"step": 4, "loss": 0.3})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.3)]
    MetricsLog(path).close()  # a fresh run (no keep_through) starts an empty log
    assert path.read_text() == ""


def test_plot_loss_writes_a_png(tmp_path):
    plot_loss([{"step": s, "loss": 5.0 / s} for s in range(1, 20)], tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------
# damaged checkpoints


def damage(step_dir: Path, size=None) -> None:
    """Truncate every array data file of a checkpoint (OCDBT ``d/`` files) to ``size`` bytes (default: half)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files, f"no array data under {step_dir}"
    for f in files:
        os.truncate(f, f.stat().st_size // 2 if size is None else size)


def leaves_equal(a, b) -> bool:
    keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    return all(
        np.array_equal(np.asarray(keys(x)), np.asarray(keys(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_damaged_newest_checkpoint_falls_back_to_the_newest_readable(tmp_path):
    _, state = train_state()
    saved = {
        step: jax.tree.map(lambda x, s=step: x + s if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
        for step in (1, 2, 3)
    }
    ckpt = Checkpointer(tmp_path)
    for step, value in saved.items():
        ckpt.save(step, value, {"tag": step})
    ckpt.close()
    damage(tmp_path / "3")
    ckpt = Checkpointer(tmp_path, create=False)
    with pytest.raises(UnreadableCheckpointError) as err:
        ckpt.restore(state)
    message = str(err.value)  # one line naming the checkpoint and the cause, not TensorStore's spec dump
    assert message.startswith(f"{tmp_path / '3'}: unreadable checkpoint: cannot read the arrays (")
    assert "\n" not in message and len(message) < 800 and "'driver'" not in message, message
    assert err.value.step == 3

    restored, meta, skipped = ckpt.restore_newest_readable(state)
    assert meta["step"] == 2 and [e.step for e in skipped] == [3]
    assert leaves_equal(restored, saved[2]) and not leaves_equal(restored, saved[3])

    moved = ckpt.set_aside(3)  # the resumed run must be able to write step 3 again
    assert moved == str(tmp_path / "3.unreadable") and (tmp_path / "3.unreadable").is_dir()
    assert ckpt.steps() == [2, 1] and ckpt.newest_readable_meta()["step"] == 2
    ckpt.save(3, restored, {"tag": "again"})
    ckpt.close()
    assert Checkpointer(tmp_path, create=False).read_meta()["tag"] == "again"


def test_no_readable_checkpoint_lists_each_one(tmp_path):
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save(step, {"a": jnp.arange(4096.0) + step}, {})
    ckpt.close()
    for step in (1, 2):
        damage(tmp_path / str(step), size=0)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, create=False).restore_newest_readable({"a": jax.ShapeDtypeStruct((4096,), jnp.float32)})
    lines = str(err.value).splitlines()
    assert lines[0] == f"{tmp_path}: no checkpoint can be read:" and len(lines) == 3
    assert lines[1].startswith(f"  {tmp_path / '2'}: unreadable checkpoint: cannot read the arrays")
    assert lines[2].startswith(f"  {tmp_path / '1'}: unreadable checkpoint: cannot read the arrays")


@pytest.mark.slow
def test_a_failed_read_prints_nothing_else(tmp_path):
    # When orbax gives up on a damaged checkpoint, TensorStore reads still in flight post to its closed
    # event loop, and Python printed "RuntimeError: Event loop is closed" tracebacks, during and after
    # the failed read, in about half of the attempts. Eight attempts in a fresh process, then exit.
    script = textwrap.dedent(f"""
        import jax.numpy as jnp
        from flax_ln.checkpoint import Checkpointer, CheckpointError
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(1, {{f"a{{i}}": jnp.arange(4096.0) + i for i in range(16)}}, {{}})
        ckpt.close()
        import pathlib
        for f in pathlib.Path({str(tmp_path)!r}, "1").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"0123456789")
        ckpt = Checkpointer({str(tmp_path)!r}, create=False)
        template = {{f"a{{i}}": jnp.zeros(4096) for i in range(16)}}
        for attempt in range(8):
            try:
                ckpt.restore(template)
            except CheckpointError as e:
                print(str(e).splitlines()[0][:60])
        ckpt.close()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"{tmp_path / '1'}: unreadable checkpoint: cann"[:60]] * 8, proc.stdout
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr[-3000:]


def test_noise_filter_drops_only_the_closed_loop_reports(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(str(unraisable.exc_value)))
    quiet = fc._FailedReadNoise()
    quiet.install()
    try:
        for error in (RuntimeError("Event loop is closed"), RuntimeError("something else"), ValueError("x")):
            sys.unraisablehook(types.SimpleNamespace(exc_value=error, object=None))
    finally:
        quiet.uninstall()
    assert seen == ["something else", "x"] and sys.unraisablehook is not quiet.hook
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved", (), None)
    assert quiet.filter(record)  # no exception from an orbax frame: kept


# ---------------------------------------------------------------------------------------
# train_music.py: resume past a damaged checkpoint, and folders it cannot write

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_music.py"
COMMON = [
    "--config",
    "tiny",
    "--max-files",
    "4",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--seed",
    "3",
    "--generate-tokens",
    "0",
]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_music", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_music_resumes_from_the_newest_readable_checkpoint(script, tmp_path, capsys):
    chorales = tmp_path / "chorales"
    music.render_bach_chorales(chorales, limit=4)
    out = tmp_path / "run"
    args = [*COMMON, "--data", str(chorales), "--out", str(out), "--ckpt-every", "1"]
    assert script.main([*args, "--steps", "3"]) == 0
    straight = [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")]
    damage(out / "checkpoints" / "3")
    capsys.readouterr()
    assert script.main([*args, "--steps", "4", "--resume"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "unreadable" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {out / 'checkpoints' / '3'}: unreadable checkpoint: ")
    assert warned[0].endswith(
        f"resuming from checkpoint 2 instead, and moved the unreadable one to {out / 'checkpoints' / '3.unreadable'}"
    ), warned[0]
    assert "Traceback" not in err and "Event loop" not in err, err
    resumed = [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")]
    # Step 3 is redone from checkpoint 2 on bitwise-identical arrays and data position: the same loss
    # (1e-6 relative allows only float32 reduction-order noise; a wrong state moves it by > 1e-3).
    assert [s for s, _ in resumed] == [1, 2, 3, 4] and resumed[:2] == straight[:2]
    np.testing.assert_allclose(resumed[2][1], straight[2][1], rtol=1e-6)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "3", "3.unreadable", "4"]


def usage_error(script, capsys, *args) -> str:
    """Run main() with ``args``: it must stop with exit code 2 and one error line, no traceback."""
    with pytest.raises(SystemExit) as stop:
        script.main([*COMMON, *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_train_music_refuses_a_folder_nobody_can_write(script, capsys, tmp_path):
    # Root may write into mode 555, so this uses a path that nobody can create: /proc is not writable.
    for extra in ([], ["--resume"]):
        line = usage_error(script, capsys, "--out", "/proc/flax_ln_out", *extra)
        assert ": error: --out /proc/flax_ln_out is not writable: /proc, where it would be created," in line, line
    line = usage_error(script, capsys, "--out", str(tmp_path), "--ckpt-dir", "/proc/flax_ln_ckpt", "--resume")
    assert ": error: --ckpt-dir /proc/flax_ln_ckpt is not writable" in line, line
    (tmp_path / "file").write_text("")
    line = usage_error(script, capsys, "--out", str(tmp_path / "file" / "run"))
    assert f"--out {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is not a folder" in line, line


@pytest.mark.slow
def test_read_only_folder_as_another_user(script, tmp_path):
    """Mode 555 for a user who does not own the folder: as root, a forked child drops to ``nobody`` first."""
    base = Path(tempfile.mkdtemp())  # tmp_path's parents are private to root; nobody must reach the folder
    try:
        base.chmod(0o755)
        read_only = base / "out"
        (read_only / "checkpoints").mkdir(parents=True)
        for folder in (read_only / "checkpoints", read_only):
            folder.chmod(0o555)
        if os.geteuid() != 0:
            results = [run_as_this_user(script, read_only, resume) for resume in (False, True)]
        else:
            results = [run_as_nobody(script, read_only, resume) for resume in (False, True)]
            check_writable_folder(read_only, "--out")  # root itself may write there, as the system says
        for code, err in results:
            assert code == 2 and "Traceback" not in err, err
            assert f"error: --out {read_only} is not writable: this folder does not let this user" in err
        assert sorted(p.name for p in read_only.iterdir()) == ["checkpoints"]  # nothing was written
    finally:
        for folder in (base, base / "out", base / "out" / "checkpoints"):
            folder.chmod(0o755)
        shutil.rmtree(base)


def run_as_this_user(script, out, resume):
    """``(exit code, stderr)`` of the script's start-up checks (argument parsing) for ``--out out``."""
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        script.parse_args([*COMMON, "--out", str(out), *(["--resume"] if resume else [])])
        return 0, sys.stderr.getvalue()
    except SystemExit as stop:
        return stop.code, sys.stderr.getvalue()
    finally:
        sys.stderr = stderr


def run_as_nobody(script, out, resume):
    """``run_as_this_user`` in a forked child that first becomes ``nobody``.

    A fresh interpreter cannot be used: the venv's python lives under /root, which nobody
    may not read. The child only parses arguments and probes the folder (no JAX work), and
    leaves with ``os._exit``.
    """
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX warns that forking a multithreaded process may deadlock
        pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child stuck on a lock inherited from a parent thread dies, so the test fails, never hangs
        os.close(read)
        code = 1
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            code, err = run_as_this_user(script, out, resume)
            os.write(write, err.encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        err = pipe.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err

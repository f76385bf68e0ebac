"""Checkpoints, metrics log and loss plot of resumable training (flax_ln.checkpoint)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_ln import GPT, GPTConfig
from flax_ln.checkpoint import Checkpointer, CheckpointError, MetricsLog, plot_loss, read_metrics
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

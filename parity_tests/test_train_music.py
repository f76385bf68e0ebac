"""examples/train_music.py end to end: a tiny smoke run, exact resume (also after SIGKILL), resume on 8
devices, clear errors for folders that cannot be resumed, the book's sampling and --sample-only."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pretty_midi
import pytest
from flax import nnx

import flax_ln
from flax_ln import music
from flax_ln.checkpoint import read_metrics

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_music.py"
# Tiny model, 4 chorales (rendered in about a second), short sequences: each run takes seconds.
COMMON = ["--config", "tiny", "--max-files", "4", "--batch-size", "8", "--seq-len", "64", "--seed", "3"]
# A resumed run executes the same compiled step on bitwise-identical restored arrays (params,
# Adam moments, dropout keys and counters) and data position, so on CPU its losses are
# bitwise equal in practice; 1e-6 relative only allows float32 reduction-order noise should
# XLA recompile differently, while a lost RNG state or data position moves the loss by > 1e-3.
RTOL_RESUME = 1e-6
# Resumed on 8 devices (data 4 x fsdp 2): float32 reductions run in another order (see test_sharding.py).
RTOL_DEVICES = 1e-4


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A persistent compilation cache shared by this module's runs: all compile the same few programs."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def chorales(tmp_path_factory):
    """4 chorales rendered once for every run but the smoke run (which renders its own, the default path)."""
    folder = tmp_path_factory.mktemp("chorales")
    music.render_bach_chorales(folder, limit=4)
    return folder


def run(out, *args, cache, devices=1, env=None, check=True):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        **(env or {}),
    }
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *COMMON, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(out):
    records = read_metrics(Path(out) / "metrics.jsonl")
    return [r["step"] for r in records], np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, jax_cache):
    """6 uninterrupted steps, checkpoints at 3 and 6, 32 sampled tokens: the smoke run and the reference."""
    out = tmp_path_factory.mktemp("straight")
    proc = run(out, "--steps", "6", "--ckpt-every", "3", "--generate-tokens", "32", cache=jax_cache)
    return out, proc


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, jax_cache, chorales):
    """3 steps that end normally (checkpoint at 3), copied before any resume touches them."""
    out = tmp_path_factory.mktemp("three")
    run(out, "--steps", "3", "--ckpt-every", "3", "--generate-tokens", "0", "--data", chorales, cache=jax_cache)
    return out


def test_smoke_outputs(straight):
    out, proc = straight
    steps, loss = losses(out)
    assert steps == [1, 2, 3, 4, 5, 6] and np.isfinite(loss).all()
    assert loss[-1] < loss[0]  # Adam 1e-4 on a fixed small data set lowers the loss within 6 steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "6"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    midi = pretty_midi.PrettyMIDI(str(out / "sample.mid"))
    assert [(i.program, i.is_drum) for i in midi.instruments] == [(1, False)]
    # 4 chorales: 3 train, the last (sorted) gives the prompt: 128 // 4 = 32 ids of it, then 32 sampled
    heldout = sorted((out / "bach_chorales").glob("*.mid"))[-1]
    assert f"sample.mid: 32 prompt ids from {heldout} + 32 sampled" in proc.stdout
    assert "data: 3 training pieces, 3 examples of 64 tokens" in proc.stdout
    assert "tok_s=" in proc.stderr and "loss=" in proc.stderr  # the tqdm bar
    print(f"tiny smoke run: loss {loss[0]:.4f} -> {loss[-1]:.4f} over {steps[-1]} steps")


def test_resume_after_three_steps_matches_six_straight_steps(straight, three_steps, tmp_path, jax_cache, chorales):
    out = tmp_path / "resumed"
    shutil.copytree(three_steps, out)
    assert losses(out)[0] == [1, 2, 3]
    run(
        out,
        "--steps",
        "6",
        "--ckpt-every",
        "3",
        "--generate-tokens",
        "0",
        "--resume",
        "--data",
        chorales,
        cache=jax_cache,
    )
    steps, resumed = losses(out)
    reference = losses(straight[0])[1]
    assert steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(resumed, reference, rtol=RTOL_RESUME, atol=0)
    print(f"resume 3 -> 6: max relative difference {np.max(np.abs(resumed / reference - 1)):.2e}")


def test_sigkill_between_checkpoints_then_resume_matches(straight, tmp_path, jax_cache, chorales):
    out = tmp_path / "killed"
    args = ["--steps", "6", "--ckpt-every", "2", "--generate-tokens", "0", "--data", chorales]
    proc = run(out, *args, env={"FLAX_LN_TEST_SIGKILL_AFTER_STEP": "5"}, check=False, cache=jax_cache)
    assert proc.returncode == -9, proc.stderr[-4000:]  # killed after logging step 5, past the step-4 checkpoint
    assert losses(out)[0] == [1, 2, 3, 4, 5] and not (out / "loss.png").exists()
    run(out, *args, "--resume", cache=jax_cache)
    steps, resumed = losses(out)
    reference = losses(straight[0])[1]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps after the last checkpoint were redone, not duplicated
    np.testing.assert_allclose(resumed, reference, rtol=RTOL_RESUME, atol=0)
    assert "6" in {p.name for p in (out / "checkpoints").iterdir()}
    print(f"SIGKILL at 5, resume -> 6: max relative difference {np.max(np.abs(resumed / reference - 1)):.2e}")


def test_resume_on_eight_devices_with_fsdp(straight, three_steps, tmp_path, jax_cache, chorales):
    out = tmp_path / "eight"
    shutil.copytree(three_steps, out)
    run(
        out,
        "--steps",
        "6",
        "--ckpt-every",
        "3",
        "--generate-tokens",
        "0",
        "--resume",
        "--fsdp",
        "2",
        "--data",
        chorales,
        devices=8,
        cache=jax_cache,
    )
    steps, resumed = losses(out)
    reference = losses(straight[0])[1]
    assert steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(resumed, reference, rtol=RTOL_DEVICES, atol=0)
    print(
        f"1-device checkpoint resumed on 8 devices (4 x 2): max relative difference "
        f"{np.max(np.abs(resumed / reference - 1)):.2e}"
    )


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_music", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fails(script, capsys, *args):
    """Run the script's main() in this process; it must return 1 with one error line, no traceback."""
    code = script.main([*COMMON, *args])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith("train_music.py: error: "), err
    return err


def test_resume_errors_name_the_folder_and_the_problem(script, capsys, three_steps, tmp_path, chorales):
    err = fails(script, capsys, "--resume", "--out", str(tmp_path / "missing"))
    assert str(tmp_path / "missing" / "checkpoints") in err and "no such folder" in err

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    err = fails(script, capsys, "--resume", "--out", str(tmp_path / "empty"))
    assert str(tmp_path / "empty" / "checkpoints") in err and "no complete checkpoint" in err

    err = fails(script, capsys, "--resume", "--out", str(three_steps), "--seq-len", "32", "--seed", "4")
    assert f"{three_steps / 'checkpoints' / '3'} is incompatible" in err
    assert "seq_len: checkpoint has 64, this run has 32" in err and "seed: checkpoint has 3, this run has 4" in err

    err = fails(script, capsys, "--resume", "--out", str(three_steps), "--data", str(chorales), "--max-files", "3")
    assert "is incompatible" in err and "data: checkpoint has" in err

    err = fails(script, capsys, "--out", str(three_steps))  # not resuming into a folder with checkpoints
    assert "already holds checkpoints (latest step 3); pass --resume" in err

    corrupt = tmp_path / "corrupt"
    shutil.copytree(three_steps, corrupt)
    for f in (corrupt / "checkpoints" / "3" / "meta").iterdir():
        f.write_text("not json")
    err = fails(script, capsys, "--resume", "--out", str(corrupt), "--data", str(chorales))
    assert str(corrupt / "checkpoints" / "3") in err and "cannot read the checkpoint metadata" in err


def test_sampling_draws_only_the_388_event_ids():
    # ln_f outputs its bias (scale 0, bias 1) and lm_head gives 388/389 the logit 16 and every event 0, so an
    # unrestricted draw is 388/389 with probability 1 - 388 / (388 + 2 e^16) ~ 1 - 2e-5 per token.
    config = flax_ln.GPTConfig.music(n_layer=1, n_head=2, n_embd=16, block_size=32)
    model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
    model.transformer.ln_f.scale[...] = jnp.zeros(16)
    model.transformer.ln_f.bias[...] = jnp.ones(16)
    model.lm_head.kernel[...] = jnp.zeros((16, 390)).at[:, music.EOS :].set(1.0)
    prompt = jnp.asarray([[376, 60, 305, 188]], jnp.int32)
    key = jax.random.key(0)
    free = np.asarray(flax_ln.generate(model, prompt, 40, rng=key))[0, 4:]
    book = np.asarray(flax_ln.generate(model, prompt, 40, vocab_limit=music.N_EVENTS, rng=key))[0, 4:]
    assert (free >= music.EOS).all()
    assert (book < music.EOS).all() and len(set(book.tolist())) > 20  # ~uniform over 388 ids
    with pytest.raises(ValueError, match="vocab_limit must be in"):
        flax_ln.generate(model, prompt, 3, vocab_limit=391, rng=key)


def test_sample_only_from_a_book_state_dict_and_from_a_checkpoint(script, capsys, three_steps, chorales, tmp_path):
    import torch

    import torch_ref

    config = script.CONFIGS["tiny"]
    torch.manual_seed(0)
    torch.save(torch_ref.GPT(config).state_dict(), tmp_path / "book.pt")
    prompt = sorted(chorales.glob("*.mid"))[0]
    for source in (tmp_path / "book.pt", three_steps / "checkpoints"):
        out = tmp_path / source.stem
        assert (
            script.main(
                [
                    "--config",
                    "tiny",
                    "--sample-only",
                    str(source),
                    "--prompt-midi",
                    str(prompt),
                    "--generate-tokens",
                    "8",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert f"sample.mid: 32 prompt ids from {prompt} + 8 sampled" in capsys.readouterr().out
        assert pretty_midi.PrettyMIDI(str(out / "sample.mid")).instruments[0].program == 1

    err = fails(
        script,
        capsys,
        "--config",
        "music",
        "--sample-only",
        str(tmp_path / "book.pt"),
        "--prompt-midi",
        str(prompt),
        "--out",
        str(tmp_path / "x"),
    )
    assert "does not fit --config music" in err and "transformer.wte.weight" in err

"""Parity on a device mesh: the flax side sharded on a (data, fsdp) mesh still agrees with torch.

Simulated CPU devices must be set before JAX starts, so each check runs in a subprocess.
The tolerance is the float32 policy itself (``TOLERANCES["float32"]``): sharding changes
only the order of the reductions XLA performs, a rounding-level difference (~1e-7).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

SHARDED_CASES = textwrap.dedent("""
    import json
    import jax
    from flax_ln import parity
    from flax_ln.book import cases
    from flax_ln.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh(4)  # (data 2, fsdp 4)
    out = {}
    for name, build, seq_len in (("gpt", cases.gpt, 8), ("encoder-decoder", cases.encoder_decoder, 6)):
        case = build("float32", 2, seq_len, 0)
        report = parity.check_case(case, parity.TOLERANCES["float32"], mesh=mesh)
        failed = [(r.name, r.relative_error) for r in report.results if not r.passed]
        out[name] = {"passed": report.passed, "failed": failed, "sharding": report.sharding, "title": report.title}
    print(json.dumps(out))
""")


def run_python(code, **env):
    environment = {**os.environ, "PYTHONPATH": os.getcwd(), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)


def test_gpt_and_encoder_decoder_agree_with_torch_when_sharded():
    proc = run_python(SHARDED_CASES, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, expect in (
        (
            "gpt",
            {
                "lm_head.kernel": "P('fsdp', None)",  # (64, 50): 50 % 4 != 0
                "transformer.wte.embedding": "P(None, 'fsdp')",  # (50, 64)
                "transformer.h.0.mlp.c_fc.kernel": "P(None, 'fsdp')",
            },
        ),  # (64, 256)
        ("encoder-decoder", {"generator.proj.kernel": "P('fsdp', None)"}),
    ):  # (32, 13)
        report = result[name]
        assert report["passed"], (name, report["failed"])
        assert report["sharding"]["mesh"] == {"data": 2, "fsdp": 4}
        assert "mesh data 2 x fsdp 4" in report["title"]
        specs = report["sharding"]["params"]
        for path, spec in expect.items():
            assert specs[path] == spec, (name, path, specs[path])
        # every parameter with an axis the fsdp size divides is split: nothing silently replicated
        assert sum("fsdp" in spec for spec in specs.values()) >= len(specs) // 2, specs


def test_cli_sets_the_cpu_device_count_itself(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a plain shell: one CPU device
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flax_ln",
            "parity",
            "--model",
            "layernorm",
            "--devices",
            "4",
            "--fsdp",
            "2",
            "--quiet",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layernorm (float32, mesh data 2 x fsdp 2)" in proc.stdout
    report = json.loads(out.read_text())
    assert len(report["environment"]["devices"]) == 4
    (model,) = report["models"]
    assert model["passed"] and model["sharding"]["mesh"] == {"data": 2, "fsdp": 2}
    assert model["sharding"]["params"] == {"a_2": "P('fsdp',)", "b_2": "P('fsdp',)"}

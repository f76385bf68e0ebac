"""Smoke tests: the benchmark scripts run and print their tables. No timing is asserted."""

import itertools
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(cmd, **env):
    # the timeout only catches a hang: beside a parallel test run a quick benchmark takes minutes
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_run_quick_prints_the_ratio_tables():
    out = run([sys.executable, "benchmarks/run.py", "--quick"])
    assert "### LayerNorm 256x128 float32: ratios" in out
    assert "| workload | comparison | ratio | target | met |" in out
    for row in (
        "LN forward | flax_ln.LayerNorm (jit) vs torch",
        "LN forward | flax_ln.LayerNorm (jit) vs numpy copy",
        "LN forward+backward | flax_ln.LayerNorm (jit) vs torch",
    ):
        assert row in out, row
    assert "### LayerNorm forward+backward at other shapes" in out
    for title in (
        "### GPT training step (fwd+bwd+clip+Adam): ratios",
        "forward+backward compile time, scan_layers",
        "training step: per-block rematerialisation",
    ):
        assert title in out, title
    # every benchmark reports the load it ran under (the smoke run marks, never waits)
    assert out.count("Load average (1 min):") >= 4


def test_load_note_marks_a_loaded_run_invalid():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as bench_run
    finally:
        sys.path.pop(0)
    assert bench_run.load_note(0.4, 0.9, 1.0).endswith("-> quiet start")
    assert bench_run.load_note(0.4, 2.1, 1.0).endswith("-> quiet start")  # its own two threads, after
    assert "INVALID" in bench_run.load_note(1.0, 0.5, 1.0)  # the load never fell below the threshold
    assert "INVALID" in bench_run.load_note(2.0, 2.5, 1.0)


def test_interleaved_leads_each_timed_call_with_calls_of_the_same_candidate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import interleaved
    finally:
        sys.path.pop(0)
    order = []
    candidates = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    timings = interleaved(candidates, repeats=3, warmup=1, lead_in=0)
    assert order == ["a", "b"] + ["a", "b"] * 3  # warm-up, then one timed call each per round
    assert all(len(t.samples) == 3 for t in timings.values())

    order.clear()
    timings = interleaved(candidates, repeats=3, warmup=0, lead_in=0.005)
    runs = [(name, sum(1 for _ in group)) for name, group in itertools.groupby(order)]
    assert [name for name, _ in runs] == ["a", "b"] * 3  # each round: a block of a's, then of b's
    assert all(count >= 2 for _, count in runs)  # at least one lead-in call before the timed one
    assert all(len(t.samples) == 3 for t in timings.values())


@pytest.mark.skipif(shutil.which("bash") is None, reason="gpu.sh is a bash script")
def test_gpu_script_dry_run(tmp_path):
    out = run(["bash", "benchmarks/gpu.sh", "--dry-run"], PYTHON=sys.executable, OUT=str(tmp_path))
    assert "DRY RUN" in out
    assert "| shape | dtype | copy_GBps | fwd_GBps | fwd_frac | bwd_GBps | bwd_frac |" in out
    assert "GPT-2 124M bf16 training step (target mfu >= 0.5)" in out
    assert "| config | dropout | batch | seq_len | params | step_ms | tokens_per_s | mfu |" in out
    assert "passed" in out and "== done (status 0)" in out
    assert "bringing up nodes" not in out  # the parity step runs in one process (-n 0), not one worker per core
    assert (tmp_path / "gpu_bench.json").exists() and (tmp_path / "parity.xml").exists()


def _bench_gpt():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpt
    finally:
        sys.path.pop(0)
    return bench_gpt


def test_gpt2_cases_run_together_alone_or_not_by_the_memory_they_need():
    bench_gpt = _bench_gpt()
    gib = 2**30
    assert bench_gpt.placement((5 * gib, 12 * gib)) == ("together", "")
    where, why = bench_gpt.placement((11.7 * gib, 19.7 * gib))  # GPT-2 B=4, T=1024 on a 23 GiB machine
    assert where == "alone" and "11.7 GiB" in why and "not interleaved" in why
    where, why = bench_gpt.placement((21.4 * gib, 21.0 * gib))  # B=8, T=1024
    assert where == "skip" and why.startswith("not run")
    assert bench_gpt.placement(None) == ("together", "")  # no memory figures (a device): left to the device


def test_a_gpt2_case_times_each_candidate_in_a_process_of_its_own():
    bench_gpt = _bench_gpt()
    notes = []
    timings = bench_gpt.gpt2_case_alone(2, 32, 2, False, notes, tiny=True)
    assert set(timings) == {"flax_ln", "torch_ref eager"}, notes
    assert all(len(t.samples) == 2 and min(t.samples) > 0 for t in timings.values())
    assert len(notes) == 2 and all("alone: first step" in n and "peak RSS" in n for n in notes), notes
    failed = bench_gpt.run_alone("--gpt2-step", "flax_ln", "--tiny", "--batch", "2", "--seq-len", "4096")
    assert failed["error"].startswith("exit 1"), failed  # longer than the block: the process fails, the run goes on

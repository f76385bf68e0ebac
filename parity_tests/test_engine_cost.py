"""What the engine does beyond the floor (one torch forward and backward, one flax compile and run), checked as
behaviour: one compile per comparison, nothing left on or written into the user's modules, each statistic of a
verdict the float64 quantity whatever the arrays' layout, and the float64 zero evidence asked only when a
gradient needs it. No timings: benchmarks/engine_floor.py measures those."""

import logging

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import flax_ln
import flax_ln.parity.compare as compare
import flax_ln.parity.core.tensor_stats as tensor_stats
import flax_ln.parity.judge as judge
import torch_ref
from flax_ln import GPTConfig
from flax_ln.parity import Tolerance, compare_modules, compare_tensors, relative_error

SMALL = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=40, block_size=8)


def gpt_pair(dtype="float32"):
    torch.manual_seed(0)
    torch_model = torch_ref.GPT(SMALL).to(getattr(torch, dtype)).eval()
    flax_model = flax_ln.GPT(SMALL, scan_layers=True, param_dtype=np.dtype(dtype), rngs=nnx.Rngs(0))
    return torch_model, flax_model, np.random.default_rng(0).integers(0, SMALL.vocab_size, (2, 8))


def test_one_compile_of_the_flax_step_per_comparison(caplog):
    torch_model, flax_model, idx = gpt_pair()
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        report = compare_modules(torch_model, flax_model, idx, dtype="float32")
    assert report.passed
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation of jit(" in r.getMessage()]
    # the forward and backward is one jitted objective; anything else XLA compiles is small glue
    assert sum("jit(objective)" in m for m in compiled) == 1, compiled


def test_the_users_modules_keep_no_gradient_and_share_no_memory():
    torch_model, flax_model, idx = gpt_pair()
    before = {k: v.clone() for k, v in torch_model.state_dict().items()}
    kept = torch.ones_like(torch_model.lm_head.weight)
    torch_model.lm_head.weight.grad = kept  # a gradient the caller had: given back as it was
    report = compare_modules(torch_model, flax_model, idx, dtype="float32")
    assert report.passed
    assert torch_model.lm_head.weight.grad is kept
    assert all(p.grad is None for n, p in torch_model.named_parameters() if n != "lm_head.weight")
    assert all(torch.equal(before[k], v) for k, v in torch_model.state_dict().items())  # nothing written into torch
    # the flax weights are the flax module's own: an in-place torch update (an optimiser step) does not reach them
    embedding = np.array(flax_model.transformer.wte.embedding[...])
    with torch.no_grad():
        torch_model.transformer.wte.weight.add_(1.0)
    np.testing.assert_array_equal(np.asarray(flax_model.transformer.wte.embedding[...]), embedding)


def float64_stats(a, b):
    """The verdict's statistics from whole float64 copies: the definitions, written out."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(a) & np.isfinite(b)
    diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))
    flat = int(np.argmax(diff))
    return float(diff.reshape(-1)[flat]), np.unravel_index(flat, diff.shape), np.sqrt(np.sum(diff**2))


@pytest.mark.parametrize("block", [7, 1 << 18])  # many blocks (the largest error in a later one), and one
def test_statistics_read_in_blocks_are_the_float64_ones(monkeypatch, block):
    monkeypatch.setattr(tensor_stats, "BLOCK", block)
    rng = np.random.default_rng(0)
    torch_grad = rng.standard_normal((40, 30)).astype(np.float32)  # torch's layout
    flax_grad = np.ascontiguousarray(torch_grad.T + rng.standard_normal((30, 40)).astype(np.float32) * 1e-3).T
    assert not flax_grad.flags.c_contiguous  # a transposed view, as a flax kernel's gradient comes back
    flax_grad[17, 3] += 0.5  # the largest error, past the first blocks
    stats = tensor_stats.pair_stats(flax_grad, torch_grad)
    max_abs, index, diff_norm = float64_stats(flax_grad, torch_grad)
    assert stats.max_abs == max_abs and stats.index == (17, 3) == tuple(int(i) for i in index)
    # sums of squares added block by block: float64 rounding of a 1200-term sum, ~1e-16 relative
    assert stats.diff_norm == pytest.approx(diff_norm, rel=1e-12)
    expected_rel = diff_norm / np.sqrt(np.sum(np.asarray(torch_grad, np.float64) ** 2))
    assert stats.relative == pytest.approx(expected_rel, rel=1e-12)
    assert relative_error(flax_grad, torch_grad) == stats.relative


def test_nonfinite_values_are_counted_and_matched_across_blocks(monkeypatch):
    monkeypatch.setattr(tensor_stats, "BLOCK", 4)
    a = np.arange(10, dtype=np.float32)
    b = a.copy()
    a[5] = b[5] = np.nan  # the same NaN on both sides: the finite rest is compared
    assert relative_error(a, b) == 0.0
    a[8] = np.inf
    result = compare_tensors("x", "output", a, b, Tolerance(1e-5))
    assert not result.passed and result.nonfinite == "NaN in flax: 1, NaN in torch: 1, Inf in flax: 1, Inf in torch: 0"
    assert result.relative_error == np.inf  # an Inf where torch has a number


def test_a_passing_comparison_never_asks_for_the_zero_evidence(monkeypatch, x64):
    def asked(*args, **kwargs):
        raise AssertionError("the float64 zero evidence was computed though no gradient needed it")

    monkeypatch.setattr(compare, "zero_gradient_names", asked)
    monkeypatch.setattr(judge, "zero_gradient_names", asked)
    monkeypatch.setattr(compare, "float64_gradients", asked)
    torch_model, flax_model, idx = gpt_pair("float64")
    assert compare_modules(torch_model, flax_model, idx, dtype="float64").passed
    torch_model, flax_model, idx = gpt_pair()
    assert compare_modules(torch_model, flax_model, idx, dtype="float32").passed


def test_short_memory_keeps_torchs_gradients_in_files_with_the_same_verdict(monkeypatch):
    import flax_ln.parity.core.spill as spill

    monkeypatch.setattr(spill, "SMALL", 64)  # every gradient of the toy GPT goes to a file
    torch_model, flax_model, idx = gpt_pair()
    in_memory = compare_modules(torch_model, flax_model, idx, dtype="float32")
    files = []
    real_to_file = spill.to_file

    def recording_to_file(array):
        files.append(real_to_file(array))
        return files[-1]

    monkeypatch.setattr(spill, "available_bytes", lambda: 1 << 20)  # a machine with 1 MiB free
    monkeypatch.setattr("flax_ln.parity.sides.torch.to_file", recording_to_file)
    spilled = compare_modules(torch_model, flax_model, idx, dtype="float32")
    assert files and all(isinstance(f, np.memmap) and not f.flags.writeable for f in files)
    assert len(files) == len([p for p in torch_model.parameters() if p.requires_grad])
    assert all(p.grad is None for p in torch_model.parameters())
    # the same torch gradients, read back from the files: every statistic equal, not merely close
    assert [(r.name, r.max_abs_error, r.relative_error, r.passed) for r in spilled.results] == [
        (r.name, r.max_abs_error, r.relative_error, r.passed) for r in in_memory.results
    ]


def test_spill_is_chosen_by_the_memory_three_more_copies_need(monkeypatch):
    import flax_ln.parity.core.spill as spill

    monkeypatch.setattr(spill, "available_bytes", lambda: 10 * 2**30)
    assert not spill.should_spill(2 * 2**30)  # 3 x 2 GiB + 1 GiB margin fits in 10 GiB
    assert spill.should_spill(7 * 2**29)  # 3 x 3.5 GiB + 1 GiB does not
    monkeypatch.setattr(spill, "available_bytes", lambda: None)  # unknown (not Linux): never
    assert not spill.should_spill(1 << 40)


def test_a_gradient_that_cannot_go_to_a_file_stays_in_memory(monkeypatch, tmp_path):
    import flax_ln.parity.core.spill as spill

    monkeypatch.setattr(spill, "SMALL", 0)
    monkeypatch.setattr(spill.tempfile, "tempdir", str(tmp_path))
    array = np.arange(1024, dtype=np.float32)

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill.os, "posix_fallocate", no_space)
    with pytest.warns(RuntimeWarning, match="stays in memory"):
        kept = spill.to_file(array)
    assert kept is array and not list(tmp_path.iterdir())  # no file left behind


def test_float64_parameters_given_back_are_the_callers_and_taken_again_exactly():
    from flax_ln.parity.islands.torch import torch_in_float64

    torch_model, _, _ = gpt_pair()
    own = {n: p.data for n, p in torch_model.named_parameters()}
    with torch_in_float64(torch_model) as cast:
        doubled = {n: p.data.clone() for n, p in torch_model.named_parameters()}
        assert all(t.dtype == torch.float64 for t in doubled.values())
        cast.release()
        assert all(same_tensor(p.data, own[n]) for n, p in torch_model.named_parameters())  # the caller's, no copy
        cast.restore()
        assert all(torch.equal(p.data, doubled[n]) for n, p in torch_model.named_parameters())  # the same values
        assert all(p.data.dtype == torch.float64 for p in torch_model.parameters())
    assert all(same_tensor(p.data, own[n]) for n, p in torch_model.named_parameters())


def same_tensor(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


def test_the_float64_check_loads_from_the_callers_weights_after_freeing_torchs_copy(monkeypatch):
    import flax_ln.convert.rules as rules

    torch_model, flax_model, idx = gpt_pair()
    seen = []
    load = rules.load_with_rules

    def watched(model, state_dict, **kwargs):
        seen.append(
            (
                {str(p.dtype) for p in torch_model.parameters()},  # what the torch model holds while flax loads
                np.shares_memory(state_dict["lm_head.weight"], torch_model.lm_head.weight.detach().numpy()),
            )
        )
        return load(model, state_dict, **kwargs)

    monkeypatch.setattr(rules, "load_with_rules", watched)
    report = compare_modules(torch_model, flax_model, idx)  # the float64 check, then float32
    assert report.passed and report.float64_check.passed
    # the check loaded the caller's float32 weights (cast exactly) while torch's float64 copy was already given back
    assert seen == [({"torch.float32"}, True), ({"torch.float32"}, True)]
    assert max(r.relative_error for r in report.float64_check.results) < 1e-12  # float64 rounding: weights exact


def test_localisation_in_the_float64_check_runs_torch_in_float64_again():
    torch_model, flax_model, idx = gpt_pair()
    flax_model.transformer.h.ln_2.eps = 1.001e-5  # a planted difference only the float64 check sees
    report = compare_modules(torch_model, flax_model, idx)
    check = report.float64_check
    assert not check.passed and check.first_divergence is not None and report.first_divergence is None
    assert "ln_2" in check.first_divergence.module
    # torch's modules recorded on its float64 parameters again: no float32 weight met (and widened) on the way
    assert not [island for island in check.islands if island.side == "torch"], check.islands
    assert all(p.dtype == torch.float32 for p in torch_model.parameters())


def test_many_pairs_read_at_once_have_each_pairs_statistics():
    rng = np.random.default_rng(1)
    pairs = {f"t{i}": (rng.standard_normal(s), rng.standard_normal(s)) for i, s in enumerate([(3, 4), (50,), ()])}
    pairs["unreadable"] = (np.ones(3), np.ones(4))  # shapes that do not broadcast: the caller's checks say why
    stats = tensor_stats.many_pair_stats(pairs)
    assert list(stats) == list(pairs) and stats["unreadable"] is None
    for name in ["t0", "t1", "t2"]:
        assert stats[name] == tensor_stats.pair_stats(*pairs[name])


def test_a_float64_judgings_zero_word_comes_from_its_norms_and_is_zero_gradient_names(monkeypatch):
    from flax_ln.parity.core.policy import tolerances_for, zero_gradient_names
    from flax_ln.parity.sides.torch import TorchSide

    rng = np.random.default_rng(2)
    torch_grads = {"a": rng.standard_normal(50), "b": np.zeros(5), "c": rng.standard_normal(5) * 1e-20}
    torch_grads["d"] = np.zeros(3)  # zero for torch, not for flax: zero only where both sides say so
    flax_grads = {k: v + 1e-17 * rng.standard_normal(v.shape) for k, v in torch_grads.items()}
    flax_grads["d"] = np.full(3, 1e-3)
    side = TorchSide(
        "t",
        "float64",
        "grad",
        [],
        [],
        {},
        {},
        list(torch_grads),
        torch_grads,
        dict.fromkeys(torch_grads, "param grad"),
        {},
        {},
    )

    def asked(*args, **kwargs):
        raise AssertionError("the gradients were read again for their norms")

    monkeypatch.setattr(judge, "zero_gradient_names", asked)
    _, _, zero = judge.judge(side, (flax_grads, {}, None), tolerances_for("float64"), asked, want_zero=True)
    assert zero == zero_gradient_names(torch_grads, flax_grads) == {"b", "c"}


def test_large_host_buffers_are_page_aligned_maps_that_jax_uses_in_place():
    from flax_ln.convert.assign import BASE_PAGES_FROM, assign, host_buffer

    small, large = host_buffer((3, 5), np.float32), host_buffer((BASE_PAGES_FROM // 8,), np.float64)
    assert small.ctypes.data % 64 == 0 and large.ctypes.data % 4096 == 0
    large[...] = 1.5
    variable = nnx.Param(jax.ShapeDtypeStruct(large.shape, np.float64))
    with jax.enable_x64(True):
        assign(variable, large, owned=True)
        assert variable.get_value().unsafe_buffer_pointer() == large.ctypes.data  # no copy of the weights
        assert float(variable.get_value()[-1]) == 1.5


def test_output_cotangents_are_the_float64_draws_cast():
    from flax_ln.parity.sides.torch import output_cotangents

    outputs = {"logits": np.zeros((2, 3), np.float32), "ids": np.zeros(2, np.int64), "h": np.zeros(4)}
    drawn = output_cotangents(outputs)
    rng = np.random.default_rng(0)  # the definition: float64 draws in order, cast to each output's dtype
    assert list(drawn) == ["logits", "h"]
    np.testing.assert_array_equal(drawn["logits"], rng.standard_normal((2, 3)).astype(np.float32))
    np.testing.assert_array_equal(drawn["h"], rng.standard_normal(4))
    assert drawn["logits"].dtype == np.float32 and drawn["h"].dtype == np.float64

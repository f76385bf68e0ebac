"""Smoke runs of examples/train_translation.py and examples/generate_gpt2.py, each in a subprocess."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_ln
from flax_ln.convert import HF_GPT2_KEYS

pytestmark = pytest.mark.slow  # every test here starts a subprocess or runs an example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str) -> str:
    """Run ``examples/<script>`` with ``args``; returns its stdout, failing with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def load_example(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- chapter 10: train_translation.py ----


def test_translation_smoke_on_a_tsv_file(tmp_path):
    words = "the cat dog sees a big small house".split()
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(40):
        src = rng.choice(words, size=rng.integers(2, 6))
        lines.append(" ".join(src) + "\t" + " ".join(w.upper() for w in src[::-1]))
    (tmp_path / "pairs.tsv").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    stdout = run_example(
        "train_translation.py",
        "--data",
        tmp_path / "pairs.tsv",
        "--steps",
        3,
        "--batch-size",
        8,
        "--layers",
        1,
        "--d-model",
        16,
        "--heads",
        2,
        "--out",
        out,
    )
    assert "36 training and 4 held-out pairs" in stdout and "exact match" in stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(np.isfinite(m["loss"]) and m["lr"] > 0 for m in metrics)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "eval.json").read_text())
    assert result["heldout"] == 4 and 0.0 <= result["exact_match"] <= 1.0 and len(result["examples"]) == 4


def test_translation_reads_and_rejects_tsv(tmp_path):
    example = load_example("train_translation.py")
    (tmp_path / "ok.tsv").write_text("ich bin müde\ti am tired\r\n\n  \nja\tyes\n", encoding="utf-8")
    want = [(["ich", "bin", "müde"], ["i", "am", "tired"]), (["ja"], ["yes"])]
    assert example.read_pairs(tmp_path / "ok.tsv") == want
    (tmp_path / "bad.tsv").write_text("ja\tyes\nno tab here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"bad.tsv:2: expected 'source<TAB>target'"):
        example.read_pairs(tmp_path / "bad.tsv")
    vocab = example.Vocab([["b", "a", "b"]])
    assert vocab.itos == ["<pad>", "<s>", "</s>", "<unk>", "b", "a"] and vocab.encode(["a", "zzz"]) == [5, 3]
    assert vocab.decode([1, 4, 5, 2, 4]) == ["b", "a"]  # from after <s> up to </s>


def test_translation_copy_task_converges(tmp_path):
    """A short copy-task run greedily reproduces every held-out sequence exactly."""
    out = tmp_path / "out"
    stdout = run_example(
        "train_translation.py",
        "--steps",
        300,
        "--d-model",
        32,
        "--heads",
        2,
        "--dropout",
        0,
        "--holdout",
        100,
        "--seed",
        0,
        "--out",
        out,
    )
    result = json.loads((out / "eval.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-20:]) < 0.1 * np.mean(losses[:20]), losses[::20]
    assert result["heldout"] == 100 and result["exact_match"] == 1.0, stdout


def test_greedy_decode_matches_the_books_growing_loop():
    """The fixed-buffer jitted decoder picks what the book's loop (ys grows by one column per step) picks."""
    model = flax_ln.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, rngs=nnx.Rngs(0))
    src = jnp.asarray(np.random.default_rng(0).integers(1, 11, (3, 7)), jnp.int32).at[2, 5:].set(0)
    src_mask = flax_ln.make_src_mask(src, 0)
    ys = flax_ln.greedy_decode(model, src, src_mask, 6, 1)
    model.eval()

    @nnx.jit  # one compilation for the whole unrolled loop instead of eager ops at five shapes
    def book_greedy_decode(model):
        memory = model.encode(src, src_mask)
        ys = jnp.ones((3, 1), jnp.int32)
        for _ in range(5):
            out = model.decode(memory, src_mask, ys, flax_ln.subsequent_mask(ys.shape[1]))
            token = jnp.argmax(model.generator(out[:, -1]), axis=-1).astype(ys.dtype)
            ys = jnp.concatenate([ys, token[:, None]], axis=1)
        return ys

    np.testing.assert_array_equal(np.asarray(ys), np.asarray(book_greedy_decode(model)))
    assert ys.dtype == src.dtype
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        flax_ln.greedy_decode(model, src, src_mask, 0, 1)


# ---- chapter 11: generate_gpt2.py ----


def write_hf_gpt2(folder: Path, model: flax_ln.GPT) -> None:
    """``model`` as a Hugging Face GPT2LMHeadModel folder: config.json + model.safetensors (untied lm_head)."""
    from safetensors.numpy import save_file

    tensors = {}
    for key, value in flax_ln.to_torch_state_dict(model).items():  # the inverse of the converter's HF key map
        action = next((a for suffix, a in HF_GPT2_KEYS.items() if key.endswith("." + suffix)), "copy")
        if action != "drop":
            tensors[key] = np.ascontiguousarray(value.T if action == "transpose" else value)
    save_file(tensors, str(folder / "model.safetensors"))
    c = model.config
    config = dict(
        model_type="gpt2",
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        activation_function="gelu_new",
        tie_word_embeddings=False,
    )
    (folder / "config.json").write_text(json.dumps(config))


def generated_ids(stdout: str) -> list[list[int]]:
    return [json.loads(m) for m in re.findall(r"^ids: (\[.*\])$", stdout, flags=re.M)]


# A byte-level BPE small enough to check by hand: every byte, then the merges below, then <|endoftext|>.
MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
]


def write_vocab_merges(folder: Path) -> dict[str, int]:
    """GPT-2-style vocab.json + merges.txt in ``folder``; returns the vocabulary (token -> id)."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}  # the 256 byte symbols (space is "Ġ")
    assert len(vocab) == 256
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES), encoding="utf-8")
    return vocab


def test_generate_gpt2_tokenizer_from_vocab_and_merges(tmp_path):
    example = load_example("generate_gpt2.py")
    tokenizer, source = example.load_tokenizer(tmp_path)
    assert tokenizer is None and "no tokenizer.json or vocab.json + merges.txt" in source
    vocab = write_vocab_merges(tmp_path)
    tokenizer, source = example.load_tokenizer(tmp_path)
    assert "merges.txt" in source
    # "hello" merges h+e, l+l, he+ll, hell+o; " world" is Ġ+w, o+r, Ġw+or, l+d, Ġwor+ld
    assert tokenizer.encode("hello world") == [vocab["hello"], vocab["Ġworld"]]
    # <|endoftext|> stays whole; "world" without its space: w, or, ld
    assert tokenizer.encode("hello<|endoftext|>world") == [
        vocab["hello"],
        vocab["<|endoftext|>"],
        vocab["w"],
        vocab["or"],
        vocab["ld"],
    ]
    for text in ["hello world", "  Tabs\tand\nnewlines  ", "naïve café, 日本語 😀 x² don't", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any text round-trips
    # tokenizer.json, when present, is read instead: here the same BPE saved by tokenizers itself
    tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_json, source = example.load_tokenizer(tmp_path)
    assert "tokenizer.json" in source
    assert from_json.encode("hello world, hello") == tokenizer.encode("hello world, hello")


def test_generate_gpt2_from_a_hugging_face_folder(tmp_path):
    config = flax_ln.GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=266, block_size=16)
    model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
    write_hf_gpt2(tmp_path, model)

    # --prompt-ids, greedy, past block_size: the same ids as flax_ln.generate on the original model
    stdout = run_example(
        "generate_gpt2.py",
        "--checkpoint",
        tmp_path,
        "--prompt-ids",
        "5,17,250",
        "--max-new-tokens",
        20,
        "--temperature",
        0,
    )
    assert "no tokenizer.json or vocab.json + merges.txt" in stdout
    want = flax_ln.generate(model, jnp.asarray([[5, 17, 250]], jnp.int32), 20, temperature=0, rng=jax.random.key(0))
    assert generated_ids(stdout) == np.asarray(want).tolist()

    # a text prompt through the folder's vocab.json + merges.txt, sampled with temperature and top-k
    vocab = write_vocab_merges(tmp_path)
    stdout = run_example(
        "generate_gpt2.py",
        "--checkpoint",
        tmp_path,
        "--prompt",
        "hello world",
        "--max-new-tokens",
        5,
        "--temperature",
        0.8,
        "--top-k",
        5,
        "--num-samples",
        2,
        "--no-scan-layers",
    )
    rows = generated_ids(stdout)
    assert len(rows) == 2 and all(row[:2] == [vocab["hello"], vocab["Ġworld"]] and len(row) == 7 for row in rows)
    assert "prompt:       'hello world'" in stdout


def test_generate_gpt2_random_weights_notice():
    stdout = run_example("generate_gpt2.py", "--prompt", "Hi", "--max-new-tokens", 4, "--top-k", 3)
    assert stdout.startswith("NOTICE: no --checkpoint given") and "RANDOM weights" in stdout
    rows = generated_ids(stdout)
    assert len(rows) == 1 and rows[0][:2] == list(b"Hi") and len(rows[0]) == 6

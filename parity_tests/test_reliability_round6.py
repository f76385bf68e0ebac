"""Reliability, sixth round: factories that must build the caller's model, a forged reference file, the caller's
torch module left as it was (tensors cached in plain attributes, a factory that returns the module itself),
dropped parameters judged by their float64 gradient, persistent buffers rebuilt in float64, float64's word on zero
gradients slab by slab, and the report's words.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from flax_ln.book.reference import DIGEST_KEY, METADATA_KEY, digest
from flax_ln.cli import main
from flax_ln.parity import KeyMap, compare_modules

WIDTH = 8
LINEAR_RULES = [(r"lin\.weight", "lin.kernel", "o i -> i o"), (r"lin\.bias", "lin.bias", None)]
LINEAR_MAP = KeyMap(LINEAR_RULES)


def _x(shape=(3, WIDTH)) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# ---- 2. a forged reference file: an extra state-dict key naming a tensor another key holds


def test_a_reference_with_an_extra_key_pointing_at_another_keys_tensor_is_refused_naming_it(tmp_path, capsys):
    path = tmp_path / "ln.safetensors"
    args = ["parity", "--model", "layernorm", "--seq-len", "4", "--batch", "1", "--quiet"]
    assert main([*args, "--save-reference", str(path)]) == 0
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    pairs = meta["models"][0]["side"]["state_dict"]["dict"]
    pairs.append(["forged.alias", copy.deepcopy(pairs[0][1])])  # the first key's tensor, under a second key
    text = json.dumps(meta)
    save_file(tensors, str(path), metadata={METADATA_KEY: text, DIGEST_KEY: digest(json.loads(text), tensors)})
    capsys.readouterr()
    try:
        code = main(["parity", "--reference", str(path), "--quiet"])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "forged.alias" in err and pairs[0][0] in err, err

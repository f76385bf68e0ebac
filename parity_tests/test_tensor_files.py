"""write_streamed: a safetensors file written a block at a time, read back by safetensors itself."""

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from flax_ln.convert.tensor_files import read_headers, write_streamed


def in_blocks(array, sizes):
    """``array``'s flat elements cut into consecutive blocks of ``sizes`` (the last takes the rest)."""
    flat = array.reshape(-1)
    bounds = [0, *np.cumsum(sizes, dtype=int).tolist(), flat.size]
    return lambda: [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_blocks_of_several_dtypes_and_shapes_read_back_exactly_by_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((5, 7)).astype(np.float32),
        "half": rng.standard_normal((3, 2, 4)).astype(ml_dtypes.bfloat16),
        "steps": np.arange(11, dtype=np.int64) * -3,
        "mask": rng.random((4, 4)) > 0.5,
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(2.5, np.float64),
    }
    blocks = {"w": [4, 16], "half": [1, 1, 20], "steps": [11], "mask": [3, 3], "empty": [], "scalar": []}
    file = tmp_path / "model.safetensors"
    write_streamed(file, [(k, a.shape, a.dtype, in_blocks(a, blocks[k])) for k, a in tensors.items()])
    back = safetensors.numpy.load_file(str(file))
    assert sorted(back) == sorted(tensors)
    for key, want in tensors.items():
        assert back[key].dtype == want.dtype and back[key].shape == want.shape, key
        np.testing.assert_array_equal(back[key], want, err_msg=key)  # bytes copied: exact
    codes = {name: code for _, name, _, code in read_headers([file])}
    assert codes == {"w": "F32", "half": "BF16", "steps": "I64", "mask": "BOOL", "empty": "F32", "scalar": "F64"}


def test_blocks_that_miss_elements_name_the_tensor(tmp_path):
    short = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"tensor 'w' of shape \(2, 3\) got 4 elements"):
        write_streamed(tmp_path / "x.safetensors", [("w", (2, 3), np.float32, lambda: [short[:4]])])


def test_a_dtype_safetensors_cannot_store_is_named(tmp_path):
    with pytest.raises(ValueError, match="tensor 'z' has dtype complex64"):
        write_streamed(tmp_path / "x.safetensors", [("z", (2,), np.complex64, lambda: [np.zeros(2, np.complex64)])])

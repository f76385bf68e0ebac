"""Hugging Face GPT-2 checkpoints (safetensors only) in and out of :class:`flax_ln.GPT`.

Reading is lazy: the safetensors headers (names, shapes, dtypes) are read first, and the
config, the key set, every shape and every dtype are checked against an abstract model
before any tensor data is touched or any parameter allocated. Keys are renamed into
torch_ref's layout by the small table :data:`HF_GPT2_KEYS` and matched to the model's
variables through the converter's rule table (:func:`flax_ln.convert.rules.torch_leaves`).
:func:`load_hf_gpt2` then creates each parameter directly on its device (or its shards
on a mesh), reading from the files only the block each device holds.
:func:`save_hf_gpt2` writes the other way. The files are read through the generic lazy
safetensors reader of :mod:`flax_ln.convert.tensor_files`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln._atomic import write_atomically
from flax_ln.convert.errors import ConversionError
from flax_ln.convert.layouts import Permute
from flax_ln.convert.rules import torch_leaves
from flax_ln.convert.tensor_files import (
    INDEX_FILE,
    SAFETENSORS_FLOATS,
    SAFETENSORS_OTHERS,
    StoredTensor,
    read_headers,
    read_json_object,
    shard_files,
)
from flax_ln.models.gpt import GPT, GPTConfig, causal_mask_buffer
from flax_ln.sharding import abstract_model

# How a Hugging Face GPT-2 key becomes a torch_ref.GPT key, by suffix (after adding the
# "transformer." prefix that GPT2Model files lack). Conv1D weights are stored (in, out),
# the transpose of nn.Linear; the attention-mask buffers are not weights. Every other
# key is copied as is.
HF_GPT2_KEYS: dict[str, str] = {
    "attn.c_attn.weight": "transpose",
    "attn.c_proj.weight": "transpose",
    "mlp.c_fc.weight": "transpose",
    "mlp.c_proj.weight": "transpose",
    "attn.bias": "drop",
    "attn.masked_bias": "drop",
}

HF_GPT2_UNPREFIXED = ("wte", "wpe", "h", "ln_f")  # GPT2Model's top-level names

# Hugging Face config entries this GPT can only take at one value: (key, HF default, allowed).
HF_GPT2_FIXED: tuple[tuple[str, Any, tuple[Any, ...]], ...] = (
    ("model_type", "gpt2", ("gpt2",)),
    ("activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh")),  # both the tanh GELU
    ("scale_attn_weights", True, (True,)),
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("reorder_and_upcast_attn", False, (False,)),
    ("layer_norm_epsilon", 1e-5, (1e-5,)),
    ("add_cross_attention", False, (False,)),
)

# GPTConfig field -> its config.json name.
HF_GPT2_SIZES = {"n_layer": "n_layer", "block_size": "n_positions", "vocab_size": "vocab_size", "n_embd": "n_embd"}


def gpt_config_from_hf(hf: Mapping[str, Any]) -> tuple[GPTConfig, bool]:
    """``(GPTConfig, tie_word_embeddings)`` from a Hugging Face GPT-2 ``config.json`` dict.

    Raises ``ValueError`` listing every setting this GPT cannot express.
    """
    problems = [
        f"{key}={hf.get(key, default)!r} (this GPT supports {' or '.join(map(repr, allowed))})"
        for key, default, allowed in HF_GPT2_FIXED
        if hf.get(key, default) not in allowed
    ]
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner={hf['n_inner']!r} (this GPT's MLP is 4*n_embd = {4 * n_embd} wide)")
    if problems:
        raise ValueError("this Hugging Face GPT-2 config cannot be expressed by flax_ln.GPT: " + "; ".join(problems))
    config = GPTConfig(
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=n_embd,
        vocab_size=hf.get("vocab_size", 50257),
        block_size=hf.get("n_positions", 1024),
        embd_pdrop=hf.get("embd_pdrop", 0.1),
        resid_pdrop=hf.get("resid_pdrop", 0.1),
        attn_pdrop=hf.get("attn_pdrop", 0.1),
    )
    return config, bool(hf.get("tie_word_embeddings", True))


def hf_config_from_gpt(config: GPTConfig, *, tied: bool, dtype: str) -> dict[str, Any]:
    """The Hugging Face GPT-2 ``config.json`` dict of ``config`` (the inverse of :func:`gpt_config_from_hf`).

    ``ignore_index`` and ``c_proj_reinit`` (loss and initialisation settings) have no
    Hugging Face counterpart and are not written.
    """
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_inner": None,
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "embd_pdrop": config.embd_pdrop,
        "resid_pdrop": config.resid_pdrop,
        "attn_pdrop": config.attn_pdrop,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def hf_to_torch_key(hf_key: str) -> tuple[str, str]:
    """``(torch_ref key, action)`` of a Hugging Face GPT-2 key; action is ``"copy"``, ``"transpose"`` or ``"drop"``."""
    name = f"transformer.{hf_key}" if hf_key.split(".")[0] in HF_GPT2_UNPREFIXED else hf_key
    return name, next((a for suffix, a in HF_GPT2_KEYS.items() if name.endswith("." + suffix)), "copy")


# ---------------------------------------------------------------------------------------
# Reading: the config, the headers renamed to torch_ref's keys, the checks


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    """A Hugging Face GPT-2 checkpoint whose headers are read: config and where every tensor lies."""

    config: GPTConfig
    tied: bool
    tensors: dict[str, StoredTensor]  # torch_ref key -> source, in torch layout; a tied lm_head.weight shares wte's
    explicit_head: StoredTensor | None  # a stored lm_head.weight that tied weights require to equal wte


def _config_from_file(file: Path) -> tuple[GPTConfig, bool]:
    hf = read_json_object(file, "the Hugging Face GPT-2 settings (n_layer, n_head, n_embd, ...)")
    try:
        return gpt_config_from_hf(hf)
    except ValueError as err:  # an unsupported setting, or a size GPTConfig refuses
        raise ValueError(f"{file}: {err}") from err


def _scan_headers(files: list[Path]) -> tuple[dict[str, StoredTensor], StoredTensor | None]:
    """Every tensor's name, shape and dtype from the safetensors headers (no data is read), renamed to torch_ref keys.

    Refuses non-floating tensors (a parameter stored as ``int8`` has lost its values),
    a key stored twice, and unreadable files. Returns the sources and the stored
    ``lm_head.weight`` (``None`` if absent).
    """
    tensors: dict[str, StoredTensor] = {}
    refused: list[str] = []
    for file, hf_key, shape, code in read_headers(files):
        key, action = hf_to_torch_key(hf_key)
        if action == "drop":
            continue
        if code not in SAFETENSORS_FLOATS:
            refused.append(f"{hf_key!r} ({SAFETENSORS_OTHERS.get(code, code)}, in {file.name})")
            continue
        if key in tensors:
            raise ValueError(
                f"{file}: {hf_key!r} is stored twice (also in {tensors[key].file} as "
                f"{tensors[key].name!r}); keep one copy"
            )
        conv1d = action == "transpose"  # stored (in, out): torch_ref's layout is the transpose
        torch_shape = shape[:-2] + shape[-2:][::-1] if conv1d else shape
        tensors[key] = StoredTensor(file, hf_key, torch_shape, conv1d)
    if refused:
        shown = ", ".join(refused[:5]) + (f", ... ({len(refused)} in all)" if len(refused) > 5 else "")
        raise ValueError(
            f"non-floating tensors in {files[0].parent}: {shown}. GPT-2 parameters must be stored as float32, "
            "float16, bfloat16 or float64: an integer or bool copy has lost the weights' values. "
            "Save the checkpoint again from the floating model"
        )
    return tensors, tensors.get("lm_head.weight")


def _check_sizes(config: GPTConfig, tensors: Mapping[str, StoredTensor], origin: str) -> None:
    """Compare the config's sizes with the tensors' shapes, so nothing is allocated for a size the files lack."""
    hf = origin != "config="
    name = (lambda field: HF_GPT2_SIZES[field]) if hf else (lambda field: field)
    found: dict[str, tuple[int, str]] = {}  # GPTConfig field -> (size in the checkpoint, where it was read)
    for key, axes in (
        ("transformer.wte.weight", ("vocab_size", "n_embd")),
        ("transformer.wpe.weight", ("block_size", "n_embd")),
    ):
        tensor = tensors.get(key)
        if tensor is not None and len(tensor.shape) == 2:
            for axis, field in enumerate(axes):
                found.setdefault(field, (tensor.shape[axis], f"{key} in {tensor.file.name} has shape {tensor.shape}"))
    layers = {int(m.group(1)) for key in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", key))}
    n_layers = max(layers) + 1 if layers else 0
    found["n_layer"] = (
        n_layers,
        f"the checkpoint holds transformer.h.0 to transformer.h.{n_layers - 1}"
        if n_layers
        else "the checkpoint holds no transformer.h.* layer",
    )
    problems = [
        f"{name(field)}={getattr(config, field)}, but {evidence}"
        for field, (size, evidence) in found.items()
        if getattr(config, field) != size
    ]
    if problems:
        fix = "fix config.json" if hf else "pass a config that matches the checkpoint"
        raise ValueError(
            f"{origin} does not match the checkpoint's tensors: "
            + "; ".join(problems)
            + f". Nothing was allocated; {fix}"
        )


def _open_checkpoint(path, config: GPTConfig | None) -> _Checkpoint:
    """Read the config and every safetensors header of ``path`` and check them against each other."""
    path = Path(path)
    tied, origin = True, "config="  # GPT-2 ties lm_head to wte
    if path.is_dir():
        if config is None:
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path}: no config.json; pass config=GPTConfig(...)")
            origin = str(path / "config.json")
            config, tied = _config_from_file(path / "config.json")
        if (path / "model.safetensors").is_file():
            files = [path / "model.safetensors"]
        elif (path / INDEX_FILE).is_file():
            files = shard_files(path, path / INDEX_FILE)
        else:
            raise FileNotFoundError(
                f"{path}: no model.safetensors. Only safetensors are read (pickled .bin files can run code); "
                "convert with transformers: model.save_pretrained(folder, safe_serialization=True)"
            )
    elif path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: expected a .safetensors file or a Hugging Face model folder")
        if config is None:
            raise ValueError(f"{path}: a single .safetensors file has no config; pass config=GPTConfig(...)")
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    tensors, explicit_head = _scan_headers(files)
    if tied and "transformer.wte.weight" in tensors:
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    _check_sizes(config, tensors, origin)
    return _Checkpoint(config, tied, tensors, explicit_head if tied else None)


def _is_transpose(key: str, layout: Permute | None, ndim: int) -> bool:
    """Whether a rule's layout swaps the last two axes (every layout in GPT-2); refuses any other."""
    if layout is None:
        return False
    if ndim == 2 and layout.to_flax(ndim) == (1, 0):
        return True
    raise NotImplementedError(
        f"{key}: the Hugging Face GPT-2 reader handles only matrix transposes, "
        f"not the layout {layout} of a {ndim}-axis array"
    )


def _placements(
    model: nnx.Module, checkpoint: _Checkpoint
) -> list[tuple[nnx.Variable, dict[int | None, StoredTensor], bool]]:
    """``[(variable, {layer: source}, transpose)]``: where each of ``model``'s parameters is read from.

    Checks first, from the headers alone, that the checkpoint's keys are exactly the
    model's and that every shape fits; every problem is listed in one
    :class:`ConversionError`.
    """
    leaves = torch_leaves(model)
    sources = checkpoint.tensors
    mismatched = []
    per_variable: dict[int, tuple[nnx.Variable, dict[int | None, StoredTensor], bool]] = {}
    for key, (var, layer, layout) in leaves.items():
        if key not in sources:
            continue
        transpose = _is_transpose(key, layout, len(var.shape) - (layer is not None))
        shape = tuple(var.shape[1:] if layer is not None else var.shape)
        if transpose:
            shape = shape[:-2] + shape[-2:][::-1]
        if sources[key].shape != shape:
            mismatched.append((key, f"expected shape {shape}, got {sources[key].shape}"))
            continue
        per_variable.setdefault(id(var), (var, {}, transpose))[1][layer] = sources[key]
    missing, unexpected = leaves.keys() - sources.keys(), sources.keys() - leaves.keys()
    if missing or unexpected or mismatched:
        raise ConversionError(missing, unexpected, mismatched)
    return list(per_variable.values())


def _check_tied_head(checkpoint: _Checkpoint) -> None:
    """With tied weights, a stored ``lm_head.weight`` must equal ``wte`` (both are read whole, once)."""
    head, wte = checkpoint.explicit_head, checkpoint.tensors.get("transformer.wte.weight")
    if head is None or wte is None:
        return
    if head.shape != wte.shape or not np.array_equal(head.read(), wte.read()):
        raise ConversionError(
            mismatched=[
                (
                    "lm_head.weight",
                    "differs from transformer.wte.weight, but the checkpoint ties them (tie_word_embeddings); "
                    "fix the checkpoint or set tie_word_embeddings=false in config.json",
                )
            ]
        )


def _checked(path, config: GPTConfig | None, build: Callable[[GPTConfig], GPT]):
    """``(checkpoint, model, placements)``: headers read and checked against ``build(config)``, an abstract model."""
    checkpoint = _open_checkpoint(path, config)
    model = build(checkpoint.config)
    placements = _placements(model, checkpoint)
    _check_tied_head(checkpoint)
    return checkpoint, model, placements


def read_hf_gpt2(path, *, config: GPTConfig | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """``(config, torch_ref state dict)`` of a Hugging Face GPT-2 checkpoint, every tensor in host memory.

    The state dict is complete for ``torch_ref.GPT(config).load_state_dict(..., strict=True)``:
    Conv1D weights transposed, a tied ``lm_head.weight`` copied from ``wte``, and torch's
    ``attn.bias`` causal-mask buffers (one (1, 1, block, block) array shared by every
    layer) added. Everything is checked from the headers first, as in
    :func:`load_hf_gpt2`; tensors keep the checkpoint's floating dtype.
    """
    checkpoint, _, _ = _checked(path, config, lambda c: nnx.eval_shape(lambda: GPT(c, rngs=nnx.Rngs(0))))
    state_dict = {key: checkpoint.tensors[key].read() for key in sorted(checkpoint.tensors)}
    mask = causal_mask_buffer(checkpoint.config.block_size)
    for i in range(checkpoint.config.n_layer):
        state_dict[f"transformer.h.{i}.attn.bias"] = mask
    return checkpoint.config, state_dict


# ---------------------------------------------------------------------------------------
# Loading, saving


def _place(var: nnx.Variable, layers: Mapping[int | None, StoredTensor], transpose: bool) -> jax.Array:
    """``var``'s value read from ``layers``, created directly with the sharding its abstract value names.

    Shard by shard: each of this process's devices gets its block, read from the file
    alone (for stacked layers, one layer slice at a time into the block) and put on the
    device before the next block is read, so the host holds one block at a time beyond
    what the devices hold. Without a sharding the whole tensor goes to the default device.
    """
    abstract = var.get_value()  # a ShapeDtypeStruct, from abstract_model
    dtype = np.dtype(abstract.dtype)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        if None in layers:
            return np.asarray(layers[None].read(index, transpose=transpose), dtype=dtype)
        out = np.empty([len(range(n)[s]) for n, s in zip(abstract.shape, index)], dtype)  # (layers, *block)
        for j, i in enumerate(range(abstract.shape[0])[index[0]]):
            out[j] = layers[i].read(index[1:], transpose=transpose)
        return out

    if abstract.sharding is None:
        return jax.device_put(block(tuple(slice(None) for _ in abstract.shape)))
    # jax.make_array_from_callback would read every block before placing any of them.
    blocks = abstract.sharding.addressable_devices_indices_map(abstract.shape)
    shards = [jax.device_put(block(index), device) for device, index in blocks.items()]
    return jax.make_array_from_single_device_arrays(abstract.shape, abstract.sharding, shards)


def load_hf_gpt2(
    path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    config: GPTConfig | None = None,
    scan_layers: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
) -> GPT:
    """A :class:`flax_ln.GPT` holding a Hugging Face GPT-2 checkpoint, in eval mode.

    ``path`` is a model folder as ``save_pretrained`` writes it (``config.json`` and
    ``model.safetensors``, or sharded ``model.safetensors.index.json``, whose shard files
    must lie inside the folder) or one ``.safetensors`` file, which needs ``config``. A
    given ``config`` is used instead of ``config.json``. Keys may carry the
    ``transformer.`` prefix (``GPT2LMHeadModel``) or not (``GPT2Model``). The four Conv1D
    weights are transposed, ``lm_head`` is tied to ``wte`` unless ``tie_word_embeddings``
    is false, the ``attn.bias``/``attn.masked_bias`` buffers are skipped (see
    :data:`HF_GPT2_KEYS`). Only safetensors are read.

    Before any tensor data is read or any parameter allocated, the headers are checked:
    the config's sizes against the tensors' shapes, then every missing, unexpected or
    mis-shaped key (one :class:`ConversionError`), and every dtype (floating only;
    float16/bfloat16 checkpoints are cast to ``param_dtype``). The model is built
    abstract (nothing is randomly initialised) and each parameter is then created
    directly with its final placement: with ``mesh``, its FSDP ``NamedSharding``, by the
    rules training uses (:func:`flax_ln.sharding.state_shardings`), each device's block
    read from the files on its own. So the host holds, beyond the devices' shards, about
    one block at a time (benchmarks/RESULTS.md, "Loading GPT-2XL onto a mesh").

    Args:
      path: folder or ``.safetensors`` file.
      mesh: a ``(data, fsdp)`` mesh from :func:`flax_ln.sharding.make_mesh`; ``None``
        puts every parameter on the default device.
      config: the :class:`GPTConfig`; required for a single file.
      scan_layers: as :class:`flax_ln.GPT` (dropout streams are seeded 0).
      dtype: as :class:`flax_ln.GPT`.
      param_dtype: as :class:`flax_ln.GPT`.

    Raises:
      ValueError: a config this GPT cannot express (e.g. ``activation_function="relu"``),
        config sizes the tensors do not have, malformed ``config.json`` or index, shard
        paths leaving the folder, non-floating tensors, or a file that is not safetensors.
      ConversionError: weights that do not fit, or ``lm_head.weight`` differing from a tied ``wte``.
    """

    def build(c: GPTConfig) -> GPT:
        return abstract_model(
            lambda: GPT(c, scan_layers=scan_layers, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)), mesh
        )

    _, model, placements = _checked(path, config, build)
    for var, layers, transpose in placements:
        var.set_value(_place(var, layers, transpose))
    model.eval()
    return model


def _host_array(value: jax.Array) -> np.ndarray:
    """A host copy of ``value``, gathered from its shards (single host: every shard must be addressable)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise ValueError(
            "save_hf_gpt2: a parameter is sharded over devices of other processes; gather the model onto "
            "one host first (e.g. jax.experimental.multihost_utils.process_allgather) or save from each "
            "host's replicated copy"
        )
    return np.asarray(value)


def save_hf_gpt2(model: GPT, path) -> Path:
    """Write ``model`` as a Hugging Face GPT-2 folder: ``config.json`` and ``model.safetensors``.

    The layout is ``GPT2LMHeadModel``'s: ``transformer.``-prefixed keys, Conv1D weights
    stored (in, out), which is the flax kernel's own layout. The book's GPT has its own
    ``lm_head``: where it equals ``wte`` (transposed) the tied form is written (no
    ``lm_head.weight``, ``"tie_word_embeddings": true``), otherwise ``lm_head.weight``
    and ``"tie_word_embeddings": false``. Tensors keep the parameters' dtype. A sharded
    model is gathered one parameter at a time; the host then holds the whole model (and
    safetensors copies it once more while serialising). ``transformers`` opens the folder
    with ``GPT2LMHeadModel.from_pretrained(path)``.

    Both files are written atomically (a temporary file, then renamed) with the permissions
    a plain ``open`` would give (``0o666`` less the umask). A folder that holds an earlier
    sharded save (``model.safetensors.index.json``) has that index and exactly the shard
    files it names removed, after the new files are in place; other files are kept. An
    index that cannot be read refuses the save, before anything is written.

    Args:
      model: a :class:`flax_ln.GPT`, unsharded or sharded on one host's devices.
      path: the folder; created if missing, its ``config.json`` and ``model.safetensors`` replaced.

    Returns:
      The folder's path.
    """
    from safetensors.numpy import save_file

    if not isinstance(model, GPT):
        raise TypeError(f"save_hf_gpt2: expected a flax_ln.GPT, got {type(model).__name__}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"save_hf_gpt2: {path} exists and is not a folder; pass a folder path")
    host: dict[int, np.ndarray] = {}  # one gathered copy per variable (stacked layers are views into it)
    tensors: dict[str, np.ndarray] = {}
    for key, (var, layer, layout) in torch_leaves(model).items():
        transpose = _is_transpose(key, layout, len(var.shape) - (layer is not None))
        if id(var) not in host:
            host[id(var)] = _host_array(var.get_value())
        value = host[id(var)] if layer is None else host[id(var)][layer]
        hf_key = key  # torch_ref's keys are GPT2LMHeadModel's
        conv1d = hf_to_torch_key(hf_key)[1] == "transpose"
        tensors[hf_key] = np.ascontiguousarray(np.swapaxes(value, -1, -2) if transpose != conv1d else value)
    tied = np.array_equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    if tied:
        del tensors["lm_head.weight"]
    dtype = str(tensors["transformer.wte.weight"].dtype)
    stale = _stale_shards(path)  # checked before anything is written: a malformed index refuses the save
    path.mkdir(parents=True, exist_ok=True)
    write_atomically(path / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    config = json.dumps(hf_config_from_gpt(model.config, tied=tied, dtype=dtype), indent=2) + "\n"
    write_atomically(path / "config.json", lambda tmp: Path(tmp).write_text(config, encoding="utf-8"))
    if stale is not None:  # only now, with the new weights in place: the index first, so no loader follows it
        (path / INDEX_FILE).unlink()
        for shard in stale:
            shard.unlink(missing_ok=True)
    return path


def _stale_shards(folder: Path) -> list[Path] | None:
    """The shard files an earlier sharded save's index in ``folder`` names (``None``: no index there).

    Only the files the index names, inside the folder, and never the ``model.safetensors``
    or ``config.json`` about to be written. An index that cannot be read refuses the save,
    naming it, so that nothing is guessed.
    """
    index_file = folder / INDEX_FILE
    if not index_file.is_file():
        return None
    try:
        shard_files(folder, index_file)  # the names lie inside the folder and the index is well-formed
    except ValueError as err:
        raise ValueError(
            f"save_hf_gpt2: {folder} holds a stale {INDEX_FILE} from a sharded save that cannot be read ({err}); "
            "nothing was written. Remove the index and its shard files yourself, or save to another folder"
        ) from err
    names = set(json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values())
    return [folder / name for name in sorted(names - {"model.safetensors", "config.json"})]

"""KeyMap.discover on real loaders: a parameter left abstract (nnx.eval_shape), a pytree loader, the probe file's
metadata, glued layer numbers folded, and a loader that splits torch tensors (an Equinox one, with eqx.tree_at)."""

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.convert import ConversionError, KeyMap

E = 8


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(E, E)
        self.b = torch.nn.Linear(E, E)


class Port(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(E, E, rngs=rngs)
        self.second = nnx.Linear(E, E, rngs=rngs)


def _abstract_loader(state):
    """bonsai's way: the model built abstract, the filled state merged; its table lacks ``b.bias``."""
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Port(nnx.Rngs(0))))
    table = {"a.weight": ("first", "kernel"), "a.bias": ("first", "bias"), "b.weight": ("second", "kernel")}
    for key, (module, leaf) in table.items():
        value = state[key].T if leaf == "kernel" else state[key]
        abstract[module][leaf].set_value(jnp.asarray(value))
    return nnx.merge(graph, abstract)


def test_a_parameter_left_abstract_is_named_and_admitted():
    with pytest.raises(ConversionError, match=r"second\.bias.*never filled: the loader left it abstract"):
        KeyMap.discover(_abstract_loader, Two(), allow_dropped=[r"b\.bias"])
    key_map = KeyMap.discover(_abstract_loader, Two(), allow_dropped=[r"b\.bias"], allow_unfilled=[r"second\.bias"])
    assert "second.bias" in key_map.discovery.unfilled
    assert "abstract" in key_map.discovery.unfilled["second.bias"]


def test_kind_function_takes_any_pytree():
    def loader(state):  # a list of (kernel, bias) pairs: no dict anywhere
        return [(jnp.asarray(state[f"{n}.weight"]).T, jnp.asarray(state[f"{n}.bias"])) for n in ("a", "b")]

    key_map = KeyMap.discover(loader, Two(), kind="function")
    source = key_map.to_source()
    assert r'r"1.0", "a b -> b a"' in source or '"1.0"' in source, source
    assert "0.1" in source and "1.1" in source


def test_probe_folder_carries_pt_format_metadata():
    seen = {}

    def loader(folder):
        raw = Path(folder, "model.safetensors").read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        seen.update(json.loads(raw[8 : 8 + length]).get("__metadata__", {}))
        from safetensors.numpy import load_file

        state = load_file(str(Path(folder, "model.safetensors")))
        return {
            "a": {"w": state["a.weight"], "b": state["a.bias"]},
            "b": {"w": state["b.weight"], "b": state["b.bias"]},
        }

    KeyMap.discover(loader, Two(), takes="folder", kind="function")
    assert seen == {"format": "pt"}


class Layered(torch.nn.Module):
    """Keys with numbers glued to letters, as torchvision's ResNet: layer1.bn1, layer2.bn2."""

    def __init__(self):
        super().__init__()
        for i in (1, 2):
            setattr(self, f"layer{i}", torch.nn.Module())
            for j in (1, 2):
                setattr(getattr(self, f"layer{i}"), f"bn{j}", torch.nn.LayerNorm(E))


def test_to_source_folds_numbers_glued_to_letters():
    def loader(state):
        return {f"stage{i}": {f"norm{j}": state[f"layer{i}.bn{j}.weight"] for j in (1, 2)} for i in (1, 2)} | {
            f"stage{i}_bias": {f"norm{j}": state[f"layer{i}.bn{j}.bias"] for j in (1, 2)} for i in (1, 2)
        }

    key_map = KeyMap.discover(loader, Layered(), kind="function")
    assert len(key_map.rules) == 2, key_map.to_source()
    assert r"layer(\d+)\.bn(\d+)\.weight" in key_map.to_source()
    assert r"stage\1.norm\2" in key_map.to_source()


eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")


class QKV(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.q, self.k, self.v, self.out = (eqx.nn.Linear(E, E, key=k) for k in keys)


def _equinox_loader(state):
    """As Equinox users write one: eqx.tree_at with slices of in_proj_weight."""
    model = QKV(jax.random.PRNGKey(0))
    w, b = state["in_proj_weight"], state["in_proj_bias"]
    return eqx.tree_at(
        lambda m: (m.q.weight, m.k.weight, m.v.weight, m.q.bias, m.k.bias, m.v.bias, m.out.weight, m.out.bias),
        model,
        tuple(jnp.asarray(x) for x in (w[:E], w[E : 2 * E], w[2 * E :], b[:E], b[E : 2 * E], b[2 * E :]))
        + (jnp.asarray(state["out_proj.weight"]), jnp.asarray(state["out_proj.bias"])),
    )


def test_discover_recovers_a_split_from_an_equinox_loader_and_round_trips():
    mha = torch.nn.MultiheadAttention(E, 2)
    key_map = KeyMap.discover(_equinox_loader, mha)
    source = key_map.to_source()
    assert '{r"[0:8]": r"q.weight", r"[8:16]": r"k.weight", r"[16:24]": r"v.weight"}' in source, source
    again = eval(source, {"KeyMap": KeyMap, "np": np})  # noqa: S307 - the map's own source
    assert again.to_source() == source
    from flax_ln.convert import load_torch_state_dict

    port = load_torch_state_dict(QKV(jax.random.PRNGKey(1)), mha.state_dict(), weights=again)
    np.testing.assert_array_equal(np.asarray(port.v.weight), mha.in_proj_weight.detach().numpy()[16:])


def test_a_loader_reading_only_part_of_a_tensor_says_so():
    def loader(state):  # v is never read from in_proj_weight
        model = QKV(jax.random.PRNGKey(0))
        w = state["in_proj_weight"]
        return eqx.tree_at(lambda m: (m.q.weight, m.k.weight), model, (jnp.asarray(w[:E]), jnp.asarray(w[E : 2 * E])))

    with pytest.raises(ConversionError, match=r"in_proj_weight.*reads 128 of its 192 elements"):
        KeyMap.discover(loader, torch.nn.MultiheadAttention(E, 2), allow_unfilled=[".*"], allow_dropped=[".*"])

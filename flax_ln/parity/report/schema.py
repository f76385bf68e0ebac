"""What a report's JSON must hold before it is read back (:func:`check_report`): every field
:func:`~flax_ln.parity.report.data.report_from_dict` reads, of the type :meth:`~flax_ln.parity.ParityReport.to_json`
writes, so that a damaged or foreign file is refused with the field named (``models[0].tensors: expected a list,
got str``), never with a traceback. Imports neither torch nor JAX."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NUMBER = (int, float, str)  # a number, or "inf"/"-inf"/"nan" as json_number writes it
TEXT_OR_NONE = (str, type(None))
RESULT_FIELDS: dict[str, Any] = {
    "name": str,
    "kind": str,
    "shape": list,
    "max_abs_error": NUMBER,
    "max_error_index": (list, type(None)),
    "relative_error": NUMBER,
    "tolerance": dict,
    "nonfinite": TEXT_OR_NONE,
    "passed": bool,
}
OPTIONAL_RESULT_FIELDS: dict[str, Any] = {
    "passed_by": TEXT_OR_NONE,
    "problem": TEXT_OR_NONE,
    "torch_vs_float64": (*NUMBER, type(None)),
    "flax_vs_float64": (*NUMBER, type(None)),
}
REPORT_FIELDS: dict[str, Any] = {"name": str, "dtype": str, "tensors": list}
OPTIONAL_REPORT_FIELDS: dict[str, Any] = {
    "seconds": (int, float),
    "first_divergence": (dict, type(None)),
    "module_errors": list,
    "isolated": (dict, type(None)),
    "lm_metrics": (dict, type(None)),
    "attribution": (dict, type(None)),
    "mode": str,
    "train_steps": list,
    "stored_dtype": TEXT_OR_NONE,
    "sharding": (dict, type(None)),
    "frozen": list,
    "dropped_parameters": list,
    "dropped_outputs": dict,
    "ties": dict,
    "shared": dict,
    "module_skipped": dict,
    "localization_note": TEXT_OR_NONE,
    "islands": list,
    "input_casts": dict,
    "constants": dict,
    "discovery": TEXT_OR_NONE,
    "float64_check": (dict, type(None)),
    "error": TEXT_OR_NONE,
    "module_pairs": dict,
    "module_inputs": list,
    "gradient_only": dict,
    "environment": (dict, type(None)),
}
ISLAND_FIELDS: dict[str, Any] = {"side": str, "module": TEXT_OR_NONE, "what": str, "lifted": bool}
TIE_FIELDS: dict[str, Any] = {"torch_aliases": list, "flax_paths": list}
ISOLATION_FIELDS: dict[str, Any] = {"modules": list, "skipped": dict, "culprits": list}
DIVERGENCE_FIELDS: dict[str, Any] = {"module": str, "inputs": list, "outputs": list}


def _names(kinds: Any) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    words = {list: "a list", dict: "an object", str: "a string", bool: "true or false", int: "a number"}
    words |= {float: "a number", type(None): "null"}
    return " or ".join(dict.fromkeys(words[k] for k in kinds))


def _check_fields(value: Any, where: str, required: Mapping[str, Any], optional: Mapping[str, Any] = {}) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
    for field, kinds in [*required.items(), *optional.items()]:
        if field not in value:
            if field in required:
                raise ValueError(f"{where}.{field}: missing")
            continue
        item = value[field]
        wrong_bool = isinstance(item, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,))
        if not isinstance(item, kinds) or wrong_bool:
            raise ValueError(f"{where}.{field}: expected {_names(kinds)}, got {type(item).__name__}")


def _check_each(items: Any, where: str, required: Mapping[str, Any], optional: Mapping[str, Any] = {}) -> None:
    for i, item in enumerate(items):
        _check_fields(item, f"{where}[{i}]", required, optional)


def check_report(data: Any, where: str = "report") -> None:
    """``ValueError`` naming the first field of ``data`` (one report's JSON dict) that is missing or of the wrong
    type; nested results, islands, ties, the isolation, the first divergence and the float64 check included."""
    _check_fields(data, where, REPORT_FIELDS, OPTIONAL_REPORT_FIELDS)
    for field in ("tensors", "module_errors", "module_inputs"):
        _check_each(data.get(field, []), f"{where}.{field}", RESULT_FIELDS, OPTIONAL_RESULT_FIELDS)
    _check_each(data.get("islands", []), f"{where}.islands", ISLAND_FIELDS)
    _check_each(data.get("train_steps", []), f"{where}.train_steps", {})
    for field in ("ties", "shared"):
        for key, tie in data.get(field, {}).items():
            _check_fields(tie, f"{where}.{field}.{key}", TIE_FIELDS)
    if data.get("isolated") is not None:
        _check_fields(data["isolated"], f"{where}.isolated", ISOLATION_FIELDS)
        _check_each(data["isolated"]["modules"], f"{where}.isolated.modules", RESULT_FIELDS, OPTIONAL_RESULT_FIELDS)
    if data.get("first_divergence") is not None:
        divergence = data["first_divergence"]
        _check_fields(divergence, f"{where}.first_divergence", DIVERGENCE_FIELDS)
        for field in ("inputs", "outputs"):
            _check_each(divergence[field], f"{where}.first_divergence.{field}", RESULT_FIELDS, OPTIONAL_RESULT_FIELDS)
    if data.get("float64_check") is not None:
        check_report(data["float64_check"], f"{where}.float64_check")


def check_reports_file(data: Any) -> None:
    """``ValueError`` naming the field unless ``data`` is a ``flax-ln parity --json`` file's dict (``"models"``, a
    list of reports) or one report's."""
    if not isinstance(data, dict):
        raise ValueError(f"the top level: expected an object, got {type(data).__name__}")
    if "models" not in data:
        check_report(data)
        return
    if not isinstance(data["models"], list):
        raise ValueError(f"models: expected a list, got {type(data['models']).__name__}")
    for i, model in enumerate(data["models"]):
        check_report(model, f"models[{i}]")
    if not isinstance(data.get("environment", {}), (dict, type(None))):
        raise ValueError(f"environment: expected an object, got {type(data['environment']).__name__}")

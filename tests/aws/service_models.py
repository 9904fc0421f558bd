"""AWS's own service models for the training-session APIs, read from botocore's data directory, and a strict
validator of wire JSON against their shapes.

botocore checks only `required`, `min` and types before it sends, and its parsers accept whatever they are given;
this validator checks every constraint a model states (types, required members, unions, min/max, patterns, enum
values, int32 ranges) and rejects members a shape does not define, so a response that parses under boto3 but
differs from what AWS sends, or a request rlloop's C++ client sends that AWS would refuse, is an error naming the
path.
"""

import math
import re

import botocore.loaders
import botocore.model

RUNTIME = "sagemakertrainingsessionruntime"
CONTROL = "sagemaker"
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

# The control-plane operations that belong to training sessions (the sagemaker model holds hundreds of others).
CONTROL_OPERATIONS = [
    "CreateTrainingSession",
    "DescribeTrainingSession",
    "ListTrainingSessions",
    "StopTrainingSession",
    "DeleteTrainingSession",
]

# The one place where AWS's side departs from its model's types: the SageMaker SDK types computeLogprobs' result
# as List[Optional[float]] and documents its first entry as None (the first token has no context), which botocore
# passes through from a JSON null. Nowhere else is a null entry accepted.
NULL_FIRST_ENTRY = ".computeLogprobs.logprobs"


def load(service):
    """The botocore ServiceModel of `service` (RUNTIME or CONTROL), from the installed botocore's data."""
    loader = botocore.loaders.Loader()
    return botocore.model.ServiceModel(loader.load_service_model(service, "service-2"), service)


def _pattern_matches(pattern, value):
    if r"\p{" in pattern:
        # Tag keys and values: Java's Unicode classes (letters, separators, numbers) have no `re` spelling, and
        # the class is the whole pattern, so it is checked character by character.
        return all(c.isalnum() or c.isspace() or c in "_.:/=+-@" for c in value)
    return re.fullmatch(pattern, value) is not None


class Violation(Exception):
    pass


def validate(shape, value, path=""):
    """Raises Violation naming the first path where `value` (decoded JSON) breaks `shape`."""
    errors = []
    _check(shape, value, path or shape.name, errors)
    if errors:
        raise Violation("; ".join(errors[:5]))


def _check(shape, value, path, errors):
    t = shape.type_name
    meta = shape.metadata
    if t == "structure":
        if meta.get("document"):
            return
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        members = shape.members
        for key in value:
            if key not in members:
                errors.append(f"{path}.{key}: not a member of {shape.name}")
        present = {k for k, v in value.items() if v is not None}
        for req in shape.required_members:
            if req not in present:
                errors.append(f"{path}.{req}: required by {shape.name}, missing")
        if meta.get("union") and len(present) != 1:
            errors.append(f"{path}: union {shape.name} needs exactly one member, got {sorted(present)}")
        for key, v in value.items():
            if key in members and v is not None:
                _check(members[key], v, f"{path}.{key}", errors)
    elif t == "list":
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        _bounds(meta, len(value), path, errors, "length")
        for i, v in enumerate(value):
            if v is None and i == 0 and path.endswith(NULL_FIRST_ENTRY):
                continue
            _check(shape.member, v, f"{path}[{i}]", errors)
    elif t == "map":
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for k, v in value.items():
            _check(shape.key, k, f"{path}<key {k!r}>", errors)
            _check(shape.value, v, f"{path}.{k}", errors)
    elif t == "string":
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {type(value).__name__}")
            return
        _bounds(meta, len(value), path, errors, "length")
        if "pattern" in meta and not _pattern_matches(meta["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {meta['pattern']}")
        enum = shape.enum
        if enum:
            if value not in enum:
                errors.append(f"{path}: {value!r} is not one of {enum}")
    elif t in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return
        lo, hi = INT32 if t == "integer" else INT64
        if not lo <= value <= hi:
            errors.append(f"{path}: {value} is outside the {t} range")
        _bounds(meta, value, path, errors, "value")
    elif t in ("double", "float"):
        if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            errors.append(f"{path}: expected a number, got {value!r}")
            return
        _bounds(meta, value, path, errors, "value")
    elif t == "boolean":
        if not isinstance(value, bool):
            errors.append(f"{path}: expected a boolean, got {value!r}")
    elif t == "timestamp":
        # JSON 1.1 and REST-JSON send timestamps as epoch seconds.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected epoch seconds, got {value!r}")
    elif t == "blob":
        if not isinstance(value, (str, bytes)):
            errors.append(f"{path}: expected a blob, got {type(value).__name__}")
    else:
        errors.append(f"{path}: shape type {t} not handled by this validator")


def _bounds(meta, n, path, errors, what):
    if "min" in meta and n < meta["min"]:
        errors.append(f"{path}: {what} {n} is below the model's min {meta['min']}")
    if "max" in meta and n > meta["max"]:
        errors.append(f"{path}: {what} {n} is above the model's max {meta['max']}")

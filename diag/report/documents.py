"""Untrusted JSON documents: one reader and one validator for every ``diag.json`` and shard file.

``check``, ``diff``, ``merge`` and ``report`` read documents a user (or a colleague, or a CI artifact)
hands them. Before any field is used, :func:`read_document` makes sure that

- the file is a regular file (:func:`diag.foundations.files.input_file`), of a sane size, valid UTF-8 JSON,
  nested at most :data:`diag.foundations.untrusted.MAX_DEPTH` levels (deeper nesting would hit Python's recursion limit
  later)
  and without integers longer than Python parses (``ValueError`` at 4300 digits);
- it follows the shipped schema (``reports_templates/diag.schema.json``): types, required keys,
  enums and constants, every error naming the field (``verdict.outputs[0].sqnr_db``);
- it makes sense: counts are non-negative, a shard's ``index`` is below its ``count`` and the count
  below :data:`MAX_SHARDS` (a count of 10^12 must be refused, not iterated).

Every failure is a ``bad-report`` error naming the file and the field. Code that reads fields the
schema does not pin down runs under :func:`diag.foundations.untrusted.fields_of`, which turns a malformed value into the
same
error instead of an internal one.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from diag.foundations.environment import templates_dir
from diag.foundations.errors import DiagError
from diag.foundations.files import input_file
from diag.foundations.untrusted import bad_report, parse_json

#: No run is split into more shards than this; a larger count is a corrupt or hostile file.
MAX_SHARDS = 100_000
#: diag.json of a 2,000-node model with histograms is a few MB; refuse to parse absurd files.
MAX_BYTES = 1 << 30

#: ``schema`` and ``schema_version`` of every diag.json this diag writes and reads.
SCHEMA = "diag/compare"
SCHEMA_VERSION = 1


@functools.cache
def _schema() -> dict[str, Any]:
    """The shipped schema, read once per process."""
    return json.loads((templates_dir() / "diag.schema.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def read_document(path: str | os.PathLike[str], role: str = "report") -> dict[str, Any]:
    """Read and validate a ``diag.json`` (a shard file too): schema first, then meaning.

    Example:
        >>> doc = read_document("run/diag.json")  # doctest: +SKIP
        >>> doc["verdict"]["grade"]  # doctest: +SKIP
        'acceptable'
    """

    p = input_file(path, role, "pass the diag.json written by diag compare")
    if p.stat().st_size > MAX_BYTES:
        raise bad_report(p, f"is {p.stat().st_size:,} bytes; no diag.json is that large")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_report(p, "is not UTF-8 text") from e
    except OSError as e:
        raise DiagError("unreadable", f"{role} '{p}'", f"cannot be read ({e.strerror})", "check permissions") from e
    doc = parse_json(text, p)
    validate_document(doc, p)
    return doc  # type: ignore[no-any-return]


def validate_document(doc: Any, path: object) -> None:
    """Schema and semantic checks of a parsed ``diag.json``; ``bad-report`` naming the field on failure."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise bad_report(path, "is not a diag compare document")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise bad_report(
            path,
            f"has schema version {str(doc.get('schema_version'))[:20]}, this diag reads {SCHEMA_VERSION}",
            "re-run diag compare with this version",
        )
    schema = _schema()
    problem = _validate(doc, schema, schema, "")
    if problem is not None:
        raise bad_report(path, problem, "re-run diag compare to write it again")
    _semantics(doc, path)


def _type_ok(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
    }.get(t, True)


def _where(at: str) -> str:
    return f"field '{at}'" if at else "the document"


def _validate(value: Any, rule: dict[str, Any], root: dict[str, Any], at: str) -> str | None:
    """The first violation of the JSON-schema subset diag's schema uses, or None.

    Supported: type, required, properties, additionalProperties, items, enum, const, oneOf, $ref.
    Recursion depth follows the document's, which :data:`diag.foundations.untrusted.MAX_DEPTH` bounds.
    """
    if "$ref" in rule:
        ref = rule["$ref"].removeprefix("#/$defs/")
        rule = {**root["$defs"][ref], **{k: v for k, v in rule.items() if k != "$ref"}}
    if "oneOf" in rule and not any(_validate(value, r, root, at) is None for r in rule["oneOf"]):
        return f"{_where(at)} has {_short(value)}, which is not a number, 'inf', '-inf', 'nan' or null"
    t = rule.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_type_ok(value, x) for x in types):
            return f"{_where(at)} is {_kind(value)}, the schema wants {' or '.join(types)}"
    if "const" in rule and value != rule["const"]:
        return f"{_where(at)} is {_short(value)}, the schema wants {rule['const']!r}"
    if "enum" in rule and value not in rule["enum"]:
        return f"{_where(at)} is {_short(value)}, the schema wants one of {rule['enum']}"
    if isinstance(value, dict):
        for key in rule.get("required", []):
            if key not in value:
                return f"{_where(at)} lacks the required key '{key}'"
        props = rule.get("properties", {})
        extra = rule.get("additionalProperties")
        for key, sub in value.items():
            child = f"{at}.{key}" if at else str(key)
            if key in props:
                problem = _validate(sub, props[key], root, child)
            elif isinstance(extra, dict):
                problem = _validate(sub, extra, root, child)
            else:
                problem = None
            if problem is not None:
                return problem
    if isinstance(value, list) and isinstance(rule.get("items"), dict):
        for i, item in enumerate(value):
            problem = _validate(item, rule["items"], root, f"{at}[{i}]")
            if problem is not None:
                return problem
    return None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: Any, at: str, path: object, top: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_report(path, f"field '{at}' is {_short(value)}, not a count (an integer >= 0)")
    if top is not None and value > top:
        raise bad_report(path, f"field '{at}' is {value:,}, more than {top:,}", "re-run diag compare to write it again")
    return value


def _semantics(doc: dict[str, Any], path: object) -> None:
    """What the schema cannot say: counts, a shard's index against its count, the state's layout."""
    run = doc["run"]
    _count(run.get("samples"), "run.samples", path)
    _count(run.get("batches"), "run.batches", path)
    shard = doc.get("shard")
    if shard is None:
        return
    if not isinstance(shard, dict):
        raise bad_report(path, "field 'shard' is not an object")
    n = _count(shard.get("count"), "shard.count", path, MAX_SHARDS)
    k = _count(shard.get("index"), "shard.index", path)
    if n < 1 or k >= n:
        raise bad_report(path, f"field 'shard.index' is {k} but 'shard.count' is {n}: shards are numbered 0..count-1")
    state = shard.get("state")
    if not isinstance(state, dict):
        raise bad_report(path, "field 'shard.state' is not an object")
    for key in ("samples", "batches", "passes"):
        _count(state.get(key), f"shard.state.{key}", path)
    for key in ("accumulated", "local", "outputs", "distributions", "deployed", "labelled"):
        part = state.get(key)
        if not isinstance(part, dict):
            raise bad_report(path, f"field 'shard.state.{key}' is {_kind(part)}, not an object")
        for name, item in part.items():
            if key == "labelled":
                _count(item, f"shard.state.labelled.{name}", path)
            elif not isinstance(item, dict):
                raise bad_report(path, f"field 'shard.state.{key}.{name}' is {_kind(item)}, not an object")
    if not isinstance(state.get("fused"), list):
        raise bad_report(path, "field 'shard.state.fused' is not an array")
    if not isinstance(shard.get("runtime_unmatched"), dict):
        raise bad_report(path, "field 'shard.runtime_unmatched' is not an object")

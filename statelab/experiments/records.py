"""Schemas of the durable logs (a study's ``cells.jsonl``, a campaign's ``blocks.jsonl``).

A log is read back on report and on resume; every record is checked against the schema of
its status before any field is used, so an edited or damaged record gives one line naming
the file, the line and the field instead of a ``KeyError`` deep inside a compile. A
schema maps each required field to the JSON types it may hold (``None`` for null); fields
beyond the schema are allowed (a record may carry more than what is read back)."""
from __future__ import annotations

from pathlib import Path

NUM = (int, float)
INT = (int,)
STR = (str,)
OPT_INT = (int, type(None))

_CELL_KEYS = {"key": STR, "spec_hash": STR, "status": STR, "prompt": STR, "selector": STR, "direction": STR,
              "repeat": INT}

#: a study's cells.jsonl, by status (statelab.experiments.matrix.cells)
STUDY_CELL = {
    "ok": {**_CELL_KEYS, "donor": STR, "recipient": STR, "klass": STR,
           "first_diff_recipient": OPT_INT, "first_diff_donor": OPT_INT, "selected_bytes": INT, "share": NUM,
           "total_value_bytes": INT, "changed_bytes": INT, "max_abs": NUM, "l2": NUM, "l2_rel": NUM,
           "first_differing_layer": OPT_INT, "verified": (bool,), "endpoint": (dict,), "endpoint_sha256": STR,
           "length": INT, "stop_reason": STR, "eog": (bool,), "donor_kv_sha256": STR, "recipient_kv_sha256": STR},
    "failed": {**_CELL_KEYS, "error": STR},
}
#: values a field may take (beyond its type)
STUDY_VALUES = {"klass": ("B", "C", "D")}

#: a campaign's blocks.jsonl (statelab.experiments.campaign)
CAMPAIGN_BLOCK = {"ok": {"key": STR, "status": STR, "spec_hash": STR, "records": (list,)}}

#: a partition folder's units.jsonl (statelab.experiments.partition), one prompt each
PARTITION_UNIT = {"ok": {"key": STR, "status": STR, "spec_hash": STR, "prompt": STR, "result": STR}}

_TARGET_KEYS = {"key": STR, "task": STR, "selector": STR, "direction": STR, "spec_hash": STR, "status": STR}
#: the findings logs of a study folder (findings/minimal.jsonl, findings/panels.jsonl)
FINDINGS_TARGET = {
    "minimal": {"ok": {**_TARGET_KEYS, "found": (bool,), "layers": (list,), "n_layers": INT, "n_positions": INT,
                       "selected_bytes": INT, "share": NUM, "evaluations": INT},
                "skipped": {**_TARGET_KEYS, "reason": STR}, "failed": {**_TARGET_KEYS, "error": STR}},
    "panels": {"ok": {**_TARGET_KEYS, "components": (list,), "box": (dict,)},
               "skipped": {**_TARGET_KEYS, "reason": STR}, "failed": {**_TARGET_KEYS, "error": STR}},
}


def _type_names(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", dict: "an object",
             list: "a list", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _is(value, types) -> bool:
    if isinstance(value, bool):  # JSON true/false is no number
        return bool in types
    return isinstance(value, types)


def check_record(rec, schema: dict, path: Path | str, line: int, error: type[Exception],
                 values: dict | None = None) -> dict:
    """``rec`` (one parsed JSON line) against ``schema`` (status -> field -> types); raise
    ``error`` in one line naming the file, the line and the field."""
    where = f"{path}: line {line}"
    if not isinstance(rec, dict):
        raise error(f"{where}: a record must be a JSON object, got {type(rec).__name__} (the log was edited?)")
    status = rec.get("status")
    if "status" not in rec:
        raise error(f"{where}: the record lacks the field 'status' (the log was edited?)")
    if status not in schema:
        raise error(f"{where}: field 'status' is {status!r}, expected one of {sorted(schema)} (the log was edited?)")
    for name, types in schema[status].items():
        if name not in rec:
            raise error(f"{where}: the {status} record lacks the field {name!r} (the log was edited?)")
        if not _is(rec[name], types):
            raise error(f"{where}: field {name!r} is {rec[name]!r}, expected {_type_names(types)} "
                        "(the log was edited?)")
    for name, allowed in (values or {}).items():
        if name in schema[status] and rec[name] not in allowed:
            raise error(f"{where}: field {name!r} is {rec[name]!r}, expected one of {list(allowed)} "
                        "(the log was edited?)")
    return rec


def check_study_cell_against_controls(rec: dict, controls: dict, path, line: int, error: type[Exception]) -> None:
    """An ok cell's class and endpoint hash, recomputed from its endpoint and the natural
    endpoints its prompt's controls hold: a valid-JSON edit (class B written as C) is refused."""
    from statelab.analysis.classes import endpoint_class
    from statelab.experiments.matrix.cells import endpoint_sha256

    where = f"{path}: line {line}"
    ep = rec["endpoint"]
    if not isinstance(ep.get("tokens"), list) or not isinstance(ep.get("eog"), bool):
        raise error(f"{where}: field 'endpoint' lacks its tokens or eog (the log was edited?)")
    if endpoint_sha256(ep["tokens"], ep["eog"]) != rec["endpoint_sha256"]:
        raise error(f"{where}: field 'endpoint_sha256' does not match the record's endpoint (the log was edited?)")
    arms = (controls.get(rec["prompt"]) or {}).get("arms") or {}
    nat_d, nat_r = (arms.get(rec["donor"]) or {}).get("natural"), (arms.get(rec["recipient"]) or {}).get("natural")
    if not isinstance(nat_d, dict) or not isinstance(nat_r, dict):
        return  # controls of another shape or missing: the compile reports the cell withheld/pending
    want = endpoint_class(ep, nat_d, nat_r)
    if rec["klass"] != want:
        raise error(f"{where}: field 'klass' is {rec['klass']!r}, but the record's endpoint against the natural "
                    f"endpoints of {rec['donor']} and {rec['recipient']} is class {want!r} (the log was edited?)")

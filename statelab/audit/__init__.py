"""Layout audits: integer address oracle, fault injection and FP64/F32 oracles for the
QB query-to-batch attention view (see :mod:`statelab.audit.oracles`)."""
from statelab.audit.oracles import (
    FAULTS,
    OBLIGATIONS,
    Fault,
    Fixture,
    MQLayout,
    OracleReport,
    PQLayout,
    QBLayout,
    audit_markdown,
    check_qb_addressing,
    evaluate_layout,
    fixtures,
    make_data,
    reference_attention,
    run_layout_audit,
    ulp_distance,
)

__all__ = [
    "FAULTS",
    "OBLIGATIONS",
    "Fault",
    "Fixture",
    "MQLayout",
    "OracleReport",
    "PQLayout",
    "QBLayout",
    "audit_markdown",
    "check_qb_addressing",
    "evaluate_layout",
    "fixtures",
    "make_data",
    "reference_attention",
    "run_layout_audit",
    "ulp_distance",
]

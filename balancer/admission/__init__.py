"""Admission: which model may take a task now, or how long until one can.

``core`` runs it atomically in Redis (Lua scripts in ``lua/``); ``model`` is
the pure-Python reference with identical semantics, used by the differential
tests and as the readable specification.
"""

from balancer.admission.core import AdmissionCore, ModelLive
from balancer.admission.model import (
    Admitted,
    Candidate,
    Decision,
    LeaseSeed,
    NoState,
    NotNow,
    ReadyTask,
    ReferenceCore,
    Rejected,
    Settlement,
)

__all__ = [
    "AdmissionCore",
    "ModelLive",
    "Admitted",
    "Candidate",
    "Decision",
    "LeaseSeed",
    "NoState",
    "NotNow",
    "ReadyTask",
    "ReferenceCore",
    "Rejected",
    "Settlement",
]

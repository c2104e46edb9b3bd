"""Admission: which model may take a task now, or how long until one can.

``core`` runs it atomically in Redis (Lua scripts in ``lua/``); ``values`` holds
what production code passes to it and gets back; ``live`` reads the live
state back (no Lua: nothing changes); ``keys`` names every Redis key
and ``fields`` every field of a model's hash; ``finishes`` keeps the finishes
that could not reach Redis and applies them once it answers. ``reference`` is the
pure-Python model with identical semantics: the readable specification, used
by the differential tests and imported by no production code.
"""

from balancer.admission.core import AdmissionCore
from balancer.admission.live import ModelLive
from balancer.admission.values import (
    Admitted,
    Candidate,
    Decision,
    LeaseSeed,
    NoState,
    NotNow,
    ReadyTask,
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
    "Rejected",
    "Settlement",
]

"""Storage backends behind one interface (:class:`Backend`): ``files`` (the embedded default,
the handoffs/ folders), ``memory`` (fast tests) and, next, PostgreSQL. The conformance suite
(tests/test_backend_conformance.py) runs the same behaviour tests on each."""
from __future__ import annotations

from .base import Backend, Claim, Meta, Row, Wakeup, describe_native

__all__ = ["Backend", "Claim", "Meta", "Row", "Wakeup", "describe_native"]

"""The PostgreSQL backend (``[store] url = "postgresql://..."``): one database shared by the
daemons of several hosts. Importing this package imports psycopg: only a store that names a
PostgreSQL URL does (``pip install 'handoffd[postgres]'``)."""
from __future__ import annotations

from .backend import PostgresBackend
from .connection import StoreError, StoreUnavailable
from .schema import LATEST as SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "PostgresBackend", "StoreError", "StoreUnavailable"]

"""UTC timestamps in the ISO 8601 form the seeds use (``2026-01-13T10:00:00Z``)."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The default clock: an aware UTC datetime."""
    return datetime.now(timezone.utc)


def iso(moment: datetime) -> str:
    """Format an aware datetime as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (milliseconds kept)."""
    m = moment.astimezone(timezone.utc)  # (formatting by hand: strftime is several times slower)
    return (f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}"
            f".{m.microsecond // 1000:03d}Z")


def parse_iso(text: str) -> datetime:
    """Parse an ISO 8601 timestamp; a naive one is taken as UTC. Raises ValueError if malformed."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value

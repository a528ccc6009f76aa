"""One PASS / WARN / FAIL line of a report (``doctor``, ``xla.preflight``)."""

from __future__ import annotations

from dataclasses import dataclass

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    """A named check, its status, what was found and, when it did not pass, the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        """False only for FAIL (a WARN is worth reading but does not stop anything)."""
        return self.status != FAIL

    def line(self) -> str:
        text = f"{self.status}  {self.name}: {self.detail}"
        return text + (f"\n      fix: {self.fix}" if self.fix and self.status != PASS else "")

    __str__ = line

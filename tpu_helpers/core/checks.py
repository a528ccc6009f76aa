"""One PASS / WARN / SKIP / FAIL line of a report (``doctor``, ``xla.preflight``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Check",
    "first_line",
]

PASS, WARN, SKIP, FAIL = "PASS", "WARN", "SKIP", "FAIL"


@dataclass(frozen=True)
class Check:
    """A named check, its status, what was found and, when it did not pass, the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        """False only for FAIL (a WARN is worth reading, a SKIP says what could not be
        checked here and why; neither stops anything)."""
        return self.status != FAIL

    def line(self) -> str:
        text = f"{self.status}  {self.name}: {self.detail}"
        return text + (f"\n      fix: {self.fix}" if self.fix and self.status != PASS else "")

    __str__ = line


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The first lines of an error's message, joined (TensorFlow's run to pages), cut to
    ``limit`` characters; the error's type when it has no message. What the package's
    messages quote of an error (``xla.helpful_line`` picks a compiler error's cause)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return " ".join(lines[:3])[:limit]

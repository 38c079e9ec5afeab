"""One warning of `sandgate lint`: where, what, the fix and its code (every lint module's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Finding:
    file: str
    line: int
    field: str
    message: str
    fix: str
    severity: str = "warning"
    code: str = ""  # sandgate.policy.lint_codes (empty: a load error)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"

    @property
    def text(self) -> str:
        """Everything but the location: field, message, fix and code."""
        fld = f"{self.field}: " if self.field else ""
        code = f" [{self.code}]" if self.code else ""
        return f"{fld}{self.message.rstrip('.')}. Fix: {self.fix}{code}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

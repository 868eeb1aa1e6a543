"""What a conformance check returns (`dsv4.check.zoo`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckResult:
    ok: bool
    error: float | None = None
    detail: str = ""
    skipped: str = ""  # non-empty: the check did not run here, and why (never a pass)
    device: str | None = None  # where it ran, when not the context's device (e.g. host-side I/O)
    backends: dict[str, list[str]] = field(default_factory=dict)  # op -> backends that ran (filled by the runner)


def skipped(reason: str) -> CheckResult:
    """A check that cannot run on this device: reported as skipped, with the reason, not as a pass."""
    return CheckResult(False, None, reason, skipped=reason)


__all__ = ["CheckResult", "skipped"]

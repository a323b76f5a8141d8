"""What a sweep's data cannot answer: :class:`NoAnswerError`.

Two kinds of error leave the critical-batch analysis. A bad setting or input a caller can fix (an
unknown objective, curves of unequal length) is the library's one user error,
:class:`globalbatch.errors.SettingError` (field, value, allowed). A question the data cannot answer
with the settings given — no batch reaches the target, no loss range every batch and seed shares,
too few points for a fit — is a :class:`NoAnswerError`: the measurement was made correctly and this
is its outcome. It subclasses ``ValueError`` so that code catching that keeps working, and the
command line reports it as one line (exit 2) like any other.
"""

from __future__ import annotations

from globalbatch.errors import SettingError

__all__ = ["NoAnswerError", "TargetNotReachedError"]


class NoAnswerError(ValueError):
    """The data cannot answer what was asked (the message says what is missing and what would help)."""


class TargetNotReachedError(NoAnswerError, SettingError):
    """A loss target given by the caller that no trial reaches: both what the data cannot answer and a
    setting the caller can fix (``field`` names it; ``allowed`` gives the lowest loss the sweep reached)."""

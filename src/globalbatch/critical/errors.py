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

__all__ = ["NoAnswerError"]


class NoAnswerError(ValueError):
    """The data cannot answer what was asked (the message says what is missing and what would help)."""

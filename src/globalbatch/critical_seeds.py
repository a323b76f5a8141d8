"""Deprecated: moved to :mod:`globalbatch.critical.seeds`; this alias goes in the next release."""

import warnings

from globalbatch.critical.seeds import *  # noqa: F401,F403
from globalbatch.critical.seeds import __all__  # noqa: F401

warnings.warn("globalbatch.critical_seeds moved to globalbatch.critical.seeds; the old name goes in the next release", FutureWarning, stacklevel=2)

"""Deprecated: moved to :mod:`globalbatch.plan.memory`; this alias goes in the next release."""

import warnings

from globalbatch.plan.memory import *  # noqa: F401,F403
from globalbatch.plan.memory import __all__  # noqa: F401

warnings.warn("globalbatch.memory moved to globalbatch.plan.memory; the old name goes in the next release", FutureWarning, stacklevel=2)

"""Deprecated: moved to :mod:`globalbatch.plan.config`; this alias goes in the next release."""

import warnings

from globalbatch.plan.config import *  # noqa: F401,F403
from globalbatch.plan.config import __all__  # noqa: F401

warnings.warn("globalbatch.config moved to globalbatch.plan.config; the old name goes in the next release", FutureWarning, stacklevel=2)

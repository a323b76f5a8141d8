"""Deprecated: moved to :mod:`globalbatch.plan.report`; this alias goes in the next release."""

import warnings

from globalbatch.plan.report import *  # noqa: F401,F403
from globalbatch.plan.report import __all__  # noqa: F401

warnings.warn("globalbatch.plan_report moved to globalbatch.plan.report; the old name goes in the next release", FutureWarning, stacklevel=2)

"""Deprecated: moved to :mod:`globalbatch.critical.readout`; this alias goes in the next release."""

import warnings

from globalbatch.critical.readout import *  # noqa: F401,F403
from globalbatch.critical.readout import __all__  # noqa: F401

warnings.warn("globalbatch.readout moved to globalbatch.critical.readout; the old name goes in the next release", FutureWarning, stacklevel=2)

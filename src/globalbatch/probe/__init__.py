"""Probe the largest micro-batch that fits on this device, and the fastest one (see search.py).

Interim: probe.py moved unchanged to probe/search.py so that its history follows the file;
the next commit splits it into modules.
"""

from globalbatch.probe.search import *  # noqa: F401,F403
from globalbatch.probe.search import __all__  # noqa: F401

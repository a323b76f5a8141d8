"""The gradient noise scale B_simple (see estimator.py).

Interim: noise.py moved unchanged to noise/estimator.py so that its history follows the file;
the next commit splits it into modules.
"""

from globalbatch.noise.estimator import *  # noqa: F401,F403
from globalbatch.noise.estimator import __all__  # noqa: F401

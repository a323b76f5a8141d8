"""Global-batch planning: pure arithmetic, no torch import.

- :mod:`~globalbatch.plan.arithmetic`: the geometry (global = micro × accum × DP), budgets, LR rules, warmup,
  the pipeline bubble, all-reduce volume, scaling-law priors (everything ``from globalbatch.plan import …`` gives).
- :mod:`~globalbatch.plan.settings`: ``PlanConfig``, what ``plan`` can be told, and the check of one value.
- :mod:`~globalbatch.plan.config`: config files (ours, DeepSpeed, Hugging Face) merged with arguments.
- :mod:`~globalbatch.plan.report`: the typed, frozen plan report and its table.
- :mod:`~globalbatch.plan.memory`: bytes per device by optimizer, precision and ZeRO/FSDP sharding.
"""

from globalbatch.plan.arithmetic import *  # noqa: F401,F403
from globalbatch.plan.arithmetic import __all__  # noqa: F401

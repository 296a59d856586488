"""nnscaler_eval: the implementation behind the public `nnscaler` package.

Nothing outside this package imports its private names; users import `nnscaler`.
"""
import torch  # noqa: F401  (first: _C links against torch's libraries, see setup.py)

from nnscaler_eval import _C  # noqa: F401  (fails early if the extension is missing)
from nnscaler_eval._install import install as _install

_install()

from nnscaler_eval import logs as _logs

_logs.configure()  # NNSCALER_LOGS=recaptures,guards,graph,fallbacks,bytecode

from nnscaler_eval import parallelize  # noqa: E402,F401  (nnscaler_eval.parallelize(...))

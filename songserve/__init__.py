"""songserve: a serving backend for acoustic-token song generation.

Three deployables share this package: the dispatcher (``songserve.api``), the worker
(``songserve.worker``) and the model pipeline the worker runs (``songserve.pipeline``).
"""

__version__ = "0.1.0"

"""Search methods built on the supernet and the probe; one module per method.

Every method turns (search-train batch, search-val batch) into one update and returns statistics as
record paths; the loop hands them to callbacks (the recorder, a progress bar).
"""

from typing import Dict, Type

from nasdiag.search.base import SearchMethod, accuracy
from nasdiag.search.darts import DARTS
from nasdiag.search.loop import SearchCallback, run_search, steps_per_epoch

#: method name -> class. Each class takes ``(network, epochs, **hyperparameters)``.
METHODS: Dict[str, Type[SearchMethod]] = {"darts": DARTS}

__all__ = ["DARTS", "METHODS", "SearchCallback", "SearchMethod", "accuracy", "run_search", "steps_per_epoch"]

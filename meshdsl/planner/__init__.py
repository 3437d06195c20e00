"""The planner: predict a layout's cost without running it, calibrate devices, search layouts.

* :mod:`~meshdsl.planner.trace`: the per-device program of a training step, traced on an abstract
  mesh (no devices, no compilation), so any device count can be planned on any machine.
* :mod:`~meshdsl.planner.memory` and :mod:`~meshdsl.planner.flops`: what that program stores and computes.
* :mod:`~meshdsl.planner.cost`: one model x mesh x layout priced on a :class:`DeviceProfile`.
* :mod:`~meshdsl.planner.search`: enumerate, prune and rank layouts.
* :mod:`~meshdsl.planner.calibrate`: measure the devices at hand into a profile.
"""

from meshdsl.planner.cost import Prediction, predict
from meshdsl.planner.profile import DeviceProfile, Link, load_profile
from meshdsl.planner.search import Candidate, SearchResult, search

__all__ = ["Candidate", "DeviceProfile", "Link", "Prediction", "SearchResult", "load_profile", "predict", "search"]

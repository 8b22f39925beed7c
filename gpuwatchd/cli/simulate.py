"""``gpuwatchd simulate``: what the command takes from the simulator package (``gpuwatchd/sim``).

The command's arguments are parsed in ``cli/main.py``; running a scenario and rendering its
timeline are :func:`gpuwatchd.sim.simulation.simulate` and
:func:`gpuwatchd.sim.timeline.render_text`.
"""

from __future__ import annotations

from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.timeline import render_text
from gpuwatchd.sim.world import SimulationError

__all__ = ["SimulationError", "render_text", "simulate"]

"""The simulator: the daemon's own engine on a virtual clock over a virtual host.

``scenario`` reads a scenario file, ``world`` is the virtual host it describes, ``simulation``
drives :class:`gpuwatchd.engine.cycle.Engine` over that host's edges, and ``timeline`` records and
renders what happened. It touches nothing real; the ``simulate`` command (``cli/main.py``)
and the tests are its users.
"""

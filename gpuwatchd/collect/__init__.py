"""Read: everything the daemon learns about the host, assembled into one frozen
:class:`gpuwatchd.core.model.Snapshot` per poll (docs/architecture.md lists the modules).
Nothing here decides or acts; when to scan all of ``/proc`` is :mod:`gpuwatchd.decide.full_scan`.
"""

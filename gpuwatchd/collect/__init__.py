"""Read: everything the daemon learns about the host.

``nvml`` (the client) and ``nvml_worker`` (the only importer of pynvml, in its own isolated
process); ``procfs`` (process and host facts from ``/proc``); ``holders`` (who holds
``/dev/nvidia*``, by fd and mapping); ``cgroups`` (what a cgroup path says about a job, pure)
and ``jobs`` (which jobs have ended, from cgroupfs); and ``collector``, which assembles one
frozen :class:`gpuwatchd.core.model.Snapshot` per poll. Nothing here decides or acts; the one rule
collection follows, when to scan all of ``/proc``, is :mod:`gpuwatchd.decide.full_scan`.
"""

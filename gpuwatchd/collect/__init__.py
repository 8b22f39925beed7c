"""Read: everything the daemon learns about the host.

NVML (through a worker process, the only importer of pynvml), process facts and the device
holder scan from ``/proc``, cgroups and jobs, and the :class:`Collector` that assembles one
frozen :class:`gpuwatchd.model.Snapshot` per poll. Nothing here decides or acts.
"""

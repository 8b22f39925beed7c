"""What the daemon publishes and answers for ``scan``: the holder and NVML views, their guard,
the scan socket."""

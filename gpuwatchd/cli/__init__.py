"""The ``gpuwatchd`` command line: argument parsing, ``scan`` and its report, ``explain``, and
``simulate`` with its virtual host. Each command reads through ``collect`` or a file, decides
through ``decide``, and prints; only ``run`` (in :mod:`gpuwatchd.daemon.lifecycle`) acts.
"""

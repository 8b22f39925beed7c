"""Configuration: the policy files, read as hostile input, into a
:class:`gpuwatchd.decide.policy.Policy`. It never acts.

``schema`` is the entry point (load, validate, merge drop-ins, render) and re-exports what
callers need; ``yamlsrc`` reads YAML text bounded and with line numbers; ``units`` parses and
writes durations and sizes; ``keys`` is the one key table, with every value's reader and
bounds; ``files`` reads the files and drop-ins and checks StrictModes.
"""

"""Configuration: the policy files, read as hostile input, into a
:class:`gpuwatchd.decide.policy.Policy` (``schema`` is the entry point). It never acts."""

"""Configuration: the YAML source reader (bounded, with line numbers), the policy schema and
its validation, drop-ins and the permission checks. It produces a
:class:`gpuwatchd.decide.policy.Policy`; it never acts.
"""

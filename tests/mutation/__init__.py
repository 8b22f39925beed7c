"""Mutation testing of decide/'s safety gates: ``python -m tests.mutation`` (``make mutate``)."""

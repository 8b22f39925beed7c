"""Where an installed gpuwatchd keeps its files unless the policy says otherwise.

This module owns the two default locations: the main policy file and the state directory. The
policy (:mod:`gpuwatchd.decide.policy`) takes its defaults from here, and so does the command's
entry (:mod:`gpuwatchd.cli.entry`), which must find a running daemon without importing the
policy.
"""

DEFAULT_CONFIG_PATH = "/etc/gpuwatchd/gpuwatchd.yaml"
DEFAULT_STATE_DIR = "/var/lib/gpuwatchd"

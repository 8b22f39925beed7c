"""Where an installed gpuwatchd keeps its files unless the policy says otherwise.

This module owns the two default locations, the main policy file and the state directory, and
where the NVML worker's files are: the policy (:mod:`gpuwatchd.decide.policy`) takes its
defaults from here, and so does the command's entry (:mod:`gpuwatchd.cli.entry`), which must
find a running daemon without importing the policy; the NVML client starts the worker from
here, and the floor knows another gpuwatchd command's worker by them.
"""

import os

DEFAULT_CONFIG_PATH = "/etc/gpuwatchd/gpuwatchd.yaml"
DEFAULT_STATE_DIR = "/var/lib/gpuwatchd"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # gpuwatchd/
# ``python3 -I NVML_LAUNCHER_FILE NVML_WORKER_FILE [FOLDER...]`` (gpuwatchd/collect/nvml.py).
NVML_LAUNCHER_FILE = os.path.join(_PACKAGE, "collect", "nvml_launch.py")
NVML_WORKER_FILE = os.path.join(_PACKAGE, "collect", "nvml_worker.py")

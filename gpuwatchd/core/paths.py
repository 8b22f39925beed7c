"""Where an installed gpuwatchd keeps its files unless the policy says otherwise: the policy
file, the state directory (for the policy and for ``cli/entry.py``, which must not import it)
and the NVML worker's files (started from here; the floor knows another command's worker).
"""

import os

DEFAULT_CONFIG_PATH = "/etc/gpuwatchd/gpuwatchd.yaml"
DEFAULT_STATE_DIR = "/var/lib/gpuwatchd"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # gpuwatchd/
# ``python3 -I NVML_LAUNCHER_FILE NVML_WORKER_FILE [FOLDER...]`` (gpuwatchd/collect/nvml.py).
NVML_LAUNCHER_FILE = os.path.join(_PACKAGE, "collect", "nvml_launch.py")
NVML_WORKER_FILE = os.path.join(_PACKAGE, "collect", "nvml_worker.py")

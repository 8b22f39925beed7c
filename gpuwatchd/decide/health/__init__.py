"""GPU health: Xids and their catalogue, recovery actions, the NVLink fabric, its state."""

"""The virtual ``nvidia-smi mig`` of a simulation: a MIG GPU instance's recovery commands.

This module owns how the virtual host answers ``reset.mig_recovery_commands``, filled in for
every GPU instance of the scenario's MIG GPUs as the reset procedure fills them (the answers:
docs/simulate.md). Nothing is executed.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatchd.act.commands import CommandResult
from gpuwatchd.decide.argv import format_argv
from gpuwatchd.sim.world import GI_PROFILE_IDS, World, WorldGpu, mig_uuid


class VirtualMig:
    """The recovery commands of every virtual GPU instance, and their answers."""

    def __init__(self, world: World, commands: Sequence[Sequence[str]]) -> None:
        self.world = world
        # argv -> (its position, the last position, the GPU, the GPU instance id)
        self.known: dict[tuple[str, ...], tuple[int, int, WorldGpu, int]] = {}
        last = len(commands) - 1
        for gpu in world.gpus.values():
            spec = gpu.spec
            for instance in spec.mig_instances:
                values = {
                    "uuid": spec.uuid, "pci_bus_id": spec.pci_bus_id, "gi": str(instance.gi),
                    "ci": "0", "mig_uuid": mig_uuid(spec.index, instance.gi),
                    "profile": str(GI_PROFILE_IDS.get(instance.profile, 0)),
                    "placement": str(instance.gi),
                }  # fmt: skip
                for position, template in enumerate(commands):
                    try:
                        argv = format_argv(template, **values)
                    except ValueError:
                        continue  # perform_reset refuses before anything runs
                    self.known.setdefault(argv, (position, last, gpu, instance.gi))

    def answer(self, argv: tuple[str, ...], now: float) -> CommandResult | None:
        """The driver's answer to ``argv`` at ``now``; None when it is no recovery command."""
        if argv not in self.known:
            return None
        position, last, gpu, gi = self.known[argv]
        self.world.settle(now)
        if self.world.instance_users(gpu, gi):
            said = f"Unable to destroy GPU instance ID {gi}: In use by another client"
            return CommandResult(argv, 255, said, False, 0.2, None)
        if position == last:
            self.world.recreate_instance(gpu, gi)
            said = f"Successfully created GPU instance ID {gi} on GPU {gpu.spec.index}"
            return CommandResult(argv, 0, said, False, 0.5, None)
        gpu.destroyed.add(gi)  # listed again once the last command re-creates it
        said = f"Successfully destroyed an instance of GPU instance ID {gi}"
        return CommandResult(argv, 0, said, False, 0.2, None)

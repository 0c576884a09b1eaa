"""The experiment engine: fresh processes per unit (fork server), executors.

A process that a runner started (fork server, batch process, spawned worker: its
environment names the runner, see :mod:`.lifeline`) is tied to the runner here, before its
module's heavy imports: a runner killed meanwhile ends it too."""
from statelab.experiments import lifeline as _lifeline

_lifeline.die_with_parent()

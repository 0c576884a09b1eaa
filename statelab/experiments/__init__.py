"""The experiment engine: fresh processes per unit (fork server), executors."""

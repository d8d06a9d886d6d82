"""An example `moe` plugin: one Experts backend, registered through the ``moe.backends`` entry point."""

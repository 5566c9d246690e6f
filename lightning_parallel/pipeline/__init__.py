"""Pure-torch pipeline mechanics (no Lightning imports): partition, plan, mesh, runner, state."""

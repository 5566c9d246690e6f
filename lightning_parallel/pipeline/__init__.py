"""The plan and the runtime, pure torch (no Lightning): partition, plan, mesh, the Sequential stage source,
the runner of torch's schedules, the stand-in for the pipelined call, step logs, twins and stage shapes."""

"""The pipeline's runtime, pure torch (no Lightning): the runner of torch's schedules, the StageSource
protocol both sources implement, a step's micro-batches, the stand-in protocol for the pipelined call,
step logs and scope, torchmetrics on the stages, and the vocabulary both sides share (stage plan,
partition, blocks). The rank grid and the device mesh are one floor below
(:mod:`lightning_parallel.layout`)."""

"""Offload: the optimizer state and its step, FSDP2's shards, or the saved activations, on the host.

One setting of the plan (``offload=``, :class:`~lightning_parallel.plan.parallel_plan.ParallelPlan`):

* ``technique.py`` - the technique (:data:`~lightning_parallel.techniques.offload.technique.TECHNIQUE`):
  its label, variants, what the job needs (a host backend beside the device's, FSDP2's parameters
  left on the host), its transform of the optimizers and its context around each training step;
* ``checks.py`` - its settings checked (what beside which data parallelism, the disk tier's directory and
  buffer), each refusal with its fix;
* ``host_optimizer.py`` - the user's optimizer class made host-stepping (plain replicas and ZeRO-1), and
  the fastest host kernel of a step;
* ``activations.py`` - saved-tensor hooks that keep the micro-batches' activations on the host;
* ``memory.py`` - what it does to a stage's bytes (device -> host), for the planner; ``timing.py`` - the
  activations' hooks timed in place on a block (``plan="auto"``), what its time charges per byte;
* ``disk_*.py``, ``scratch.py`` - the disk tier (``offload_to="disk"``): the state in files streamed
  through a bounded host buffer (``disk_optimizer.py``); for the planner its disk column and the
  seconds of its streaming (``disk_plan.py``) at the disk's bandwidth, measured once (``disk_rate.py``);
* ``search_options.py`` - what the planner's search may try with it (``--no-offload``, ``--offload-dir``:
  each a ``Search`` keyword and a flag, declared once).

State dicts stay the user's optimizer's (same class name, keys, ids and param groups; the state tensors
live on the host), so checkpoints load with or without offload and at another world size. On a
CPU-only machine host and device are the same memory: the copies are still separate tensors, so the
control path and its exactness are what the tests exercise there.
"""

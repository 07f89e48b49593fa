"""Fleet tuning: many models, many GPUs, one tuning cache (``convpass tune``).

* :mod:`convpass.fleet.driver` - collect the distinct problems of the models while the workers
  start and then tune them, model by model as they are collected; pick the target devices,
  schedule, write each tuned model (one decision table per device type) as soon as its problems
  are settled, while the workers measure the rest;
* :mod:`convpass.fleet.models` - the models' specs, their problems as collected and the order in
  which those are measured; :mod:`convpass.fleet.report` - what a run did, as JSON and as text;
* :mod:`convpass.fleet.model_procs` - the processes beside the driver that collect (graph passes)
  and write the models, so that the driver's own process only hands out tasks;
* :mod:`convpass.fleet.scheduler` - tasks on worker slots: retries, lost workers, timeouts,
  interrupts; the driver is the only writer of the cache;
* :mod:`convpass.fleet.local` - the embedded executor: one worker process per local GPU;
* :mod:`convpass.fleet.ray_cluster` - the Ray executor (optional: ``pip install 'convpass[fleet]'``);
* :mod:`convpass.fleet.worker` - what runs in a worker; :mod:`convpass.fleet.measurers` - what it
  measures with (the GPU tuner, or a recorded cache replayed without a GPU);
* :mod:`convpass.cli.tune` - the ``tune`` subcommand.

Nothing here imports Ray, CuPy or cuDNN at import time.
"""

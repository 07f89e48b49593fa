"""Fleet tuning: many models, many GPUs, one tuning cache (``convpass tune``).

* :mod:`convpass.fleet.driver` - collect the distinct problems of all models while the workers
  start, pick the target devices, schedule, write each tuned model (one decision table per device
  type) as soon as its problems are settled, while the workers measure the rest;
* :mod:`convpass.fleet.scheduler` - tasks on worker slots: retries, lost workers, timeouts,
  interrupts; the driver is the only writer of the cache;
* :mod:`convpass.fleet.local` - the embedded executor: one worker process per local GPU;
* :mod:`convpass.fleet.ray_cluster` - the Ray executor (optional: ``pip install 'convpass[fleet]'``);
* :mod:`convpass.fleet.worker` - what runs in a worker; :mod:`convpass.fleet.measurers` - what it
  measures with (the GPU tuner, or a recorded cache replayed without a GPU);
* :mod:`convpass.fleet.cli` - the ``tune`` subcommand.

Nothing here imports Ray, CuPy or cuDNN at import time.
"""

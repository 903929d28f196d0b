"""The farm's side of Kiln: compile workers, kernel fan-out, GPU autotuning and in-flight
de-duplication.

- ``workers.pipeline``: the steps themselves, without Ray (``compile_inprocess`` is the
  ``inprocess`` farm mode, and the client's own fallback);
- ``workers.actors``: ``CompileWorker`` (graph to kernel sources), ``KernelWorker`` (one
  kernel, one config, one target at a time), ``Autotuner`` (``num_gpus=1``);
- ``workers.coordinator``: ``KilnFarm``, the named detached actor every client calls
  (``get_farm_actor()``).

- ``workers.ray_farm``: ``RayFarm``, the coordinator reached over Ray (clients and the
  gateway call it); ``workers.farm_api``: what the farm's clients and its gateway share;
- ``workers.serve``: the processes ``kiln farm up`` starts: the gateway, the cluster's
  start and stop, their wire format and files.

Importing this package does not import Ray; ``workers.actors`` and
``workers.coordinator`` do. Workers import ``compiler`` and never ``frontend``.
"""

# The coordinator's counters (``KilnFarm.stats``), every one reported, zeros included.
FARM_COUNTERS = ("requests", "recent_hits", "deduplicated", "failures", "graph_compiles",
                 "kernel_compiles", "kernel_cache_hits", "autotune_calls",
                 "autotuned_kernels", "gemm_benchmarks", "refused", "published",
                 "not_published", "republished")

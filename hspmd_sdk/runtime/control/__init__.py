"""The launcher's side: ``launch`` and the training launchers, the :class:`~.job.Job` and its controller with
its policies (a fixed Program, a user's switch, elastic and straggler replans, mixed-length candidates), the
checks made before any worker starts (options, resources), progress, faults, grow-back, profiling and the
job's outputs (TensorBoard, measured timelines).  It reaches the workers only through a transport and the
protocol's values (:mod:`hspmd_sdk.runtime.protocol`, :mod:`hspmd_sdk.runtime.spec`)."""

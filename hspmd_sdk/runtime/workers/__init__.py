"""The worker's side: what runs inside each worker process (the entry, the training session, the step
executor and its kernels, communication, gradient buckets, switch execution, parameters, liveness, devices and
the authenticated rendezvous store).  It imports nothing of the launcher's side or of the transports: a worker
knows the launcher only through the protocol's values."""

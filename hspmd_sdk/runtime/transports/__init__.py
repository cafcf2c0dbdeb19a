"""How workers are started and reached: local processes (forked from a warm server), SSH hosts (the transport,
its per-host agent and the hosts' description) and Slurm allocations, all behind one
:class:`~.transport.Transport` interface that includes rendezvous."""

"""Helpers for testing and demonstrating the SDK, shipped so that tutorials and users' own tests can use them.

* :mod:`.sshd`: real OpenSSH servers on loopback addresses (or in network namespaces) as SSH "hosts", with keys
  of their own (``LoopbackHosts``), for launching over SSH on one machine;
* :mod:`.entries`: small worker entries (``"hspmd_sdk.testing.entries:allreduce_check"``, ``fail_on_rank``,
  ``hang_on_rank``, ``sleep_forever``, ...) for the launcher, its failures and its fault detection;
* :mod:`.slurm`: a real Slurm cluster on one machine (munged, slurmctld, one slurmd per node in its own network
  namespace, fake GPUs as GRES; ``LocalSlurm``, as root), for the Slurm transport and ``Cluster.from_slurm``;
* :mod:`.comm_cases`: the worker entry that executes resolved communication plans on real process groups.

Nothing in the rest of the package imports this one.
"""

"""``hspmd launch FILE --hostfile hosts.txt`` (over SSH) or ``hspmd launch FILE --slurm [--partition P]`` (as
Slurm job steps): train a strategy (or run an entry) on other machines.

``FILE`` is a strategy JSON (or a packaged example name).  Over SSH the cluster comes from a DeepSpeed-style
hostfile (``host slots=N [kind=H20]``); per-host SSH settings (address, port, user, python, workdir, env) come
from ``--ssh-hosts hosts.json`` (``{"host": {...}}``); ``--python``, ``--workdir``, ``--ssh-port`` and
``--ssh-user`` set the defaults for every host.  With ``--slurm`` the cluster is read from the scheduler
(:meth:`~hspmd_sdk.Cluster.from_slurm`: every usable node of ``--partition``, or the ``--nodes`` named; their
kinds from the GPU GRES types) and every rank runs as a job step of an allocation on its node
(:class:`~hspmd_sdk.runtime.SlurmTransport`; ``--time``, ``--account``, ``--qos``, ``--constraint`` go to the
allocations; ``--python``: the workers' interpreter).  ``--check`` only runs the preflight (over Slurm: the
allocations are granted, then cancelled).  ``--entry module:function`` runs that entry instead of training (FILE
is then not needed).

Exit status: 0 success, 1 failure (preflight, a worker, a connection), 130 interrupted (every worker stopped).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .checkpoint import add_training_checkpoint_arguments, training_checkpoint_options
from .command import EXIT_INTERRUPTED, Command
from .inputs import MAX_SEED, MAX_STEPS, MAX_TOKENS, add_fault_arguments, int_in, number_above, resolve_file
from ..core.cluster import Cluster
from ..core.specialize import specialize
from ..core.strategy import Strategy
from ..core.strategy_plan import plan_from_strategy
from ..errors import PlanValidationError
from ..models.registry import load_model_spec


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", nargs="?", help="strategy JSON to train (or a packaged example name)")
    p.add_argument("--hostfile", metavar="PATH", help="SSH hosts: 'host slots=N [kind=KIND]' a line (or --slurm)")
    p.add_argument("--entry", metavar="MODULE:FUNCTION", help="run this entry instead of training FILE")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=10, help="training steps (default 10)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    p.add_argument("--model", default="tiny", metavar="PRESET", help="model preset or config JSON (default tiny)")
    p.add_argument("--data", default="stdlib", choices=["stdlib", "synthetic"],
                   help="stdlib (default: the standard library's source, real text) or synthetic (random tokens)")
    p.add_argument("--lr", type=number_above(0), default=1e-3)
    p.add_argument("--seq-len", type=int_in(1, MAX_TOKENS), default=None, metavar="N")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: gloo for CPU hosts, nccl for GPU hosts")
    p.add_argument("--elastic", action="store_true",
                   help="survive workers and hosts that die: replan for the survivors and switch in memory")
    p.add_argument("--straggler", action="store_true",
                   help="replan around a rank that stays slower than under its plan")
    add_fault_arguments(p)
    g = p.add_argument_group("SSH")
    g.add_argument("--ssh-hosts", metavar="JSON", help="per-host settings {host: {address, port, user, python, "
                                                       "workdir, env}}")
    g.add_argument("--python", default=None, help="remote Python for every host (default python3)")
    g.add_argument("--workdir", default=None, help="remote working directory for every host")
    g.add_argument("--ssh-port", type=int_in(1, 65535), default=None)
    g.add_argument("--ssh-user", default=None)
    g.add_argument("--known-hosts", default=None, metavar="PATH", help="default ~/.ssh/known_hosts")
    g.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust hosts not in known_hosts yet (adds their keys; a changed key is still refused)")
    g.add_argument("-i", "--identity", action="append", default=None, metavar="KEY",
                   help="private key file (repeatable; default: ssh-agent and ~/.ssh/id_*)")
    g.add_argument("--check", action="store_true", help="only check the hosts (exit 0 if all pass)")
    g = p.add_argument_group("Slurm")
    g.add_argument("--slurm", action="store_true",
                   help="run on the Slurm cluster's nodes (read from the scheduler), each rank a job step")
    g.add_argument("--partition", metavar="P", help="Slurm partition (default: the cluster's default)")
    g.add_argument("--nodes", metavar="LIST", help="only these Slurm nodes (e.g. 'gpu[01-04]')")
    g.add_argument("--time", metavar="LIMIT", help="the allocations' time limit (e.g. 2:00:00)")
    g.add_argument("--account", metavar="A", help="Slurm account to charge")
    g.add_argument("--qos", metavar="Q", help="Slurm quality of service")
    g.add_argument("--constraint", metavar="C", help="Slurm node features required (e.g. h800)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="per-rank logs (default: a temporary folder)")
    p.add_argument("--quiet", action="store_true", help="do not echo the workers' lines")

    add_training_checkpoint_arguments(p)


def _transport(args: argparse.Namespace) -> Any:
    # lazy: launcher/transports, not loaded at `hspmd --help`
    from ..runtime.transports.hosts import read_hosts_file
    from ..runtime.transports.ssh import SSHTransport

    default: dict[str, Any] = {}
    for key, value in (("python", args.python), ("workdir", args.workdir), ("port", args.ssh_port),
                       ("user", args.ssh_user)):
        if value is not None:
            default[key] = value
    hosts = read_hosts_file(args.ssh_hosts) if args.ssh_hosts else None
    return SSHTransport(hosts, default=default, known_hosts=args.known_hosts,
                        accept_new_host_keys=args.accept_new_host_keys, client_keys=args.identity)


def _check_arguments(args: argparse.Namespace) -> None:
    """What can be checked before any host is contacted."""
    from ..runtime.spec import ENTRY_PATTERN  # lazy: the runtime's launch spec, not loaded at `hspmd --help`

    problems = []
    if args.entry is not None and not ENTRY_PATTERN.fullmatch(args.entry):
        problems.append(("--entry", f"{args.entry[:80]!r} is not 'module:function' (dotted module, identifier)"))
    if not args.entry and not args.file and not args.check:
        problems.append(("FILE", "give a strategy to train, or --entry module:function"))
    if args.entry is not None and (args.elastic or args.straggler):
        problems.append(("--elastic/--straggler", "apply to training a strategy, not to an --entry"))
    if args.entry is not None and (args.checkpoint_dir or args.resume_from):
        problems.append(("--checkpoint-dir/--resume-from", "apply to training a strategy, not to an --entry"))
    if not args.slurm and not args.hostfile:
        problems.append(("--hostfile/--slurm", "say where to run: --hostfile hosts.txt (SSH hosts) or --slurm (the "
                                               "Slurm cluster's nodes)"))
    if args.slurm and args.hostfile:
        problems.append(("--hostfile/--slurm", "give one of them: the hosts come from the hostfile or from Slurm"))
    ssh_only = [flag for flag, value in (("--ssh-hosts", args.ssh_hosts), ("--workdir", args.workdir),
                                         ("--ssh-port", args.ssh_port), ("--ssh-user", args.ssh_user),
                                         ("--known-hosts", args.known_hosts),
                                         ("--accept-new-host-keys", args.accept_new_host_keys),
                                         ("--identity", args.identity)) if value]
    if args.slurm and ssh_only:
        problems.append((ssh_only[0], "applies to SSH hosts, not to --slurm"))
    slurm_only = [flag for flag, value in (("--partition", args.partition), ("--nodes", args.nodes),
                                           ("--time", args.time), ("--account", args.account), ("--qos", args.qos),
                                           ("--constraint", args.constraint)) if value]
    if slurm_only and not args.slurm:
        problems.append((slurm_only[0], "applies to --slurm"))
    if args.stall < 2 * args.heartbeat:
        problems.append(("--stall", f"{args.stall:g} s must be at least two heartbeats (--heartbeat "
                                    f"{args.heartbeat:g})"))
    if problems:
        raise PlanValidationError(problems, what="arguments")


def run_launch(args: argparse.Namespace) -> int:
    """Run ``hspmd launch``; :class:`~hspmd_sdk.errors.HSPMDError` propagates (the CLI prints it, status 1)."""
    # lazy: launcher/transports, not loaded at `hspmd --help`
    from ..runtime.control.train import launch

    _check_arguments(args)
    if args.slurm:
        return _run_slurm(args)
    cluster = Cluster.from_hostfile(args.hostfile)
    transport = _transport(args)
    try:  # closed on every path that starts no job; a started job closes it when it ends
        report = transport.check(cluster)
        print(report)
        if args.check or not report.ok:
            transport.close()
            if not report.ok:
                print("\npreflight failed, nothing was started:\n" + report.problems_text(), file=sys.stderr)
            return 0 if report.ok else 1
        common = _common(args, transport, preflight=False)
        job = (launch(None, cluster, entry=args.entry, **common) if args.entry
               else _launch_training(args, cluster, common))
    except BaseException:
        transport.close()
        raise
    return _follow(job, cluster)


def _common(args: argparse.Namespace, transport: Any, *, preflight: bool) -> dict[str, Any]:
    return dict(transport=transport, preflight=preflight, timeout_s=args.timeout, backend=args.backend,
                log_dir=args.log_dir, echo=not args.quiet, seed=args.seed, steps=args.steps,
                heartbeat_s=args.heartbeat, stall_s=args.stall, resource_check=not args.no_resource_check)


def _run_slurm(args: argparse.Namespace) -> int:
    """``hspmd launch ... --slurm``: the cluster read from Slurm, every rank a job step on its node."""
    # lazy: launcher/transports, not loaded at `hspmd --help`
    from ..runtime.control.train import launch
    from ..runtime.transports.slurm import SlurmTransport

    cluster = Cluster.from_slurm(args.partition, args.nodes)
    print(f"Slurm: {cluster}: " + ", ".join(f"{n.host} ({len(n.ranks)} {n.kind})" for n in cluster.nodes))
    transport = SlurmTransport(partition=args.partition, time=args.time, account=args.account, qos=args.qos,
                               constraint=args.constraint, python=args.python)
    try:  # closed on every path that starts no job; a started job closes it when it ends
        if args.check:
            transport.preflight(cluster)
            print("preflight OK: " + ", ".join(f"{h}: allocation {j}" for h, j in sorted(
                transport.allocations.items())) + " (cancelled again)")
            transport.close()
            return 0
        common = _common(args, transport, preflight=True)
        job = (launch(None, cluster, entry=args.entry, **common) if args.entry
               else _launch_training(args, cluster, common))
    except BaseException:
        transport.close()
        raise
    return _follow(job, cluster)


def _follow(job: Any, cluster: Any) -> int:
    """Wait for ``job``, printing where it runs, its losses, reconfigurations and logs."""
    hosts = len({n.host for n in cluster.nodes})
    print(f"job {job.job_id}: {cluster.num_ranks} ranks on {hosts} host{'s' if hosts != 1 else ''}; logs in "
          f"{job.log_dir}", flush=True)
    try:
        result = job.wait()
    except KeyboardInterrupt:
        print(f"\ninterrupted: every worker was stopped; logs in {job.log_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.losses:
        print("losses: " + " ".join(f"{x:.6f}" for x in result.losses))
    for event in result.events:
        print(f"reconfigured at {event}\n  -> {event.strategy}")
    print(f"done in {result.wall_time:.1f} s; logs in {result.log_dir}")
    return 0


def _launch_training(args: argparse.Namespace, cluster: Any, common: dict[str, Any]) -> Any:
    from ..runtime.control.train import launch  # lazy: torch (train)

    config = load_model_spec(args.model)
    strategy = Strategy.load(resolve_file(args.file))
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    options = {k: v for k, v in common.items() if k != "preflight"}  # the one training path checks the hosts itself
    return launch(program, cluster, data=args.data, lr=args.lr, seq_len=args.seq_len,
                           elastic=args.elastic, straggler=args.straggler, **training_checkpoint_options(args),
                           **options)


LAUNCH = Command("train a strategy (or run an entry) on remote hosts over SSH or on a Slurm cluster",
                 add_launch_arguments, run_launch)

"""Worker entries for the runtime benchmarks: our executor and a torch-only peer, interleaved in one job.

:func:`bench_entry` runs inside the SDK's own worker processes (started by
:func:`hspmd_sdk.runtime.control.launcher.launch_entry`, gloo already initialised), so process setup, thread count and data are
identical for both contestants.  Per round it runs ``steps`` training steps of HSPMD's
:class:`~hspmd_sdk.runtime.workers.executor.StepExecutor` and ``steps`` of the peer (the order alternates between rounds so
that a slow patch of background load hits both alike; with ``steps=1`` the two alternate step by step, and the
ratio of each adjacent (ours, peer) pair is a ratio under nearly the same load); every step is bracketed by ``dist.barrier()`` on both
sides, so a step's time is the wall time of the slowest rank.  The first ``warmup`` steps of each contestant are
dropped.

Peers (all torch-only, training the same parameters from :func:`hspmd_sdk.models.build_reference` with
``torch.optim.Adam`` on the same global batches; ``adam: "fused"`` in a peer's options gives it torch's fused
Adam kernel, the one our ranks run, instead of torch's default, :func:`peer_adam`):

* ``ddp``: ``DistributedDataParallel`` on the reference module, each rank its ``B / world`` rows (``autocast:
  "bf16"``: its forward under ``torch.autocast`` bf16 — torch's own bf16 recipe, fp32 weights and all-reduce);
* ``tp_ddp``: DTensor tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` on ``wq/wk/wv/w1/w3`` and
  ``RowwiseParallel`` on ``wo/w2``) over the ``tp`` dimension of a ``(dp, tp)`` device mesh, then DDP over the
  ``dp`` dimension.  DTensor's styles need ``nn.Linear``, so the peer model is :class:`LinearLlama`: the
  reference's parameters in ``nn.Linear`` modules (weight = the reference's ``[in, out]`` matrix transposed) and
  the reference's math.  The embedding and LM head stay replicated within the TP group (Megatron's and ours are
  vocab-parallel);
* ``pp_1f1b``: ``torch.distributed.pipelining`` with one manually built :class:`~torch.distributed.pipelining.
  PipelineStage` per rank (layers split evenly; embedding on the first, final norm + LM head on the last) and
  ``Schedule1F1B``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hspmd_sdk.models import build_reference
from hspmd_sdk.runtime.protocol import training_of
from hspmd_sdk.models.llama.reference import LlamaReference
from hspmd_sdk.models.llama.reference import rmsnorm as _rmsnorm, rope as _rope

__all__ = ["bench_entry", "LinearLlama"]


# ---- contestants ----------------------------------------------------------------------------------------------
def peer_adam(params: Any, run: Mapping[str, Any], conf: Mapping[str, Any]) -> torch.optim.Adam:
    """The peer's ``torch.optim.Adam``: ``conf["adam"] == "fused"`` torch's fused kernel (the one our ranks run,
    :meth:`hspmd_sdk.runtime.workers.executor.AdamConfig.build`), else torch's default for these tensors (on CPU the
    for-loop implementation: what a user of ``torch.optim.Adam(params, lr)`` gets)."""
    params = list(params)
    if conf.get("adam", "default") == "fused":
        return torch.optim.Adam(params, lr=training_of(run).optimizer.lr, fused=True)
    return torch.optim.Adam(params, lr=training_of(run).optimizer.lr)


class _Ours:
    """HSPMD's executor on this rank (what :func:`hspmd_sdk.runtime.control.train._train_one` builds)."""

    def __init__(self, state: Any, run: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> None:
        from hspmd_sdk.runtime.workers.comm import comm_groups
        from hspmd_sdk.runtime.workers.executor import AdamConfig, StepExecutor, program_comm_plans
        from hspmd_sdk.runtime.protocol import program_of_run as _program_of

        program = _program_of(run)
        state.create_groups(comm_groups(program_comm_plans(program)))
        a = training_of(run).optimizer
        self.ex = None
        if state.rank in program.ranks:
            self.ex = StepExecutor(program, state.rank, state, seed=int(run["seed"]),
                                   global_batch=int(run["global_batch"]), seq_len=int(run["seq_len"]),
                                   adam=AdamConfig(lr=a.lr, betas=tuple(a.betas), eps=a.eps,
                                                   weight_decay=a.weight_decay), device=state.device,
                                   precision=run.get("precision", "fp32"), **dict(options or {}))

    def step(self, batch: torch.Tensor) -> float:
        if self.ex is None:
            return 0.0
        return self.ex.step(batch if self.ex.needs_data else None)


class _LossModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens, targets)


class _PeerDDP:
    """torch DDP on the reference module; rank ``r`` trains rows ``[r*B/W, (r+1)*B/W)``.  ``autocast: "bf16"``:
    the forward under ``torch.autocast(dtype=torch.bfloat16)`` (fp32 parameters, gradients and all-reduce)."""

    def __init__(self, state: Any, run: Mapping[str, Any], conf: Mapping[str, Any]) -> None:
        from hspmd_sdk import LlamaConfig
        from torch.nn.parallel import DistributedDataParallel as DDP

        config = LlamaConfig.model_validate(run["config"])
        self.module = DDP(_LossModule(build_reference(config, int(run["seed"]))))
        self.opt = peer_adam(self.module.parameters(), run, conf)
        w, r = dist.get_world_size(), dist.get_rank()
        rows = int(run["global_batch"]) // w
        self.rows = slice(r * rows, (r + 1) * rows)
        self.autocast = conf.get("autocast") == "bf16"

    def step(self, batch: torch.Tensor) -> float:
        b = batch[self.rows]
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.module(b[:, :-1], b[:, 1:])
        loss.backward()
        self.opt.step()
        return float(loss.detach())


class LinearLlama(nn.Module):
    """The reference Llama with its projections as ``nn.Linear`` (for DTensor's parallel styles).

    Same initial values (``weight = reference[in, out].T``) and the reference's math; the attention reshapes
    with ``-1`` heads so that it runs on the local heads of a column-parallel projection."""

    def __init__(self, config: Any, seed: int = 0) -> None:
        super().__init__()
        ref = build_reference(config, seed)
        self.config = config
        self.embed = nn.Embedding.from_pretrained(ref.embed.weight.detach().clone(), freeze=False)
        self.layers = nn.ModuleList()
        for layer in ref.layers:
            m = nn.Module()
            m.attn_norm = nn.Parameter(layer.attn_norm.weight.detach().clone())
            m.mlp_norm = nn.Parameter(layer.mlp_norm.weight.detach().clone())
            m.attn, m.mlp = nn.Module(), nn.Module()
            for part, names in ((m.attn, ("wq", "wk", "wv", "wo")), (m.mlp, ("w1", "w3", "w2"))):
                src = layer.attn if part is m.attn else layer.mlp
                for n in names:
                    w = getattr(src, n).detach()
                    lin = nn.Linear(w.shape[0], w.shape[1], bias=False)
                    with torch.no_grad():
                        lin.weight.copy_(w.t())
                    setattr(part, n, lin)
            self.layers.append(m)
        self.final_norm = nn.Parameter(ref.final_norm.weight.detach().clone())
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(ref.lm_head.weight.detach().t())

    def _attention(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        q = m.attn.wq(x).view(b, s, -1, c.head_dim)
        k = m.attn.wk(x).view(b, s, -1, c.head_dim)
        v = m.attn.wv(x).view(b, s, -1, c.head_dim)
        q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        return m.attn.wo(o.transpose(1, 2).reshape(b, s, -1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = self.embed(tokens)
        for m in self.layers:
            h = h + self._attention(m, _rmsnorm(h, m.attn_norm, c.rms_eps))
            x = _rmsnorm(h, m.mlp_norm, c.rms_eps)
            h = h + m.mlp.w2(F.silu(m.mlp.w1(x)) * m.mlp.w3(x))
        logits = self.lm_head(_rmsnorm(h, self.final_norm, c.rms_eps))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _PeerTPDDP:
    """DTensor TP over mesh dim ``tp`` (``parallelize_module``), DDP over ``dp``; rank layout ``[[0, 1], [2, 3]]``
    (TP groups {0,1}, {2,3}; DP groups {0,2}, {1,3}) like the SDK's ``dp2xtp2`` strategy."""

    def __init__(self, state: Any, run: Mapping[str, Any], conf: Mapping[str, Any]) -> None:
        from hspmd_sdk import LlamaConfig
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        config = LlamaConfig.model_validate(run["config"])
        dp, tp = int(conf["dp"]), int(conf["tp"])
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = LinearLlama(config, int(run["seed"]))
        plan = {**{f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}, "attn.wo": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
        for m in model.layers:
            parallelize_module(m, mesh["tp"], plan)
        self.mode = conf.get("dp_mode", "ddp")
        self.dp_group = mesh["dp"].get_group()
        if dp > 1 and self.mode == "ddp":
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            from torch.nn.parallel import DistributedDataParallel as DDP

            _pre_dp_module_transform(model)
            self.module: nn.Module = DDP(model, process_group=self.dp_group)
        else:
            self.module = model
        self.model = model
        self.opt = peer_adam(model.parameters(), run, conf)
        rows = int(run["global_batch"]) // dp
        i = mesh["dp"].get_local_rank()
        self.rows = slice(i * rows, (i + 1) * rows)
        self.dp = dp

    def step(self, batch: torch.Tensor) -> float:
        b = batch[self.rows]
        self.opt.zero_grad(set_to_none=True)
        loss = self.module(b[:, :-1], b[:, 1:])
        loss.backward()
        if self.dp > 1 and self.mode != "ddp":  # manual gradient all-reduce (no overlap)
            for p in self.model.parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.dp_group)
                g.div_(self.dp)
        self.opt.step()
        return float(loss.detach())


class _Stage(nn.Module):
    """Layers ``[first, last]`` of the reference (plus the embedding on stage 0, final norm + head at the end)."""

    def __init__(self, ref: LlamaReference, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = ref.config
        self.is_first, self.is_last = is_first, is_last
        self.embed = ref.embed if is_first else None
        self.layers = nn.ModuleList(ref.layers[first:last + 1])
        self.final_norm = ref.final_norm if is_last else None
        self.lm_head = ref.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = F.embedding(x, self.embed.weight) if self.is_first else x
        for layer in self.layers:
            h = h + LlamaReference._attention(self, layer, _rmsnorm(h, layer.attn_norm.weight, c.rms_eps))
            y = _rmsnorm(h, layer.mlp_norm.weight, c.rms_eps)
            h = h + (F.silu(y @ layer.mlp.w1) * (y @ layer.mlp.w3)) @ layer.mlp.w2
        if self.is_last:
            h = _rmsnorm(h, self.final_norm.weight, c.rms_eps) @ self.lm_head.weight
        return h


class _PeerPipeline:
    """``torch.distributed.pipelining``: one ``PipelineStage`` per rank, ``Schedule1F1B`` (or GPipe)."""

    def __init__(self, state: Any, run: Mapping[str, Any], conf: Mapping[str, Any]) -> None:
        from hspmd_sdk import LlamaConfig
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        config = LlamaConfig.model_validate(run["config"])
        n, r = dist.get_world_size(), dist.get_rank()
        per = config.num_layers // n
        ref = build_reference(config, int(run["seed"]))
        self.stage_mod = _Stage(ref, r * per, (r + 1) * per - 1, r == 0, r == n - 1)
        del ref
        self.first, self.last = r == 0, r == n - 1
        stage = PipelineStage(self.stage_mod, r, n, torch.device("cpu"))
        vocab = config.vocab_size

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

        cls = ScheduleGPipe if conf.get("schedule") == "gpipe" else Schedule1F1B
        self.sched = cls(stage, n_microbatches=int(conf["num_micro_batches"]), loss_fn=loss_fn)
        self.opt = peer_adam(self.stage_mod.parameters(), run, conf)

    def step(self, batch: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.first:
            self.sched.step(batch[:, :-1])
        elif self.last:
            self.sched.step(target=batch[:, 1:], losses=losses)
        else:
            self.sched.step()
        self.opt.step()
        return float(sum(float(l) for l in losses) / len(losses)) if losses else 0.0


PEERS: dict[str, Callable[..., Any]] = {"ddp": _PeerDDP, "tp_ddp": _PeerTPDDP, "pp": _PeerPipeline}


# ---- the entry ------------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], float], cpu: list[float] | None = None) -> tuple[float, float]:
    """Wall seconds of ``fn`` between two barriers (the slowest rank) and its loss; ``cpu`` gets this process's
    CPU seconds in ``fn`` (every thread: the compute and gloo's)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = fn()
    c1 = time.process_time()
    dist.barrier()
    if cpu is not None:
        cpu.append(c1 - c0)
    return time.perf_counter() - t0, loss


def bench_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Payload: ``run`` (a :func:`~hspmd_sdk.runtime.control.train.training_run` dict), ``peer`` (``{"kind": ...}`` and
    the peer's options), ``rounds``, ``steps`` (per round and contestant), ``warmup``.  Returns per-step times
    (after warm-up) and losses of both contestants."""
    from hspmd_sdk.runtime.control.train import dataset_for

    p = spec.payload
    run, conf = p["run"], p["peer"]
    ours = _Ours(state, run, p.get("ours_options"))
    peer = PEERS[conf["kind"]](state, run, conf)
    dataset = dataset_for(run["data"], int(run["config"]["vocab_size"]))
    B, S, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
    batches = [dataset.global_batch(s, B, S, seed) for s in range(8)]
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    cpu: dict[str, list[float]] = {"ours": [], "peer": []}
    losses: dict[str, list[float]] = {"ours": [], "peer": []}
    done = {"ours": 0, "peer": 0}
    contestants = {"ours": ours, "peer": peer}
    for rnd in range(int(p["rounds"])):
        order = ["ours", "peer"] if rnd % 2 == 0 else ["peer", "ours"]
        for name in order:
            for s in range(int(p["steps"])):
                batch = batches[done[name] % len(batches)]
                spent: list[float] = []
                dt, loss = _timed(lambda: contestants[name].step(batch), spent)
                if done[name] >= int(p["warmup"]):
                    times[name].append(dt)
                    cpu[name].append(spent[0])
                done[name] += 1
                losses[name].append(loss)
    return {"times": times, "cpu": cpu, "losses": losses, "threads": torch.get_num_threads()}


# ---- compute-only slow-device emulation (part d) ----------------------------------------------------------------
def _emulating_executor(base: Any, factor: float) -> Any:
    """A :class:`StepExecutor` subclass that emulates a ``factor``-times slower device by sleeping
    ``(factor - 1)`` times the measured duration of each *compute* piece only: every forward kernel, every
    ``torch.autograd.backward`` call (its stage's backward; for TP plans this includes the TP group's in-backward
    all-reduces, charged as compute) and the Adam step.  Waiting for other ranks (receives, gradient
    synchronisation) is not stretched — unlike ``WorkerState.emulate``, which stretches the whole step."""

    class Emulating(base):  # type: ignore[misc, valid-type]
        emulated_s = 0.0

        def _stretch(self, dt: float) -> None:
            extra = (factor - 1.0) * dt
            if extra > 0:
                time.sleep(extra)
                self.emulated_s += extra

        def _compute(self, op: Any, vals: dict) -> None:
            t0 = time.perf_counter()
            super()._compute(op, vals)
            self._stretch(time.perf_counter() - t0)

        def backward(self, mb: int, **kw: Any) -> float:
            orig = torch.autograd.backward

            def timed(*a: Any, **k: Any) -> None:
                t0 = time.perf_counter()
                orig(*a, **k)
                self._stretch(time.perf_counter() - t0)

            torch.autograd.backward = timed
            try:
                return super().backward(mb, **kw)
            finally:
                torch.autograd.backward = orig

    return Emulating


def emulated_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Payload ``runs`` (training-run dicts), ``factors`` (rank -> slowdown), ``rounds``, ``warmup`` (and optional
    ``threads``: torch threads per worker; ``link_probe``: ``{"sizes", "compute_s"}`` -- after every round, every
    rank times :func:`compute_burst` at once, then ranks (0, 1), (2, 3), ... sweep
    :func:`hspmd_sdk.runtime.control.profile.collective_sweep` back to back and in context;
    ``time_comm``: also return each step's seconds and calls inside collectives): build every
    run's executor with compute-only emulation, then step the runs in turn (one step each per round, so load
    affects all alike); returns each run's per-step times (barrier to barrier) after warm-up, and the rank's peak
    memory (``memory_mb``: :func:`hspmd_sdk.runtime.metrics.memory_mb`, peak RSS on a CPU)."""
    from hspmd_sdk.runtime.workers.comm import comm_groups
    from hspmd_sdk.runtime.workers.executor import AdamConfig, StepExecutor, program_comm_plans
    from hspmd_sdk.runtime.data import dataset_for
    from hspmd_sdk.runtime.protocol import program_of_run as _program_of

    p = spec.payload
    if p.get("threads"):
        torch.set_num_threads(int(p["threads"]))
    factor = float(p["factors"].get(str(state.rank), 1.0))
    cls = _emulating_executor(StepExecutor, factor) if factor != 1.0 else StepExecutor
    contestants = []
    for run in p["runs"]:
        program = _program_of(run)
        state.create_groups(comm_groups(program_comm_plans(program)))
        ex = cls(program, state.rank, state, seed=int(run["seed"]), global_batch=int(run["global_batch"]),
                 seq_len=int(run["seq_len"]), adam=AdamConfig(lr=training_of(run).optimizer.lr),
                 device=state.device)
        opt_step = ex.optimizer.step
        if factor == 1.0:
            ex.emulated_s = 0.0

        def stepped(*args: Any, _f: Any = opt_step, _ex: Any = ex, **kw: Any) -> Any:
            t0 = time.perf_counter()
            r = _f(*args, **kw)
            _ex._stretch(time.perf_counter() - t0)
            return r

        if factor != 1.0:
            ex.optimizer.step = stepped
        dataset = dataset_for(run["data"], int(run["config"]["vocab_size"]))
        B, S, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
        contestants.append((ex, [dataset.global_batch(s, B, S, seed) for s in range(4)]))
    clock = _CommClock() if p.get("time_comm") else None
    probe = p.get("link_probe")
    pair = None
    if probe and dist.get_world_size() >= 2:  # ranks (0, 1), (2, 3), ... measure their link between the rounds
        groups = [dist.new_group([r, r + 1]) for r in range(0, dist.get_world_size() - 1, 2)]
        pair = groups[state.rank // 2] if state.rank // 2 < len(groups) else None
    link: dict[str, list] = {"isolated": [], "in_context": [], "burst_s": []}
    times: list[list[float]] = [[] for _ in contestants]
    comm: list[list[tuple[float, int, dict]]] = [[] for _ in contestants]
    try:
        if clock is not None:
            clock.install()
        for rnd in range(int(p["warmup"]) + int(p["rounds"])):
            for i, (ex, batches) in enumerate(contestants):
                batch = batches[rnd % len(batches)]
                if clock is not None:
                    clock.reset()
                dt, _ = _timed(lambda: ex.step(batch if ex.needs_data else None))
                if rnd >= int(p["warmup"]):
                    times[i].append(dt)
                    if clock is not None:
                        comm[i].append((clock.seconds, clock.calls, {k: list(v) for k, v in clock.ops.items()}))
            if probe:
                dist.barrier()
                burst = torch.tensor([compute_burst()], dtype=torch.float64)  # every rank at once
                dist.all_reduce(burst)  # the mean over the ranks: the share of a core each rank gets in this job
                if rnd >= int(p["warmup"]):
                    link["burst_s"].append(float(burst) / dist.get_world_size())
                dist.barrier()
                if pair is not None:
                    _probe_link(pair, probe, link, keep=rnd >= int(p["warmup"]))
                dist.barrier()
    finally:
        if clock is not None:
            clock.uninstall()
    from hspmd_sdk.runtime.metrics import memory_mb

    return {"runs": [{"times": t, "emulated_s": ex.emulated_s, "collectives": c}
                     for t, c, (ex, _) in zip(times, comm, contestants)], "link": link,
            "memory_mb": memory_mb(state.device)}  # this rank's peak: every run's tensors held at once


class _CommClock:
    """Seconds and calls this rank spends inside torch.distributed's collectives (the executor's blocking
    all-reduce / all-gather / reduce-scatter / all-to-all / broadcast; point-to-point and barriers not counted)
    while installed: the measured side of the simulator's TP communication."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.ops: dict[str, list[float]] = {}  # op name -> [calls, bytes of the first tensor, seconds]
        self._orig: dict[str, Any] = {}

    def reset(self) -> None:
        self.seconds, self.calls, self.ops = 0.0, 0, {}

    def install(self) -> None:
        for name in self.NAMES:
            self._orig[name] = fn = getattr(dist, name)
            setattr(dist, name, self._timed(fn))

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.calls += 1
                t = next((x for x in a if isinstance(x, torch.Tensor)), None)
                tally = self.ops.setdefault(fn.__name__, [0, 0, 0.0])
                tally[0] += 1
                tally[1] += 0 if t is None else t.numel() * t.element_size()
                tally[2] += dt
        return call


def compute_burst(n: int = 256, k: int = 150) -> float:
    """Seconds of ``k`` fp32 ``n x n`` matmuls (after one warm-up; ~50 ms, many scheduler slices): timed alone in
    the bench's process and by every rank at once inside a job, the ratio is the share of a core each rank gets
    there (other ranks, background load)."""
    a = torch.randn(n, n)
    a @ a
    t0 = time.perf_counter()
    for _ in range(k):
        a @ a
    return time.perf_counter() - t0


def _probe_link(pair: Any, probe: Mapping[str, Any], link: dict[str, list], keep: bool) -> None:
    """One sweep of the blocking all-reduce on this rank's pair, back to back and in context (after
    ``probe["compute_s"]`` of compute, and after ``probe["skew_compute_s"]`` when given;
    :func:`hspmd_sdk.runtime.control.profile.collective_sweep`), under the same load as the steps around it."""
    from hspmd_sdk.runtime.control.profile import collective_sweep

    sizes = [int(x) for x in probe["sizes"]]
    iso = collective_sweep(sizes, pair, iters=int(probe.get("isolated_iters", 3)))
    ctx = collective_sweep(sizes, pair, compute_s=float(probe["compute_s"]), iters=int(probe.get("iters", 8)))
    long = (collective_sweep(sizes, pair, compute_s=float(probe["skew_compute_s"]), iters=int(probe.get("iters", 8)))
            if probe.get("skew_compute_s") else None)
    if keep:
        link["isolated"].append(iso)
        link["in_context"].append(ctx)
        if long is not None:
            link.setdefault("in_context_long", []).append(long)


def breakdown_entry(state: Any, spec: Any) -> dict[str, Any]:
    """Where our step's time goes: ``F`` + ``B`` (compute) vs ``POST`` (gradient synchronisation + Adam) per step,
    each bracketed by barriers; payload ``run``, ``rounds``, ``warmup``.  Single-pipeline-stage plans only."""
    from hspmd_sdk.runtime.control.train import dataset_for

    p = spec.payload
    run = p["run"]
    ours = _Ours(state, run)
    ex = ours.ex
    dataset = dataset_for(run["data"], int(run["config"]["vocab_size"]))
    B, S, seed = int(run["global_batch"]), int(run["seq_len"]), int(run["seed"])
    parts: dict[str, list[float]] = {"fwd_bwd": [], "post": [], "grad_sync_only": []}
    for s in range(int(p["warmup"]) + int(p["rounds"])):
        batch = dataset.global_batch(s, B, S, seed)
        ex._feeds = ex._local_feeds({"tokens": batch[:, :-1], "targets": batch[:, 1:]})
        ex.records.clear()

        def fb() -> float:
            ex.pre()
            for mb in range(ex.num_micro):
                ex.forward(mb)
                ex.backward(mb)
            return 0.0

        t_fb, _ = _timed(fb)
        opt_step = ex.optimizer.step
        opt_t = [0.0]

        def timed_opt(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = opt_step(*a, **k)
            opt_t[0] = time.perf_counter() - t0
            return r

        ex.optimizer.step = timed_opt
        t_post, _ = _timed(lambda: ex.post() or 0.0)
        ex.optimizer.step = opt_step
        if s >= int(p["warmup"]):
            parts["fwd_bwd"].append(t_fb)
            parts["post"].append(t_post)
            parts["grad_sync_only"].append(t_post - opt_t[0])
    return parts

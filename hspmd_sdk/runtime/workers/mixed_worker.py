"""A worker's mixed-length run (worker side; SPEC §7, see :mod:`.mixed` for the whole design): the step's
candidate and micro-batches from the launcher's ``dispatch`` messages, length switches, and the micro-batches'
feeds (padded rows, or one packed row)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ...errors import HSPMDError
from ..protocol import program_of_run, unpack_payload
from .session import TrainSession

if TYPE_CHECKING:
    import torch

    from ...core.graph import Graph
    from ...core.model_spec import ModelSpec
    from ...core.specialize import Program
    from .executor import StepExecutor
    from .worker import WorkerState

__all__ = ["MixedSession", "micro_batch_feeds", "target_placeholders"]


#: Seconds a worker waits for the dispatch of a step before it fails (the launcher plans ahead; this is a hang).
DISPATCH_WAIT_S = 120.0


def target_placeholders(graph: "Graph") -> set[str]:
    """Placeholders the loss operator reads directly (the targets: their ``-100`` entries are padding)."""
    node = graph.producer(graph.loss)
    return {t for t in node.inputs if graph.producer(t).kind == "placeholder"}


def micro_batch_feeds(model: "ModelSpec", graph: "Graph", sequences: Sequence[np.ndarray], *,
                      packed: bool = False) -> dict[str, Any]:
    """The graph's placeholders for one padded micro-batch: ``model.feeds`` of the sequences padded on the right
    (:func:`~.data.padded_rows`), padding ``-100`` in the targets (masked out of the loss) and ``0`` in every other
    integer feed (a valid token; causal attention keeps padding out of the real positions).  ``packed``: one row,
    each sequence's feeds back to back (``[1, sum of lengths]``; the kernels keep the sequences apart)."""
    import torch

    from ..data import padded_rows  # lazy: torch (data)
    from .kernels import IGNORE_INDEX  # lazy: torch (kernels)

    if packed:
        parts = [model.feeds(torch.as_tensor(np.asarray(q), dtype=torch.int64)[None]) for q in sequences]
        for k, v in parts[0].items():
            if not isinstance(v, torch.Tensor) or v.dim() < 2 or v.shape[0] != 1:
                raise HSPMDError(f"packing needs every feed of model.feeds as [1, S, ...] for one sequence; feed "
                                 f"{k!r} is {tuple(getattr(v, 'shape', ()))}: pass packing=False")
        return {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}

    feeds = dict(model.feeds(padded_rows(sequences, IGNORE_INDEX)))
    targets = target_placeholders(graph)
    for k, v in feeds.items():
        if k not in targets and isinstance(v, torch.Tensor) and not v.is_floating_point():
            feeds[k] = v.masked_fill(v == IGNORE_INDEX, 0)
    return feeds


class MixedSession(TrainSession):
    """A worker's mixed-length run (see the module docstring): the step's candidate and micro-batches from the
    launcher's ``dispatch`` message, a length switch where the candidate's Program changes (a candidate that runs
    the same Program with other windows keeps the running one: :func:`same_layouts`), the pipeline's micro-batches
    at their own shapes.

    Elastic (``elastic=True``): the version a worker holds is ``(reconfiguration id, candidate)``; the state from
    before a length switch is kept until the next commit, as for a user's switch, and a recovery brings the
    candidates replanned on the survivors (:meth:`~..control.recovery.Recovery.replan_candidates`), among
    which the dispatch goes on."""

    #: a grow comes with the dispatch of its step (:meth:`~..control.candidates.CandidateSwitch.grow`)
    GROWS_BY = "dispatch"

    def __init__(self, state: "WorkerState", run: Mapping[str, Any], index: int, offset: int) -> None:
        mixed = run["mixed"]
        self.choice = int(mixed["first"])
        run = {**run, "recompute": None}  # every candidate's own (Program.recompute), whichever runs
        super().__init__(state, run, index, offset)
        self.version = (0, self.choice)
        # after a recovery (the candidates replanned on the survivors) or a user's switch of candidates
        # (``Job.switch([...])``): index among the world's candidates -> its Program
        self.pool: dict[int, Any] | None = None
        self.batches = self.dataset  # dataset_for(a mixed spec): LengthBatches
        self.candidates: dict[int, Any] = {self.choice: self.program}
        self.switch_plans: dict[tuple[int, int], Any] = {}
        self.dispatch: dict[str, Any] = {}
        self.waits: list[float] = []
        self.trained: dict[int, list[int]] = {}
        self.length_switches: list[dict[str, Any]] = []
        self._targets = target_placeholders(self.program.graph)
        self.validation: Any = None  # the validation batches, read at the first validation
        self._joined_at: int | None = None  # a newcomer: the grow's step, whose dispatch it applied joining

    def _candidate(self, i: int) -> "Program":
        got = self.candidates.get(i)
        if got is None and self.pool is not None:
            got = self.candidates[i] = self.pool[i]
        if got is None:
            c = self.run["mixed"]["candidates"][i]
            got = self.candidates[i] = program_of_run({**self.run, "plan": c["plan"], "bindings": c["bindings"],
                                                     "program": c.get("program")})
        return got

    def _make_executor(self, params: "Mapping[str, torch.Tensor] | None",
                       optimizer_state: Mapping[str, Mapping[str, Any]] | None) -> None:
        self.B = int(self.program.bindings["B"])  # each candidate's default batch (the dispatch overrides it)
        super()._make_executor(params, optimizer_state)

    def _drop_unused_groups(self, program: "Program") -> None:
        """Keep every candidate's groups: the job switches back and forth between a few Programs."""

    def _take_dispatch(self, step: int) -> dict[str, Any]:
        """The launcher's dispatch of ``step`` for the world this worker is in (``gen``: the reconfiguration id);
        dispatches for a world replaced since are dropped."""
        end = time.monotonic() + DISPATCH_WAIT_S
        while True:
            self._collect()
            for i, m in enumerate(self._messages):
                if m.get("type") == "dispatch" and int(m.get("id", -1)) == step \
                        and int(m.get("gen", 0)) == self.reconfigured:
                    return self._messages.pop(i)
            if time.monotonic() > end:
                raise HSPMDError(f"rank {self.state.launch_rank}: no dispatch of step {step} from the launcher "
                                 f"within {DISPATCH_WAIT_S:.0f} s")
            time.sleep(0.002)

    def _recover(self, reason: str) -> int:
        step = super()._recover(reason)
        raw = self.last_reconfigure
        if "candidates" in raw:
            self._use_candidates(unpack_payload(raw["candidates"]), 0)
            self.choice = int(raw["choice"])
            self.candidates[self.choice] = self.program
        self.version = (self.reconfigured, self.choice)
        self._messages = [m for m in self._messages
                          if m.get("type") != "dispatch" or int(m.get("gen", 0)) == self.reconfigured]
        return step

    def _use_candidates(self, programs: Sequence["Program"], base: int) -> None:
        """A new candidate set from now on, ``programs[j]`` the world's candidate ``base + j``: an elastic
        recovery's (replanned on the survivors, from 0) or a user's switch of candidates (``Job.switch([...])``,
        after the world's earlier sets).  The switch plans between the old ones go."""
        self.pool = {base + j: p for j, p in enumerate(programs)}
        self.candidates = {}
        self.switch_plans.clear()

    def _join(self) -> int:
        """A newcomer joins the running mixed-length job (``Job.grow``): the dispatch of the grow's step gives the
        new candidates, the grown world and the switch to the chosen one, of which the running ranks send this rank
        its shards (it holds nothing); that step's dispatch is then applied here.  Returns the grow's step."""
        msg = self._grow_message(self.state.spec.timeout_s)
        grow, step = msg["grow"], int(msg["id"])
        t0 = time.perf_counter()
        self.reconfigured = self.state.generation = int(grow["reconfigured"])
        self._use_candidates(unpack_payload(msg["candidates"]), int(msg["base"]))
        choice = int(msg["choice"])
        program, plan = self._candidate(choice), unpack_payload(msg["plan"])
        at, count, _ = self._enter_grown_world(grow, None)
        if at != step:
            raise HSPMDError(f"rank {self.state.launch_rank}: the grow's dispatch is for step {step}, the running "
                             f"ranks grow at step {at}")
        self.committed, self.adam_steps = step - 1, int(count)
        nbytes = self._switch_to(program, plan, source={}, step_count=count)
        self.joining = False
        self.dispatch, self._joined_at = msg, step
        self.choice, self.version = choice, (self.reconfigured, choice)
        self.waits.append(0.0)
        self._messages = [m for m in self._messages if m.get("type") != "dispatch" or int(m.get("id", -1)) > step]
        self._switched(step, int(msg["from"]), "grow", time.perf_counter() - t0, nbytes)
        return step

    def _switched(self, step: int, src: int, what: str, seconds: float, nbytes: int) -> None:
        """Record and report a switch at ``step``'s boundary (a length switch, a switch of candidates, a grow:
        ``what``) from candidate ``src`` to the one chosen now."""
        self.length_switches.append({"step": step, "from": src, "to": self.choice, "seconds": round(seconds, 6),
                                     "what": what, **self.last_switch})
        self.state.channel.send("switched", id=step, what="length" if what == "length" else "candidates",
                                step=self.offset + step, seconds=round(seconds, 6), bytes=nbytes,
                                **self.last_switch)

    def _maybe_switch(self, step: int) -> None:
        if step == self._joined_at:  # a newcomer applied this step's dispatch when it joined
            self._joined_at = None
            return
        t0 = time.perf_counter()
        msg = self._take_dispatch(step)
        self.waits.append(time.perf_counter() - t0)
        lengths = self.batches.step_lengths(step)
        if [int(x) for x in msg["lengths"]] != lengths:
            raise HSPMDError(f"rank {self.state.launch_rank}: the launcher's dispatch of step {step} is for lengths "
                             f"{msg['lengths'][:8]}..., this worker's data gives {lengths[:8]}...: the data differs")
        self.dispatch = msg
        choice = int(msg["choice"])
        if "from" not in msg:  # the same Program (or another candidate with the same one): nothing moves
            self.choice = choice
            self.version = (self.reconfigured, choice)
            return
        what = "length"
        if "candidates" in msg:  # a user's switch of candidates or a grow: this step's dispatch is among the new ones
            self._use_candidates(unpack_payload(msg["candidates"]), int(msg["base"]))
            what = "grow" if msg.get("grow") is not None else "candidates"
        key = (int(msg["from"]), choice)
        if "plan" in msg:
            self.switch_plans[key] = unpack_payload(msg["plan"])
        if key not in self.switch_plans:
            raise HSPMDError(f"rank {self.state.launch_rank}: no switch plan {key} for step {step}")
        program = self._candidate(choice)
        self.state.step = self.offset + step  # the switch belongs to the step it precedes (fault injection)
        if self.elastic:  # a failure during the switch recovers from the state before it
            self._keep_previous()
        t1 = time.perf_counter()
        if what == "grow":  # the job grows: every rank leaves this world for the larger one, then the same BSR
            tensors = self._state_by_name()
            self._enter_grown_world(msg["grow"], step)
            nbytes = self._switch_to(program, self.switch_plans[key], source=tensors)
        else:
            nbytes = self._switch_to(program, self.switch_plans[key])
        self.choice = choice
        self.version = (self.reconfigured, choice)
        self._switched(step, key[0], what, time.perf_counter() - t1, nbytes)

    def _reports(self, ex: "StepExecutor", rank: int) -> bool:
        """Whether ``rank`` reports the sequences its pipeline trained (``trained``): the lowest loss rank of its
        pipeline's last stage, so that each pipeline reports once (TP replicas hold copies of the loss; each rank
        of a context-parallel last stage holds a part of every sequence)."""
        if not ex.loss_contributor():
            return False
        last = next((p[-1] for p in self.program.pipelines if any(rank in st for st in p)), [rank])
        return rank == min(r for r in last if ex.loss_contributor(r))

    def _step(self, step: int) -> float:
        state, ex = self.state, self.ex
        state.step = self.offset + step
        state.begin_step()
        indices = self.batches.step_indices(step)
        lengths = [int(self.batches.lengths[i]) for i in indices]
        total = sum(lengths)
        agreed: dict[str, float] = {}
        lr = self._set_lr(step)

        def commit(mine: float) -> float:
            counted = float(ex.trained_targets) if ex is not None and ex.loss_contributor() else 0.0
            agreed.update(self._agree(step, loss=(mine, "sum"), tokens=(counted, "sum"),
                                      stop=(float(self.stop_heard), "max")))
            return agreed["grad_norm"]

        tokens = None
        if ex is not None:
            mbs = self.dispatch["micro_batches"][ex.pipeline]
            packed = bool(self.dispatch.get("packed"))
            micro: list[tuple[Any, ...]] = []
            for mb in mbs:
                seqs = [self.batches.sequences[indices[i]] for i in mb]
                feeds = (micro_batch_feeds(self.program.model, self.program.graph, seqs, packed=packed)
                         if ex.needs_data else None)
                if packed:  # one row of the sequences back to back
                    docs = tuple(lengths[i] for i in mb)
                    micro.append((1, sum(docs), feeds, docs))
                else:
                    micro.append((len(mb), max(lengths[i] for i in mb), feeds))
            ex.step(None, micro_batches=micro, loss_normalizer=total, before_update=commit,
                    capture_grads=bool(self.capture) and step == 0)
            if self._reports(ex, state.rank):
                self.trained[step] = [indices[i] for mb in mbs for i in mb]
            if self.capture and step == 0:  # the boxes of step 0's Program (the run may end under another)
                from .params import shard_box  # lazy: torch (params)

                self._grad_boxes = {k: shard_box(self.program, k, state.rank) for k in ex.params}
                self._grads0 = {k: v.detach().cpu().clone() for k, v in (ex.captured_grads or {}).items()}
            tokens = sum(lengths[i] for mb in mbs for i in mb) if ex.stage == 0 else None
        else:
            commit(0.0)
        if int(agreed["tokens"]) != total:
            raise HSPMDError(f"step {step}: the pipelines' losses read {int(agreed['tokens'])} real target tokens, "
                             f"the step has {total}: a sequence was trained twice or not at all")
        self._in_commit = None
        self.committed = step
        self.adam_steps += 1
        self.previous = None
        self._maybe_stop(step, agreed)
        val, cut = self._after_commit(step)  # a checkpoint under the candidate running now (any loads it)
        self._record(step, agreed, lr, val)
        state.report(self.offset + step, loss=agreed["loss"], tokens=tokens, run=self.index,
                     compute_s=round(ex.compute_s, 6) if ex is not None else None, choice=self.choice,
                     dispatch_wait_s=round(self.waits[-1], 6) if self.waits else None,
                     grad_norm=agreed["grad_norm"], lr=lr, val_loss=val)
        if cut is not None:
            cut.completed = (step, agreed["loss"])  # the step itself is done: the train loop keeps its loss
            raise cut
        return agreed["loss"]

    def _validation_summand(self, index: int) -> float:
        """Validation batch ``index`` of the validation split (:class:`~..data.ValidationSequences`, cut at the
        run's ``eval_context``: a length every candidate's every pipeline takes) under the running candidate:
        sequence ``j`` of the batch goes to pipeline ``j mod P``, one micro-batch each, forward only; the loss is
        the mean over the batch's real target tokens, as the single-device reference computes it."""
        ex = self.ex
        if ex is None:
            return 0.0
        if self.validation is None:
            from ..data import validation_of  # lazy: numpy (data)

            self.validation = validation_of(self.run["data"], int(self.run["eval_context"]))
        sequences = self.validation.batch(index)
        total = sum(int(q.size) - 1 for q in sequences)
        pipelines = len(self.program.pipelines)
        micro = [(1, int(q.size) - 1, micro_batch_feeds(self.program.model, self.program.graph, [q], packed=False)
                  if ex.needs_data else None)
                 for j, q in enumerate(sequences) if j % pipelines == ex.pipeline]
        return ex.evaluate(micro_batches=micro, loss_normalizer=total)

    def train(self) -> dict[str, Any]:
        self._grad_boxes: dict[str, Any] | None = None
        self._grads0: dict[str, Any] = {}
        out = super().train()
        path = Path(self.capture or ".") / f"run{self.index}_rank{self.state.launch_rank}.pt"
        if self.capture and path.exists():  # step 0's gradients with step 0's boxes ("grad_boxes")
            import torch

            saved = torch.load(path, map_location="cpu")
            saved["grads"], saved["grad_boxes"] = self._grads0, self._grad_boxes or {}
            torch.save(saved, path)
        out.update({"trained": {str(k): v for k, v in self.trained.items()},
                    "dispatch_wait_s": [round(w, 6) for w in self.waits], "length_switches": self.length_switches})
        return out

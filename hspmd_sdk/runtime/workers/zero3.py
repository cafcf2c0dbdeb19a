"""ZeRO-3 (``settings.zero == 3``, SPEC §15): a gathered parameter lives only around its use.

At ZeRO-1 and -2 a rank's parameters are already sharded at rest (the fp32 masters are its shards); ``PRE``
gathers each one once per step and holds it through every forward and backward of the step.  At ZeRO-3 the
gathered tensor of each parameter is one leaf per step whose *storage* is filled only while it is read:

* forward: gathered with its *unit* (FSDP's: the parameters of one layer over one set of ranks, consecutive layers
  merged up to :data:`ZERO3_UNIT_BYTES`; one coalesced collective per owner) just before the first operator of the
  micro-batch that reads one of them (the next unit posted while it computes: prefetch), each freed after its last
  reader (aliases — a ``split`` or ``reshape`` of it, views of its storage — keep it until their own last reader);
* backward: the outputs of every operator that read it pass through :class:`_Regather`, whose backward gathers
  it again before that operator's backward needs it; it is freed once autograd has accumulated its gradient.

A replica that runs fewer micro-batches than another (GPipe) joins the other's extra gathers of its shards after its
own last forward and last backward (:meth:`Zero3Params.phantom`), in the order its own passes posted them.  The
gathers use process groups of their own (``WorkerState.create_twin_groups``), so that the gradient buckets'
collectives, posted during the last backward, never need to interleave with them alike on every rank.

Freeing resizes the storage to 0 (FSDP2's approach): the tensor object, the one autograd saved, stays; refilling
it keeps its version counter, so autograd accepts it.  The gather itself is the parameters' own ``PRE`` plans
(``SplitAllGather`` from the resolution), so nothing new is resolved and the collectives per group are issued in
the order of the operators — the same on every replica whose schedule runs the layer's forwards and backwards
in the same order (the Strategy's check refuses what would not: ``Strategy._zero3_problem``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

from ...core.plan import ZERO3_UNIT_BYTES
from .comm import Pending

__all__ = ["Zero3Params", "ZERO3_UNIT_BYTES"]


class _Regather(torch.autograd.Function):
    """Identity forward; backward first fills the storage of the parameters the producing operator read."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: "Zero3Params",  # type: ignore[override]
                names: tuple[str, ...]) -> torch.Tensor:
        ctx.owner, ctx.names = owner, names
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        for name in ctx.names:
            ctx.owner.fill(name)
        return grad, None, None


class Zero3Params:
    """The ZeRO-3 parameters of one rank's stage: which they are, their step leaves, when each is filled.

    ``units``: the gathered tensors' names in units (FSDP's: a layer's parameters over one set of ranks), units
    and members in the order the forward first reads them; ``start(k)`` posts unit ``k``'s gathers at once
    (coalesced: one collective per owner, :class:`~.buckets.GatherBuckets`) and returns one :class:`~.comm.Pending`
    per member; ``on_leaf(name, leaf)`` is called once per step for each leaf made (the gradient synchronisation
    watches it).  A member read while empty fills its unit (only the empty members are copied into); after a unit
    is filled in the forward, the next one is posted (prefetch)."""

    def __init__(self, units: list[list[str]], start: Callable[[int], list[Pending]],
                 on_leaf: Callable[[str, torch.Tensor], None]) -> None:
        self.units = units
        self.unit_of = {name: k for k, members in enumerate(units) for name in members}
        self._start_unit, self._on_leaf = start, on_leaf
        self.begin_step()

    def __contains__(self, name: str) -> bool:
        return name in self.unit_of

    @property
    def names(self) -> list[str]:
        return list(self.unit_of)

    def begin_step(self) -> None:
        """A new step: new leaves (the gradient synchronisation watches each step's own), nothing filled."""
        self.leaves: dict[str, torch.Tensor] = {}
        self._full: set[str] = set()
        self._prefetched: dict[int, list[Pending]] = {}
        self._alias: dict[str, str] = {}      # a value sharing a parameter's storage -> the parameter
        self._live: dict[str, set[str]] = {}  # parameter -> the names of this micro-batch still reading it
        self.held_bytes = 0
        self.peak_bytes = 0
        self.gathers = 0  # units gathered this step
        self.sequences: dict[str, list[int]] = {}  # "F" / "B": the units posted by a micro-batch's pass, in order
        self._recording: list[int] | None = None

    # ---- filling and freeing --------------------------------------------------------------------------------
    def _post(self, k: int) -> list[Pending]:
        self.gathers += 1
        if self._recording is not None:
            self._recording.append(k)
        return self._start_unit(k)

    def fill(self, name: str) -> torch.Tensor:
        """The leaf of ``name`` with its storage filled (its unit gathered now unless it is)."""
        if name in self._full:
            return self.leaves[name]
        k = self.unit_of[name]
        pending = self._prefetched.pop(k, None) or self._post(k)
        for member, got in zip(self.units[k], pending):
            value = got.wait()
            if member not in self._full:
                self._place(member, value)
        return self.leaves[name]

    def _place(self, name: str, value: torch.Tensor) -> None:
        nbytes = value.numel() * value.element_size()
        leaf = self.leaves.get(name)
        if leaf is None:
            if not value.is_contiguous() or value.untyped_storage().nbytes() != nbytes:
                value = value.clone()  # a storage of its own, exactly its size: freeing it frees nothing else
            leaf = self.leaves[name] = value.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(lambda _t, n=name: self.free(n))
            self._on_leaf(name, leaf)
        else:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(leaf):
                leaf.untyped_storage().resize_(nbytes)
                leaf.copy_(value)
        self._full.add(name)
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def free(self, name: str) -> None:
        """Let ``name``'s gathered storage go (the leaf stays, empty)."""
        if name not in self._full:
            return
        storage = self.leaves[name].untyped_storage()
        self.held_bytes -= storage.nbytes()
        storage.resize_(0)
        self._full.discard(name)

    def _prefetch_after(self, k: int) -> None:
        """Post the gathers of the unit after ``k`` (overlap), unless it is full or posted."""
        nxt = k + 1
        if nxt < len(self.units) and nxt not in self._prefetched \
                and any(m not in self._full for m in self.units[nxt]):
            self._prefetched[nxt] = self._post(nxt)

    # ---- one micro-batch's forward ------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """``name`` for an operator of the forward: filled, and live until :meth:`dropped`."""
        filled = name not in self._full
        leaf = self.fill(name)
        self._live.setdefault(name, set()).add(name)
        if filled:
            self._prefetch_after(self.unit_of[name])
        return leaf

    def owners(self, names: Iterable[str]) -> tuple[str, ...]:
        """The ZeRO-3 parameters among ``names`` (directly or through an alias)."""
        out = []
        for n in names:
            p = n if n in self.unit_of else self._alias.get(n)
            if p is not None and p not in out:
                out.append(p)
        return tuple(out)

    def produced(self, owners: tuple[str, ...], outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An operator that read ``owners`` made ``outputs``: those that are views of an owner's storage become its
        aliases; every differentiable output is wrapped so that its backward refills the owners first."""
        out = {}
        for name, v in outputs.items():
            if not isinstance(v, torch.Tensor):
                out[name] = v
                continue
            ptr = v.untyped_storage().data_ptr()
            for p in owners:
                if self.leaves[p].untyped_storage().data_ptr() == ptr:
                    self._alias[name] = p
                    self._live[p].add(name)
            out[name] = _Regather.apply(v, self, owners) if v.requires_grad else v
        return out

    def dropped(self, name: str) -> None:
        """The forward has no reader of ``name`` left: a parameter none of whose names is live is freed."""
        p = name if name in self.unit_of else self._alias.get(name)
        if p is None:
            return
        live = self._live.get(p)
        if live is not None:
            live.discard(name)
            if not live:
                del self._live[p]
                self.free(p)

    # ---- replicas that run fewer micro-batches (GPipe) -----------------------------------------------------------
    @contextmanager
    def recording(self, kind: str) -> Iterator[None]:
        """``with zero3.recording("F"):`` around a micro-batch's forward (``"B"``: backward) keeps the order in which
        it posts its units' gathers (:attr:`sequences`), for :meth:`phantom`."""
        self._recording = []
        try:
            yield
        finally:
            self.sequences[kind], self._recording = self._recording, None

    def phantom(self, kind: str, times: int) -> None:
        """Join ``times`` more passes' gathers, as recorded (:meth:`recording`), without computing: a replica of the
        layers that runs fewer micro-batches than another serves the other's gathers of its shards (every rank of
        a group issues its collectives in the same order; the values are dropped)."""
        for _ in range(times):
            for k in self.sequences.get(kind, []):
                for got in self._post(k):
                    got.wait()

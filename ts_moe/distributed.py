"""Expert parallelism: a Mixtral-style MoE layer whose experts are sharded over
the ranks of a ``torch.distributed`` process group.

Each of the group's ``W`` ranks holds ``E / W`` consecutive experts (rank
``r``: experts ``[r * E/W, (r + 1) * E/W)``) in the fused layouts, and a copy
of the router.  A forward on a rank's own tokens::

    route locally                       weights, experts (T, k); slots in expert order
    exchange the counts                 all_to_all_single: (W, E/W) slots per (rank, expert)
    dispatch the token rows             all_to_all_single: each slot's row to its expert's rank
    local grouped GEMMs                 grouped_gemm_swiglu, grouped_gemm on the rows received
    return the results                  all_to_all_single back, in the order sent
    combine                             ts_moe.combine (fp32 weights, one rounding)

Two modes:

- exact (``capacity=None``): the per-rank counts cross to the host once per
  layer call (one sync: the split sizes of the exchange); every slot is
  computed.  For prefill and training.
- capacity (``capacity=C``): each rank sends exactly ``C`` rows to every rank
  (padding rows are zero and land after the last local expert, where the GEMMs
  write zeros), so nothing syncs and a call is CUDA-graph capturable.  Slots
  past a destination's ``C`` are dropped: they contribute zero, and their
  number is kept on the device in :attr:`ExpertParallelMoE.dropped_slots`
  (never silently: :meth:`ExpertParallelMoE.check_no_drops` raises if any).

Everything is differentiable (the exchange's backward is the reverse
exchange), deterministic (gathers with sort-based or gather gradients, no
atomics) and built on ``torch.distributed`` collectives only (NCCL on GPUs,
gloo on CPUs).  The router is replicated: its gradient on each rank is from
that rank's tokens (sum it across ranks, as DDP does for replicated parameters).

Errors reach every rank wherever that costs no extra host sync, so no rank is
left waiting in a collective for one that has given up:

- construction (``__init__``, :meth:`~ExpertParallelMoE.from_weights`,
  :meth:`~ExpertParallelMoE.from_pretrained`) is one ``all_gather``: the
  ranks agree on the sizes, top-k, capacity, routing (``renormalize``), dtype
  and device type, and a rank whose own arguments (or checkpoint) fail still
  joins it with its reason.  The rank that failed raises its own error; every
  other rank a ValueError quoting it.  Ranks that disagree, or a size past 64
  bits on any rank, make all raise the same ValueError;
- a forward in exact mode sends a "refused" flag with the counts and reads it
  at the mode's one sync: a rank whose input is refused raises its own error
  there, every other rank a RuntimeError naming it, before any row moves, and
  the group stays usable for the next call;
- a forward in capacity mode never syncs, so a rank whose input is refused
  raises at once and the others wait in the exchange until the process
  group's timeout (``init_process_group(..., timeout=...)``: 30 minutes by
  default for gloo, 10 for NCCL, whose watchdog then ends the process).  Set
  a short one where a hung decode step costs more than a restart.
"""

import torch
import torch.distributed as dist
from torch import nn

from .checks import check_flag
from .experts import check_tensor as _check_tensor
from .moe import check_layer_config, init_linear_
from .ops import (combine, grouped_gemm, grouped_gemm_swiglu, route, router_logits, scatter_rows,
                  sort_slots)
from .reference import gather_permutation, gather_rows


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_rows, out_splits, in_splits, group):
        ctx.splits, ctx.in_rows, ctx.group = (out_splits, in_splits), x.shape[0], group
        out = x.new_empty((out_rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


def all_to_all_rows(x, out_rows, out_splits=None, in_splits=None, group=None):
    """Send ``x``'s rows to the ranks of ``group`` (``in_splits[r]`` rows to rank
    ``r``; None: equal parts) and receive ``out_rows`` rows (``out_splits``);
    differentiable in ``x``."""
    return _AllToAll.apply(x, out_rows, out_splits, in_splits, group)


class _GatherRows(torch.autograd.Function):
    """:func:`ts_moe.reference.gather_rows` (an index outside ``[0, M)`` reads a zero
    row) whose gradient sums the rows back by :func:`ts_moe.ops.scatter_rows`
    (sort-based: deterministic), not by ``index_add`` (atomics)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return scatter_rows(grad.contiguous(), index, ctx.rows), None


def _gather(x, index):
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherRows.apply(x, index)
    return gather_rows(x, index)


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ExpertParallelMoE needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) before it is built")
    return dist.get_world_size(group), dist.get_rank(group)


# what the ranks agree on at construction, in one int64 row per rank: a number,
# or (width > 0) a text of that many bytes; a rank that failed sends its reason
_AGREEMENT = (("refused", 0), ("reason", 512), ("hidden_size", 0), ("intermediate_size", 0),
              ("num_experts", 0), ("top_k", 0), ("capacity", 0), ("renormalize", 0),
              ("dtype", 32), ("device type", 16))
_NOT_INT64 = -2**63  # sent for a number outside int64 (every agreed number is >= 0)


def _encode(values: dict) -> list[int]:
    row = []
    for name, width in _AGREEMENT:
        value = values.get(name, "" if width else 0)
        if width:
            data = str(value).encode()[:width]
            row += [*data, *bytes(width - len(data))]
        else:
            value = int(value)
            row.append(value if _NOT_INT64 < value < 2**63 else _NOT_INT64)
    return row


def _decode(row: list[int]) -> dict:
    values, at = {}, 0
    for name, width in _AGREEMENT:
        if width:
            values[name] = bytes(b for b in row[at:at + width] if b).decode(errors="replace")
            at += width
        else:
            values[name] = row[at]
            at += 1
    return values


def _agree(group, device, values: dict, refusal: Exception | None = None) -> None:
    """The construction's collective: every rank's ``values`` (or its ``refusal``)
    gathered, then the same outcome on every rank (the module docstring)."""
    world, _ = _group_info(group)
    if refusal is not None:
        values = {"refused": 1, "reason": f"{type(refusal).__name__}: {refusal}"}
    mine = torch.tensor(_encode(values), dtype=torch.int64,
                        device=_collective_device(group, device))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    ranks = [_decode(row) for row in torch.stack(every).tolist()]
    refused = [f"rank {r}: {v['reason']}" for r, v in enumerate(ranks) if v["refused"]]
    if refusal is not None:
        raise refusal
    if refused:
        raise ValueError(f"the layer was not built on any rank: {'; '.join(refused)}")
    names = [name for name, _ in _AGREEMENT[2:]]
    huge = [f"{n} on rank {r}" for r, v in enumerate(ranks) for n in names
            if v[n] == _NOT_INT64]
    if huge:
        raise ValueError(f"{', '.join(huge)}: not a 64-bit integer; the layer was not built "
                         f"on any rank")
    differ = [n for n in names if any(v[n] != ranks[0][n] for v in ranks)]
    if differ:
        raise ValueError(f"ranks disagree on {', '.join(differ)}: " + "; ".join(
            f"{n} per rank {[v[n] for v in ranks]}" for n in differ))


class ExpertParallelMoE(nn.Module):
    """A Mixtral MoE layer with its experts sharded over ``group`` (default: the world).

    Parameters on each rank: ``router`` (E, H), replicated; ``gate_up_proj``
    (E/W, 2I, H) and ``down_proj`` (E/W, H, I), this rank's experts
    ``[rank * E/W, (rank + 1) * E/W)``.  ``forward(x)`` maps this rank's (..., H)
    tokens to (..., H), every rank calling it (a collective).  ``capacity``:
    None for exact splits (one host sync per call), or the rows each rank sends
    to each rank (no sync; see the module docstring).

    Construction is a collective too: the ranks check they agree on the sizes,
    top-k, capacity, ``renormalize`` (as :class:`ts_moe.MoE`'s), dtype and
    device type, and a rank whose arguments fail tells the others (errors: the
    module docstring).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, group=None, capacity: int | None = None, renormalize: bool = True,
                 device=None, dtype=None):
        super().__init__()
        world, rank = _group_info(group)
        try:
            check_layer_config(hidden_size, intermediate_size, num_experts, top_k)
            check_flag("renormalize", renormalize)
            if num_experts % world:
                raise ValueError(f"num_experts = {num_experts} must be divisible by the group's "
                                 f"size {world} (each rank holds num_experts / {world} experts)")
            if capacity is not None and (isinstance(capacity, bool)
                                         or not isinstance(capacity, int) or capacity < 1):
                raise ValueError(f"capacity must be None or a positive int, got {capacity!r}")
            probe = torch.empty(0, device=device, dtype=dtype)  # the defaults, resolved
        except (ValueError, TypeError, RuntimeError) as exc:
            _agree(group, device, {}, exc)  # raises exc here, after telling the others
        _agree(group, device, {
            "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_experts": num_experts, "top_k": top_k, "capacity": capacity or 0,
            "renormalize": renormalize, "dtype": probe.dtype, "device type": probe.device.type})
        self.group, self.world, self.rank = group, world, rank
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.capacity = num_experts, top_k, capacity
        self.renormalize = renormalize
        self.local_experts = num_experts // world
        self.first_expert = rank * self.local_experts
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.local_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(
            torch.empty(self.local_experts, hidden_size, intermediate_size, **factory))
        self.register_buffer("dropped_slots", torch.zeros((), dtype=torch.int64, device=device),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init per matrix (each rank draws its own experts;
        use :meth:`from_weights` for weights that match a single-process layer)."""
        init_linear_(self.router, self.gate_up_proj, self.down_proj)

    @classmethod
    def from_weights(cls, weights, top_k: int, *, group=None, capacity: int | None = None,
                     renormalize: bool = True):
        """The sharded layer on this rank from a layer's weights: ``{"router": (E, H),
        "gate_up_proj", "down_proj"}`` holding all E experts (this rank's slice is
        copied) or only this rank's E/W (used as they are)."""
        world, _ = _group_info(group)
        try:  # every check before the construction's collective: told to the other ranks
            router, gate_up, down = (weights[k] for k in ("router", "gate_up_proj", "down_proj"))
            for name, t, rank in (("router", router, 2), ("gate_up_proj", gate_up, 3),
                                  ("down_proj", down, 3)):
                _check_tensor(name, t, rank)
            num_experts, hidden = router.shape
            held, two_inter = gate_up.shape[:2]
            for name, t, shape in (("gate_up_proj", gate_up, (held, two_inter, hidden)),
                                   ("down_proj", down, (held, hidden, two_inter // 2))):
                if held not in (num_experts, num_experts // world) or t.shape != shape:
                    raise ValueError(
                        f"{name}: expected ({num_experts} or {num_experts // world}, "
                        f"{', '.join(map(str, shape[1:]))}) for the router's E = {num_experts} "
                        f"over {world} ranks and H = {hidden}, got {tuple(t.shape)}")
        except (KeyError, TypeError, ValueError) as exc:
            _agree(group, None, {}, exc)  # raises exc here, after telling the others
        layer = cls(hidden, two_inter // 2, num_experts, top_k, group=group,
                    capacity=capacity, renormalize=renormalize, device=router.device,
                    dtype=router.dtype)
        lo, n = layer.first_expert, layer.local_experts
        if held == num_experts:
            gate_up, down = gate_up[lo:lo + n], down[lo:lo + n]
        with torch.no_grad():
            for param, t in ((layer.router, router), (layer.gate_up_proj, gate_up),
                             (layer.down_proj, down)):
                param.copy_(t)
        return layer

    @classmethod
    def from_pretrained(cls, path, layer: int, *, group=None, capacity: int | None = None,
                        device=None):
        """Layer ``layer`` of a local Mixtral (or Qwen3-MoE) checkpoint, reading only
        this rank's experts (:func:`ts_moe.load_mixtral_experts` with ``experts=``);
        config.json read and checked as :meth:`ts_moe.MoE.from_pretrained` reads it."""
        from .checkpoint import EXPERT_FIELDS
        from .loaders import load_mixtral_experts
        from .pretrained import block_settings

        world, rank = _group_info(group)
        try:  # a failure here (a missing file on this rank's host) is told to the others
            settings = block_settings(path, "ExpertParallelMoE.from_pretrained")
            num_experts = settings.num_experts
            if num_experts is None or num_experts % world:
                raise ValueError(f"{path}/config.json: the expert count "
                                 f"({' / '.join(EXPERT_FIELDS)}) = {num_experts!r} must be a "
                                 f"positive int divisible by the group's size {world}")
            n = num_experts // world
            weights = load_mixtral_experts(path, layers=[layer], device=device,
                                           experts=range(rank * n, (rank + 1) * n))[layer]
        except (OSError, KeyError, TypeError, ValueError) as exc:
            _agree(group, device, {}, exc)  # raises exc here, after telling the others
        return cls.from_weights(weights, settings.top_k, group=group, capacity=capacity,
                                renormalize=settings.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (..., H) -> (..., H); a collective over the group.  A
        refused ``x`` raises on every rank in exact mode, on this rank alone in
        capacity mode (the module docstring)."""
        refusal = self._input_error(x)
        if refusal is not None and self.capacity is not None:
            raise refusal  # the others wait in the exchange until the group's timeout
        tokens = (x.reshape(-1, self.hidden_size) if refusal is None
                  else self.router.new_empty((0, self.hidden_size)))  # joins the exchange
        if self.capacity is None:
            weights, slots, counts, received, refused = self._plan(tokens, refusal is not None)
            y_sorted = self._exchange_exact(tokens, slots, counts, received, refused, refusal)
        else:
            weights, slots, counts, received, _ = self._plan(tokens)
            y_sorted = self._exchange_capacity(tokens, slots, counts, received)
        return combine(y_sorted, weights, slots.inverse).view(x.shape)

    def _input_error(self, x) -> Exception | None:
        if not isinstance(x, torch.Tensor):
            return TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            return ValueError(f"x must be (..., {self.hidden_size}), got {tuple(x.shape)}")
        if x.dtype != self.router.dtype or x.device != self.router.device:
            return TypeError(f"x must be {self.router.dtype} on {self.router.device}, got "
                             f"{x.dtype} on {x.device}")
        return None

    def _plan(self, tokens, refused: bool | None = None):
        """Route ``tokens`` (T, H) and exchange the counts (a collective): the
        combine weights, the slots in expert order, the (W, E/W) slots this rank
        sends to each rank's experts, the (W, E/W) it receives for its own, and,
        where ``refused`` is given (exact mode), each rank's refused flag (W,),
        sent with the counts."""
        weights, experts = route(router_logits(tokens, self.router), self.top_k,
                                 renormalize=getattr(self, "renormalize", True))
        slots = sort_slots(experts, self.num_experts)
        counts = torch.diff(slots.offs, prepend=slots.offs.new_zeros(1)).to(torch.int64)
        counts = counts.view(self.world, self.local_experts)
        if refused is None:
            received = all_to_all_rows(counts, self.world, group=self.group)
            return weights, slots, counts, received, None
        flag = counts.new_full((self.world, 1), int(refused))
        received = all_to_all_rows(torch.cat([counts, flag], 1), self.world, group=self.group)
        return weights, slots, counts, received[:, :-1], received[:, -1]

    def exchange_rows(self, x: torch.Tensor) -> tuple[list[int], list[int]]:
        """The rows this rank would send to and receive from each rank for tokens
        ``x`` (exact splits; a collective and a host sync): what the exchange of
        a forward moves, for the harness."""
        _, _, counts, received, _ = self._plan(x.reshape(-1, self.hidden_size))
        sizes = torch.cat([counts.sum(1), received.sum(1)]).tolist()
        return sizes[:self.world], sizes[self.world:]

    def _experts(self, rows, row_expert):
        """The local experts on received ``rows``; ``row_expert`` (R,) the local
        expert of each (``E/W``: none, a padding row).  Returns (R, H) in the
        order of ``rows``."""
        local = sort_slots(row_expert.view(-1, 1), self.local_experts)
        h = grouped_gemm_swiglu(rows, self.gate_up_proj, local.offs, a_index=local.token_index)
        y = grouped_gemm(h, self.down_proj.transpose(-2, -1), local.offs)
        return gather_permutation(y, local.inverse)

    def _exchange_exact(self, tokens, slots, counts, received, refused, refusal):
        # the one host sync of this mode: the exchange's split sizes, and the
        # ranks that refused their input (they raise here, and so do the others)
        w = self.world
        sizes = torch.cat([counts.sum(1), received.sum(1), received.flatten(), refused]).tolist()
        if refusal is not None:
            raise refusal
        if any(sizes[-w:]):
            raise RuntimeError(f"rank(s) {[r for r in range(w) if sizes[-w + r]]} refused their "
                               f"input to this call (their own errors say why); no rank ran it")
        send, recv, per_expert = sizes[:w], sizes[w:2 * w], sizes[2 * w:-w]
        rows = all_to_all_rows(_gather(tokens, slots.token_index), sum(recv), recv, send,
                               self.group)
        row_expert = torch.repeat_interleave(
            torch.arange(self.local_experts, device=tokens.device).repeat(w),
            received.flatten(), output_size=sum(per_expert))
        y = self._experts(rows, row_expert)
        return all_to_all_rows(y, sum(send), send, recv, self.group)

    def _exchange_capacity(self, tokens, slots, counts, received):
        w, cap, device = self.world, self.capacity, tokens.device
        send = counts.sum(1)                                   # (W,) slots for each rank
        start = torch.cumsum(send, 0) - send                   # their first sorted slot
        j = torch.arange(cap, device=device)
        num_slots = slots.token_index.shape[0]
        pos = (start[:, None] + j).clamp(max=max(num_slots - 1, 0))
        kept = j < send[:, None]                               # (W, C)
        token = torch.where(kept, slots.token_index[pos] if num_slots else pos, -1)
        self.dropped_slots = (send - cap).clamp(min=0).sum().detach()
        rows = all_to_all_rows(_gather(tokens, token.flatten().to(torch.int32)), w * cap,
                               group=self.group)
        # what arrives from rank s: its slots in expert order, cut at C rows
        ends = torch.cumsum(received, 1).clamp(max=cap)        # (W, E/W)
        row_expert = torch.searchsorted(ends, j.expand(w, cap).contiguous(), right=True)
        y = self._experts(rows, row_expert.flatten())
        back = all_to_all_rows(y, w * cap, group=self.group)   # (W * C, H) in the order sent
        # sorted slot p went to rank r as row p - start[r] of its block (if < C)
        p = torch.arange(num_slots, device=device)
        dest = torch.searchsorted(torch.cumsum(send, 0), p, right=True).clamp(max=w - 1)
        offset = p - start[dest]
        source = torch.where(offset < cap, dest * cap + offset, -1)
        return _gather(back, source.to(torch.int32))

    def check_no_drops(self) -> None:
        """Raise if the last call (capacity mode) dropped slots (a host sync)."""
        dropped = int(self.dropped_slots)
        if dropped:
            raise RuntimeError(f"rank {self.rank}: {dropped} (token, expert) slots exceeded "
                               f"capacity {self.capacity} in the last call and were dropped")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, world={self.world}, "
                f"rank={self.rank}, experts=[{self.first_expert}, "
                f"{self.first_expert + self.local_experts}), capacity={self.capacity}"
                + ("" if getattr(self, "renormalize", True) else ", renormalize=False"))


def _collective_device(group, device) -> torch.device:
    """Where this group's collectives take tensors: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
    return torch.device("cpu")

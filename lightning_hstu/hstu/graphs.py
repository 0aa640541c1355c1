"""The dense part of a step replayed from CUDA graphs (forward and backward), captured by the engine.

As ``torch.cuda.make_graphed_callables`` does, one graph is recorded for the forward and one for the backward
of a function of tensors with static shapes, replayed by an autograd function: the forward task replays the
first, ``loss.backward()`` in the backward task replays the second, and autograd carries the graph's input
gradients on to the (eager) TorchRec embeddings. The graphs read the parameters in place, and the backward
graph itself adds their gradients into megatron-core's gradient buffers (``accumulators``), so that autograd
has no node per parameter to run; a parameter without one gets its gradient through autograd, in ``.grad``
(where megatron-core's per-parameter hooks move it). On the light benchmark's step the copy of every
parameter into the graph, megatron-core's 26 hooks and autograd's stream syncs for them took about 1.5 ms of
8.4 (one H200, BENCHMARKS.md).

A capture needs every input shape to be fixed and nothing else on the GPU to misbehave while it records,
so it is done by the engine between two steps (no task running; see ``Engine(graphs=...)``), for each
input signature seen ``warmup`` times, up to ``max_graphs`` signatures; any other signature runs eagerly,
said once in the log.

``GraphedAdamW`` does the same for the optimizer step (the optimizer_step task): AdamW with its state and
learning rate on the device, its step captured once the gradients it reads stay the same tensors.
"""

import contextlib
import logging
from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

log = logging.getLogger(__name__)

Signature = tuple
"""The inputs' (shape, dtype, requires_grad) and the caller's CUDA autocast dtype (None: off)."""


class GraphedMethod:
    """Calls ``module.<method>(*tensors)`` eagerly until the engine has captured it for the calls'
    signature, then replays the graphs. The method must be a pure function of its tensor arguments and of
    the module's parameters (the backward graph computes their gradients), with shapes that depend on the
    arguments' shapes only. ``accumulators`` maps parameters to tensors of their shape and dtype into which
    the replayed backward adds their gradients instead of into ``.grad`` (``MegatronDenseGrads.accumulators``:
    megatron-core's ``main_grad``); a parameter not in it gets its gradient in ``.grad``. Once a parameter's
    storage moved (``param.data = ...``) the graphs no longer read it: they are dropped, and the calls run
    eagerly until captured again. Token-wise arguments can be grown to a fixed number of rows (``__call__``'s
    ``rows`` and ``grown``; the method must treat zero rows as no tokens), so that one graph serves calls of
    any token count up to it.

    The signatures' graphs share one memory pool: the buffers one signature's forward leaves for its backward
    are free again once that backward has run, and another signature's graphs reuse them, so the pool holds
    about the largest signature's memory rather than the sum over signatures. That asks of the caller what
    a training step does anyway: a forward's backward runs before the next forward of any signature.
    """

    def __init__(
        self,
        module: nn.Module,
        method: str,
        *,
        warmup: int = 3,
        max_graphs: int = 2,
        accumulators: Mapping[nn.Parameter, torch.Tensor] | None = None,
    ):
        if warmup < 1 or max_graphs < 1:
            raise ValueError(f"warmup ({warmup}) and max_graphs ({max_graphs}) must be at least 1")
        self.module, self.method, self.warmup, self.max_graphs = module, method, warmup, max_graphs
        self.accumulators = dict(accumulators or {})
        self.name = f"{type(module).__name__}.{method}"
        self.graphs: dict[Signature, _Graphs] = {}
        self._calls: Counter = Counter()
        self._samples: dict[Signature, tuple[torch.Tensor, ...]] = {}
        self._told: set[Signature] = set()
        self.replays = self.eager_calls = 0
        self._parameters: tuple[nn.Parameter, ...] = ()
        self._passed: tuple[nn.Parameter, ...] = ()  # those whose gradient autograd delivers (no accumulator)
        self._addresses: tuple[int, ...] = ()
        self._pool = None  # the graphs' memory pool, made at the first capture

    def __call__(
        self, *args: torch.Tensor, rows: int | None = None, grown: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, ...]:
        """``module.<method>(*args)``, with the arguments at the positions ``grown`` (token-wise: one row per
        token) grown to ``rows`` rows by zero rows at their end, so that calls of any token count up to
        ``rows`` share one signature. A replay writes them into the graph's input buffers and zeros only the
        rows an earlier call left there; their gradients come back for their own rows."""
        for i in grown:
            if rows is None or len(args[i]) > rows:
                raise ValueError(f"{self.name}: argument {i} has {len(args[i])} rows, more than rows={rows}")
        signature = _signature(args, rows, grown)
        graphs = self.graphs.get(signature)
        if graphs is not None and self._in_place():
            self.replays += 1
            # The graph's outputs are its static buffers, overwritten by the next replay: hand out copies.
            return tuple(out.clone() for out in _Replay.apply(graphs, grown, *args, *self._passed))
        self.eager_calls += 1
        args = tuple(_grown(a, rows) if i in grown else a for i, a in enumerate(args))
        if args and args[0].is_cuda and torch.is_grad_enabled():
            self._calls[signature] += 1
            if signature not in self._samples and len(self.graphs) < self.max_graphs:
                self._samples[signature] = tuple(_sample(a) for a in args)
            if len(self.graphs) >= self.max_graphs and signature not in self._told:
                self._told.add(signature)
                log.warning(
                    "%s: inputs %s are not captured (%d graphs already): running eagerly",
                    self.name,
                    _describe(signature),
                    len(self.graphs),
                )
        return getattr(self.module, self.method)(*args)

    def pending(self) -> list[Signature]:
        """Signatures seen ``warmup`` times and not captured yet, within the graph budget."""
        ready = [s for s, n in self._calls.items() if n >= self.warmup and s not in self.graphs]
        return ready[: max(0, self.max_graphs - len(self.graphs))]

    def capture(self) -> list[str]:
        """Capture the pending signatures; the caller guarantees that no other thread uses the GPU
        meanwhile (the engine calls it between steps). Returns what it captured, described."""
        captured = []
        if not self._parameters:  # listed once; a replay only compares their addresses
            self._parameters = tuple(self.module.parameters())
            self._addresses = tuple(p.data_ptr() for p in self._parameters)
            self._passed = tuple(p for p in self._parameters if self._accumulator(p) is None)
        # The graphs read the parameters where they live: leaves of their own over the same storage (_Call).
        aliases = tuple(_alias(p) for p in self._parameters)
        into = tuple(self._accumulator(p) for p in self._parameters)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for signature in self.pending():
            call = _Call(self.module, self.method, signature[-1])
            with torch.enable_grad():  # grad mode is thread-local: the capturing thread may not have it on
                samples = self._samples.pop(signature)
                self.graphs[signature] = _Graphs(call, samples, aliases, into, self.warmup, self._pool)
            captured.append(_describe(signature))
            log.info("%s: captured CUDA graphs (forward and backward) for inputs %s", self.name, captured[-1])
        return captured

    def _accumulator(self, p: nn.Parameter) -> torch.Tensor | None:
        """Where the backward graph adds ``p``'s gradient; None: it goes to autograd (``.grad``)."""
        into = self.accumulators.get(p)
        fits = into is not None and (into.shape, into.dtype, into.device) == (p.shape, p.dtype, p.device)
        return into if fits else None

    def _in_place(self) -> bool:
        """Whether the parameters' storage is where the capture found it; if not, the graphs are dropped (and
        the signatures counted again from zero)."""
        if tuple(p.data_ptr() for p in self._parameters) == self._addresses:
            return True
        log.warning("%s: a parameter's storage moved since the capture: graphs dropped, running eagerly", self.name)
        self.graphs.clear()
        self._pool = None
        self._calls.clear()
        self._told.clear()
        self._parameters = ()
        return False


class _Graphs:
    """The forward and backward graphs of ``call(*inputs, *parameters)`` for one signature, recorded as
    ``torch.cuda.make_graphed_callables`` records them (warm-up iterations on a side stream, both graphs in
    the memory pool ``pool``), except that the backward graph also adds each parameter's gradient into its
    accumulator (``into``; None: the gradient is handed to autograd)."""

    def __init__(self, call, samples: tuple[torch.Tensor, ...], aliases, into, warmup: int, pool):
        surface = (*samples, *aliases)
        wanted = [t for t in surface if t.requires_grad]
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(warmup):
                outputs = [o for o in call(*surface) if o.requires_grad]
                torch.autograd.grad(outputs, wanted, [torch.empty_like(o) for o in outputs], allow_unused=True)
            del outputs
        torch.cuda.synchronize()
        self.forward, self.backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward, pool=pool):
            self.outputs = tuple(call(*surface))
        self.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in self.outputs)
        with torch.cuda.graph(self.backward, pool=pool):
            grads = torch.autograd.grad(
                [o for o in self.outputs if o.requires_grad],
                wanted,
                [g for g in self.grad_outputs if g is not None],
                allow_unused=True,
            )
            by_input = dict(zip(map(id, wanted), grads))
            added = [(a, by_input.get(id(p))) for p, a in zip(aliases, into) if a is not None]
            added = [(a, g) for a, g in added if g is not None]
            if added:
                torch._foreach_add_([a for a, _ in added], [g for _, g in added])
        self.inputs = samples
        self.filled = [len(t) if t.dim() else 0 for t in samples]  # rows a grown input's last call wrote
        # the gradients handed to autograd: the inputs', then the parameters' that have no accumulator
        handed = (*samples, *(p for p, a in zip(aliases, into) if a is None))
        self.grad_inputs = tuple(by_input.get(id(t)) for t in handed)


class _Replay(torch.autograd.Function):
    """Replays a ``_Graphs``: ``apply(graphs, grown, *inputs, *parameters without accumulator)``; the inputs at
    the positions ``grown`` have at most their static buffer's rows (``GraphedMethod.__call__``)."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, grown: tuple[int, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.graphs, ctx.rows = graphs, {}
        for i, (static, value) in enumerate(zip(graphs.inputs, tensors)):
            if i in grown:  # the real rows first; zero the rows past them that an earlier call wrote
                rows, filled = len(value), graphs.filled[i]
                static[:rows].copy_(value)
                if filled > rows:
                    static[rows:filled].zero_()
                graphs.filled[i] = ctx.rows[i] = rows
            elif static.data_ptr() != value.data_ptr():
                static.copy_(value)
        graphs.forward.replay()
        return tuple(o.detach() for o in graphs.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        graphs = ctx.graphs
        for static, grad in zip(graphs.grad_outputs, grads):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        graphs.backward.replay()
        handed = (
            None if g is None else (g[: ctx.rows[i]] if i in ctx.rows else g).detach()
            for i, g in enumerate(graphs.grad_inputs)
        )
        return (None, None, *handed)


class GraphedAdamW(torch.optim.AdamW):
    """AdamW whose step the engine captures in a CUDA graph between two steps and then replays: one graph
    launch per step in place of the foreach kernels' launches and their host work.

    A replay reads the gradients where the capture found them, so it needs the same gradient tensors every
    step (megatron-core's buffer views, as ``MegatronDenseGrads.finalize`` leaves them), the state on the
    device (``capturable=True``, set here for CUDA parameters) and the learning rate as a device tensor (an
    LR scheduler fills it in place; a number written over it is copied into it before the replay). A step
    whose gradients are not the captured ones (a parameter without one: the step skipped after a non-finite
    loss) runs eagerly; so does every step until ``warmup`` eager steps have seen the same gradients. Other
    hyperparameters are read at capture time. On the CPU it is AdamW."""

    def __init__(self, params, lr: float = 1e-3, *, warmup: int = 3, **kwargs):
        params = list(params)
        tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
        self.cuda = bool(tensors) and all(p.is_cuda for p in tensors)
        if self.cuda:
            kwargs["capturable"] = True
        super().__init__(params, lr=lr, **kwargs)
        # each group's learning rate, on the device, for good: the tensors a graph reads
        self._lrs = [torch.tensor(float(g["lr"]), device=tensors[0].device) for g in self.param_groups if self.cuda]
        self._keep_lrs()
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self._captured: tuple | None = None  # the gradients' addresses the graph reads
        self._seen: tuple | None = None
        self._same_seen = 0
        self.replays = self.eager_steps = 0

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._gradients()
        self._keep_lrs()
        if self.graph is not None and grads == self._captured:
            self.graph.replay()
            self.replays += 1
            return loss
        super().step()
        self.eager_steps += 1
        if self.cuda and self.graph is None and None not in grads:
            self._same_seen = self._same_seen + 1 if grads == self._seen else 1
            self._seen = grads
        return loss

    def pending(self) -> list[str]:
        """The step, once ``warmup`` eager steps in a row read the same gradients (captured once)."""
        return ["step"] if self.graph is None and self._same_seen >= self.warmup else []

    def capture(self) -> list[str]:
        """Capture the step; the caller guarantees that no other thread uses the GPU meanwhile (the engine
        calls it between steps). Recording runs nothing: the next step is the first replay."""
        if not self.pending():
            return []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            super().step()
        self.graph, self._captured = graph, self._seen
        described = f"AdamW step over {len(self._captured)} parameters"
        log.info("%s: captured a CUDA graph", described)
        return [described]

    def _keep_lrs(self) -> None:
        """Puts a learning rate written over a group's device tensor (a number, a loaded checkpoint's tensor)
        into that tensor, and the tensor back into the group."""
        for group, lr in zip(self.param_groups, self._lrs):
            if group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr

    def _gradients(self) -> tuple:
        return tuple(
            None if p.grad is None else (p.grad.data_ptr(), p.grad.shape)
            for group in self.param_groups
            for p in group["params"]
        )


class _Call(nn.Module):
    """``module.<method>(*inputs)`` as a module of no parameters whose arguments are the inputs followed by
    the module's parameters (``torch.func.functional_call``), under the autocast its eager calls ran with.

    Why the parameters come in as arguments: a data-parallel wrapper (megatron-core's DDP, torch DDP) has
    already created each parameter's gradient accumulator on the stream it was built on (the legacy
    default stream), and a backward capture that reached them would make that stream wait on the capture
    (cudaErrorStreamCaptureImplicit). The graph computes the gradients of its arguments instead, leaves over
    the parameters' storage (``GraphedMethod.capture``), and adds them into their accumulators itself, or
    hands them to autograd outside the graph (``_Graphs``)."""

    def __init__(self, module: nn.Module, method: str, autocast_dtype: torch.dtype | None):
        super().__init__()
        self._bound = [_Method(module, method)]  # a list: not a submodule, so _Call has no parameters
        self._names = [f"owner.{name}" for name, _ in module.named_parameters()]
        self.autocast_dtype = autocast_dtype

    def forward(self, *args):
        inputs, parameters = args[: len(args) - len(self._names)], args[len(args) - len(self._names) :]
        autocast = (
            torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)  # graphs: no cache
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            return torch.func.functional_call(self._bound[0], dict(zip(self._names, parameters)), inputs)


def token_capacity(events: int, most: int, per_power_of_two: int = 32) -> int:
    """``events`` rounded up to one of ``per_power_of_two`` steps per power of two (a power of two itself;
    thirty-two: at most 3.125% more), capped at ``most``: the few static token counts the jagged dense part is
    captured for. The rows past the events cost the attention nothing, but the linear maps, norms and losses
    compute them all."""
    step = 1 << max(0, events.bit_length() - per_power_of_two.bit_length())
    return min(-(-events // step) * step, most)


class _Method(nn.Module):
    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.owner, self.method = module, method

    def forward(self, *inputs):
        return getattr(self.owner, self.method)(*inputs)


def _signature(args: tuple[torch.Tensor, ...], rows: int | None = None, grown: tuple[int, ...] = ()) -> Signature:
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    shapes = ((rows, *a.shape[1:]) if i in grown else tuple(a.shape) for i, a in enumerate(args))
    return (*((shape, a.dtype, a.requires_grad) for shape, a in zip(shapes, args)), autocast)


def _alias(parameter: nn.Parameter) -> torch.Tensor:
    """A leaf over ``parameter``'s storage (no copy), with its own gradient."""
    return parameter.detach().requires_grad_(parameter.requires_grad)


def _grown(values: torch.Tensor, rows: int) -> torch.Tensor:
    """``values`` with zero rows appended up to ``rows``."""
    if rows == len(values):
        return values
    return torch.cat([values, values.new_zeros((rows - len(values), *values.shape[1:]))])


def _sample(value: torch.Tensor) -> torch.Tensor:
    """A static input of the same shape, dtype and values (valid indices included), owned by the graph."""
    return value.detach().clone().requires_grad_(value.requires_grad)


def _describe(signature: Signature) -> str:
    *inputs, autocast = signature
    shapes = ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in inputs)
    return shapes + (f" under {str(autocast).removeprefix('torch.')} autocast" if autocast is not None else "")

"""Capture of graph nodes on the real model, per micro-batch, with their token positions.

:func:`run_graph` decodes a prompt with a :class:`Geometry` (a prefill schedule, i.e.
external submissions and ``n_ubatch``, plus an attention layout) and records the wanted
graph nodes of every graph computation with a :class:`GraphMeta` that says which token
positions (and which output positions) its rows belong to. The locator
(:mod:`statelab.audit.locate`) and the E1 attention capture (:mod:`statelab.audit.e1`)
are built on it.

Positions and KV cells: a fresh context decoding one sequence from position 0 writes
token position p into KV cell p (llama.cpp's slot search on an empty unified cache), so
the KV-cache writes (``SET_ROWS`` into ``cache_k_l*`` / ``cache_v_l*``) are reduced at
capture time to the cells written by that micro-batch, in token order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from statelab.errors import ConfigError
from statelab.lab.formation import REST, Schedule, parse_schedule
from statelab.runtime import Context, ContextConfig, context_identity, layouts
from statelab.runtime.ggml_ops import GraphCapture
from statelab.runtime.layouts import FAMILY_LAYOUTS, Layout, LayoutError

VIEW_OPS = {"VIEW", "PERMUTE", "RESHAPE", "TRANSPOSE", "NONE"}
KV_PAD = 256  # llama.cpp pads the KV cells a graph sees to 256

_LAYER_SUFFIX = re.compile(r"^(?P<base>.*?)-(?P<layer>\d+)(?P<rest>(?: \(\w+\))*)$")
_CACHE = re.compile(r"^cache_(?P<kv>[kv])_l(?P<layer>\d+)(?P<rest>.*)$")
_UNNAMED = re.compile(r"^node_\d+$")
_UNNAMED_BASE = re.compile(r"^node_\d+(?= \()")  # a view/permute of an unnamed node: "node_9 (view)"
OUTPUT_NAMES = {"norm", "result_norm", "result_output", "result_embd", "result_embd_pooled"}


def parse_node_name(name: str, op: str) -> tuple[str, int | None]:
    """(canonical name, layer or None). ``node_123`` (unnamed) becomes ``<OP>``, and the base of a
    decorated unnamed node (``node_9 (view) (permuted)``) ``<node>``: ggml numbers unnamed nodes by
    graph position, which differs between layouts; the layer comes from a ``-<il>`` suffix (before
    view decorations) or a ``cache_k_l<il>`` prefix."""
    if _UNNAMED.match(name):
        return f"<{op}>", None
    name = _UNNAMED_BASE.sub("<node>", name)
    m = _LAYER_SUFFIX.match(name)
    if m:
        return m.group("base") + m.group("rest"), int(m.group("layer"))
    m = _CACHE.match(name)
    if m:
        return f"cache_{m.group('kv')}" + m.group("rest"), int(m.group("layer"))
    return name, None


def name_layer(name: str) -> int | None:
    """Layer index that a node name carries, if any (for capture filters)."""
    return parse_node_name(name, "")[1]


def is_kv_cache_node(name: str) -> bool:
    return name.startswith("cache_k_l") or name.startswith("cache_v_l")


@dataclass(frozen=True)
class Geometry:
    """A prefill schedule (external submissions + n_ubatch) and an attention layout."""

    schedule: Schedule
    layout: Layout = Layout.MQ

    @property
    def name(self) -> str:
        s = self.schedule.name
        return s if self.layout == Layout.MQ else f"{s}:{self.layout}"

    def describe(self) -> str:
        return f"{self.schedule.describe()} layout={self.layout}"


def parse_geometry(text: str) -> Geometry:
    """``SCHEDULE[:LAYOUT]``: a schedule as in ``statelab capture`` (A, B, C, R, ub4,
    16+rest@ub4, ...) and optionally MQ, PQ or QB (default MQ), each optionally with "+W"
    (row-by-row weight products, native/patches/0003)."""
    t = str(text).strip()
    sched, _, lay = t.partition(":")
    try:
        lay = Layout.parse(lay or Layout.MQ, FAMILY_LAYOUTS, "attention layout")
    except LayoutError as e:
        raise ConfigError(f"geometry {text!r}: {e}") from None
    return Geometry(parse_schedule(sched), lay)


@dataclass
class GraphMeta:
    """One graph computation (micro-batch) of a run."""

    call: int  # decode call
    graph: int  # micro-batch within the call
    positions: np.ndarray  # token positions of its rows
    out_positions: np.ndarray  # positions whose rows are outputs (logits requested)
    admission: object | None = None  # layouts.Admission of the call (patched build only)

    @property
    def n_tokens(self) -> int:
        return int(len(self.positions))

    @property
    def n_outputs(self) -> int:
        return int(len(self.out_positions))


@dataclass
class GraphRun:
    """Everything recorded while decoding one prompt with one geometry."""

    geometry: Geometry
    tokens: np.ndarray
    graphs: list[GraphMeta]
    nodes: list  # runtime.ggml_ops.CapturedNode
    logits: np.ndarray  # FP32 logits of the last position
    identity: dict
    n_layer: int
    extra: dict = field(default_factory=dict)

    def meta(self, call: int, graph: int) -> GraphMeta:
        return self._index[(call, graph)]

    def __post_init__(self):
        self._index = {(g.call, g.graph): g for g in self.graphs}


def plan_calls(n_tokens: int, schedule: Schedule, logits: str) -> list[dict]:
    """The decode calls of a schedule with their micro-batches (llama.cpp splits a
    single-sequence submission into consecutive chunks of n_ubatch)."""
    if logits not in ("last", "all"):
        raise ConfigError(f"logits must be 'last' or 'all', got {logits!r}")
    calls, pos = [], 0
    for size in schedule.submissions(n_tokens):
        flags = np.zeros(size, dtype=bool)
        if logits == "all":
            flags[:] = True
        elif pos + size == n_tokens:
            flags[-1] = True
        ub = []
        for s in range(0, size, schedule.n_ubatch):
            e = min(size, s + schedule.n_ubatch)
            p = np.arange(pos + s, pos + e)
            ub.append((p, p[flags[s:e]]))
        calls.append({"pos0": pos, "size": size, "flags": flags, "ubatches": ub})
        pos += size
    return calls


def context_size(n_tokens: int) -> int:
    return max(KV_PAD, -(-n_tokens // KV_PAD) * KV_PAD)


def check_layout(layout, backend: str = "cpu") -> None:
    layout = Layout.parse(layout)
    if layout.needs_patch and not layouts.available():
        raise ConfigError(f"attention layout {layout} needs the layout patch "
                          "(native/patches/0002-attention-layouts.patch), which this build lacks")
    if layout.repair and not layouts.weight_repair_available():
        raise ConfigError(f"layout {layout} needs the weight-product patch "
                          "(native/patches/0003-row-invariant-weight-products.patch), which this build lacks")
    why = layouts.patch_refusal(layout, backend) if layout.needs_patch else None
    if why:
        raise ConfigError(why)


def run_graph(model, tokens, geometry: Geometry, base_config=None, *, want=None, want_srcs=None,
              keep_data=None, logits: str = "last", prefix=None, prefix_schedule: Schedule | None = None,
              n_ctx: int | None = None, capture: bool = True, require_admitted: bool = True) -> GraphRun:
    """Decode `tokens` with `geometry` in a fresh context and capture the wanted nodes.

    want(name) / want_srcs(name) / keep_data(name): see runtime.ggml_ops.GraphCapture.
    prefix: tokens decoded first *without* capture (with prefix_schedule, default whole),
    so that `tokens` are a continuation at positions len(prefix)...
    capture=False runs without any eval callback (the capture-off control); the run then
    has no nodes and no micro-batch bookkeeping beyond the plan.
    """
    toks = np.asarray(tokens, dtype=np.int32).ravel()
    pre = np.asarray(prefix if prefix is not None else [], dtype=np.int32).ravel()
    if len(toks) == 0:
        raise ConfigError("nothing to decode: no tokens")
    check_layout(geometry.layout, model.backend)
    n_total = len(pre) + len(toks)
    cfg0 = base_config or ContextConfig(backend=model.backend)
    n_ctx = n_ctx or context_size(n_total)
    if n_total > n_ctx:
        raise ConfigError(f"{n_total} tokens do not fit n_ctx={n_ctx}")
    sched = geometry.schedule
    n_batch = max(sched.n_batch, sched.n_ubatch, len(pre) or 1)
    cfg = cfg0.with_(n_ctx=n_ctx, n_ubatch=sched.n_ubatch, n_batch=n_batch)
    plan = plan_calls(len(toks), sched, logits)
    n_cells_ref = {}
    info = model.info
    emb = {"k": info.n_embd_k_gqa, "v": info.n_embd_v_gqa}
    graph_pos: dict[tuple[int, int], np.ndarray] = {}

    def reduce(node):
        # KV-cache writes: keep only the cells this micro-batch wrote (cell == position)
        if node.data is None or not is_kv_cache_node(node.name) or node.op != "SET_ROWS":
            return
        kv = node.name[6]
        arr = np.asarray(node.data)
        f = emb[kv]
        n_cells = arr.size // f
        n_cells_ref[kv] = n_cells
        if node.ne[0] == 1:  # transposed V: element j*kv_size + cell
            cells = arr.reshape(f, n_cells).T
        else:
            cells = arr.reshape(n_cells, f)
        pos = graph_pos.get((node.call, node.graph))
        node.data = cells[pos].copy() if pos is not None else None

    cap = GraphCapture(want or (lambda n: True), want_srcs=want_srcs, keep_data=keep_data, reduce=reduce)
    ctx = Context(model, cfg, capture=cap if capture else None)
    graphs: list[GraphMeta] = []
    admissions = []
    try:
        if len(pre):
            psched = prefix_schedule or Schedule("prefix", (REST,), max(512, len(pre)), max(512, len(pre)))
            saved = cap.want
            cap.want = lambda n: False
            pos = 0
            for size in psched.submissions(len(pre)):
                ctx.decode(pre[pos:pos + size], pos, logits="none")
                pos += size
            cap.want = saved
            cap.check()
        if layouts.available():  # the prefix is always the native graph; the layout applies from here
            # PQ/QB are admitted up to max queries (the library's default 4): a geometry's ubatch is its query count
            layouts.set_max_queries(ctx, min(layouts.MAX_QUERIES_LIMIT, max(4, sched.n_ubatch)))
            layouts.set_layout(ctx, geometry.layout)
        base_call = ctx.n_decode_calls
        off = len(pre)
        for ci, c in enumerate(plan):
            call = base_call + ci
            for gi, (p, _) in enumerate(c["ubatches"]):
                graph_pos[(call, gi)] = p + off
            ctx.decode(toks[c["pos0"]:c["pos0"] + c["size"]], off + c["pos0"], logits=c["flags"])
            cap.check()
            adm = layouts.last_admission(ctx) if layouts.available() else None
            # another graph than the geometry names: refuse, never compare it (callers that record the
            # admission themselves, like E1's cells, pass require_admitted=False)
            if require_admitted and adm is not None and not adm.admitted:
                raise ConfigError(f"geometry {geometry.name}: layout {adm.requested} was not built ({adm.reason}); "
                                  f"the graph was {adm.built}")
            admissions.append(adm)
            n_graphs = cap.graphs_per_call.get(call, 0)
            if capture and n_graphs != len(c["ubatches"]):
                raise ConfigError(f"decode call {ci} computed {n_graphs} graph(s), expected {len(c['ubatches'])} "
                                  f"micro-batches of n_ubatch={sched.n_ubatch} (capture could not follow the run)")
            for gi, (p, po) in enumerate(c["ubatches"]):
                graphs.append(GraphMeta(call, gi, p + off, po + off, adm))
        last = ctx.logits(-1)
        rows = np.flatnonzero(plan[-1]["flags"])
        out_logits = np.stack([ctx.logits(int(i)) for i in rows]) if len(rows) else np.zeros((0, model.n_vocab),
                                                                                              np.float32)
        ident = context_identity(model, cfg)
    finally:
        ctx.close()
    run = GraphRun(geometry, toks, graphs, cap.nodes, last, ident, model.n_layer,
                   {"prefix_tokens": int(len(pre)), "logits": logits, "n_ctx": n_ctx, "captured": bool(capture),
                    "kv_cells": n_cells_ref, "admissions": admissions, "out_logits": out_logits})
    return run


def check_layer(model, layer: int) -> int:
    n = model.n_layer
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ConfigError(f"layer must be an integer, got {layer!r}")
    if not 0 <= layer < n:
        raise ConfigError(f"layer {layer} does not exist: the model has {n} layers (0..{n - 1})")
    return int(layer)


def parse_layers(spec, n_layer: int) -> list[int] | None:
    """'all' -> None; '0', '0-3', '0,14,29', 'first,middle,last' -> a sorted list."""
    if spec is None:
        return None
    s = str(spec).strip().lower()
    if s in ("all", "*", ""):
        return None
    named = {"first": 0, "middle": n_layer // 2, "last": n_layer - 1}
    out = set()
    for part in s.split(","):
        part = part.strip()
        if part in named:
            out.add(named[part])
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ConfigError(f"bad layer list {spec!r}: use all, 3, 0-2, 0,15,29 or first,middle,last")
        a = int(m.group(1))
        b = int(m.group(2) or a)
        if b < a:
            raise ConfigError(f"bad layer range {part!r}")
        for i in range(a, b + 1):
            if i >= n_layer:
                raise ConfigError(f"layer {i} does not exist: the model has {n_layer} layers (0..{n_layer - 1})")
            out.add(i)
    return sorted(out)


INPUT_NAMES = {"embd", "inp_embd", "inp_pos", "inp_out_ids"}


def layer_filter(layers: list[int] | None, n_layer: int, include_io: bool = True):
    """A capture filter for nodes of the given layers (None: all), plus the model input and
    output nodes (``embd``, ``norm``, ``result_*``) when include_io.

    Nodes without a layer number inside the layers (views of graph inputs such as
    ``attn_inp_kq_mask (view)``, unnamed ``concat`` / ``get_rows``) belong to the layer being
    built around them: the filter follows the graph order it is asked in (the eval callback
    asks about every node, in order) and gives them the layer of the last numbered node."""
    if layers is None:
        return lambda name: True
    keep = set(layers)
    current = [-1]

    def want(name: str) -> bool:
        il = name_layer(name)
        if il is not None:
            current[0] = il
            return il in keep
        if name in INPUT_NAMES:
            current[0] = -1
            return include_io
        if name in OUTPUT_NAMES:
            current[0] = n_layer
            return include_io
        return current[0] in keep

    return want


__all__ = ["Geometry", "GraphMeta", "GraphRun", "INPUT_NAMES", "OUTPUT_NAMES", "VIEW_OPS", "check_layer",
           "context_size", "is_kv_cache_node", "layer_filter", "name_layer", "parse_geometry", "parse_layers",
           "parse_node_name", "plan_calls", "run_graph"]
